"""Scenario tests of the block index through the public API, for every eviction policy.

Internals are not pinned: every test observes the store through KVStore's
methods (lookup, load, tiers_of, state_of, stats, events) and ends with the
invariant checker.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, Status, Tier, leading_ok
from tierstore.config import PoliciesConfig
from tierstore.errors import ConfigError, InvariantError, LayoutError, QuotaExceeded, StoreClosedError
from tierstore.index import BlockIndex, BlockState, IndexRuntime, IndexShape
from tierstore.index.rows import RowTable
from tierstore.policies import policy_names

from .conftest import FakeEntry, SlowEngine, make_blocks, memory_segment_store, tokens

B = 16
POLICIES = policy_names()


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


def test_store_lookup_load_roundtrip_through_every_tier(make_store, layout, ns, policy):
    s = make_store(hbm=2, host=2, nvme=16, eviction=policy, promotion="none")
    s.record_events(True)
    blocks = {}
    for c in range(3):  # later chains push earlier ones down: every tier ends up holding blocks
        toks = tokens(4 * B, start=1000 * c)
        blocks[c] = make_blocks(layout, 4, seed=c)
        assert s.store(ns, toks, blocks[c]) == [Status.OK] * 4
    seen = set()
    for c in range(3):
        toks = tokens(4 * B, start=1000 * c)
        seen.update(t for k in s.keys_for(ns, toks) for t in s.tiers_of(k)[:1])
        with s.request() as rid:
            hit = s.lookup(ns, toks, request_id=rid)
            assert hit.matched_blocks == 4 and hit.matched_tokens == 4 * B
            st, out = s.load(hit.keys)
            assert leading_ok(st) == 4
            assert all(torch.equal(a, b) for a, b in zip(out, blocks[c]))
    assert seen == {Tier.HBM, Tier.HOST, Tier.NVME}
    kinds = [e[0] for e in s.take_events()]
    assert kinds.count("stored") == 12 and "demoted" in kinds
    s.check_invariants(quiescent=True)


def test_lookup_tiers_and_hit_counters_per_block_over_mixed_tiers(make_store, layout, ns):
    """A chain matched on three tiers: each block's tier, the per-tier hit counters, and a chain
    matched on one tier (the lookup's one-tier shortcut) counted the same way."""
    s = make_store(hbm=2, host=2, nvme=16, promotion="none")
    toks = tokens(6 * B)
    assert s.store(ns, toks, make_blocks(layout, 6)) == [Status.OK] * 6
    keys = s.keys_for(ns, toks)
    top = [s.tiers_of(k)[0] for k in keys]
    assert set(top) == {Tier.HBM, Tier.HOST, Tier.NVME}
    c0 = s.stats()
    hit = s.lookup_keys(keys)
    assert hit.tiers == top and hit.matched_blocks == 6 and len(hit.load_s) == 6
    c1 = s.stats()
    for t in (Tier.HBM, Tier.HOST, Tier.NVME):
        name = f"hit_blocks_{t.name.lower()}"
        assert c1.get(name, 0) - c0.get(name, 0) == top.count(t)
    one = [k for k, t in zip(keys, top) if t == Tier.NVME][:1]  # a 1-block chain: one tier
    hit1 = s.lookup_keys(one)
    c2 = s.stats()
    assert hit1.tiers == [Tier.NVME] and c2["hit_blocks_nvme"] - c1["hit_blocks_nvme"] == 1
    assert c2.get("hit_blocks_hbm", 0) == c1.get("hit_blocks_hbm", 0)
    assert c2["lookup_hits"] - c1["lookup_hits"] == 1
    s.check_invariants(quiescent=True)


def test_deterministic_slot_ids_and_events(make_store, layout, ns):
    s = make_store(hbm=4, host=0, nvme=0)
    s.record_events(True)
    toks = tokens(3 * B)
    s.store(ns, toks, make_blocks(layout, 3))
    keys = s.keys_for(ns, toks)
    assert [s._index.memory_slot(k, Tier.HBM) for k in keys] == [0, 1, 2]
    assert s.take_events() == [("stored", k, "hbm") for k in keys]
    assert s.take_events() == []


@pytest.mark.parametrize("ntok,expect_blocks", [(4 * B, 4), (4 * B - 1, 3), (4 * B + 1, 4)])
def test_block_boundaries(make_store, layout, ns, ntok, expect_blocks):
    s = make_store()
    full = tokens(5 * B)
    s.store(ns, full, make_blocks(layout, 5))
    hit = s.lookup(ns, full[:ntok])
    assert hit.matched_blocks == expect_blocks
    assert hit.matched_tokens == expect_blocks * B
    assert s.stats()["partial_tail_tokens"] == ntok - expect_blocks * B


def test_partial_tail_is_never_stored(make_store, layout, ns):
    s = make_store()
    with pytest.raises(LayoutError):
        s.store(ns, tokens(2 * B + 5), make_blocks(layout, 3))
    assert s.stats()["blocks"] == 0
    s.check_invariants(quiescent=True)


@pytest.mark.parametrize("field", ["tenant", "model", "adapter"])
def test_identity_isolation_both_directions(make_store, layout, field):
    s = make_store()
    a = Namespace(model="m@1", adapter="", tenant="A")
    b = dataclasses.replace(a, **{field: "other"})
    toks = tokens(3 * B)
    s.store(ns=a, token_ids=toks, kv_blocks=make_blocks(layout, 3))
    assert s.lookup(b, toks).matched_blocks == 0
    assert s.lookup(a, toks).matched_blocks == 3
    s.store(b, toks, make_blocks(layout, 3, seed=1))
    assert s.lookup(b, toks).matched_blocks == 3
    st, out = s.load(s.lookup(a, toks))
    assert torch.equal(out[0], make_blocks(layout, 3)[0])


def test_duplicate_store_is_idempotent_and_does_not_fail_batch(make_store, layout, ns):
    s = make_store()
    toks = tokens(4 * B)
    blocks = make_blocks(layout, 4)
    s.store(ns, toks[: 2 * B], blocks[:2])
    assert s.store(ns, toks, blocks) == [Status.EXISTS, Status.EXISTS, Status.OK, Status.OK]


def test_store_without_space_is_rejected_cleanly(make_store, layout, ns):
    s = make_store(hbm=2, host=0, nvme=0)
    toks = tokens(2 * B)
    with s.request() as rid:
        s.store(ns, toks, make_blocks(layout, 2))
        s.lookup(ns, toks, request_id=rid)  # both ACTIVE: nothing evictable
        other = tokens(3 * B, start=10_000)
        assert s.store(ns, other, make_blocks(layout, 3)) == [Status.NO_SPACE] * 3
        assert s.lookup(ns, toks).matched_blocks == 2  # existing entries intact
    s.check_invariants(quiescent=True)


def test_active_and_pinned_blocks_are_never_victims(make_store, layout, ns, clock, policy):
    s = make_store(hbm=3, host=0, nvme=0, eviction=policy)
    a, b = tokens(B), tokens(B, start=100)
    s.store(ns, a, make_blocks(layout, 1))
    s.store(ns, b, make_blocks(layout, 1))
    ka, kb = s.keys_for(ns, a)[0], s.keys_for(ns, b)[0]
    with s.request() as rid:
        s.lookup(ns, a, request_id=rid)
        assert s.state_of(ka) is BlockState.ACTIVE
        lease = s.pin(ns, b, lease_s=10)
        assert s.state_of(kb) is BlockState.PINNED
        st = s.store(ns, tokens(3 * B, start=500), make_blocks(layout, 3))
        assert st[0] == Status.OK and st[1] == Status.NO_SPACE
        assert s.resident([ka, kb]) == [True, True]
    assert s.state_of(ka) is BlockState.EVICTABLE
    clock.advance(11)  # lease expires
    assert s.state_of(kb) is BlockState.EVICTABLE
    assert s.store(ns, tokens(2 * B, start=900), make_blocks(layout, 2)) == [Status.OK, Status.OK]
    assert s.unpin(lease) in (True, False)
    s.check_invariants(quiescent=True)


def test_pin_quota(make_store, layout, ns):
    s = make_store(pin_quota_bytes=2 * layout.bytes_per_block)
    toks = tokens(3 * B)
    s.store(ns, toks, make_blocks(layout, 3))
    with pytest.raises(QuotaExceeded):
        s.pin(ns, toks)
    lease = s.pin(ns, toks[: 2 * B])
    assert s.unpin(lease)
    assert not s.unpin(lease)
    with pytest.raises(ConfigError):
        s.pin(ns, toks, lease_s=0)


def test_aborted_request_releases_references(make_store, layout, ns):
    s = make_store()
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    with pytest.raises(RuntimeError):
        with s.request() as rid:
            s.lookup(ns, toks, request_id=rid)
            assert all(s.state_of(k) is BlockState.ACTIVE for k in s.keys_for(ns, toks))
            raise RuntimeError("engine aborted the request")
    assert all(s.state_of(k) is BlockState.EVICTABLE for k in s.keys_for(ns, toks))
    assert s.stats()["aborted_requests"] == 1
    s.check_invariants(quiescent=True)


def test_probe_does_not_reference_or_touch(make_store, layout, ns):
    s = make_store(hbm=2, host=0, nvme=0)
    a = tokens(B)
    s.store(ns, a, make_blocks(layout, 1))
    s.store(ns, tokens(B, start=50), make_blocks(layout, 1))
    for _ in range(5):
        assert s.probe(ns, a) == B
        assert s.exists(s.keys_for(ns, a)) == 1
    assert s.stats()["lookups"] == 0 if "lookups" in s.stats() else True
    s.store(ns, tokens(B, start=99), make_blocks(layout, 1))  # evicts the LRU block: a
    assert s.probe(ns, a) == 0


def test_demotion_and_promotion(make_store, layout, ns):
    s = make_store(hbm=1, host=1, nvme=8, promotion="top")
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    k = s.keys_for(ns, toks)[0]
    assert s.evict(Tier.HBM, 1) == 1
    assert s.tiers_of(k) == [Tier.HOST]
    assert s.evict(Tier.HOST, 1) == 1
    assert s.tiers_of(k) == [Tier.NVME]
    st, out = s.load(s.lookup(ns, toks))
    assert st == [Status.OK] and torch.equal(out[0], make_blocks(layout, 1)[0])
    assert s.tiers_of(k) == [Tier.HBM, Tier.NVME]  # promoted, NVMe copy kept
    before = s.stats().get("nvme_write_bytes", 0)
    s.evict(Tier.HBM, 1)  # has a lower copy: nothing is rewritten to flash
    assert s.stats().get("nvme_write_bytes", 0) == before
    s.check_invariants(quiescent=True)


def test_invalidate_namespace_defers_in_use_blocks(make_store, layout, ns):
    s = make_store()
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    used = s.stats()["bytes_per_tier"]
    with s.request() as rid:
        s.lookup(ns, toks, request_id=rid)
        assert s.invalidate(ns) == 2
        assert s.lookup(ns, toks).matched_blocks == 0
        assert s.bytes_per_tier() == used  # still held by the request
        s.check_invariants(quiescent=True)
    assert sum(s.bytes_per_tier().values()) == 0
    s.check_invariants(quiescent=True)


def test_token_verification_catches_collision(make_store, layout, ns):
    s = make_store(verify_tokens=True)
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    key = s.keys_for(ns, toks)
    r = s._index.lookup(key, [tokens(B, start=7)])  # same key, different tokens: a forged collision
    assert r.matched_blocks == 0 and s.stats()["verify_mismatch"] == 1
    assert s.lookup(ns, toks).matched_blocks == 1


def test_corrupt_nvme_block_is_a_miss_not_wrong_kv(make_store, layout, ns):
    s = make_store(hbm=0, host=0, nvme=4)
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    key = s.keys_for(ns, toks)[0]
    _, off = s.nvme.locate(key)
    s.nvme.engine.raw()[off + 5] ^= 0x01
    st, out = s.load(s.lookup(ns, toks))
    assert st == [Status.IO_ERROR] and out == [None]
    assert s.lookup(ns, toks).matched_blocks == 0  # never served again
    assert s.stats()["io_errors"] == 1
    s.check_invariants(quiescent=True)


def test_a_failed_block_is_counted_only_in_its_leading_run(make_store, layout, ns):
    """Issue 19 item 3: metrics count the blocks the engine uses (the leading OK run)."""
    s = make_store(hbm=0, host=0, nvme=16)
    toks = tokens(8 * B)
    s.store(ns, toks, make_blocks(layout, 8))
    keys = s.keys_for(ns, toks)
    _, off = s.nvme.locate(keys[4])
    s.nvme.engine.raw()[off + 7] ^= 0x10
    st, _ = s.load(keys)
    assert st == [Status.OK] * 4 + [Status.IO_ERROR] + [Status.OK] * 3
    snap = s.stats()
    assert snap["loaded_blocks"] == 4 and snap["reused_tokens"] == 4 * B


def test_concurrent_cold_loads_share_one_read(layout, ns, clock):
    """Delay hits: four loads of one cold NVMe block while its read is in flight
    read it once; the others find it promoted."""
    slow = SlowEngine.make(64 << 20)
    s = KVStore(
        layout,
        hbm_bytes=0,
        host_bytes=4 * layout.bytes_per_block,
        nvme=memory_segment_store(layout, 8, slow),
        clock=clock,
        promotion="top",
    )
    try:
        toks = tokens(B)
        s.store(ns, toks, make_blocks(layout, 1))
        s.evict(Tier.HOST, 1)
        key = s.keys_for(ns, toks)
        reads_before = s.nvme.stats()["get_hits"]
        slow.slow_reads = True
        results = []
        ths = [threading.Thread(target=lambda: results.append(s.load(key))) for _ in range(4)]
        for t in ths:
            t.start()
        assert slow.read_started.wait(10)
        time.sleep(0.3)
        slow.release.set()
        for t in ths:
            t.join(30)
        assert all(r[0] == [Status.OK] for r in results)
        assert all(torch.equal(r[1][0], make_blocks(layout, 1)[0]) for r in results)
        assert s.nvme.stats()["get_hits"] - reads_before == 1
        assert s.stats()["merged_loads"] == 3
        s.check_invariants(quiescent=True)
    finally:
        slow.release.set()
        s.close()


def test_useful_hits_follow_cost_model(make_store, layout, ns):
    s = make_store(hbm=0, host=0, nvme=8)
    s.cost_model.prefill_tokens_per_s = 1e12  # recompute is nearly free
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    hit = s.lookup(ns, toks)
    assert hit.matched_blocks == 2 and hit.useful_blocks == 0
    s.cost_model.prefill_tokens_per_s = 10.0  # recompute is slow
    assert s.lookup(ns, toks).useful_blocks == 2


def test_nvme_region_eviction_frees_whole_segments(layout, ns, clock):
    """The region manager evicts whole segments and the index hears of every
    block that left: index and NVMe tier always agree."""
    from tierstore.io import SegmentStorage

    bb = layout.bytes_per_block
    nv = SegmentStorage(
        None,
        capacity_bytes=8 * 64 * 1024,
        block_bytes=bb,
        segment_size_bytes=64 * 1024,
        engine="memory",
        extent_size_bytes=64 * 1024,
        owns_engine=True,
    )
    s = KVStore(layout, hbm_bytes=0, host_bytes=0, nvme=nv, clock=clock)
    try:
        for i in range(40):
            toks = tokens(4 * B, start=1000 * i)
            assert s.store(ns, toks, make_blocks(layout, 4, seed=i)) == [Status.OK] * 4
        st = nv.stats()
        assert st["dead_blocks"] == 0 and st["regions_evicted"] > 0
        assert s.bytes_per_tier()["nvme"] == st["blocks"] * bb
        hit = s.lookup(ns, tokens(4 * B, start=1000 * 39))
        assert hit.matched_blocks == 4
        assert s.lookup(ns, tokens(4 * B)).matched_blocks == 0  # the oldest region went first
        s.check_invariants(quiescent=True)
    finally:
        s.close()


# ----------------------------------------------------------------------------- concurrency
def test_lookups_proceed_while_a_demotion_writes_to_a_slow_nvme(layout, ns, clock):
    """The index lock is never held across I/O: a store whose demotion is stuck
    in an NVMe write does not stop lookups (of other blocks) or loads from memory."""
    slow = SlowEngine.make(64 << 20)
    bb = layout.bytes_per_block
    s = KVStore(
        layout, hbm_bytes=0, host_bytes=4 * bb, nvme=memory_segment_store(layout, 32, slow), clock=clock
    )
    try:
        hot = tokens(2 * B, start=50_000)
        s.store(ns, hot, make_blocks(layout, 2, seed=9))
        s.store(ns, tokens(2 * B), make_blocks(layout, 2))  # host now full
        assert s.lookup(ns, hot).matched_blocks == 2  # hot is the most recently used: not a victim
        slow.slow_writes = True
        fut = s.store(ns, tokens(2 * B, start=7000), make_blocks(layout, 2, seed=3), wait=False)
        assert slow.write_started.wait(10)  # the demotion of two victims is writing
        t0 = time.perf_counter()
        for _ in range(200):
            assert s.lookup(ns, hot).matched_blocks == 2
        st, out = s.load(s.lookup(ns, hot))
        elapsed = time.perf_counter() - t0
        assert leading_ok(st) == 2 and torch.equal(out[0], make_blocks(layout, 2, seed=9)[0])
        assert not fut.done() and elapsed < 5
        slow.release.set()
        assert fut.result(30) == [Status.OK, Status.OK]
        s.check_invariants(quiescent=True)
    finally:
        slow.release.set()
        s.close()


def test_load_deadline_turns_a_slow_read_into_a_miss_then_completes_harmlessly(layout, ns, clock):
    """Seed failure injection 7: an SSD load slowed past its deadline is a MISS
    (the engine recomputes); the late read then lands without touching the
    engine's buffer, nothing is freed twice, and a later load succeeds."""
    slow = SlowEngine.make(64 << 20)
    bb = layout.bytes_per_block
    s = KVStore(
        layout, hbm_bytes=0, host_bytes=2 * bb, nvme=memory_segment_store(layout, 16, slow), clock=clock
    )
    try:
        toks = tokens(2 * B)
        blocks = make_blocks(layout, 2)
        s.store(ns, toks, blocks)
        s.evict(Tier.HOST, 2)
        keys = s.keys_for(ns, toks)
        slow.slow_reads = True
        dest = torch.zeros((2, *layout.block_shape), dtype=layout.dtype)
        st, out = s.load(keys, list(dest.unbind(0)), timeout_s=0.3)
        assert st == [Status.MISS, Status.MISS] and out == [None, None]
        assert s.stats()["load_timeouts"] == 1
        slow.release.set()
        s.drain()  # the late read completes in the background
        assert not dest.any(), "a load past its deadline wrote into the engine's buffer"
        st, out = s.load(keys)
        assert leading_ok(st) == 2 and all(torch.equal(a, b) for a, b in zip(out, blocks))
        s.check_invariants(quiescent=True)
    finally:
        slow.release.set()
        s.close()


def test_load_deadline_turns_a_slow_memory_copy_into_misses(make_store, layout, ns):
    """Seed failure injection 7, CPU side: host-tier copies slowed (0.25 s a
    block, injected into the mover) past a 0.3 s deadline. The blocks not
    delivered by then are MISS and their destinations stay untouched (a copy
    in progress at the deadline finishes first and counts as delivered); the
    late part of the load skips its copies, frees nothing twice, and the
    blocks load later."""
    s = make_store(hbm=0, host=4, nvme=0)
    toks = tokens(4 * B)
    blocks = make_blocks(layout, 4)
    s.store(ns, toks, blocks)
    keys = s.keys_for(ns, toks)
    mover = s._mover.memory  # every memory copy passes through the memory handler's view
    real_view = mover.view

    def slow_view(tier, slot):
        time.sleep(0.25)
        return real_view(tier, slot)

    mover.view = slow_view
    dest = torch.zeros((4, *layout.block_shape), dtype=layout.dtype)
    st, out = s.load(keys, list(dest.unbind(0)), timeout_s=0.3)  # all four copies take >= 1 s
    assert st[-1] is Status.MISS and s.stats()["load_timeouts"] == 1
    for i, x in enumerate(st):
        if x is Status.OK:
            assert torch.equal(dest[i], blocks[i]) and out[i] is not None
        else:
            assert x is Status.MISS and out[i] is None and not dest[i].any(), "a missed block was written"
    s.drain()  # the late part completes in the background
    mover.view = real_view
    s.check_invariants(quiescent=True)
    assert s.references() == {}
    st, out = s.load(keys)
    assert leading_ok(st) == 4 and all(torch.equal(a, b) for a, b in zip(out, blocks))


def test_load_deadline_from_memory_delivers_in_time(make_store, layout, ns):
    s = make_store(hbm=0, host=4, nvme=0)
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    st, out = s.load(s.keys_for(ns, toks), timeout_s=30)
    assert st == [Status.OK, Status.OK]
    with pytest.raises(ConfigError):
        s.load(s.keys_for(ns, toks), timeout_s=0)
    fut = s.store(ns, tokens(3 * B), make_blocks(layout, 3), wait=False)  # the mover's store queue
    assert fut.result(30)[2] is Status.OK
    s.close()
    with pytest.raises(StoreClosedError):  # a closed store takes no more work
        s.load(s.keys_for(ns, toks), wait=False)


# ----------------------------------------------------------------------------- two-phase contract
def _index(*, nvme: bool = False, clock=None, **shape_kw) -> BlockIndex:
    runtime = IndexRuntime() if clock is None else IndexRuntime(clock=clock)
    shape = IndexShape(4096, 16, nvme_blocks=0 if nvme else None, **shape_kw)
    return BlockIndex(shape, PoliciesConfig(), runtime)


def _k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_the_index_refuses_a_shape_its_policies_cannot_use():
    """IndexShape.check: write-through needs an NVMe tier, and some tier must exist."""
    with pytest.raises(ConfigError, match="write_policy='write_through' needs an NVMe tier"):
        BlockIndex(IndexShape(4096, 16, host_blocks=4), PoliciesConfig(write_policy="write_through"))
    with pytest.raises(ConfigError, match="every tier is disabled"):
        BlockIndex(IndexShape(4096, 16), PoliciesConfig())
    ix = BlockIndex(IndexShape(4096, 16, nvme_blocks=0), PoliciesConfig(write_policy="write_through"))
    assert ix.tiers == [Tier.NVME]


def test_a_growing_row_table_keeps_every_room_on_its_new_arrays():
    """The RowTable replaces its arrays when it grows (index/rows.py); the rooms that share it
    (pins, placement, completion, introspection) must all see the new ones: a pin taken before
    the growth still protects its blocks, the blocks stored across it are all resident, and the
    slots, flags and policies agree afterwards."""
    ix = _index(host_blocks=8, nvme=True)
    ns = bytes(32)
    first = [_k(i) for i in range(8)]
    ix.complete_store(ix.prepare_store(ns, first))
    ix.pin(ns, first[:2], lease_s=100.0)
    cap = ix.rows.table.capacity_rows
    keys = [_k(1000 + i) for i in range(2 * cap)]
    plan = ix.prepare_store(ns, keys)
    ix.complete_store(
        plan,
        nvme_statuses={i: Status.OK for i, _ in plan.nvme_new},
        demote_statuses={d.row: Status.OK for d in plan.nvme_demote},
    )
    assert ix.rows.table.capacity_rows > cap
    assert ix.state_of(first[0]) is BlockState.PINNED and Tier.HOST in ix.tiers_of(first[0])
    assert ix.probe(keys) == len(keys)
    assert ix.resident_blocks()["host"] == 8
    ix.pin(ns, keys[-1:], lease_s=100.0)
    assert ix.state_of(keys[-1]) is BlockState.PINNED
    ix.check_invariants(quiescent=True)


def test_namespace_ids_past_uint16_widen_the_rows_namespace_column():
    """Row namespace ids are ``uint16`` (index/rows.py) until a 65536th namespace: the column
    is widened then, and every block keeps its namespace (never a wrapped id)."""
    ix = _index(host_blocks=8)
    first, late = b"\x01" * 32, b"\x02" * 32
    ix.complete_store(ix.prepare_store(first, [_k(1)]))
    for i in range(1, 1 << 16):  # ids 2..65536 after `first`'s 1: `late` gets 65537
        ix.rows.namespaces.intern(i.to_bytes(32, "big"))
    assert ix.rows.ns.dtype == np.uint16
    ix.complete_store(ix.prepare_store(late, [_k(2)]))
    assert ix.rows.namespaces.ids[late] > 0xFFFF and ix.rows.ns.dtype == np.int32
    assert ix.rows.view(ix.rows.table.get(_k(2))).ns == late
    assert ix.rows.view(ix.rows.table.get(_k(1))).ns == first


def test_a_memory_tier_slot_column_is_int16_only_when_every_slot_fits():
    """index/rows.py: 2 bytes a row for a tier of at most 32768 slots, 4 above; slot ids and the
    -1 of "not in this tier" read back exactly in both, across a growth of the table."""
    rt = RowTable(16, 64, {Tier.HBM: 1 << 15, Tier.HOST: (1 << 15) + 1})
    assert rt.slot[Tier.HBM].dtype == np.int16 and rt.slot[Tier.HOST].dtype == np.int32
    assert RowTable(16, 64).slot[Tier.HBM].dtype == np.int32  # no counts: the wide column
    rows = rt.new_rows([_k(i) for i in range(40)], 0, np.arange(40), -1, 0.0)
    rt.set_slot(int(rows[0]), Tier.HBM, (1 << 15) - 1)
    rt.set_slot(int(rows[1]), Tier.HOST, 1 << 15)
    rt.grow()
    assert int(rt.slot[Tier.HBM][rows[0]]) == (1 << 15) - 1 and int(rt.slot[Tier.HOST][rows[1]]) == 1 << 15
    assert int(rt.slot[Tier.HBM][rows[1]]) == -1 and rt.top(int(rows[0])) is None  # still PENDING


def test_chain_positions_past_int16_widen_the_position_column():
    rt = RowTable(16, 64)
    rows = rt.new_rows([_k(1), _k(2)], 0, np.array([0, 0x7FFF]), -1, 0.0)
    assert rt.pos.dtype == np.int16
    far = rt.new_rows([_k(3)], 0, np.array([0x8000]), -1, 0.0)
    assert rt.pos.dtype == np.int32
    assert rt.view(int(far[0])).position == 0x8000 and rt.view(int(rows[1])).position == 0x7FFF


def test_abandoned_prepare_store_leaks_nothing():
    ix = _index(hbm_blocks=2, host_blocks=2)
    ns = bytes(32)
    done = ix.prepare_store(ns, [_k(1), _k(2)])
    ix.complete_store(done)
    plan = ix.prepare_store(ns, [_k(3), _k(4), _k(5)])  # evicts: victims are held
    assert ix.in_flight() == 1
    assert ix.probe([_k(3)]) == 0  # not visible before completion
    ix.abort_store(plan)
    ix.check_invariants(quiescent=True)
    assert ix.probe([_k(1), _k(2)]) == 2 and ix.probe([_k(3)]) == 0
    with pytest.raises(InvariantError):
        ix.complete_store(plan)


def test_failed_complete_store_keeps_victims_and_forgets_new_blocks():
    ix = _index(hbm_blocks=1, host_blocks=1)
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1), _k(2)]))
    plan = ix.prepare_store(ns, [_k(3)])
    assert plan.copies or plan.frees  # a victim was chosen
    st = ix.complete_store(plan, failed=True)
    assert st == [Status.IO_ERROR]
    assert ix.probe([_k(1), _k(2)]) == 2 and ix.probe([_k(3)]) == 0
    ix.check_invariants(quiescent=True)


