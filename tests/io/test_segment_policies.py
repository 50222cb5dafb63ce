"""Segment policies (io/segment_policies.py): each policy's eviction order on hand-made segment
stats, ties broken by segment id, and the registry the ``region_policy`` key names."""

import threading

import numpy as np
import pytest
import torch

from tierstore.errors import ConfigError, Status
from tierstore.io import segments
from tierstore.io.memory import MemoryEngine
from tierstore.io.segment_manager import SegmentManager, SegmentState
from tierstore.io.segment_policies import (
    SEGMENT_POLICY,
    FifoSegments,
    GreedyCompaction,
    LruSegments,
    MinLiveSegments,
    SegmentStats,
)
from tierstore.io.segments import SegmentStorage


def stats(live, written, touched, sealed_at) -> SegmentStats:
    return SegmentStats(*(np.asarray(a, dtype=np.int64) for a in (live, written, touched, sealed_at)))


# Eight segments; ties on every key: touched 5 at 1, 3, 6; sealed_at 9 at 0, 4, 7; live 2 at 1, 2, 6.
ST = stats(
    live=[3, 2, 2, 0, 4, 5, 2, 1],
    written=[3, 4, 2, 6, 4, 5, 3, 1],
    touched=[7, 5, 2, 5, 9, 1, 5, 8],
    sealed_at=[9, 3, 8, 1, 9, 2, 6, 9],
)


def old_if_chain(policy: str, listener: bool, sealed: np.ndarray, st: SegmentStats) -> list[int]:
    """SegmentStorage._victims before the split (io/segments.py at 88f2af8), transcribed."""
    if not listener:
        sealed = sealed[st.live[sealed] < st.written[sealed]]
        return sealed[np.argsort(st.live[sealed], kind="stable")].tolist()
    if policy == "min_live":
        return sealed[np.argsort(st.live[sealed], kind="stable")].tolist()
    if policy == "lru":
        return sealed[np.argsort(st.touched[sealed], kind="stable")].tolist()
    return sealed[np.argsort(st.sealed_at[sealed], kind="stable")].tolist()


def test_each_policy_orders_by_its_key_with_ties_in_segment_id_order():
    sealed = np.arange(8)
    assert LruSegments().order(sealed, ST).tolist() == [5, 2, 1, 3, 6, 0, 7, 4]
    assert FifoSegments().order(sealed, ST).tolist() == [3, 5, 1, 6, 2, 0, 4, 7]
    assert MinLiveSegments().order(sealed, ST).tolist() == [3, 7, 1, 2, 6, 0, 4, 5]
    # without a listener: only segments with dead blocks (1, 3, 6), fewest live first, ties by id
    assert GreedyCompaction().order(sealed, ST).tolist() == [3, 1, 6]


def test_a_subset_of_sealed_segments_keeps_ascending_ids_among_ties():
    sealed = np.array([1, 3, 6])  # touched 5 each: all tied
    assert LruSegments().order(sealed, ST).tolist() == [1, 3, 6]
    assert FifoSegments().order(np.array([0, 4, 7]), ST).tolist() == [0, 4, 7]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("policy", ["lru", "fifo", "min_live"])
def test_orders_equal_the_if_chain_they_replace(policy, seed):
    rng = np.random.default_rng(seed)
    n = 40
    written = rng.integers(0, 6, n)
    st = stats(
        live=rng.integers(0, 6, n) % (written + 1),
        written=written,
        touched=rng.integers(0, 5, n),
        sealed_at=rng.integers(0, 5, n),
    )
    sealed = np.flatnonzero(rng.random(n) < 0.6)
    for listener in (True, False):
        pol = SEGMENT_POLICY.make(policy) if listener else GreedyCompaction()
        assert pol.order(sealed, st).tolist() == old_if_chain(policy, listener, sealed, st)


def test_registry_names_and_refusal_wording():
    assert SEGMENT_POLICY.family == "region_policy"
    assert SEGMENT_POLICY.names() == ["lru", "fifo", "min_live"]
    assert segments.REGION_POLICIES == ("lru", "fifo", "min_live")
    msg = r"^region_policy='clock': accepted values are \['lru', 'fifo', 'min_live'\]$"
    with pytest.raises(ConfigError, match=msg):
        SEGMENT_POLICY.make("clock")
    with pytest.raises(ConfigError, match=r"^region_policy='clock': accepted values are"):
        SegmentStorage(
            None, 2 << 20, 4096, segment_size_bytes=256 << 10, engine="memory", region_policy="clock"
        )


