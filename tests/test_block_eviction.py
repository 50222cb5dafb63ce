"""``tiers.nvme.eviction_granularity: block`` through KVStore and the trace replay (issue 26 item 1):
the index's NVMe policy names single victims, the store stays within its live budget, a reopen
serves only what it kept, and the packaged excerpt replays with no wrong KV."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.errors import ConfigError
from tierstore.io.segment_manager import SegmentState
from tierstore.io.segments import _gc_would_take_full_or_newest
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


SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, tokens_per_block=16)


def _small_prompt(i: int):
    toks = np.arange(i * 1000, i * 1000 + 4 * B)
    kv = np.random.default_rng(i).standard_normal((4, *SMALL.block_shape)).astype(np.float16)
    return toks, torch.from_numpy(kv)


def _open_small(path) -> KVStore:
    """4 KiB blocks, put 4 at a time: an extent of 4 spends a fifth of its slots on its header, so
    the segments fill before the live budget (which counts full extents) is reached."""
    bb = SMALL.bytes_per_block
    return KVStore(
        SMALL,
        hbm_bytes=0,
        host_bytes=16 * bb,
        nvme_path=str(path),
        nvme_bytes=2 << 20,
        eviction_granularity="block",
    )


def test_a_full_tier_reopened_evicts_its_oldest_recovered_blocks_not_the_new_ones(tmp_path):
    """The trial: after a kill -9 (here: a copy of the open tier) and a reopen, every new block was
    dropped at once by region GC (its segment, the one just written, had as few live blocks as any)
    while the recovered blocks stayed, so new prompts never hit. Segments full below the live budget
    now evict single blocks in the NVMe policy's order (after a reopen, the recovered blocks oldest
    write first), each counted."""
    n, m = 130, 60
    path = tmp_path / "tier"
    w = _open_small(tmp_path / "w")
    for i in range(n):  # the trial's writer, smaller
        w.store(NS, *_small_prompt(i), lifetime="conversation")
        if i % 5 == 0:
            w.load(w.lookup(NS, _small_prompt(i // 2)[0]).keys)
    for f in tmp_path.iterdir():  # what a kill -9 leaves: every acknowledged write is durable
        shutil.copy(f, path.with_name(f.name.replace("w", "tier", 1)))
    w.close()
    s = _open_small(path)
    try:
        nb = s.stats()["nvme_backend"]
        recovered = nb["recovered_blocks"]
        assert 0 < recovered < nb["live_budget_blocks"]  # the trial's state: full below the budget
        old = [i for i in range(n) if s.lookup(NS, _small_prompt(i)[0]).matched_blocks]
        for i in range(n, n + m):
            assert s.store(NS, *_small_prompt(i)) == [Status.OK] * 4
        nb = s.stats()["nvme_backend"]
        assert nb["region_evicted_blocks"] == 0 and nb["block_evictions"] > 0
        gone = nb["block_evictions"] + nb["region_evicted_blocks"]
        assert nb["blocks"] == recovered + nb["put_blocks_ok"] - gone
        for i in range(n + m - 40, n + m):
            toks, kv = _small_prompt(i)
            st, out = s.load(s.lookup(NS, toks).keys)
            assert st == [Status.OK] * 4 and all(torch.equal(a, b) for a, b in zip(out, kv))
        left = [i for i in old if s.lookup(NS, _small_prompt(i)[0]).matched_blocks]
        assert left and left == old[len(old) - len(left) :]  # the oldest recovered went first
        s.check_invariants(quiescent=True)
    finally:
        s.close()
    s = _open_small(path)
    try:  # an evicted recovered block never comes back (its tombstone was durable)
        assert not any(s.lookup(NS, _small_prompt(i)[0]).matched_blocks for i in old[: len(old) - len(left)])
    finally:
        s.close()


def test_the_capacity_warning_names_the_live_budget_apart_from_what_the_segments_hold(tmp_path, caplog):
    """The trial read 'holds at least 1729 blocks ... when each block is stored alone' in block mode
    and saw 1729 blocks live, while the README says at most ``live_fraction`` are: 1729 was the live
    budget (``live_fraction`` of what full extents hold), not what one-block extents hold."""
    with caplog.at_level("WARNING", logger="tierstore"):
        s = _open_small(tmp_path / "tier")
    try:
        (said,) = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
        m = re.search(r"holds at least (\d+) blocks .* up to (\d+) blocks .* keeps at most (\d+)", said)
        assert m, said
        least, most, budget = map(int, m.groups())
        assert (least, most) == s.nvme.segment_capacity_blocks()
        assert budget == s.stats()["nvme_backend"]["live_budget_blocks"]
        assert least < budget <= 0.9 * most  # live_fraction of the segments past the reserve and an open one
    finally:
        s.close()


def test_a_full_tier_with_holes_reclaims_them_by_region_gc_before_evicting_more_blocks(tmp_path):
    """``free_segment`` (b556b7a) ran whenever no segment was free: LRU victims lie scattered over the
    segments, so it evicted many before one emptied (130 per segment on the excerpt) and the tier
    held 88 % of its live budget; conversation 10 % (``bench/frontier_store.py``, ``c``, 0.90) saved
    19.73 % less prefill than a flat LRU against 8.15 % before (bench/README_frontier.md, s34blk2).
    Where region GC's choice has holes (and is not the newest segment), GC reclaims them first."""
    s = _open_small(tmp_path / "tier")
    try:
        for i in range(160):
            s.store(NS, *_small_prompt(i))
            if i % 3 == 0:
                s.load(s.lookup(NS, _small_prompt(max(0, i - 7))[0]).keys)
        nb = s.stats()["nvme_backend"]
        assert nb["regions_evicted"] >= 10  # 1 when free_segment ran first (22 now)
        assert nb["gc_evicted_blocks"] == nb["region_evicted_blocks"] > 0
        assert nb["blocks"] == nb["put_blocks_ok"] - nb["block_evictions"] - nb["region_evicted_blocks"]
        for i in range(140, 160):  # the newest prompts stay whole
            assert s.lookup(NS, _small_prompt(i)[0]).matched_blocks == 4
        s.check_invariants(quiescent=True)
    finally:
        s.close()