def test_nvme_write_failure_refuses_the_rest_of_the_chain():
    ix = _index(nvme=True)
    plan = ix.prepare_store(bytes(32), [_k(1), _k(2), _k(3)])
    assert [i for i, _ in plan.nvme_new] == [0, 1, 2]
    st = ix.complete_store(plan, {0: Status.OK, 1: Status.NO_SPACE, 2: Status.OK})
    assert st == [Status.OK, Status.NO_SPACE, Status.NO_SPACE]
    assert ix.probe([_k(1), _k(2), _k(3)]) == 1
    ix.check_invariants(quiescent=True)


def test_load_completing_after_its_lease_expired_is_harmless():
    now = [0.0]
    ix = _index(host_blocks=2, clock=lambda: now[0])
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1)]))
    ix.pin(ns, [_k(1)], lease_s=1.0)
    plan = ix.prepare_load([_k(1)])
    now[0] = 5.0  # the lease expired while the bytes moved
    assert ix.complete_load(plan, [Status.OK]) is None
    assert ix.state_of(_k(1)) is BlockState.EVICTABLE
    ix.check_invariants(quiescent=True)


class _CountingLeases(dict):
    """The pin room's lease dict, counting the leases any iteration over it visits."""

    visited = 0

    def items(self):
        type(self).visited += len(self)
        return super().items()


