"""Scenario tests of the tier manager, run for every registered eviction policy."""
from __future__ import annotations

import threading

import pytest
import torch

from tierstore import KVStore, Namespace, Status, Tier, leading_ok
from tierstore.errors import LayoutError, QuotaExceeded
from tierstore.manager import BlockState
from tierstore.policies import policy_names

from .conftest import make_blocks, tokens

B = 16
POLICIES = policy_names()


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


def test_store_lookup_load_roundtrip_through_every_tier(make_store, layout, ns, policy):
    s = make_store(hbm=2, host=2, nvme=16, eviction=policy, promotion="none")
    s.manager.record_events = True
    toks = tokens(8 * B)
    blocks = make_blocks(layout, 8)
    assert s.store(ns, toks, blocks) == [Status.OK] * 8
    tiers = [s.manager.tiers_of(k)[0] for k in s.keys_for(ns, toks)]
    assert set(tiers) == {Tier.HBM, Tier.HOST, Tier.NVME}
    with s.request() as rid:
        hit = s.lookup(ns, toks, request_id=rid)
        assert hit.matched_blocks == 8 and hit.matched_tokens == 8 * B
        st, out = s.load(hit)
        assert leading_ok(st) == 8
        for a, b in zip(out, blocks):
            assert torch.equal(a, b)
    s.manager.check_invariants()
    kinds = [e[0] for e in s.manager.events]
    assert kinds.count("stored") == 8


def test_deterministic_slot_ids_and_events(make_store, layout, ns):
    s = make_store(hbm=4, host=0, nvme=0)
    s.manager.record_events = True
    toks = tokens(3 * B)
    s.store(ns, toks, make_blocks(layout, 3))
    keys = s.keys_for(ns, toks)
    assert [s.manager.index[k].slots[Tier.HBM] for k in keys] == [0, 1, 2]
    assert s.manager.events == [("stored", k, "hbm") for k in keys]


@pytest.mark.parametrize("ntok,expect_blocks", [(4 * B, 4), (4 * B - 1, 3), (4 * B + 1, 4)])
def test_block_boundaries(make_store, layout, ns, ntok, expect_blocks):
    s = make_store()
    full = tokens(5 * B)
    s.store(ns, full, make_blocks(layout, 5))
    hit = s.lookup(ns, full[:ntok])
    assert hit.matched_blocks == expect_blocks
    assert hit.matched_tokens == expect_blocks * B
    snap = s.stats()
    assert snap["partial_tail_tokens"] == ntok - expect_blocks * B


def test_partial_tail_is_never_stored(make_store, layout, ns):
    s = make_store()
    with pytest.raises(LayoutError):
        s.store(ns, tokens(2 * B + 5), make_blocks(layout, 3))
    assert s.manager.index == {}


@pytest.mark.parametrize("field", ["tenant", "model", "adapter"])
def test_identity_isolation_both_directions(make_store, layout, field):
    import dataclasses
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
    s.store(ns, toks[:2 * B], blocks[:2])
    assert s.store(ns, toks, blocks) == [Status.EXISTS, Status.EXISTS, Status.OK, Status.OK]


def test_store_without_space_is_rejected_cleanly(make_store, layout, ns):
    s = make_store(hbm=2, host=0, nvme=0)
    toks = tokens(2 * B)
    with s.request() as rid:
        s.store(ns, toks, make_blocks(layout, 2))
        s.lookup(ns, toks, request_id=rid)  # both ACTIVE: nothing evictable
        other = tokens(3 * B, start=10_000)
        st = s.store(ns, other, make_blocks(layout, 3))
        assert st == [Status.NO_SPACE] * 3
        assert s.lookup(ns, toks).matched_blocks == 2  # existing entries intact
    s.manager.check_invariants()


