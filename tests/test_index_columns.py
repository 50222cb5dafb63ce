"""The index's narrow row columns (tierstore/index/rows.py): times as millisecond ticks, counters
as 16-bit integers. Each column widens, rebases or saturates at the first value past its range
and never wraps; a pin's expiry is exact to the tick and never early."""

from __future__ import annotations

import numpy as np

from tierstore.config import PoliciesConfig
from tierstore.index import BlockIndex, IndexRuntime, IndexShape
from tierstore.index.rows import HITS_MAX, TICKS_PER_S, RowTable

from .conftest import FakeClock

#: The span of ``uint32`` ticks, in seconds (49.7 days).
SPAN_S = ((1 << 32) - 2) / TICKS_PER_S


def _k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _rows(rt: RowTable, first: int, n: int, now: float) -> list[int]:
    return rt.new_rows([_k(i) for i in range(first, first + n)], 0, np.zeros(n), -1, now).tolist()


def test_times_read_back_to_the_millisecond_and_a_trace_clocks_exactly():
    """A trace clock's times (whole ms from 0, as the replay sets them) read back as the same float;
    a monotonic clock's to within half a tick; 0.0 (never written to NVMe) stays 0.0."""
    rt = RowTable(16, 64)
    (r,) = _rows(rt, 0, 1, 0.0)  # a replay starts at trace time 0
    v = rt.view(r)
    assert (v.created_s, v.last_access_s, v.nvme_written_s) == (0.0, 0.0, 0.0)
    for ms in (1, 7, 330_000, 123_457):
        rt.stamp("last", r, ms / 1000.0)
        assert v.last_access_s == ms / 1000.0 and v.created_s == 0.0
    rt.stamp("nvme_at", r, 72_000.1234567)
    assert abs(v.nvme_written_s - 72_000.1234567) <= 0.5 / TICKS_PER_S
    assert rt.created.dtype == np.uint32 and rt.last.dtype == np.uint32


def test_a_time_past_the_span_rebases_in_place_when_the_live_times_fit():
    """Free rows' times do not hold the base back: a time 60 days on rebases the columns (still
    ``uint32``, the same arrays); then a time 60 days before the live ones widens them. Every
    live time reads back unchanged."""
    rt = RowTable(16, 64)
    old = _rows(rt, 0, 2, 1000.0)
    live = _rows(rt, 2, 1, 1000.0 + 40 * 86400)
    for r in old:
        rt.drop_new(r)
    last = rt.last
    far = 1000.0 + 60 * 86400 + 0.001
    rt.stamp("last", live[0], far)
    assert rt.last is last and rt.last.dtype == np.uint32  # rebased in place
    assert rt.view(live[0]).created_s == 1000.0 + 40 * 86400 and rt.view(live[0]).last_access_s == far
    (early,) = _rows(rt, 3, 1, 5.0)  # live times now span 60 days, more than 49.7
    assert rt.last.dtype == np.int64  # widened, not wrapped
    assert rt.view(early).created_s == 5.0 and rt.view(live[0]).last_access_s == far
    assert rt.view(live[0]).created_s == 1000.0 + 40 * 86400


def test_a_time_before_the_base_rebases_down_without_widening():
    rt = RowTable(16, 64)
    (a,) = _rows(rt, 0, 1, 500.0)
    (b,) = _rows(rt, 1, 1, 2.5)  # the clock went back (a trace replayed from 0 on the same index)
    assert rt.created.dtype == np.uint32
    assert rt.view(a).created_s == 500.0 and rt.view(b).created_s == 2.5
    assert int(rt.created[b]) < int(rt.created[a])  # order kept


def test_live_times_spanning_more_than_uint32_widen_every_time_column_to_int64():
    rt = RowTable(16, 64)
    (a,) = _rows(rt, 0, 1, 10.0)
    rt.stamp("nvme_at", a, 10.0)
    rt.stamp("last", a, 10.0 + SPAN_S)  # the latest time a uint32 holds beside 10.0: a rebase
    assert rt.last.dtype == np.uint32 and rt.tick_base == 10 * TICKS_PER_S - 1
    assert int(rt.last[a]) == 0xFFFFFFFF
    rt.stamp("last", a, 10.0 + SPAN_S + 0.001)  # one tick past, while created (live) is at 10.0
    assert all(getattr(rt, c).dtype == np.int64 for c in ("created", "last", "pin_until", "nvme_at"))
    v = rt.view(a)
    assert v.created_s == 10.0 and v.nvme_written_s == 10.0
    assert abs(v.last_access_s - (10.0 + SPAN_S + 0.001)) <= 0.5 / TICKS_PER_S
    assert v.last_access_s > v.nvme_written_s  # no wrap: a later time is still later


def _pinned_index() -> tuple[BlockIndex, FakeClock, int]:
    clock = FakeClock()
    ix = BlockIndex(IndexShape(4096, 16, host_blocks=4), PoliciesConfig(), IndexRuntime(clock=clock))
    ix.complete_store(ix.prepare_store(bytes(32), [_k(1), _k(2)]))
    return ix, clock, int(ix.rows.table.get(_k(1)))