def test_a_pin_does_not_visit_every_live_lease():
    """Many leases on one block: a pin pops only the leases that are due, it scans none.

    ``Pins.expire`` used to run over every live lease on each ``pin`` (8,000 leases on one block
    made a pin ~3.5x slower than 2,000, measured through ``KVStore.pin``).
    """
    now = [0.0]
    ix = _index(host_blocks=2, clock=lambda: now[0])
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1)]))
    ix.pins.leases = _CountingLeases(ix.pins.leases)
    for _ in range(500):
        ix.pin(ns, [_k(1)], lease_s=3600.0)
    _CountingLeases.visited = 0
    for _ in range(100):
        ix.pin(ns, [_k(1)], lease_s=3600.0)
    assert _CountingLeases.visited < 500, _CountingLeases.visited  # was 100 pins x 500+ leases
    assert len(ix.leases) == 600


class _CountingPins(dict):
    """One row's {lease id: expiry}, counting the leases a scan of its values visits."""

    visited = 0

    def values(self):
        type(self).visited += len(self)
        return super().values()


def test_an_unpin_scans_the_rows_other_leases_only_when_it_held_the_latest_expiry():
    """Ending one of 500 leases on a block: the block's ``pin_until`` is rescanned only when the
    ended lease held the latest expiry (was: a scan of every lease on the row each time, 205 us an
    unpin at 8,000 leases on one block), and ``pin_until`` stays the latest live expiry."""
    now = [0.0]
    ix = _index(host_blocks=2, clock=lambda: now[0])
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1)]))
    leases = [ix.pin(ns, [_k(1)], lease_s=100.0 + i) for i in range(500)]
    row = next(iter(ix.pins.row_pins))
    ix.pins.row_pins[row] = _CountingPins(ix.pins.row_pins[row])
    _CountingPins.visited = 0
    for lease in leases[:400]:  # the oldest first: none held the latest expiry
        assert ix.unpin(lease.lease_id)
    assert _CountingPins.visited == 0
    rt = ix.pins.rows
    assert rt.pin_until[row] == rt.tick(leases[-1].expiry_s, up=True)
    assert ix.unpin(leases[-1].lease_id)  # the latest: the 99 others are scanned once
    assert _CountingPins.visited == 99
    assert rt.pin_until[row] == rt.tick(leases[-2].expiry_s, up=True)
    now[0] = leases[-2].expiry_s + 1
    assert ix.leases == {} and ix.state_of(_k(1)) is BlockState.EVICTABLE
    ix.check_invariants(quiescent=True)


