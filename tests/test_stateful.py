"""Hypothesis stateful test: >= 10,000 random operations on the tier manager.

Invariants after every step: pools, policies and refcounts agree
(``check_invariants``), no count goes negative, blocks referenced by an open
request are still present, and every load returns exactly the stored bytes.
At teardown, after releasing and clearing everything, every pool is fully free.
"""
from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tierstore import KVStore, Namespace, Status, Tier, get_layout
from tierstore.errors import QuotaExceeded
from tierstore.tiers.nvme import SlotFileStorage

L = get_layout("tiny")
B = L.tokens_per_block
STEPS = {"n": 0}
NAMESPACES = [Namespace(model="m", tenant=t) for t in ("a", "b")]


def block_for(key: bytes) -> torch.Tensor:
    raw = torch.zeros(L.bytes_per_block, dtype=torch.uint8)
    raw[:32] = torch.frombuffer(bytearray(key), dtype=torch.uint8)
    raw[32:64] = torch.frombuffer(bytearray(key), dtype=torch.uint8)
    return raw


class Clock:
    now_s = 0.0

    def __call__(self):
        return self.now_s


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.TemporaryDirectory()
        bb = L.bytes_per_block
        nv = SlotFileStorage(self.dir.name + "/nvme.bin", 6 * (((bb + 128 + 4095) // 4096) * 4096), bb)
        self.clock = Clock()
        self.store = KVStore(L, hbm_bytes=3 * bb, host_bytes=3 * bb, nvme=nv, clock=self.clock,
                             pin_quota_bytes=4 * bb, evict_batch_blocks=2)
        self.m = self.store.manager
        self.open_requests: dict[int, list[bytes]] = {}
        self.leases = []
        self.next_rid = 0

    def teardown(self):
        try:
            self.teardown_check()
        finally:
            self.store.close()
            self.dir.cleanup()

    def _prompt(self, chain: int, nblocks: int):
        toks = np.concatenate([np.full(B, chain * 100 + i, dtype=np.int64) for i in range(nblocks)])
        return toks

    @rule(ns=st.sampled_from(NAMESPACES), chain=st.integers(0, 5), n=st.integers(1, 4))
    def store_prefix(self, ns, chain, n):
        toks = self._prompt(chain, n)
        keys = self.store.keys_for(ns, toks)
        st_ = self.store.store(ns, toks, [block_for(k) for k in keys])
        assert len(st_) == n
        assert all(s in (Status.OK, Status.EXISTS, Status.NO_SPACE) for s in st_)

    @rule(ns=st.sampled_from(NAMESPACES), chain=st.integers(0, 5), n=st.integers(1, 4), hold=st.booleans())
    def lookup_and_load(self, ns, chain, n, hold):
        toks = self._prompt(chain, n)
        rid = self.next_rid
        self.next_rid += 1
        hit = self.store.lookup(ns, toks, request_id=rid if hold else None)
        if hold and hit.matched_blocks:
            self.open_requests[rid] = hit.keys
        statuses, outs = self.m.load(hit.keys)
        for k, s, o in zip(hit.keys, statuses, outs):
            if s is Status.OK:
                assert bytes(o[:32].numpy()) == k, "wrong KV served"
            elif hold:
                raise AssertionError("a referenced block must load")

    @precondition(lambda self: self.open_requests)
    @rule(data=st.data(), cancel=st.booleans())
    def release(self, data, cancel):
        rid = data.draw(st.sampled_from(sorted(self.open_requests)))
        n = self.m.cancel(rid) if cancel else self.m.release(rid)
        assert n == len(self.open_requests.pop(rid))

    @rule(ns=st.sampled_from(NAMESPACES), chain=st.integers(0, 5), n=st.integers(1, 3),
          lease=st.floats(0.5, 5.0))
    def pin(self, ns, chain, n, lease):
        try:
            self.leases.append(self.store.pin(ns, self._prompt(chain, n), lease_s=lease))
        except QuotaExceeded:
            pass

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unpin(self, data):
        lease = data.draw(st.sampled_from(self.leases))
        self.leases.remove(lease)
        self.store.unpin(lease)

    @rule(tier=st.sampled_from([Tier.HBM, Tier.HOST, Tier.NVME]), n=st.integers(1, 3))
    def evict(self, tier, n):
        held = [e for rid in self.open_requests for e in self.m.requests.get(rid, [])
                if not e.doomed and tier in e.slots]
        self.m.evict(tier, n)
        for e in held:
            assert tier in e.slots, "an ACTIVE block was evicted"

    @rule(ns=st.sampled_from(NAMESPACES))
    def invalidate(self, ns):
        self.store.invalidate(ns)

    @rule(dt=st.floats(0.1, 3.0))
    def advance_clock(self, dt):
        self.clock.now_s += dt

    @invariant()
    def consistent(self):
        STEPS["n"] += 1
        self.m.check_invariants()
        for ks in self.open_requests.values():
            for k in ks:
                assert k in self.m.index or any(d.key == k for d in self.m.doomed.values())

    def teardown_check(self):
        for rid in list(self.open_requests):
            self.m.release(rid)
        self.m.clear()
        for p in self.m.pools.values():
            assert p.free_blocks == p.num_blocks
        assert self.m.nvme.free_blocks() == self.m.nvme.capacity_blocks()
        assert not self.m.index and not self.m.doomed


def test_stateful_10k_operations():
    STEPS["n"] = 0
    run_state_machine_as_test(
        ManagerMachine,
        settings=settings(max_examples=60, stateful_step_count=200, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck)))
    assert STEPS["n"] >= 10_000, STEPS
