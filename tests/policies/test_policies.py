"""Eviction policies, SSD admission, lifetime prediction, cost model and prefetch."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tierstore import Status, Tier, leading_ok
from tierstore.errors import ConfigError
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.index import BlockState
from tierstore.policies import (
    CostAwarePolicy,
    PrefixLifetimePredictor,
    S3FIFOPolicy,
    SecondSightingAdmission,
    make_policy,
    policy_names,
)
from tierstore.policies.cost import CostModel
from tierstore.policies.lifetime import DemotionClassifier, make_classifier, true_class

from ..conftest import FakeEntry as E
from ..conftest import make_blocks, tokens

B = 16


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_registered():
    assert {"lru", "s3fifo", "cost"} <= set(policy_names())


@pytest.mark.parametrize("name", ["lru", "s3fifo", "cost", "class_lru"])
def test_all_or_nothing_and_victims_stay_tracked(name):
    p = make_policy(name)
    for i in range(6):
        p.on_insert(E(k(i), position=i), float(i))
    prot = {k(0), k(1), k(2), k(3)}
    assert p.evict(3, lambda key: key in prot, 10.0) == []
    assert len(p) == 6
    got = p.evict(2, lambda key: key in prot, 10.0)
    assert sorted(got) == sorted([k(4), k(5)]) and len(p) == 6
    for v in got:
        p.on_remove(v)
    assert len(p) == 4
    assert p.evict(1, lambda key: True, 11.0) == []
    p.on_remove(b"unknown")
    assert len(p) == 4


def test_s3fifo_evicts_one_hit_wonders_before_reused_keys():
    p = S3FIFOPolicy()
    hot = E(k(0))
    p.on_insert(hot, 0.0)
    p.on_access(hot, 1.0)
    for i in range(1, 20):
        p.on_insert(E(k(i)), float(i))
    victims = p.evict(5, lambda key: False)
    assert k(0) not in victims and victims == [k(i) for i in range(1, 6)]
    for v in victims:
        p.on_remove(v)
    p.on_insert(E(k(1)), 30.0)  # ghost hit: straight into M
    assert k(1) in p._q["M"]


def test_cost_keeps_frequently_reused_blocks_and_ages():
    p = CostAwarePolicy()
    hot = E(k(0))
    p.on_insert(hot, 0.0)
    for t in range(1, 6):
        hot.hits += 1
        hot.last_access_s = float(t)
        p.on_access(hot, float(t))
    for i in range(1, 5):
        p.on_insert(E(k(i), created_s=6.0, position=i), 6.0)
    v = p.evict(3, lambda key: False, 7.0)
    assert k(0) not in v
    assert v[0] == k(4)  # equal value: the deepest chain position goes first
    for x in v:
        p.on_remove(x)
    assert p.inflation > 0  # GDS aging: L rose to the victims' priority


def test_cost_value_formula():
    cm = CostModel(prefill_tokens_per_s=1000.0)
    p = CostAwarePolicy(cost=cm, horizon_s=100.0, tokens_per_block=10)
    e = E(k(0), size_bytes=1000, hits=0, created_s=0.0)
    import math

    p_reuse = 1 - math.exp(-1.0)
    denom = 1000 + cm.load_s("nvme", 1000) * cm.bandwidth_bytes_per_s["nvme"]
    assert p.value(e, 50.0) == pytest.approx(p_reuse * 0.01 / denom)


# ---------------------------------------------------------------- manager properties, every policy
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "hold", "pin", "inflight", "evict", "tick", "release"]),
        st.integers(0, 7),
        st.floats(0.5, 4.0),
    ),
    min_size=5,
    max_size=40,
)


@pytest.mark.parametrize("policy", policy_names())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_protected_blocks_never_evicted_and_pins_expire(make_store, layout, ns, clock, policy, ops):
    """Under every policy: a referenced (ACTIVE), pinned or being-read block is
    never evicted from the store, whatever stores and evictions happen."""
    s = make_store(hbm=2, host=2, nvme=4, eviction=policy, evict_batch_blocks=2)
    ix = s._index  # the index is layer 4's public class; loads in flight are held through it
    held, leases, reading = {}, [], []
    for i, (op, c, x) in enumerate(ops):
        toks = tokens(2 * B, start=1000 * c)
        keys = s.keys_for(ns, toks)
        if op == "store":
            s.store(ns, toks, make_blocks(layout, 2, seed=c))
        elif op == "hold":
            rid = ("r", i)
            if s.lookup(ns, toks, request_id=rid).matched_blocks:
                held[rid] = s.lookup(ns, toks).keys
        elif op == "pin":
            leases.append(s.pin(ns, toks, lease_s=x))
        elif op == "inflight":
            plan = ix.prepare_load(keys[:1])  # a load whose bytes are still moving
            reading.append(plan)
        elif op == "evict":
            for t in (Tier.HBM, Tier.HOST):
                s.evict(t, c % 3 + 1)
        elif op == "tick":
            clock.advance(x)
        elif op == "release" and held:
            s.release(next(iter(held)))
            held.pop(next(iter(held)))
        now = clock()
        for ks in held.values():
            assert all(s.resident(ks)), "an ACTIVE block was evicted"
        for lease in leases:
            if lease.expiry_s > now and lease.lease_id in s.leases():
                assert all(s.resident(lease.keys)), "a PINNED block was evicted"
                assert all(s.state_of(k) in (BlockState.PINNED, BlockState.ACTIVE) for k in lease.keys)
        for plan in reading:
            for k, src in zip(plan.keys, plan.sources):
                if src is not None:
                    assert s.tiers_of(k), "a block being read was evicted"
        s.check_invariants()
    for plan in reading:
        ix.complete_load(plan, [Status.OK] * len(plan.keys), promote=False)
    for rid in list(held):
        s.release(rid)
    # every pin expires exactly at its lease
    for lease in leases:
        clock.now_s = lease.expiry_s
        assert lease.lease_id not in s.leases()
    s.check_invariants(quiescent=True)


@pytest.mark.parametrize("policy", policy_names())
def test_pin_expires_at_lease(make_store, layout, ns, clock, policy):
    s = make_store(hbm=2, host=0, nvme=0, eviction=policy)
    toks = tokens(B)
    s.store(ns, toks, make_blocks(layout, 1))
    key = s.keys_for(ns, toks)[0]
    s.pin(ns, toks, lease_s=5.0)
    clock.advance(4.999)
    assert s.state_of(key) is BlockState.PINNED
    assert s.store(ns, tokens(2 * B, start=50), make_blocks(layout, 2))[1] == Status.NO_SPACE
    clock.advance(0.001)
    assert s.state_of(key) is BlockState.EVICTABLE
    assert s.store(ns, tokens(2 * B, start=90), make_blocks(layout, 2)) == [Status.OK, Status.OK]


# ---------------------------------------------------------------- admission
def test_second_sighting_admission_unit():
    a = SecondSightingAdmission(ghost_keys=2)
    assert not a(E(k(1)))
    assert a(E(k(1)))  # second sighting
    assert a(E(k(2), hits=1))  # reused in memory
    for i in (3, 4, 5):
        a(E(k(i)))
    assert not a(E(k(3)))  # forgotten: the ghost holds 2 keys
    with pytest.raises(ConfigError):
        SecondSightingAdmission(min_hits=0)


def test_admission_keeps_bytes_off_flash_and_counts_lost_hits(make_store, layout, ns):
    adm = SecondSightingAdmission()
    s = make_store(hbm=0, host=2, nvme=8, admit=adm)
    a, b = tokens(2 * B), tokens(2 * B, start=500)
    s.store(ns, a, make_blocks(layout, 2))
    s.store(ns, b, make_blocks(layout, 2))  # pushes a's blocks out of host: rejected, dropped
    st_ = s.stats()
    assert st_["admission_rejected_blocks"] == 2
    assert st_["admission_rejected_bytes"] == 2 * layout.bytes_per_block
    assert st_.get("nvme_write_bytes", 0) == 0
    assert s.lookup(ns, a).matched_blocks == 0
    st_ = s.stats()
    assert st_["admission_lost_lookups"] == 1 and st_["admission_lost_blocks"] == 2
    s.store(ns, a, make_blocks(layout, 2))  # comes back: second sighting admits it next time
    s.store(ns, tokens(2 * B, start=900), make_blocks(layout, 2))
    assert s.stats()["nvme_write_bytes"] > 0
    assert s.lookup(ns, a).matched_blocks == 2
    s.check_invariants(quiescent=True)


# ---------------------------------------------------------------- lifetime
def test_prefix_lifetime_predictor_rules():
    p = PrefixLifetimePredictor(shared_prefix_blocks=1, medium_ns_reuse=0.9)
    e = E(k(0), position=0, hits=1, created_s=0.0, last_access_s=5000.0)
    e.ns, e.lifetime = b"n", None
    assert p(e, 10.0) is LifetimeClass.LONG  # shared prefix, reused
    e.position = 3
    assert p(e, 10.0) is LifetimeClass.MEDIUM
    e.hits, e.last_access_s = 3, 30.0
    assert p(e, 40.0) is LifetimeClass.LONG  # regular reuse
    e.hits = 0
    assert p(e, 40.0) is LifetimeClass.SHORT
    e.lifetime = LifetimeClass.LONG
    assert p(e, 40.0) is LifetimeClass.LONG  # engine hint wins
    p.observe("x", 0.0)
    assert p.classify("x") is LifetimeClass.SHORT
    p.observe("x", 1.0)
    p.observe("x", 2.0)
    assert p.classify("x") is LifetimeClass.LONG
    assert p.classify("x", hint="query") is LifetimeClass.SHORT
    assert true_class(1.0, 2.0, 5.0) is LifetimeClass.SHORT
    assert true_class(3.0, 2.0, 5.0) is LifetimeClass.MEDIUM
    assert true_class(5.0, 2.0, 5.0) is LifetimeClass.LONG


def test_demotion_classifier_rules():
    c = DemotionClassifier(shared_prefix_blocks=2, window=4)
    e = E(k(0), position=5, hits=0, created_s=0.0)
    e.lifetime = None
    assert c(e, 100.0) is LifetimeClass.SHORT  # no history yet: an age is not "young"
    assert c(e, 10.0) is LifetimeClass.MEDIUM  # age 10 s < the median of ages seen (100 s)
    assert c(e, 1000.0) is LifetimeClass.SHORT  # older than the median, never hit
    e.hits = 1
    assert c(e, 1000.0) is LifetimeClass.MEDIUM  # reused in memory
    e.position = 1
    assert c(e, 1000.0) is LifetimeClass.LONG  # reused shared prefix
    e.lifetime = LifetimeClass.SHORT
    assert c(e, 1000.0) is LifetimeClass.SHORT  # the engine's hint wins
    for _ in range(8):  # the window forgets: only the last 4 ages count
        e.lifetime, e.hits, e.position = None, 0, 5
        c(e, 2000.0)
    assert c(e, 1500.0) is LifetimeClass.MEDIUM  # 1,500 s < median of the last four (2,000 s)
    assert isinstance(make_classifier("demotion"), DemotionClassifier)
    with pytest.raises(ConfigError):
        DemotionClassifier(window=0)


# ---------------------------------------------------------------- load vs recompute (peers' failure modes)
def test_disk_hits_slower_than_recompute_are_not_loaded(make_store, layout, ns, caplog):
    s = make_store(hbm=0, host=6, nvme=8, promotion="none")
    toks = tokens(6 * B)
    s.store(ns, toks, make_blocks(layout, 6))
    assert s.evict(Tier.HOST, 4) == 4  # the chain head (oldest) goes to NVMe
    cm = s.cost_model
    cm.prefill_tokens_per_s = B / 1e-3  # recomputing a block takes 1 ms
    for _ in range(60):  # the I/O engine measures a slow disk: 10 ms per block
        cm.observe_load("nvme", layout.bytes_per_block, 1e-2)
    # by default a measurement never makes a tier slower than declared (a busy machine must not
    # turn every hit into a miss): the hits stay useful, and the slow measurement is logged once
    hit = s.lookup(ns, toks)
    assert hit.matched_blocks == 6 and hit.useful_blocks == 6 and hit.not_useful_reason is None
    assert cm.measured_s("nvme", layout.bytes_per_block) == pytest.approx(1e-2)
    assert [r.message for r in caplog.records].count(
        next(r.message for r in caplog.records if "measured 10.00 ms" in r.message)
    ) == 1
    # a deployment that trusts its measurements lifts the bound: the slow NVMe run is not loaded
    cm.max_slowdown = float("inf")
    hit = s.lookup(ns, toks)
    assert hit.matched_blocks == 6
    assert all(t == Tier.NVME for t in hit.tiers[:4])
    assert hit.useful_blocks == 0  # the leading NVMe run is slower than recompute
    assert hit.not_useful_reason.startswith("load slower than recompute: est ")
    assert "nvme: measured 10 ms per block" in hit.not_useful_reason
    # a declared slow disk is not loaded either, measured or not
    cm.max_slowdown = 1.0
    cm.reset_measurements()
    cm.bandwidth_bytes_per_s["nvme"] = layout.bytes_per_block / 1e-2
    assert s.lookup(ns, toks).useful_blocks == 0
    cm.bandwidth_bytes_per_s["nvme"] = 1e12
    cm.latency_s["nvme"] = 0.0
    assert s.lookup(ns, toks).useful_blocks == 6


def test_slow_nvme_never_turns_a_short_prefill_into_a_long_one(make_store, layout, ns):
    """A 0.9 s prefill must not become 40 s because the store 'hit' on a slow disk."""
    n = 8
    s = make_store(hbm=0, host=0, nvme=16)
    toks = tokens(n * B)
    s.store(ns, toks, make_blocks(layout, n))
    cm = s.cost_model
    cm.prefill_tokens_per_s = n * B / 0.9  # the whole prompt prefills in 0.9 s
    cm.bandwidth_bytes_per_s["nvme"] = layout.bytes_per_block / 5.0  # 5 s per block: 40 s for 8
    hit = s.lookup(ns, toks)
    assert hit.matched_blocks == n and hit.useful_blocks == 0
    ttft_s = sum(hit.load_s[: hit.useful_blocks]) + cm.prefill_s((n - hit.useful_blocks) * B)
    assert ttft_s == pytest.approx(0.9)
    # mixed: a fast host prefix is still used, the slow NVMe tail is recomputed
    s2 = make_store(hbm=0, host=n, nvme=16, promotion="none")
    s2.store(ns, toks, make_blocks(layout, n))
    s2.evict(Tier.HOST, n // 2)  # the oldest half (chain head) goes to NVMe
    c2 = s2.cost_model
    c2.prefill_tokens_per_s = n * B / 0.9
    c2.bandwidth_bytes_per_s["nvme"] = layout.bytes_per_block / 5.0
    h2 = s2.lookup(ns, toks)
    assert h2.tiers[0] == Tier.NVME and h2.useful_blocks == 0


def test_useful_part_only_is_loaded(make_store, layout, ns):
    n = 6
    s = make_store(hbm=0, host=n, nvme=16, promotion="none")
    toks = tokens(n * B)
    s.store(ns, toks, make_blocks(layout, n))
    s.evict(Tier.HOST, n)
    s.load(s.keys_for(ns, toks)[:3])  # not promoted: promotion none
    cm = s.cost_model
    cm.prefill_tokens_per_s = B / 1e-3
    cm.latency_s["nvme"] = 0.5
    hit = s.lookup(ns, toks)
    assert hit.useful_blocks == 0
    cm.latency_s["nvme"] = 1e-4
    hit = s.lookup(ns, toks)
    assert hit.useful_blocks == n
    st_, _ = s.load(hit)
    assert leading_ok(st_) == n


def test_measured_prefill_rate_is_positive():
    from tierstore.policies.cost import measure_prefill_tokens_per_s

    r = measure_prefill_tokens_per_s(hidden=64, layers=1, tokens=64, repeats=2)
    assert r > 0


# ---------------------------------------------------------------- prefetch
def test_prefetch_brings_prefix_up_without_blocking(tmp_path, layout, ns, clock):
    from tierstore import KVStore
    from tierstore.io import format as fmt

    from ..conftest import SlowEngine, memory_segment_store

    bb = layout.bytes_per_block
    slow = SlowEngine.make(17 * fmt.extent_bytes_for(1, bb))
    s = KVStore(
        layout,
        hbm_bytes=0,
        host_bytes=4 * bb,
        nvme=memory_segment_store(layout, 16, slow),
        clock=clock,
        promotion="none",
    )
    try:
        toks = tokens(3 * B)
        blocks = make_blocks(layout, 3)
        s.store(ns, toks, blocks)
        s.evict(Tier.HOST, 3)
        keys = s.keys_for(ns, toks)
        assert all(s.tiers_of(x) == [Tier.NVME] for x in keys)
        slow.slow_reads = True
        fut = s.prefetch(ns, toks, tier="host")
        assert slow.read_started.wait(10)
        # other operations proceed while the read is in flight, and the block is never a victim
        other = tokens(4 * B, start=7000)
        assert s.store(ns, other, make_blocks(layout, 4, seed=3)) == [Status.OK] * 4
        for _ in range(20):  # region eviction keeps (copies forward) the blocks being read
            s.nvme.compact()
        assert all(Tier.NVME in s.tiers_of(x) for x in keys)
        assert not fut.done()
        slow.release.set()
        assert fut.result(10) == 3
        assert all(Tier.HOST in s.tiers_of(x) for x in keys)
        hit = s.lookup(ns, toks)
        assert all(t == Tier.HOST for t in hit.tiers)
        st_, out = s.load(hit)
        assert leading_ok(st_) == 3 and all(torch.equal(a, b) for a, b in zip(out, blocks))
        assert s.stats()["prefetched_blocks"] == 3
        with pytest.raises(ConfigError):
            s.prefetch(ns, toks, tier="hbm")  # disabled tier
        s.check_invariants(quiescent=True)
    finally:
        slow.release.set()
        s.close()


@pytest.mark.parametrize("name", ["lru", "s3fifo", "cost", "class_lru"])
def test_max_scan_bounds_the_victim_search(name):
    """A promotion asks for a cheap victim among the coldest few only (index CHEAP_SCAN_BLOCKS)."""

    def fresh():
        p = make_policy(name)
        for i in range(50):
            p.on_insert(E(k(i), position=i), float(i))
        return p

    order = fresh().evict(50, lambda key: False, 60.0)  # the policy's own victim order
    assert sorted(order) == sorted(k(i) for i in range(50))
    p = fresh()
    only_last = lambda key: key != order[-1]  # noqa: E731  the one evictable key comes last
    assert p.evict(1, only_last, 60.0, max_scan=5) == []
    assert p.evict(1, only_last, 60.0) == [order[-1]]
    assert len(p) == 50


def test_lru_batch_hooks_keep_the_order_of_key_by_key_calls():
    """LRU's on_insert_many / on_access_many run as C calls over the batch; with keys already
    present, repeated, or (for an access) absent they must leave the order of the one-by-one hooks."""
    from tierstore.policies.lru import LRUPolicy

    keys = [i.to_bytes(32, "little") for i in range(12)]
    absent = (99).to_bytes(32, "little")
    one, many = LRUPolicy(), LRUPolicy()
    ops = [
        ("insert", keys[:6]),
        ("insert", keys[3:9]),  # half present
        ("access", keys[1:4]),
        ("access", [keys[7], absent, keys[0]]),  # an absent key in the batch
        ("insert", [keys[10], keys[10], keys[2]]),  # repeated
        ("access", keys[8::-2]),
    ]
    for op, ks in ops:
        for k in ks:
            getattr(one, f"on_{op}")(E(k), 0.0)
        getattr(many, f"on_{op}_many")(ks, lambda j, ks=ks: E(ks[j]), 0.0)
        assert list(many._order) == list(one._order), op
    assert absent not in many._order