def test_leases_expire_in_time_once_each_with_unpinned_ones_between():
    """The expiry heap: due leases end and are counted once; an unpinned lease is not counted as
    expired when its time comes; the heap stays within a constant factor of the live leases."""
    now = [0.0]
    ix = _index(host_blocks=2, clock=lambda: now[0])
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1)]))
    short = [ix.pin(ns, [_k(1)], lease_s=10.0 + i) for i in range(5)]
    long = ix.pin(ns, [_k(1)], lease_s=1000.0)
    assert ix.unpin(short[0].lease_id) and ix.unpin(short[1].lease_id)
    now[0] = 12.5  # short[2] (12 s) is due, short[3] (13 s) is not
    live = ix.leases
    assert sorted(live) == sorted([short[3].lease_id, short[4].lease_id, long.lease_id])
    assert ix.metrics.snapshot()["pin_expired"] == 1
    assert ix.state_of(_k(1)) is BlockState.PINNED
    now[0] = 20.0
    assert sorted(ix.leases) == [long.lease_id]
    assert ix.metrics.snapshot()["pin_expired"] == 3
    for _ in range(2000):  # pin/unpin churn under a long lease
        assert ix.unpin(ix.pin(ns, [_k(1)], lease_s=1000.0).lease_id)
    assert len(ix.pins._expiry_heap) <= 2 * len(ix.pins.leases) + 65
    now[0] = 2000.0
    assert ix.leases == {} and ix.metrics.snapshot()["pin_expired"] == 4
    assert ix.state_of(_k(1)) is BlockState.EVICTABLE
    ix.check_invariants(quiescent=True)


