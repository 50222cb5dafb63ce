import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from tierstore.errors import ConfigError
from tierstore.identity import Namespace, block_hashes, chain_ids

B = 16


def test_hash_is_deterministic_across_processes():
    ns = Namespace(model="m@1", tenant="t")
    here = block_hashes(ns.digest(), np.arange(64), B)
    code = (
        "import numpy as np; from tierstore.identity import *; "
        "print(','.join(h.hex() for h in block_hashes(Namespace(model='m@1', tenant='t').digest(), "
        "np.arange(64), 16)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    assert out == ",".join(h.hex() for h in here)
    assert all(len(h) == 32 for h in here)


def test_known_digests_are_pinned():
    """The chain is an on-disk and on-wire key: a change would orphan every NVMe file and
    remote entry (it must come with a new layout fingerprint), so the digests are pinned."""
    d = Namespace(model="m@1", tenant="t").digest()
    assert d.hex() == "bdee501f0902f9ee9ed38e8c9bb6ba8126c605df2458b71f60336cb22679b074"
    keys = block_hashes(d, np.arange(48), B)
    assert keys[-1].hex() == "1ffe4577b70a59a1e3374d5c911cf9449253bed9dbc6b236335a24cc359316ee"
    assert (
        chain_ids(d, [1, 2, 3])[-1].hex()
        == "d64dcba7113dbe3828d6c0bec26e5ed791f5acaf2ca91c18cb54a2230cb21898"
    )
    # the optimised loop equals one link at a time
    from tierstore.identity import hash_block, tokens_to_bytes

    parent = d
    for i, k in enumerate(keys):
        parent = hash_block(parent, tokens_to_bytes(np.arange(48)[i * B : (i + 1) * B]))
        assert k == parent


def test_only_full_blocks_are_hashed():
    d = Namespace(model="m").digest()
    assert len(block_hashes(d, np.arange(47), B)) == 2
    assert len(block_hashes(d, np.arange(48), B)) == 3
    assert len(block_hashes(d, np.arange(15), B)) == 0


def test_chain_depends_on_prefix():
    d = Namespace(model="m").digest()
    a = block_hashes(d, np.arange(32), B)
    b = block_hashes(d, np.r_[np.arange(16) + 1, np.arange(16, 32)], B)
    assert a[0] != b[0] and a[1] != b[1]  # same second-block tokens, different prefix


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "m@2"),
        ("tokenizer", "tok@2"),
        ("chat_template", "x"),
        ("adapter", "lora1"),
        ("rope_scaling", "yarn:4"),
        ("kv_dtype", "fp8_e4m3"),
        ("layout_version", 2),
        ("tp_rank", 1),
        ("tp_size", 4),
        ("pp_size", 2),
        ("tenant", "other"),
    ],
)
def test_every_identity_field_changes_the_digest(field, value):
    base = Namespace(model="m@1", tokenizer="tok@1", tp_size=2)
    other = dataclasses.replace(base, **{field: value})
    assert base.digest() != other.digest()
    assert base.digest() == Namespace(model="m@1", tokenizer="tok@1", tp_size=2).digest()


def test_bad_namespace_rejected():
    with pytest.raises(ConfigError):
        Namespace(model="")
    with pytest.raises(ConfigError):
        Namespace(model="m", tp_rank=2, tp_size=2)


@pytest.mark.parametrize(
    "field, value",
    [
        ("tenant", 5),
        ("tenant", None),
        ("tenant", ""),
        ("tokenizer", None),
        ("kv_dtype", 16),
        ("layout_version", "x"),
        ("tp_size", True),
        ("pp_rank", 0.0),
    ],
)
def test_a_namespace_field_of_the_wrong_type_is_refused(field, value):
    """Fresh-user trial 8: Namespace(tenant=5) or layout_version="x" were accepted, each a scope of
    its own (tenant None and "" gave different keys): every engine that spelled it right missed."""
    with pytest.raises(ConfigError, match=rf"Namespace\.{field}="):
        Namespace(model="m", **{field: value})


def test_chain_ids_matches_prefix_semantics():
    d = Namespace(model="m").digest()
    a = chain_ids(d, [1, 2, 3])
    b = chain_ids(d, [1, 2, 4])
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize(
    "bad",
    [np.random.default_rng(0).random(32), ["a"] * 32, np.full(32, -1), np.zeros((2, 16), dtype=np.int64)],
)
def test_bad_token_ids_are_typed_errors(bad):
    with pytest.raises(ConfigError):
        block_hashes(Namespace(model="m").digest(), bad, B)


def test_digest_cache_is_bounded_and_scoped():
    from tierstore.identity import DigestCache

    c = DigestCache(scope=b"x" * 32)
    d = Namespace(model="m").digest()
    assert c(d) != d and c(d) == c(Namespace(model="m")) and len(c(d)) == 32
    for i in range(DigestCache.MAX_ENTRIES + 10):
        c(i.to_bytes(32, "little"))
    assert len(c._digests) <= DigestCache.MAX_ENTRIES
    assert DigestCache()(d) == d  # unscoped: a ready digest is returned as is


def test_scoped_keys_of_a_batch_are_scoped_key_of_each():
    from tierstore.errors import ConfigError
    from tierstore.identity import scoped_key, scoped_keys

    d = bytes(range(32))
    keys = ["a" * 64, b"\x01\x02", "ü", "x"]
    assert scoped_keys(d, keys) == [scoped_key(d, k) for k in keys]
    assert scoped_keys(d, []) == []
    with pytest.raises(ConfigError):
        scoped_keys(d, ["ok", ""])
    with pytest.raises(ConfigError):
        scoped_keys(d[:31], ["ok"])
