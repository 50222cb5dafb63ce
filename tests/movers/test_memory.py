"""The memory handler on CPU BlockPools: slot copies in plan order, engine gathers and scatters
(per block, and the BlockRows and PageBatch batches moved per tier at once), the load gate, promotions."""

from __future__ import annotations

import pytest
import torch

from tierstore.contract import Demotion, Tier
from tierstore.errors import LayoutError, Status
from tierstore.io.pages import BlockRows, FragmentPlan, KVPagePool
from tierstore.movers import LoadGate, MemoryHandler
from tierstore.movers.memory import run_start, runs_of
from tierstore.tiers.memory import BlockPool

BB = 256


def rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


@pytest.fixture
def memory() -> MemoryHandler:
    pools = {Tier.HBM: BlockPool("hbm", 4, BB), Tier.HOST: BlockPool("host", 8, BB)}
    for i, p in enumerate(pools.values()):
        p.data.copy_(rand(p.num_blocks, 100 + i))
    return MemoryHandler(pools)


def no_view(*_a):
    raise AssertionError("a BlockRows batch copies whole tiers, never one slot at a time")


def test_copy_down_runs_in_plan_order(memory):
    hbm0, host1 = memory.view(Tier.HBM, 0).clone(), memory.view(Tier.HOST, 1).clone()
    # lowest tier first: host slot 1's block moves to slot 2 before HBM slot 0's lands in slot 1
    memory.copy_down(
        [Demotion(0, b"a", Tier.HOST, 1, Tier.HOST, 2), Demotion(1, b"b", Tier.HBM, 0, Tier.HOST, 1)]
    )
    assert torch.equal(memory.view(Tier.HOST, 2), host1)
    assert torch.equal(memory.view(Tier.HOST, 1), hbm0)


def test_gather_per_block_and_as_rows_give_the_same_bytes(memory):
    src = rand(5, 1)
    items = [(0, Tier.HOST, 3), (1, Tier.HOST, 4), (2, Tier.HBM, 2), (3, Tier.HOST, 0), (4, Tier.HBM, 1)]
    memory.gather([FragmentPlan.of_bytes(r) for r in src], items)
    for i, t, s in items:
        assert torch.equal(memory.view(t, s), src[i])
    src2 = rand(5, 2)
    memory.view = no_view  # consecutive host run 0-1 -> 3-4 (slice copy), the rest index_copy_
    memory.gather(BlockRows(src2.clone()), items)
    del memory.view
    for i, t, s in items:
        assert torch.equal(memory.view(t, s), src2[i])


def test_a_single_block_of_rows_goes_through_the_slot_view(memory):
    src = rand(1, 3)
    seen = []
    real = memory.view
    memory.view = lambda t, s: seen.append((t, s)) or real(t, s)
    memory.gather(BlockRows(src.clone()), [(0, Tier.HOST, 5)])
    assert seen == [(Tier.HOST, 5)] and torch.equal(real(Tier.HOST, 5), src[0])


def test_scatter_without_gate_per_block_and_as_rows(memory):
    items = [(0, Tier.HOST, 6), (2, Tier.HBM, 3), (1, Tier.HOST, 7)]
    out = torch.zeros(3, BB, dtype=torch.uint8)
    st = [Status.MISS] * 4
    memory.scatter([FragmentPlan.of_bytes(r, destination=True) for r in out.unbind(0)], items, None, st)
    assert st == [Status.OK] * 3 + [Status.MISS]
    for i, t, s in items:
        assert torch.equal(out[i], memory.view(t, s))
    rows = BlockRows(torch.zeros(3, BB, dtype=torch.uint8), destination=True)
    st = [Status.MISS] * 3
    memory.view = no_view
    memory.scatter(rows, items, None, st)
    del memory.view
    assert st == [Status.OK] * 3
    for i, t, s in items:
        assert torch.equal(rows.rows[i], memory.view(t, s))