def test_invalidate_while_a_store_is_in_flight_discards_it():
    ix = _index(host_blocks=4)
    ns = bytes(32)
    plan = ix.prepare_store(ns, [_k(1), _k(2)])
    t = threading.Thread(target=lambda: ix.invalidate(ns))
    t.start()
    time.sleep(0.1)
    assert t.is_alive()  # waits for the store, so a durable record can follow it
    ix.complete_store(plan)
    t.join(10)
    assert not t.is_alive() and ix.probe([_k(1)]) == 0
    ix.check_invariants(quiescent=True)


def test_batch_policy_hooks_decide_as_the_single_ones(policy):
    """The index tells policies about a chain at once (on_insert_many /
    on_access_many); every policy must then pick the victims it would pick
    when told key by key."""
    from tierstore.policies import make_policy

    one, many = make_policy(policy), make_policy(policy)
    keys = [i.to_bytes(32, "little") for i in range(40)]
    ents = {k: FakeEntry(k, position=i % 8) for i, k in enumerate(keys)}
    ops = [
        ("insert", keys[0:16]),
        ("access", keys[4:12]),
        ("insert", keys[16:32]),
        ("access", keys[0:3] + keys[20:25]),
        ("insert", keys[32:40]),
        ("access", keys[30:36]),
    ]
    for now, (op, ks) in enumerate(ops):
        for k in ks:
            ents[k].hits += op == "access"
            ents[k].last_access_s = float(now)
            getattr(one, f"on_{op}")(ents[k], float(now))
        getattr(many, f"on_{op}_many")(ks, lambda j, ks=ks: ents[ks[j]], float(now))
    assert len(one) == len(many) == 40
    never = lambda k: False  # noqa: E731
    assert one.evict(12, never, 10.0) == many.evict(12, never, 10.0)


