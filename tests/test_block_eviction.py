"""``tiers.nvme.eviction_granularity: block`` through KVStore and the trace replay (issue 26 item 1):
the index's NVMe policy names single victims, the store stays within its live budget, a reopen
serves only what it kept, and the packaged excerpt replays with no wrong KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.errors import ConfigError
from tierstore.layout import KVLayout
from tierstore.replay import ReplayConfig, run_replay

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
NS = Namespace(model="m@1", tenant="acme")
B = LAYOUT.tokens_per_block


def _prompt(i: int, blocks: int = 4):
    toks = np.arange(i * 1000, i * 1000 + blocks * B)
    kv = torch.from_numpy(
        np.random.default_rng(i).standard_normal((blocks, *LAYOUT.block_shape)).astype(np.float16)
    )
    return toks, kv


def _open(path, **kw) -> KVStore:
    bb = LAYOUT.bytes_per_block
    return KVStore(
        LAYOUT,
        hbm_bytes=2 * bb,
        host_bytes=4 * bb,
        nvme_path=str(path),
        eviction_granularity="block",
        **{"nvme_bytes": 1 << 20, **kw},
    )


def test_bad_granularity_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="eviction_granularity"):
        KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=1 << 20, eviction_granularity="segment")


def test_kvstore_block_mode_keeps_the_recent_blocks_and_reopens(tmp_path):
    s = _open(tmp_path)
    n = 60
    for i in range(n):
        assert s.store(NS, *_prompt(i)) == [Status.OK] * 4
        s.check_invariants(quiescent=True)  # the index's NVMe policy tracks every NVMe copy
    nv = s.stats()["nvme_backend"]
    assert nv["eviction_granularity"] == "block" and nv["block_evictions"] > 0
    assert nv["blocks"] <= nv["live_budget_blocks"]
    old, new = _prompt(0), _prompt(n - 1)
    assert s.lookup(NS, old[0]).matched_blocks == 0  # least recently used: evicted
    hit = s.lookup(NS, new[0])
    st, out = s.load(hit.keys)
    assert st == [Status.OK] * 4 and all(torch.equal(a, b) for a, b in zip(out, new[1]))
    s.close()
    s = _open(tmp_path)
    try:
        s.check_invariants(quiescent=True)
        back = 0
        for i in range(n):
            toks, kv = _prompt(i)
            hit = s.lookup(NS, toks)
            st, out = s.load(hit.keys)
            assert all(torch.equal(a, b) for a, b in zip(out[: hit.matched_blocks], kv))
            back += hit.matched_blocks
        assert 0 < back <= s.stats()["nvme_backend"]["live_budget_blocks"]
        for i in range(n, n + 20):  # evicting again after the reopen (a restarted LRU starts as FIFO)
            assert s.store(NS, *_prompt(i)) == [Status.OK] * 4
        s.check_invariants(quiescent=True)
    finally:
        s.close()


@pytest.fixture(scope="module")
def excerpt_reports():
    out = {}
    for gran in ("region", "block"):
        out[gran] = run_replay(
            ReplayConfig(
                limit=600,
                nvme_options={"device": "sim", "model": {"utilization": 0.9}, "eviction_granularity": gran},
            )
        )
    return out


def test_excerpt_replays_in_block_mode(excerpt_reports):
    blk, reg = excerpt_reports["block"], excerpt_reports["region"]
    for rep in (blk, reg):
        assert rep.kv["wrong_kv_blocks"] == 0 and rep.kv["io_error_blocks"] == 0
    nb = blk.final_stats["nvme_backend"]
    assert nb["block_evictions"] > 0 and nb["segments_reset"] > 0
    assert nb["blocks"] <= nb["live_budget_blocks"]
    assert "block_evictions" not in reg.final_stats["nvme_backend"]
    assert blk.device["e2e_wa"] >= 1.0 and blk.kv["saved_prefill_tokens"] > 0


def test_a_smaller_reopen_keeps_the_live_budget_and_counts_every_dropped_block(tmp_path, caplog):
    """The trial: 2 MiB -> 1 MiB -> 512 KiB recovered 46 blocks where ``live_budget_blocks`` was 37.
    Each reopen keeps exactly its live budget (the oldest blocks beyond it are dropped), and every
    block stored before the close is either recovered or counted in ``recovery_dropped_blocks``
    (tombstoned blocks in the segments past the new end are not counted again)."""
    n = 60
    s = _open(tmp_path, nvme_bytes=2 << 20)
    for i in range(n):
        assert s.store(NS, *_prompt(i)) == [Status.OK] * 4
    s.close()  # flushes the memory tiers down
    before = s.stats()["nvme_backend"]["blocks"]
    assert s.stats()["nvme_backend"]["block_evictions"] > 0  # tombstones in the segments dropped next
    for nbytes in (1 << 20, 512 << 10):
        caplog.clear()
        s = _open(tmp_path, nvme_bytes=nbytes)
        try:
            nb = s.stats()["nvme_backend"]
            assert nb["blocks"] == nb["recovered_blocks"] == nb["live_budget_blocks"] < before
            assert nb["recovered_blocks"] + nb["recovery_dropped_blocks"] == before
            assert len([r for r in caplog.records if "live budget" in r.getMessage()]) == 1
            s.check_invariants(quiescent=True)
            kept = 0
            for i in range(n):
                toks, kv = _prompt(i)
                hit = s.lookup(NS, toks)
                st, out = s.load(hit.keys)
                assert st == [Status.OK] * hit.matched_blocks
                assert all(torch.equal(a, b) for a, b in zip(out, kv))
                kept += hit.matched_blocks
            assert kept <= nb["live_budget_blocks"]
            assert s.store(NS, *_prompt(n + nbytes)) == [Status.OK] * 4
            s.check_invariants(quiescent=True)
        finally:
            s.close()
        before = s.stats()["nvme_backend"]["blocks"]
