"""Bad input to the Python API is a typed TierStoreError (found by a new-user run of the README)."""

from __future__ import annotations

import os

import pytest
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.errors import ConfigError
from tierstore.layout import KVLayout

LAY = KVLayout(2, 2, 4, torch.float32, 16, "newuser")


@pytest.mark.parametrize("kw", [dict(hbm_bytes=-1), dict(host_bytes="abc")])
def test_bad_capacities_are_config_errors(kw):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        KVStore(LAY, **kw)


def test_a_missing_nvme_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        KVStore(LAY, nvme_path=str(tmp_path / "no" / "such" / "dir" / "kv"), nvme_bytes=1 << 26)


def test_a_string_is_not_a_namespace():
    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        with pytest.raises(ConfigError, match="namespace must be"):
            s.lookup("notans", list(range(32)))
    finally:
        s.close()


@pytest.mark.parametrize("keys", [None, 5, bytes(32)])
def test_keys_that_are_no_sequence_of_keys_are_a_layout_error(keys):
    """Fresh-user trial 8: store.load(None) raised a bare TypeError ('NoneType' object is not
    iterable); a single 32-byte key (not in a list) is refused by name too."""
    from tierstore.errors import LayoutError

    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        with pytest.raises(LayoutError, match="block keys are a sequence"):
            s.load(keys)
        with pytest.raises(LayoutError, match="block keys are a sequence"):
            s.exists(keys)
    finally:
        s.close()


def test_storing_zero_new_blocks_returns_an_empty_list():
    """The README's loop (`store(ns, ids, new_kv, start_block=n)`) on a second pass: all hit."""
    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        ns, ids = Namespace(model="m"), list(range(64))
        kv = torch.ones((4,) + tuple(LAY.block_shape))
        assert len(s.store(ns, ids, kv)) == 4
        assert s.store(ns, ids, kv[4:], start_block=4) == []
        assert len(s.lookup(ns, ids).keys) == 4
    finally:
        s.close()


@pytest.mark.parametrize(
    "kw", [{"nvme_path": "PATH"}, {"nvme_bytes": 64 << 20}, {"nvme_path": "PATH", "nvme_bytes": 0}]
)
def test_an_nvme_tier_needs_both_a_path_and_a_size(tmp_path, kw):
    """One without the other opened a memory-only store and said nothing (found by a new-user
    trial: the user believed the blocks were kept on NVMe)."""
    from tierstore import KVStore, get_layout

    kw = {k: (str(tmp_path / "t.nvme") if v == "PATH" else v) for k, v in kw.items()}
    with pytest.raises(ConfigError, match="an NVMe tier needs both"):
        KVStore(get_layout("tiny"), host_bytes=1 << 20, **kw)
    assert not (tmp_path / "t.nvme").exists()


def test_sizes_may_be_given_as_strings(tmp_path):
    from tierstore import KVStore, get_layout

    s = KVStore(get_layout("tiny"), host_bytes="1MiB", nvme_path=str(tmp_path) + "/", nvme_bytes="64MiB")
    try:
        caps = s.capacity_bytes()
        assert caps["host"] == 1 << 20 and 0 < caps["nvme"] <= 64 << 20
    finally:
        s.close()


@pytest.mark.parametrize("blocks", [None, 3, "kv"])
def test_kv_blocks_that_are_not_blocks_get_a_layout_error(blocks):
    from tierstore import KVStore, Namespace, get_layout
    from tierstore.errors import LayoutError

    lay = get_layout("tiny")
    s = KVStore(lay, host_bytes=1 << 20)
    try:
        with pytest.raises(LayoutError, match="kv_blocks: expected"):
            s.store(Namespace(model="m", tokenizer="t"), list(range(lay.tokens_per_block)), blocks)
    finally:
        s.close()


@pytest.mark.parametrize("first_position", [-1, 2**31 - 1, 2**63, 10**30])
def test_a_chain_position_out_of_range_is_a_layout_error_and_stores_nothing(first_position):
    """``store_keys(first_position=2**63)`` raised a bare OverflowError from numpy, and
    ``first_position=-1`` or one past the index's int32 positions was stored (wrapped) silently:
    fresh-user trial 4a; the HTTP daemon answered 500 for the same manifest."""
    from tierstore.errors import LayoutError

    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        ns = Namespace(model="m")
        keys = [bytes([i]) * 32 for i in range(1, 3)]
        kv = torch.ones((2,) + tuple(LAY.block_shape))
        with pytest.raises(LayoutError, match="first_position"):
            s.store_keys(ns, keys, list(kv), first_position=first_position)
        assert s.stats()["blocks"] == 0 and s.exists(keys) == 0
        assert s.store_keys(ns, keys, list(kv), first_position=2**31 - 3) == [Status.OK] * 2
    finally:
        s.close()


@pytest.mark.parametrize("kw", ["nvme_path", "journal_path"])
def test_a_path_with_a_nul_byte_is_a_config_error(tmp_path, kw):
    """``nvme_path="/tmp/x\\0y"`` raised os's bare ValueError ("embedded null byte"): trial 4b."""
    paths = {"nvme_path": str(tmp_path / "t.nvme"), kw: str(tmp_path / "x\x00y")}
    with pytest.raises(ConfigError, match="NUL byte"):
        KVStore(LAY, nvme_bytes=64 << 20, eviction_granularity="block", **paths)
    assert not os.listdir(tmp_path)


def test_a_tier_file_given_as_the_journal_is_named_as_a_tier(tmp_path):
    """Trial 4b: a tier file tierstore wrote, given as journal_path, was called "a file tierstore did
    not write"; its label says what it is."""
    tier = str(tmp_path / "a.nvme")
    KVStore(LAY, nvme_path=tier, nvme_bytes=64 << 20).close()
    before = open(tier, "rb").read(4096)
    with pytest.raises(ConfigError, match="an NVMe tier tierstore wrote"):
        KVStore(
            LAY,
            nvme_path=str(tmp_path / "b.nvme"),
            nvme_bytes=64 << 20,
            eviction_granularity="block",
            journal_path=tier,
        )
    assert open(tier, "rb").read(4096) == before