def test_a_store_failing_midway_never_serves_overwritten_victims(make_store, layout, ns):
    """The mover gathers a new block into a victim's slot, then the next
    source raises: the victim must not be restored (its slot holds the new
    block's bytes now). It is a miss, never wrong KV; nothing leaks."""
    from tierstore.io.pages import FragmentPlan

    class Exploding(FragmentPlan):
        def __init__(self):
            super().__init__(None, layout.bytes_per_block, None, torch.uint8, 1)

        def gather(self, staging, offset):
            raise RuntimeError("source memory went away")

    s = make_store(hbm=0, host=2, nvme=0)
    old = make_blocks(layout, 2, seed=1)
    s.store(ns, tokens(2 * B), old)
    new = make_blocks(layout, 1, seed=2)[0]
    keys = [bytes([5, i]) + bytes(30) for i in range(2)]
    with pytest.raises(RuntimeError):
        s.store_keys(ns, keys, [new, Exploding()])
    assert s.stats()["store_failed_midway"] == 1
    for k, blk in zip(s.keys_for(ns, tokens(2 * B)), old):
        st, out = s.load([k])
        assert st == [Status.MISS] or torch.equal(out[0], blk), "a victim's overwritten slot was served"
    assert not any(s.resident(keys))
    s.check_invariants(quiescent=True)
    assert s.store_keys(ns, keys, make_blocks(layout, 2, seed=3)) == [Status.OK, Status.OK]  # nothing leaked


def test_resident_blocks_counts_nvme_copies_with_the_index_lock_released(monkeypatch):
    """The NVMe count of ``resident_blocks`` (and so of ``stats`` and ``bytes_per_tier``, which a
    metrics scrape polls) is a pass over every row's flags: 10M rows took ~25 ms under the index
    lock, and every lookup waited for it (issue 25 item 4). It runs after the lock is released,
    and it still counts only indexed rows on NVMe: not doomed rows, not freed rows."""
    import numpy as np

    import tierstore.index.introspect as introspect

    ix = _index(host_blocks=4, nvme=True)
    ns = bytes(32)
    keys = [_k(i) for i in range(12)]
    plan = ix.prepare_store(ns, keys)
    ix.complete_store(
        plan,
        nvme_statuses={i: Status.OK for i, _ in plan.nvme_new},
        demote_statuses={d.row: Status.OK for d in plan.nvme_demote},
    )
    on_nvme = ix.resident_blocks()["nvme"]
    assert on_nvme == sum(Tier.NVME in ix.tiers_of(k) for k in keys) > 0
    ix.remove(keys[:2])  # freed rows: their flags are cleared
    ix.check_invariants(quiescent=True)
    assert ix.resident_blocks()["nvme"] == sum(Tier.NVME in ix.tiers_of(k) for k in keys)
    held = []

    class Numpy:
        def __getattr__(self, name):
            return getattr(np, name)

        def count_nonzero(self, a):
            held.append(ix._lock._is_owned())
            return np.count_nonzero(a)

    monkeypatch.setattr(introspect, "np", Numpy())
    ix.resident_blocks()
    assert held == [False]