def test_free_segment_runs_when_gc_would_drop_a_full_or_the_newest_segment(tmp_path):
    """The rule between ``free_segment`` and region GC (``segments._gc_would_take_full_or_newest``):
    GC's first choice full of live blocks (a reopen; segments filled below the budget) or the newest
    sealed segment (its blocks were just written) -> single LRU victims; holes elsewhere -> GC."""
    s = _open_small(tmp_path / "tier")
    try:
        st = s.nvme
        for i in range(60):  # no eviction yet: every sealed segment is full of live blocks
            s.store(NS, *_small_prompt(i))
        segs = st._segs
        sealed = np.flatnonzero(segs.state == SegmentState.SEALED)
        assert sealed.size >= 3 and s.stats()["nvme_backend"]["block_evictions"] == 0
        assert _gc_would_take_full_or_newest(st)  # every segment full: GC would drop live blocks

        def hollow(si: int) -> None:  # delete all but one block of segment si
            keys = st._loc.keys_of(segs.live_rows(si, st._loc).tolist())
            st.delete(keys[1:])

        newest = int(sealed[np.argmax(segs.sealed_at[sealed])])
        hollow(newest)
        assert _gc_would_take_full_or_newest(st)  # GC's choice would be the newest segment
        oldest = int(sealed[np.argmin(segs.sealed_at[sealed])])
        hollow(oldest)
        assert oldest < newest and segs.live[oldest] == segs.live[newest] == 1  # min_live's tie: lowest index
        assert not _gc_would_take_full_or_newest(st)  # holes in an older segment: region GC
    finally:
        s.close()