def test_a_pin_never_ends_before_its_lease_and_at_most_one_tick_after():
    ix, clock, r = _pinned_index()
    other = int(ix.rows.table.get(_k(2)))
    lease = ix.pin(bytes(32), [_k(1)], lease_s=0.0012)  # between two ticks, nearer the earlier
    assert lease.expiry_s == 1000.0012
    for t in (1000.0, 1000.0011, 1000.00119, 1000.0012, 1000.0019):
        assert ix.rows.pinned(r, t) and ix.rows.protected_many(np.array([r]), t)[0]
    assert not ix.rows.pinned(r, 1000.002)  # the tick at or after the expiry
    assert not ix.rows.pinned(other, 1000.0) and not ix.rows.protected(other, 1000.0)
    clock.advance(0.0012)
    assert ix.leases == {}  # the lease itself ends exactly at its expiry
    assert not ix.rows.pinned(r, 1000.0012)  # and so does the row's pin


def test_pins_hold_when_the_clock_is_before_every_stored_time():
    """``now`` before the columns' base (a replay clock set back): a pin is still a pin, no pin is none."""
    ix, clock, r = _pinned_index()
    clock.now_s = 3.0
    ix.pin(bytes(32), [_k(1)], lease_s=2.0)
    assert ix.rows.pinned(r, 2.0) and ix.rows.pinned(r, 4.999) and not ix.rows.pinned(r, 5.0)
    other = int(ix.rows.table.get(_k(2)))
    assert not ix.rows.pinned(other, 1.0) and not ix.rows.pinned(other, -50.0)
    assert ix.rows.view(other).created_s == 1000.0


def test_hits_saturate_at_the_uint16_maximum():
    rt = RowTable(16, 64)
    rows = np.array(_rows(rt, 0, 2, 0.0))
    rt.hits[rows] = [HITS_MAX - 1, 5]
    rt.count_hits(rows)
    rt.count_hits(rows)
    assert rt.hits.dtype == np.uint16 and rt.hits[rows].tolist() == [HITS_MAX, 7]


def test_refs_and_readers_widen_to_int32_at_the_first_count_past_int16():
    rt = RowTable(16, 64)
    rows = np.array(_rows(rt, 0, 2, 0.0))
    for name in ("refs", "readers"):
        rt.count_up(name, rows)  # far from the limit: stays int16
        assert getattr(rt, name).dtype == np.int16
        getattr(rt, name)[rows[0]] = 0x7FFF - 2
        rt.count_up(name, np.array([rows[0], rows[0], rows[1]]))  # repeats count: 0x7FFF, fits
        assert getattr(rt, name).dtype == np.int16 and int(getattr(rt, name)[rows[0]]) == 0x7FFF
        rt.count_up(name, int(rows[0]))
        a = getattr(rt, name)
        assert a.dtype == np.int32 and a[rows].tolist() == [0x8000, 2]
    rt2 = RowTable(16, 64)
    r2 = np.array(_rows(rt2, 0, 1, 0.0))
    rt2.readers[r2] = 0x7FFF - 1
    rt2.count_up("readers", np.repeat(r2, 2))  # the array path: one past the limit
    assert rt2.readers.dtype == np.int32 and int(rt2.readers[r2[0]]) == 0x8000


def test_a_request_reference_past_int16_is_kept_and_released():
    """Through lookup and release: the 32768th reference widens ``refs``; none is lost."""
    ix, _clock, r = _pinned_index()
    ix.rows.refs[r] = 0x7FFF
    res = ix.lookup([_k(1)], request_id="q")
    assert res.matched_blocks == 1 and ix.rows.refs.dtype == np.int32 and int(ix.rows.refs[r]) == 0x8000
    assert ix.release("q") == 1 and int(ix.rows.refs[r]) == 0x7FFF
    ix.rows.refs[r] = 0
    ix.check_invariants(quiescent=True)


def test_counts_of_a_call_count_every_occurrence_in_any_order():
    """``count_up``/``count_down`` over a call's rows (one fancy-indexed update when the rows are
    distinct, ``ufunc.at`` otherwise): a row given twice counts twice, ascending or not."""
    rt = RowTable(16, 64)
    rows = np.array(_rows(rt, 0, 4, 0.0))
    for order in (rows, rows[::-1], rows[[2, 0, 3, 1]], rows[[1, 1, 3, 1]], rows[[0, 2, 2, 0]]):
        before = rt.readers.astype(np.int64)
        want = before.copy()
        np.add.at(want, order, 1)
        rt.count_up("readers", order)
        assert rt.readers.tolist() == want.tolist()
        assert not rt.count_down("readers", order)
        assert rt.readers.tolist() == before.tolist()
    assert rt.count_down("refs", rows[[1, 1]]), "a count below zero is reported"


def test_a_release_of_repeated_keys_drops_each_reference():
    """A request that looked a key up twice (and one up once) holds and releases every reference."""
    ix, _clock, r = _pinned_index()
    res = ix.lookup([_k(1), _k(1)], request_id="q")
    assert res.matched_blocks == 2 and int(ix.rows.refs[r]) == 2
    assert ix.release("q") == 2 and int(ix.rows.refs[r]) == 0
    ix.check_invariants(quiescent=True)