def test_scatter_under_a_gate_delivers_only_while_it_is_open(memory):
    out = torch.zeros(2, BB, dtype=torch.uint8)
    dests = [FragmentPlan.of_bytes(r, destination=True) for r in out.unbind(0)]
    gate = LoadGate()
    st = [Status.MISS] * 2
    memory.scatter(dests, [(0, Tier.HOST, 1)], gate, st)
    assert st == [Status.OK, Status.MISS] and gate.delivered == {0}
    assert gate.close() == {0}
    memory.scatter(dests, [(1, Tier.HOST, 2)], gate, st)  # after the deadline: nothing lands
    assert st == [Status.OK, Status.MISS] and not out[1].any()
    # a gate also turns off the BlockRows batch: each block is copied under it
    rows = BlockRows(torch.zeros(2, BB, dtype=torch.uint8), destination=True)
    st = [Status.MISS] * 2
    memory.scatter(rows, [(0, Tier.HOST, 1), (1, Tier.HOST, 2)], LoadGate(), st)
    assert st == [Status.OK] * 2 and torch.equal(rows.rows[1], memory.view(Tier.HOST, 2))


class Unreadable(FragmentPlan):
    def __init__(self) -> None:
        self.nbytes = BB

    def gather(self, staging, offset):
        raise RuntimeError("the engine freed this buffer")


def test_promote_reads_back_loaded_blocks_and_reports_failures(memory):
    loaded = rand(2, 4)
    plans = [FragmentPlan.of_bytes(loaded[0]), Unreadable(), FragmentPlan.of_bytes(loaded[1])]
    ok = memory.promote([(0, 10, Tier.HBM, 0), (1, 11, Tier.HBM, 1), (2, 12, Tier.HBM, 2)], plans)
    assert ok == [True, False, True]
    assert torch.equal(memory.view(Tier.HBM, 0), loaded[0])
    assert torch.equal(memory.view(Tier.HBM, 2), loaded[1])


def test_copy_slots(memory):
    want = memory.view(Tier.HOST, 7).clone()
    memory.copy_slots([(Tier.HOST, 7, Tier.HBM, 3)])
    assert torch.equal(memory.view(Tier.HBM, 3), want)


def test_the_gate_refuses_copies_past_its_deadline_before_anyone_closes_it():
    """A load's deadline holds even when the thread that closes the gate runs late: a copy
    that would start after the deadline is refused by the gate itself (under load,
    test_load_deadline_turns_a_slow_memory_copy_into_misses saw every copy delivered)."""
    import time as _time

    gate = LoadGate(_time.monotonic() + 0.05)
    with gate.enter([0]) as ok:
        assert ok
    _time.sleep(0.06)
    with gate.enter([1]) as ok:
        assert not ok
    assert gate.close() == {0}