def test_a_region_callback_holds_the_index_lock_per_chunk_and_decides_as_per_block():
    """A region of small blocks holds ~16k of them: examining and dropping them in one hold of
    the index lock kept lookups waiting 13 ms and 55-77 ms (issue 25 item 4). The listener takes
    the lock per CHUNK_KEYS keys, and still keeps exactly the blocks in use (pinned or referenced)
    and drops the others from NVMe."""
    from tierstore.index.listener import CHUNK_KEYS

    ix = _index(nvme=True)
    ns = bytes(32)
    n = 2 * CHUNK_KEYS + 10
    keys = [_k(i) for i in range(n)]
    plan = ix.prepare_store(ns, keys)
    ix.complete_store(plan, nvme_statuses={i: Status.OK for i, _ in plan.nvme_new})
    ix.pin(ns, keys[5:7], lease_s=100.0)
    assert ix.lookup(keys[:1], request_id="r").matched_blocks == 1  # keys[0] referenced
    inner = ix.listener._lock
    holds = []

    class Counting:
        def __enter__(self):
            holds.append(1)
            return inner.__enter__()

        def __exit__(self, *exc):
            return inner.__exit__(*exc)

    ix.listener._lock = Counting()
    keep = ix.listener.on_reclaim(keys + [_k(10**6)])  # an unknown key is not kept
    assert [i for i, k in enumerate(keep) if k] == [0, 5, 6]
    assert len(holds) == 3  # ceil((n + 1) / CHUNK_KEYS)
    holds.clear()
    ix.listener.on_dropped([k for k, kept in zip(keys, keep) if not kept])
    assert len(holds) == 3
    ix.listener._lock = inner
    assert ix.resident_blocks()["nvme"] == 3
    assert ix.lookup(keys[5:7]).matched_blocks == 2 and ix.lookup(keys[1:2]).matched_blocks == 0
    ix.release("r")
    ix.check_invariants(quiescent=True)


def test_victims_short_of_the_need_are_taken_in_one_pass_from_an_lru_tier():
    """When a tier holds fewer evictable blocks than a store needs, choose_victims took them one
    evict(1) at a time, each scanning the LRU order again from its cold end past every protected
    block: a 256-block store into a 64-slot host tier held the index lock 16-19 ms (issue 25
    item 4), and 20-40 ms CPU still with picks in halving runs. For a policy whose evict(k) is k
    such picks (LRU), the partial answer comes from one evict_upto call: the same victims, in
    the same order, each key tested once (a chunk at a time with the index's vectorised test)."""
    import types

    import numpy as np

    from tierstore.index.placement import choose_victims
    from tierstore.policies.lru import LRUPolicy

    lru = LRUPolicy()
    assert lru.evict_is_prefix
    keys = [_k(i) for i in range(64)]
    for k in keys:
        lru.on_insert(types.SimpleNamespace(key=k), 0.0)
    pinned = set(keys[:8]) | set(keys[30:34])
    calls, tested = [], []

    def evict(m, p, s):
        calls.append(m)
        return lru.evict(m, p, 0.0, max_scan=s)

    def prot(k):
        tested.append(k)
        return k in pinned

    one_by_one = choose_victims(evict, 256, 1, prot, None)
    singles, scanned = len(calls), len(tested)
    calls.clear(), tested.clear()
    upto = choose_victims(evict, 256, 1, prot, None, lambda m, p, s: lru.evict_upto(m, p, 0.0, max_scan=s))
    assert upto == one_by_one == [k for k in keys if k not in pinned]
    assert singles == 1 + 52 + 1 and scanned > 52 * 8  # evict(256), 52 picks, a refused pick
    assert calls == [] and sorted(tested) == sorted(keys)  # one pass: each key tested once

    class Vector:  # the index's protector: a chunk of keys tested in one call
        def __init__(self):
            self.chunks = []

        def __call__(self, k):
            raise AssertionError("tested one key at a time")

        def many(self, ks):
            self.chunks.append(len(ks))
            return np.array([k in pinned for k in ks])

    vec = Vector()
    assert lru.evict_upto(256, vec) == one_by_one and vec.chunks == [64]
    vec.chunks.clear()
    assert lru.evict_upto(10, vec) == one_by_one[:10] and vec.chunks == [64]
    # a refusal-free batch of evict() takes the same path; max_scan keeps its widening meaning
    assert lru.evict(10, vec) == one_by_one[:10] and lru.evict(60, vec) == []
    assert lru.evict_upto(5, prot, max_scan=10) == choose_victims(evict, 5, 1, prot, 10)


def test_new_nvme_blocks_are_classified_per_call_as_the_classifier_would_per_block():
    """A store's new NVMe blocks were classified one view and one call each under the index lock
    (0.7 ms of a 2.6 ms prepare_store of 256 blocks, issue 25 item 4); with the default
    classifier it is one vectorised pass: the same class per block as default_classify, kept
    in the rows (nvme_class) as before. Another classifier is still called once per block."""
    import itertools
    import types

    import numpy as np

    from tierstore.fdp.lifetime import LifetimeClass
    from tierstore.policies.lifetime import default_classify, default_classify_many

    combos = list(itertools.product([-1, 0, 1, 2], [0, 1, 2, 7]))
    hint = np.array([h for h, _ in combos], dtype=np.int8)
    hits = np.array([n for _, n in combos], dtype=np.int32)
    want = [
        default_classify(types.SimpleNamespace(lifetime=None if h < 0 else LifetimeClass(h), hits=n), 0.0)
        for h, n in combos
    ]
    assert default_classify_many(hint, hits).tolist() == [int(c) for c in want]

    for lifetime, cls in ((None, LifetimeClass.SHORT), ("system", LifetimeClass.LONG)):
        ix = _index(nvme=True)
        plan = ix.prepare_store(b"n" * 32, [_k(i) for i in range(32)], lifetime=lifetime)
        assert [i for i, _ in plan.nvme_new] == list(range(32))
        assert all(type(c) is LifetimeClass and c is cls for _, c in plan.nvme_new)
        assert ix.rows.nvme_class[plan.rows].tolist() == [int(cls)] * 32
        ix.abort_store(plan)
        ix.check_invariants(quiescent=True)
    seen = []
    custom = lambda e, now: seen.append(e.position) or LifetimeClass.MEDIUM  # noqa: E731
    ix = BlockIndex(IndexShape(4096, 16, nvme_blocks=0), PoliciesConfig(), IndexRuntime(classify=custom))
    plan = ix.prepare_store(b"n" * 32, [_k(i) for i in range(32)])
    assert seen == list(range(32)) and {c for _, c in plan.nvme_new} == {LifetimeClass.MEDIUM}