def test_active_and_pinned_blocks_are_never_victims(make_store, layout, ns, clock, policy):
    s = make_store(hbm=3, host=0, nvme=0, eviction=policy)
    a, b = tokens(B), tokens(B, start=100)
    s.store(ns, a, make_blocks(layout, 1))
    s.store(ns, b, make_blocks(layout, 1))
    ka, kb = s.keys_for(ns, a)[0], s.keys_for(ns, b)[0]
    with s.request() as rid:
        s.lookup(ns, a, request_id=rid)
        assert s.manager.state_of(ka) is BlockState.ACTIVE
        lease = s.pin(ns, b, lease_s=10)
        assert s.manager.state_of(kb) is BlockState.PINNED
        st = s.store(ns, tokens(3 * B, start=500), make_blocks(layout, 3))
        assert st[0] == Status.OK and st[1] == Status.NO_SPACE
        assert ka in s.manager.index and kb in s.manager.index
    assert s.manager.state_of(ka) is BlockState.EVICTABLE
    clock.advance(11)  # lease expires
    assert s.manager.state_of(kb) is BlockState.EVICTABLE
    assert s.store(ns, tokens(2 * B, start=900), make_blocks(layout, 2)) == [Status.OK, Status.OK]
    assert s.unpin(lease) in (True, False)
    s.manager.check_invariants()


def test_pin_quota(make_store, layout, ns):
    s = make_store(pin_quota_bytes=2 * layout.bytes_per_block)
    toks = tokens(3 * B)
    s.store(ns, toks, make_blocks(layout, 3))
    with pytest.raises(QuotaExceeded):
        s.pin(ns, toks)
    lease = s.pin(ns, toks[:2 * B])
    assert s.unpin(lease)
    assert not s.unpin(lease)


def test_aborted_request_releases_pins(make_store, layout, ns):
    s = make_store()
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    with pytest.raises(RuntimeError):
        with s.request() as rid:
            s.lookup(ns, toks, request_id=rid)
            raise RuntimeError("engine aborted the request")
    assert all(e.ref_count == 0 for e in s.manager.index.values())
    assert s.stats()["aborted_requests"] == 1


def test_probe_does_not_reference_or_touch(make_store, layout, ns):
    s = make_store(hbm=2, host=0, nvme=0)
    a = tokens(B)
    s.store(ns, a, make_blocks(layout, 1))
    s.store(ns, tokens(B, start=50), make_blocks(layout, 1))
    for _ in range(5):
        assert s.probe(ns, a) == B
    s.store(ns, tokens(B, start=99), make_blocks(layout, 1))  # evicts the LRU block: a
    assert s.probe(ns, a) == 0


def test_demotion_and_promotion(make_store, layout, ns):
    s = make_store(hbm=1, host=1, nvme=8, promotion="top")
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    k = s.keys_for(ns, toks)[0]
    s.manager.evict(Tier.HBM, 1)
    assert s.manager.tiers_of(k) == [Tier.HOST]
    s.manager.evict(Tier.HOST, 1)
    assert s.manager.tiers_of(k) == [Tier.NVME]
    st, out = s.load(s.lookup(ns, toks))
    assert st == [Status.OK] and torch.equal(out[0], make_blocks(layout, 1)[0])
    assert s.manager.tiers_of(k) == [Tier.HBM, Tier.NVME]  # promoted, NVMe copy kept
    before = s.stats().get("nvme_write_bytes", 0)
    s.manager.evict(Tier.HBM, 1)  # has a lower copy: nothing is rewritten to flash
    assert s.stats().get("nvme_write_bytes", 0) == before


def test_invalidate_namespace_defers_in_use_blocks(make_store, layout, ns):
    s = make_store()
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    with s.request() as rid:
        s.lookup(ns, toks, request_id=rid)
        assert s.invalidate(ns) == 2
        assert s.lookup(ns, toks).matched_blocks == 0
        assert len(s.manager.doomed) == 2
    assert len(s.manager.doomed) == 0
    assert all(p.free_blocks == p.num_blocks for p in s.manager.pools.values())


