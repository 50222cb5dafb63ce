"""Engine-independent helpers of the connectors (tierstore.integrations._common)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from tierstore.errors import ConfigError
from tierstore.integrations._common import (
    config_fingerprint,
    fingerprint_model_dir,
    model_identity,
    split_extra_config,
)


def write_model(d, weights: bytes, config: str = '{"hidden_size": 8}'):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(config)
    (d / "model.safetensors").write_bytes(weights)
    return str(d)


def test_fingerprint_follows_the_weights_not_the_path(tmp_path):
    a = write_model(tmp_path / "a", b"\x01" * 5000)
    b = write_model(tmp_path / "b", b"\x01" * 5000)
    c = write_model(tmp_path / "c", b"\x01" * 4999 + b"\x02")  # last byte differs
    d = write_model(tmp_path / "d", b"\x01" * 5000, config='{"hidden_size": 16}')
    assert fingerprint_model_dir(a) == fingerprint_model_dir(b)
    assert fingerprint_model_dir(a) != fingerprint_model_dir(c)
    assert fingerprint_model_dir(a) != fingerprint_model_dir(d)


def test_fingerprint_reads_only_the_edges_of_large_files(tmp_path):
    big = bytearray(b"\x00" * 10_000)
    a = write_model(tmp_path / "a", bytes(big))
    big[5000] = 1  # a change in the middle, beyond both edges
    b = write_model(tmp_path / "b", bytes(big))
    assert fingerprint_model_dir(a, edge_bytes=1000) == fingerprint_model_dir(b, edge_bytes=1000)
    assert fingerprint_model_dir(a, edge_bytes=6000) != fingerprint_model_dir(b, edge_bytes=6000)


def test_fingerprint_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        fingerprint_model_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.json"):
        fingerprint_model_dir(str(tmp_path / "empty"))


def test_model_identity(tmp_path):
    d = write_model(tmp_path / "m", b"w" * 100)
    assert model_identity("org/m", "abc123") == ("org/m@abc123", True)
    assert model_identity(d, "abc123") == (f"{d}@abc123", True)
    assert model_identity(d, None) == (f"local@sha256:{fingerprint_model_dir(d)}", True)
    ident, exact = model_identity("org/m", None, {"hidden_size": 8})
    assert not exact and ident == f"org/m@config-sha256:{config_fingerprint({'hidden_size': 8})}"
    assert model_identity("org/m", None, {"hidden_size": 9})[0] != ident
    assert model_identity("org/m", "abc", override="mine") == ("mine", True)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    knob: int = 1


def test_split_extra_config():
    cfg, own = split_extra_config(
        {"tiers": {"host": {"capacity_bytes": "1MiB"}}, "mine": {"knob": 3}}, "mine", Section, "extra"
    )
    assert cfg.tiers.host.capacity_bytes == 1 << 20 and own.knob == 3
    cfg, own = split_extra_config(None, "mine", Section, "extra")
    assert own.knob == 1 and cfg.tiers.nvme is None


@pytest.mark.parametrize(
    "doc, match",
    [
        (
            {"tierz": {}},
            r"unknown key\(s\) \['tierz'\]; accepted keys are "
            r"\['mine', 'policies', 'remote', 'store', 'tiers'\]",
        ),
        ({"mine": {"knobs": 1}}, "knobs: unknown key"),
        ({"layout": {"preset": "tiny"}}, "derived from the engine"),
        ({"policies": {"eviction": "nope"}}, "policies.eviction"),
        ([1], "expected a mapping"),
    ],
)
def test_split_extra_config_errors(doc, match):
    with pytest.raises(ConfigError, match=match):
        split_extra_config(doc, "mine", Section, "extra")


def test_start_and_shutdown_lines_say_tiers_recovery_and_what_was_written_down(tmp_path, caplog):
    """Issue 22, item 13: the one start line and the one shutdown line every connector logs."""
    import logging

    import numpy as np
    import torch

    from tierstore import KVStore, Namespace, get_layout
    from tierstore.integrations._common import close_store_logged, log_store_opened
    from tierstore.units import format_bytes

    log = logging.getLogger("tierstore.test-connector")
    lay = get_layout("tiny")
    path = str(tmp_path / "kv")
    ns = Namespace(model="m")
    toks = np.arange(6 * lay.tokens_per_block)
    with caplog.at_level(logging.INFO, logger="tierstore.test-connector"):
        s = KVStore(lay, host_bytes=8 * lay.bytes_per_block, nvme_path=path, nvme_bytes=16 << 20)
        log_store_opened(log, "engine e1", s, "layout x")
        s.store(ns, toks, torch.randn(6, *lay.block_shape).to(lay.dtype))  # write-back: in host memory only
        assert close_store_logged(log, "engine e1", s) == 6
        s = KVStore(lay, host_bytes=8 * lay.bytes_per_block, nvme_path=path, nvme_bytes=16 << 20)
        log_store_opened(log, "engine e2", s)
        assert close_store_logged(log, "engine e2", s) == 0
        m = KVStore(lay, host_bytes=8 * lay.bytes_per_block)
        m.store(ns, toks[: 2 * lay.tokens_per_block], torch.randn(2, *lay.block_shape).to(lay.dtype))
        log_store_opened(log, "engine e3", m)
        close_store_logged(log, "engine e3", m)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 6, lines
    host, nvme = format_bytes(8 * lay.bytes_per_block), format_bytes(s.capacity_bytes()["nvme"])
    assert nvme != "16.00MiB"  # the tier holds fewer bytes of KV than the file's: the line says why
    assert lines[0] == (
        f"tierstore opened for engine e1: tiers host {host}, nvme {nvme} at {path} "
        f"(0 blocks recovered; the 16.00MiB given hold {nvme} of KV blocks: extent headers and whole "
        "segments take the rest); remote tier off; layout x"
    )
    assert (
        lines[1] == "tierstore closed for engine e1: 6 blocks written down to NVMe, 6 blocks on NVMe "
        "for a restart on the same path"
    )
    assert lines[2].startswith("tierstore opened for engine e2: ") and "(6 blocks recovered;" in lines[2]
    assert lines[3].endswith(
        ": 0 blocks written down to NVMe, 6 blocks on NVMe for a restart on the same path"
    )
    assert lines[4] == f"tierstore opened for engine e3: tiers host {host}; remote tier off"
    assert lines[5] == "tierstore closed for engine e3: no NVMe tier, the 2 blocks in memory are not kept"


def test_split_extra_config_with_own_keys_at_the_top_level_as_a_secondary_tier():
    """The offloading tier's and SGLang's form: own keys beside the store's sections, extra
    sections refused with the connector's reason, and a tier below the engine's HBM."""
    kw = dict(
        refuse={"layout": "'layout' comes from the pool", "remote": "'remote' is not supported"},
        secondary="the engine owns HBM",
        note=" (plus the engine's keys)",
    )
    cfg, own = split_extra_config(
        {"tiers": {"host": {"capacity_bytes": "1MiB"}}, "knob": 5, "policies": {"admission": "second_hit"}},
        None,
        Section,
        "tier",
        **kw,
    )
    assert (
        own.knob == 5 and cfg.tiers.host.capacity_bytes == 1 << 20 and cfg.policies.admission == "second_hit"
    )
    for doc, match in [
        (
            {"tiers": {"host": {"capacity_bytes": "1MiB"}}, "bogus": 1},
            r"invalid tier: unknown key\(s\) \['bogus'\]; accepted keys are "
            r"\['knob', 'policies', 'store', 'tiers'\] "
            r"\(plus the engine's keys\)",
        ),
        ({"remote": {}}, "invalid tier: 'remote' is not supported"),
        ({"layout": {}}, "invalid tier: 'layout' comes from the pool"),
        (
            {"tiers": {"hbm": {"capacity_bytes": "1MiB"}, "host": {"capacity_bytes": "1MiB"}}},
            "invalid tier: tiers.hbm must be 0; the engine owns HBM",
        ),
        ({"knob": 1}, r"invalid tier: no tier configured; give tiers.nvme \{path, capacity_bytes\}"),
        ({"tiers": {"host": {"capacity_bytes": "1MiB"}}, "knob": "x"}, "invalid tier:\n  knob='x'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            split_extra_config(doc, None, Section, "tier", **kw)
    # without ``secondary`` an HBM tier and an empty store are fine (the vLLM KV connector)
    cfg, _ = split_extra_config({"tiers": {"hbm": {"capacity_bytes": "1MiB"}}}, None, Section, "tier")
    assert cfg.tiers.hbm.capacity_bytes == 1 << 20