def page_pool(n: int, seed: int) -> tuple[torch.Tensor, KVPagePool]:
    """An SGLang ``page_first``-like pool ``(2, n, BB // 2)``: a block is two strided halves (K, V)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (2, n, BB // 2), dtype=torch.uint8, generator=g)
    return buf, KVPagePool([buf], block_dim=1, kv_dim=0)


def block_bytes(buf: torch.Tensor, b: int) -> torch.Tensor:
    return torch.cat([buf[0, b], buf[1, b]])


@pytest.mark.parametrize(
    "ids, slots",
    [
        ([2, 3, 4, 5], [1, 2, 3, 4]),  # one run on both sides: one copy
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        ([9, 1, 4, 0, 7], [5, 0, 7, 2, 3]),  # no runs: one gather
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 0, 1, 2, 3, 4, 5, 6, 7]),  # short runs: a gather
        (list(range(20)), list(range(20, 30)) + list(range(10))),  # two long runs: two copies
        (range(3, 9), [0, 1, 2, 3, 4, 5]),  # a range of ids (SGLang's consecutive pages)
        (range(3, 9), [0, 1, 2, 4, 5, 6]),  # a range of ids, slots in two runs
    ],
)
def test_a_page_batch_moves_like_its_blocks_one_by_one(ids, slots):
    """A PageBatch (blocks of a page pool by id) lands in and comes back from the slots as
    the per-block plans would move it, whichever of the run copy / gather paths it takes."""
    host = BlockPool("host", 30, BB)
    memory = MemoryHandler({Tier.HOST: host})
    buf, pool = page_pool(30, 5)
    items = [(i, Tier.HOST, s) for i, s in enumerate(slots)]
    memory.view = no_view
    memory.gather(pool.batch(ids), items)
    del memory.view
    for b, s in zip(ids, slots):
        assert torch.equal(host.view(s), block_bytes(buf, b))
    out_buf, out = page_pool(30, 6)
    before = out_buf.clone()
    dst_ids = [29 - b for b in ids]
    st = [Status.MISS] * len(ids)
    memory.view = no_view
    memory.scatter(out.batch(dst_ids, destination=True), items, None, st)
    del memory.view
    assert st == [Status.OK] * len(ids)
    for b, d in zip(ids, dst_ids):
        assert torch.equal(block_bytes(out_buf, d), block_bytes(buf, b))
    untouched = sorted(set(range(30)) - set(dst_ids))
    assert torch.equal(out_buf[:, untouched], before[:, untouched])


def test_a_page_batch_is_checked_once_and_refuses_what_plans_refuses():
    _buf, pool = page_pool(6, 7)
    with pytest.raises(LayoutError, match="more than once"):
        pool.batch([1, 2, 1], destination=True)
    with pytest.raises(LayoutError, match="more than once"):
        pool.batch([1, 3, 3], destination=True)  # sorted, not ascending: no fast pass
    assert pool.batch([0, 2, 5], destination=True).row_ids == [0, 2, 5]
    assert pool.batch(range(1, 4), destination=True).row_ids == [1, 2, 3]  # a range: bounds only
    assert len(pool.batch(range(0), destination=True)) == 0
    with pytest.raises(LayoutError, match="block id 6 outside"):
        pool.batch(range(4, 7), destination=True)
    with pytest.raises(LayoutError, match="block id 7 outside"):
        pool.batch(range(7, 9))
    with pytest.raises(LayoutError, match="block id -1 outside"):
        pool.batch(range(-1, 2))
    assert pool.batch(range(0, 6, 2)).row_ids == [0, 2, 4]  # a stepped range: the general path
    with pytest.raises(LayoutError, match="outside"):
        pool.batch([0, 6])
    with pytest.raises(LayoutError, match="not an integer"):
        pool.batch([0.0, 1.0])
    assert len(pool.batch([1, 2, 1])) == 3  # reading a block twice is fine
    b = pool.batch([4, 0])
    assert torch.equal(b[1].strided, pool.plan(0).strided) and b[0:2][0] is b[0]


def test_run_start_finds_one_run_and_nothing_else():
    assert run_start([4, 5, 6]) == 4 and run_start(range(7, 9)) == 7 and run_start([3]) == 3
    assert run_start(range(5, 6, 3)) == 5  # one id is a run whatever the step
    assert run_start([]) is None and run_start(range(0)) is None
    assert run_start([4, 6, 5]) is None  # first and last fit a run, the middle does not
    assert run_start([4, 4, 6]) is None and run_start([5, 4]) is None and run_start(range(0, 6, 2)) is None
    assert run_start((1, 2, 3)) == 1


@pytest.mark.parametrize(
    "dst, src",
    [
        ([0, 1, 2], [5, 6, 7]),
        (range(4, 8), [0, 1, 2, 3]),
        ([0, 1, 2, 3], [5, 6, 9, 10]),
        ([3, 1, 2], [0, 1, 2]),
        ([7], [2]),
        ([0, 2, 4, 5], [1, 3, 5, 6]),
    ],
)
def test_runs_of_fast_pass_agrees_with_the_numpy_pass(dst, src):
    """One run is found without numpy; every other case goes through the numpy pass: the same
    runs either way (checked against a plain loop)."""
    want: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src):
        if want and want[-1][0] + want[-1][2] == d and want[-1][1] + want[-1][2] == s:
            want[-1] = (want[-1][0], want[-1][1], want[-1][2] + 1)
        else:
            want.append((d, s, 1))
    assert runs_of(dst, src) == want