def test_token_verification_catches_collision(make_store, layout, ns):
    s = make_store(verify_tokens=True)
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    key = s.keys_for(ns, toks)
    other = [tokens(B, start=7)]
    r = s.manager.lookup(key, other)  # same key, different tokens: a forged collision
    assert r.matched_blocks == 0 and s.stats()["verify_mismatch"] == 1
    assert s.manager.lookup(key, [toks]).matched_blocks == 1


def test_corrupt_nvme_block_is_a_miss_not_wrong_kv(make_store, layout, ns):
    s = make_store(hbm=0, host=0, nvme=4)
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    nv = s.manager.nvme
    import os
    slot = nv._index[s.keys_for(ns, toks)[0]]
    with open(nv.path, "r+b") as f:
        f.seek(slot * nv.slot_bytes + 128 + 5)
        b = f.read(1)
        f.seek(slot * nv.slot_bytes + 128 + 5)
        f.write(bytes([b[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    st, out = s.load(s.lookup(ns, toks))
    assert st == [Status.IO_ERROR] and out == [None]
    assert s.lookup(ns, toks).matched_blocks == 0  # never served again
    s.manager.check_invariants()


def test_concurrent_cold_loads_share_one_read(make_store, layout, ns):
    s = make_store(hbm=0, host=4, nvme=8, promotion="none")
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    s.manager.evict(Tier.HOST, 1)
    key = s.keys_for(ns, toks)
    nv = s.manager.nvme
    real_get = nv.get
    gate = threading.Event()
    calls = []

    def slow_get(keys, dests):
        calls.append(list(keys))
        gate.wait(5)
        return real_get(keys, dests)
    nv.get = slow_get
    results = []
    ths = [threading.Thread(target=lambda: results.append(s.load(key))) for _ in range(4)]
    for t in ths:
        t.start()
    import time
    time.sleep(0.3)
    gate.set()
    for t in ths:
        t.join()
    assert len(calls) == 1
    assert all(r[0] == [Status.OK] for r in results)
    assert s.stats()["merged_loads"] == 3


def test_useful_hits_follow_cost_model(make_store, layout, ns):
    s = make_store(hbm=0, host=0, nvme=8)
    s.manager.config.cost.prefill_tokens_per_s = 1e12  # recompute is nearly free
    toks = tokens(2 * B)
    s.store(ns, toks, make_blocks(layout, 2))
    hit = s.lookup(ns, toks)
    assert hit.matched_blocks == 2 and hit.useful_blocks == 0
    s.manager.config.cost.prefill_tokens_per_s = 10.0  # recompute is slow
    assert s.lookup(ns, toks).useful_blocks == 2


def test_nvme_eviction_frees_whole_segments(layout, ns, clock):
    """With a log-structured backend, NVMe eviction takes whole reclaim groups
    (segments), so no dead space is stranded in sealed segments."""
    from tierstore.io import SegmentStorage
    bb = layout.bytes_per_block
    nv = SegmentStorage(None, capacity_bytes=8 * 64 * 1024, block_bytes=bb, segment_size_bytes=64 * 1024,
                        engine="memory", extent_size_bytes=64 * 1024)
    s = KVStore(layout, hbm_bytes=0, host_bytes=0, nvme=nv, clock=clock)
    try:
        for i in range(40):
            toks = tokens(4 * B, start=1000 * i)
            assert s.store(ns, toks, make_blocks(layout, 4, seed=i)) == [Status.OK] * 4
        st = nv.stats()
        assert st["dead_blocks"] == 0
        assert s.stats()["evicted_groups_nvme"] > 0
        live = [k for k in s.manager.index]
        assert len(live) == st["blocks"]
        hit = s.lookup(ns, tokens(4 * B, start=1000 * 39))
        assert hit.matched_blocks == 4
        s.manager.check_invariants()
    finally:
        s.close()