def test_the_chunked_victim_test_agrees_with_the_per_key_one():
    """Protector.many (a chunk of keys in one pass) keeps exactly the keys that the per-key test
    keeps: pinned, referenced by a request, held by a plan in flight, absent from the index, or
    in the caller's set; and a store short of victims takes the same ones through it."""
    ix = _index(host_blocks=16, nvme=True)
    ns = bytes(32)
    keys = [_k(i) for i in range(16)]
    ix.complete_store(ix.prepare_store(ns, keys))
    ix.pin(ns, keys[0:2], lease_s=100.0)
    ix.lookup(keys[4:6], request_id="r")  # referenced until released
    held = ix.prepare_store(ns, [_k(100)])  # takes a batch of victims: EVICT_HOST until it completes
    probe = keys + [_k(999)]
    for extra in (None, {keys[9], _k(999)}):
        prot = ix.placement.protector(extra, ix._now())
        assert prot.many(probe).tolist() == [prot(k) for k in probe]
    per_key = [k for k in keys if not ix.placement.protector(None, ix._now())(k)]
    assert per_key and not set(per_key) & set(keys[0:2] + keys[4:6])  # some free, none pinned or referenced
    plan = ix.prepare_store(ns, [_k(200 + i) for i in range(32)])  # short of victims: takes all
    assert sorted(d.key for d in plan.nvme_demote) == sorted(per_key)
    ix.abort_store(plan)
    ix.abort_store(held)
    ix.release("r")
    ix.check_invariants(quiescent=True)


def test_a_load_holds_and_releases_per_call_a_key_given_twice_a_miss_and_a_removed_block():
    """prepare_load / complete_load over a whole call (one gather, one release): a key given
    twice is held twice and released twice, a miss holds nothing, and a block removed while the
    load held it is freed when the load completes, not before."""
    ix = _index(host_blocks=4)
    ns = bytes(32)
    ix.complete_store(ix.prepare_store(ns, [_k(1), _k(2)]))
    plan = ix.prepare_load([_k(1), _k(9), _k(1), _k(2)])
    assert plan.rows[1] == -1 and plan.sources[1] is None
    assert [s[0] if s else None for s in plan.sources] == [Tier.HOST, None, Tier.HOST, Tier.HOST]
    r1, r2 = plan.rows[0], plan.rows[3]
    assert plan.rows[2] == r1 and ix.rows.readers[r1] == 2 and ix.rows.readers[r2] == 1
    assert ix.remove([_k(2)]) == 1  # doomed while read: its slot stays until the load completes
    assert r2 in ix.rows.doomed
    free_before = ix.placement.alloc[Tier.HOST].free
    assert ix.complete_load(plan, [Status.OK, Status.MISS, Status.OK, Status.OK]) is None
    assert ix.rows.readers[r1] == 0 and r2 not in ix.rows.doomed
    assert ix.placement.alloc[Tier.HOST].free == free_before + 1
    assert ix.metrics.snapshot()["loaded_blocks"] == 1
    ix.check_invariants(quiescent=True)


def test_flush_candidates_in_a_shared_key_table_come_in_the_index_s_own_row_order():
    """With the NVMe locator's key table shared, row numbers follow both sides' history; the
    flush candidates (a clean shutdown, background cleaning; ties of coldest-first too) still
    come in the order an index with a table of its own gives: its ascending rows, freed rows
    reused last freed first (HeldKeys' ordinals). Key order instead (session 35) lost 0.89 % of
    the full conversation trace's saved prefill and broke the simulator-equals-store test."""
    import hashlib

    from tierstore.keytable import LOCATOR, KeyTable

    def _h(i: int) -> bytes:  # digests, as block keys are: key order is no age order
        return hashlib.sha256(i.to_bytes(8, "little")).digest()

    def flush_order(table: KeyTable | None, coldest_first: bool) -> tuple[list[bytes], BlockIndex]:
        ix = BlockIndex(
            IndexShape(4096, 16, host_blocks=64, nvme_blocks=0),
            PoliciesConfig(),
            IndexRuntime(clock=lambda: 0.0, key_table=table),  # one time: every tie
        )
        ns = bytes(32)
        for i in range(0, 48, 4):
            if table is not None:  # the locator takes rows between the index's, frees some
                table.add_absent([_h(10_000 + 3 * i + j) for j in range(3)], LOCATOR)
                if i % 8 == 4:
                    table.remove(_h(10_000 + 3 * i - 12), holder=LOCATOR)
            ix.complete_store(ix.prepare_store(ns, [_h(i + j) for j in range(4)]))
            if i % 12 == 8:  # the index frees rows (last freed, first reused)
                assert ix.remove([_h(i - 7), _h(i - 2)]) == 2
        plan = ix.prepare_flush(100, coldest_first=coldest_first)
        assert plan is not None
        return [d.key for d in plan.nvme_demote], ix

    for coldest_first in (False, True):
        own, ix = flush_order(None, coldest_first)
        assert len(own) == 48 - 8 and own == sorted(own, key=ix.rows.table.get)  # its rows, ascending
        assert flush_order(KeyTable(16), coldest_first)[0] == own


@pytest.mark.parametrize("n", [2, 15, 32, 64, 79])
def test_a_short_store_plans_as_the_batched_path_does(monkeypatch, n):
    """Stores under SCALAR_STORE_KEYS keys find or insert each key with one scalar probe
    (RowTable.add_new); the longer path is a vectorised lookup then a batch insert. Same
    statuses (EXISTS for a key held or given earlier in the call), same rows, slots, victims
    and counts, including rows reused from the free list; a malformed key inserts nothing."""
    from tierstore.index import core as index_core

    def run(threshold: int):
        monkeypatch.setattr(index_core, "SCALAR_STORE_KEYS", threshold)
        ix = _index(hbm_blocks=40, host_blocks=40)
        ns = b"n" * 32
        p = ix.prepare_store(ns, [_k(i) for i in range(1000, 1000 + 30)])
        ix.complete_store(p)
        ix.invalidate(ns)  # its rows go to the free list: the stores below reuse them
        ix.end_invalidate(ns)
        held = [_k(i) for i in range(0, n, 3)]
        ix.complete_store(ix.prepare_store(ns, held))
        keys = [_k(i) for i in range(n)] + [_k(0), _k(n - 1)]  # held keys, new keys, repeats
        plans = [ix.prepare_store(ns, keys[j : j + n], first_position=j) for j in (0, 2)]
        out = [repr(p) for p in plans]  # statuses, rows, slots, victims and their fates
        assert Status.EXISTS in plans[0].statuses and None in plans[0].statuses
        out.append([ix.complete_store(p) for p in plans])
        ix.check_invariants()
        return out, dict(ix.metrics.counters)

    assert run(threshold=10_000) == run(threshold=0)
    monkeypatch.undo()
    ix = _index(hbm_blocks=40, host_blocks=40)
    with pytest.raises(LayoutError):
        ix.prepare_store(b"n" * 32, [_k(5000), b"short"] * max(1, n // 2))
    assert ix.rows.table.get(_k(5000)) == -1  # nothing inserted before the refusal
    ix.check_invariants()
