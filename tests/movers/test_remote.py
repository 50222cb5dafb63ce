"""The remote handler on MooncakeTier + the in-memory Mooncake client: host-pool registration,
fetch and publish (verified bytes only, under the gate), lost victims published before their slot
is reused, held slots and after_release, and a whole remote fill through the executor."""

from __future__ import annotations

import threading
import time
import types

import torch

from tierstore.contract import StorePlan, Tier
from tierstore.errors import Status
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.io.pages import FragmentPlan, plan_fragments
from tierstore.movers import HandlerTable, LoadGate, MemoryHandler, Movers, NvmeHandler, RemoteHandler
from tierstore.tiers.memory import BlockPool

from ..conftest import memory_segment_store

# the tier's helpers (its fixtures come in through conftest.py)
from ..remote.test_tier import BB, block, key, publish


def host_pool(n: int = 4) -> BlockPool:
    return BlockPool("host", n, BB)


def plans_of(out: torch.Tensor) -> list[FragmentPlan]:
    return [FragmentPlan.of_bytes(r, destination=True) for r in out.unbind(0)]


def test_a_cpu_host_pool_is_registered_once(make_tier):
    t = make_tier()
    assert RemoteHandler(t, host_pool()).zero_copy
    assert not RemoteHandler(t, None).zero_copy
    assert not RemoteHandler(t, host_pool(0)).zero_copy  # no slots: nothing to register


def test_publish_then_fetch_only_verified_bytes_under_the_gate(make_tier):
    a, b = RemoteHandler(make_tier()), RemoteHandler(make_tier())
    whole = FragmentPlan.of_bytes(block(1))
    halves = plan_fragments([block(2)[: BB // 2].clone(), block(2)[BB // 2 :].clone()])  # gathered first
    assert a.publish([key(1), key(2)], [whole, halves]) == [Status.OK] * 2
    assert a.tier.flush(5)
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert b.fetch([key(2), key(9), key(1)], plans_of(out)) == [Status.OK, Status.MISS, Status.OK]
    assert torch.equal(out[0], block(2)) and torch.equal(out[2], block(1)) and not out[1].any()
    gate = LoadGate()
    out = torch.zeros(1, BB, dtype=torch.uint8)
    assert b.fetch([key(1)], plans_of(out), gate.at([4])) == [Status.OK] and gate.delivered == {4}
    gate.close()
    out = torch.zeros(1, BB, dtype=torch.uint8)
    assert b.fetch([key(1)], plans_of(out), gate.at([4])) == [Status.MISS] and not out.any()


def test_lost_victims_are_copied_before_their_slot_is_reused(make_tier):
    t = make_tier()
    pool = host_pool()
    memory = MemoryHandler({Tier.HOST: pool})
    remote = RemoteHandler(t, pool)
    memory.view(Tier.HOST, 1).copy_(block(7))
    remote.publish_lost([(key(7), Tier.HOST, 1)], memory)
    memory.view(Tier.HOST, 1).zero_()  # the slot is reused at once
    assert t.flush(5)
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(7)], [d]) == [Status.OK] and torch.equal(d, block(7))


def test_fill_buffers_are_host_slots_when_registered(make_tier):
    pool = host_pool()
    memory = MemoryHandler({Tier.HOST: pool, Tier.HBM: BlockPool("hbm", 2, BB)})
    bufs = RemoteHandler(make_tier(), pool).fill_buffers([(Tier.HOST, 2), (Tier.HBM, 0), None], memory)
    assert bufs[0].data_ptr() == memory.view(Tier.HOST, 2).data_ptr()
    # an HBM slot or no slot: a private staging buffer, copied on once the block is verified
    assert all(b.numel() == BB and b.data_ptr() != memory.view(Tier.HBM, 0).data_ptr() for b in bufs[1:])
    staged = RemoteHandler(make_tier(), None).fill_buffers([(Tier.HOST, 2)], memory)
    assert staged[0].data_ptr() != memory.view(Tier.HOST, 2).data_ptr()


def test_a_late_transfer_holds_its_slots_until_it_returns(make_tier, cluster):
    t = make_tier(timeout_s=0.3)
    pool = host_pool()
    memory = MemoryHandler({Tier.HOST: pool})
    remote = RemoteHandler(t, pool)
    assert publish(t, [1]) == [Status.OK]
    ran: list = []
    cluster.hang.clear()  # the next Mooncake call blocks past the tier's timeout
    try:
        assert remote.get_into([key(1)], remote.fill_buffers([(Tier.HOST, 2)], memory)) == [Status.IO_ERROR]
        assert remote.held == frozenset({2}) and remote.held_of({1, 2}) == {2}
        remote.after_release({2, 3}, lambda: ran.append(("held", threading.current_thread())))
        remote.after_release({1}, lambda: ran.append(("free", threading.current_thread())))
        assert [r[0] for r in ran] == ["free"]  # slot 1 was never held: at once, on this thread
        assert ran[0][1] is threading.current_thread()
    finally:
        cluster.hang.set()  # the late transfer returns: the slot is released on the tier's thread
    assert t.wait_ok(5)
    deadline = time.monotonic() + 5
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r[0] for r in ran] == ["free", "held"] and ran[1][1] is not threading.current_thread()
    assert remote.held == frozenset()


def test_a_remote_fill_lands_in_its_slot_the_destination_and_nvme(make_tier):
    src = make_tier()
    assert publish(src, [1, 2]) == [Status.OK] * 2
    pool = host_pool()
    storage = memory_segment_store(types.SimpleNamespace(bytes_per_block=BB), 4)
    try:
        pids = {LifetimeClass.LONG: 3}
        movers = Movers(
            HandlerTable(
                MemoryHandler({Tier.HOST: pool}),
                NvmeHandler(storage, pids.get),
                RemoteHandler(make_tier(), pool),
            )
        )
        placed = []
        real = storage.put_fragments
        storage.put_fragments = lambda k, f, p, n: placed.append(p) or real(k, f, p, n)
        plan = StorePlan(
            [key(1), key(2), key(3)],
            [None] * 3,
            [0, 1, 2],
            memory=[(0, Tier.HOST, 1)],
            nvme_new=[(1, LifetimeClass.LONG)],
            ns=b"n" * 32,
        )
        out = torch.zeros(3, BB, dtype=torch.uint8)
        gate = LoadGate()  # the plan's keys are blocks 10, 11 and 12 of some load
        st, nvme_st, dem_st, held = movers.run_remote_fill(plan, plans_of(out), gate.at([10, 11, 12]))
        assert st == [Status.OK, Status.OK, Status.MISS] and gate.delivered == {10, 11}
        assert nvme_st == {1: Status.OK, 2: Status.IO_ERROR}  # not delivered: the index forgets it
        assert dem_st == {} and held == set() and placed == [[3]]
        assert torch.equal(out[0], block(1)) and torch.equal(out[1], block(2)) and not out[2].any()
        assert torch.equal(pool.view(1), block(1))  # fetched zero-copy into its host slot
        d = torch.zeros(BB, dtype=torch.uint8)
        assert movers.nvme.read([key(2)], [[d]])[0] == [Status.OK] and torch.equal(d, block(2))
    finally:
        storage.close()