def _manager(policy: str, n: int = 8) -> SegmentManager:
    return SegmentManager(
        n,
        1 << 20,
        4096,
        4,
        1,
        0,
        SEGMENT_POLICY.make(policy),
        threading.Lock(),
        lambda off, length: None,
        {"preallocate_errors": 0},
    )


@pytest.mark.parametrize("policy", ["lru", "fifo", "min_live"])
def test_manager_offers_only_sealed_segments_in_policy_order(policy):
    m = _manager(policy)
    for name, arr in zip(SegmentStats._fields, ST):
        getattr(m, name)[:] = arr
    m.state[:] = SegmentState.SEALED
    m.state[[2, 5]] = SegmentState.OPEN, SegmentState.RECLAIMING
    sealed = np.array([0, 1, 3, 4, 6, 7])
    assert m.victims(listener_attached=True) == SEGMENT_POLICY.make(policy).order(sealed, ST).tolist()
    assert m.victims(listener_attached=False) == [3, 1, 6]
    m.state[:] = SegmentState.FREE
    assert m.victims(listener_attached=True) == []


class _KeepNothing:
    def on_reclaim(self, keys):
        return [False] * len(keys)

    def on_dropped(self, keys):
        pass


@pytest.mark.parametrize("policy, evicted", [("fifo", 0), ("lru", 1), ("min_live", 2)])
def test_a_store_evicts_the_segment_its_policy_puts_first(policy, evicted):
    """Seven segments of eight one-block extents filled in order; segment 0's first block is then
    hit (LRU keeps it) and segment 2 loses a block (fewest live); the next put evicts one segment."""
    seg, cap = 64 << 10, 8 * (64 << 10)
    s = SegmentStorage(
        None,
        cap,
        4096,
        segment_size_bytes=seg,
        engine=MemoryEngine(cap),
        extent_size_bytes=8192,
        region_policy=policy,
        listener=_KeepNothing(),
    )
    keys = [bytes([i + 1]) * 32 for i in range(57)]
    for k in keys[:56]:
        assert s.put([k], [torch.full((4096,), k[0], dtype=torch.uint8)]) == [Status.OK]
    assert [s.locate(k)[0] for k in keys[:56:8]] == list(range(7))
    s.touch([keys[0]])
    s.delete([keys[16]])
    assert s.put([keys[56]], [torch.zeros(4096, dtype=torch.uint8)]) == [Status.OK]
    assert s.stats()["regions_evicted"] == 1
    gone = [i for i, k in enumerate(keys[:56]) if not s.contains(k) and i != 16]
    assert gone == [i for i in range(8 * evicted, 8 * evicted + 8) if i != 16]
    s.close()


def test_open_for_runs_fallocate_with_the_passed_lock_released_and_takes_it_back():
    lock = threading.Lock()
    seen = []

    def preallocate(off, length):
        seen.append((off, length, lock.locked()))
        if len(seen) == 2:
            raise OSError(28, "No space left on device")

    counters = {"preallocate_errors": 0}
    m = SegmentManager(4, 1 << 20, 4096, 4, 1, 0, LruSegments(), lock, preallocate, counters)
    with lock:
        plans, leftover = m.plan_extents({None: [0, 1]}, allow_reserve=False)
        assert lock.locked()
        assert [p.seg for p in plans] == [0] and not leftover
        m.seal(0, set())
        plans, leftover = m.plan_extents({7: [0]}, allow_reserve=False)  # fallocate fails: no space
    assert seen == [(0, 1 << 20, False), (1 << 20, 1 << 20, False)]
    assert plans == [] and leftover == {7: [0]}
    assert counters["preallocate_errors"] == 1 and m.state[1] == SegmentState.FREE


def test_a_segment_with_holes_stays_sealed_and_an_empty_one_is_handed_back():
    m = _manager("lru", n=4)
    m.state[0] = SegmentState.SEALED
    m.live[0], m.written[0] = 2, 3
    assert m.dead_blocks() == 1
    assert m.release(0) is False and m.state[0] == SegmentState.SEALED  # 1 live of 3 written: holes
    assert m.dead_blocks() == 2
    assert m.release(0) is True and m.state[0] == SegmentState.RECLAIMING  # no live block: reclaim whole
    m.state[2] = SegmentState.OPEN
    m.live[2] = 1
    assert m.release(2) is False and m.state[2] == SegmentState.OPEN  # an open one is never handed back
