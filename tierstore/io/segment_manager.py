"""Segments of the NVMe tier: their states, the open segment per placement, extent allocation.

:class:`SegmentManager` is CacheLib Navy's ``RegionManager`` for
:class:`~tierstore.io.segments.SegmentStorage`: per-segment arrays (state,
generation, write pointer, blocks written and live, placement, readers,
sealed-at sequence, last touch, member rows), the open segment of every
placement stream, the next write sequence number, and the decisions that use
only them: which segment an extent goes to (:meth:`SegmentManager.plan_extents`),
when one is sealed, and in which order sealed segments are offered for
eviction (:meth:`SegmentManager.victims`, by a :mod:`~tierstore.io.segment_policies`
policy; never by a policy's name).

Life cycle (:class:`SegmentState`): ``FREE -> OPEN`` (allocated whole with
fallocate when a stream needs room) ``-> SEALED`` (its tail cannot take one
more extent) ``-> RECLAIMING -> FREE`` (trimmed by the owner).

Accounting: ``written - live`` blocks of a segment are dead (holes). A segment
is reused only once it has no live block (it is then reclaimed whole); a
sealed segment with holes stays sealed until eviction or compaction empties it.

Locking: the manager has no lock of its own. Every method runs under the
owner's metadata lock, which is passed in; :meth:`SegmentManager.open_for`
releases it around fallocate (an I/O) and takes it again. Callers of
:meth:`plan_extents` also hold the owner's write lock (only writers take free
segments).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import format as fmt
from .segment_policies import GreedyCompaction, SegmentPolicy, SegmentStats

if TYPE_CHECKING:
    from .batch import ExtentPipeline
    from .engine import IOEngine
    from .locator import BlockLocator

__all__ = ["SegmentState", "ExtentPlan", "SegmentManager", "NO_PLACEMENT", "RoomParts", "SegmentRoom"]

#: ``placement`` of a segment whose writes carry none.
NO_PLACEMENT = -1
_log = logging.getLogger("tierstore.io.segments")


class SegmentState(enum.IntEnum):
    """Life cycle of a segment (reclaim unit); see the module doc."""

    FREE = 0
    OPEN = 1
    SEALED = 2
    RECLAIMING = 3


@dataclasses.dataclass
class ExtentPlan:
    """One extent to write: segment, device offset, sequence number, segment generation,
    placement, the indices (into the put's keys) of its blocks, and, once filled, its entries."""

    seg: int
    ext_off: int
    seq: int
    gen: int
    placement: int | None
    idx: list
    entries: list = dataclasses.field(default_factory=list)


class SegmentManager:
    """Per-segment state and extent allocation of one segment store (module doc).

    Parameters
    ----------
    n_segments, segment_bytes : int
        Geometry: segment ``i`` is device bytes ``[i * segment_bytes, (i + 1) * segment_bytes)``.
    block_bytes, blocks_per_extent : int
        Block size and the most blocks one extent holds.
    reserve : int
        Free segments only garbage collection may take.
    start0 : int
        Byte of segment 0 where its extent chain starts (after the tier's label; 0 without one).
    policy : SegmentPolicy
        Eviction order when a listener is attached.
    lock : threading.Lock
        The owner's metadata lock (held by every caller).
    preallocate : callable
        ``preallocate(offset, length)``: the engine's fallocate (raises ``OSError``).
    counters : dict
        The owner's counters (``preallocate_errors`` is counted here).
    """

    def __init__(
        self,
        n_segments: int,
        segment_bytes: int,
        block_bytes: int,
        blocks_per_extent: int,
        reserve: int,
        start0: int,
        policy: SegmentPolicy,
        lock: threading.Lock,
        preallocate: Callable[[int, int], object],
        counters: dict,
    ) -> None:
        n = self.n_segments = int(n_segments)
        self.segment_bytes = int(segment_bytes)
        self.block_bytes = int(block_bytes)
        self.blocks_per_extent = int(blocks_per_extent)
        self.reserve = int(reserve)
        self.start0 = int(start0)
        self.policy = policy
        self.one_block_extent_bytes = fmt.extent_bytes_for(1, self.block_bytes)
        self._lock = lock
        self._preallocate = preallocate
        self._st = counters
        self._warned_no_space = 0
        #: segments holding space when a preallocation last failed (the file system was full);
        #: ``None`` until one fails, and again once more segments than that hold space
        self._short: int | None = None
        self.state = np.zeros(n, dtype=np.uint8)
        self.gen = np.zeros(n, dtype=np.int64)
        self.wp = np.zeros(n, dtype=np.int64)
        self.written = np.zeros(n, dtype=np.int64)
        self.live = np.zeros(n, dtype=np.int64)
        self.placement = np.full(n, NO_PLACEMENT, dtype=np.int64)
        self.readers = np.zeros(n, dtype=np.int64)
        self.sealed_at = np.zeros(n, dtype=np.int64)  # seq when sealed: FIFO order
        self.touched = np.zeros(n, dtype=np.int64)  # last write or hit (a tick): LRU order
        self.ticks = 0
        self.members: list[array] = [array("i") for _ in range(n)]
        self.open: dict[int | None, int] = {}
        self.to_reclaim: list[int] = []
        self.next_seq = 1

    # ------------------------------------------------------------ geometry
    def chain_start(self, si: int) -> int:
        """Byte of segment ``si`` where its extent chain starts (segment 0: after the label)."""
        return self.start0 if si == 0 else 0

    def segment_of(self, off: int) -> int:
        return off // self.segment_bytes

    def capacity_blocks(self) -> int:
        """Blocks the store can hold when empty (one per extent; batched puts pack more)."""
        per = self.segment_bytes // self.one_block_extent_bytes
        per0 = (self.segment_bytes - self.start0) // self.one_block_extent_bytes
        return (self.n_segments - self.reserve) * per - (per - per0)

    def packed_capacity_blocks(self) -> int:
        """Blocks the store can hold when empty if every extent is full: stores in batches of
        ``blocks_per_extent`` blocks, one header per extent (:func:`~tierstore.io.format.extent_bytes_for`);
        the most, as :meth:`capacity_blocks` is the least."""
        full = fmt.extent_bytes_for(self.blocks_per_extent, self.block_bytes)

        def per_segment(room: int) -> int:
            n, rest = divmod(room, full)
            return n * self.blocks_per_extent + fmt.blocks_fitting(
                rest, self.blocks_per_extent, self.block_bytes
            )

        per, per0 = per_segment(self.segment_bytes), per_segment(self.segment_bytes - self.start0)
        return (self.n_segments - self.reserve) * per - (per - per0)

    def free_blocks(self) -> int:
        """Blocks that fit without evicting anything (worst case: one per extent)."""
        per = self.segment_bytes // self.one_block_extent_bytes
        n_free = int((self.state == SegmentState.FREE).sum())
        total = max(0, n_free - self.reserve) * per
        if total and self.state[0] == SegmentState.FREE:  # segment 0 holds the label
            total -= per - (self.segment_bytes - self.start0) // self.one_block_extent_bytes
        for si in self.open.values():
            total += (self.segment_bytes - int(self.wp[si])) // self.one_block_extent_bytes
        return total

    def state_counts(self) -> dict[str, int]:
        """``segments_<state>`` -> number of segments in it."""
        return {f"segments_{s.name.lower()}": int((self.state == s).sum()) for s in SegmentState}

    def _holding(self) -> int:
        """Segments holding space now (every state but free)."""
        return int((self.state != SegmentState.FREE).sum())

    def usable_segments(self) -> int:
        """Segments the tier can use: all of them, or, after a preallocation failed (its file
        system is full), the segments that held space then, until more hold space again."""
        return self.n_segments if self._short is None else min(self.n_segments, self._short)

    def dead_blocks(self) -> int:
        """Blocks written and no longer live, over all segments."""
        return int((self.written - self.live).sum())

    @property
    def nbytes(self) -> int:
        members = sum(m.itemsize * len(m) for m in self.members)
        return members + sum(
            a.nbytes
            for a in (
                self.state,
                self.gen,
                self.wp,
                self.written,
                self.live,
                self.placement,
                self.readers,
                self.sealed_at,
            )
        )

    # ------------------------------------------------------------ allocation
    def fit(self, remaining: int, want: int) -> int:
        """Blocks (at most ``want``) one extent in ``remaining`` bytes holds."""
        return fmt.blocks_fitting(remaining, min(want, self.blocks_per_extent), self.block_bytes)

    def take_free(self, allow_reserve: bool) -> int | None:
        free = np.flatnonzero(self.state == SegmentState.FREE)
        floor = 0 if allow_reserve else self.reserve
        return int(free[0]) if free.size > floor else None

    def seal(self, si: int, planned: set) -> None:
        self.state[si] = SegmentState.SEALED
        self.sealed_at[si] = self.next_seq
        pl = int(self.placement[si])
        self.open.pop(None if pl == NO_PLACEMENT else pl, None)
        if self.live[si] == 0 and si not in planned and self.written[si] > 0:
            # everything in it died before it filled: reclaim at once (after this plan)
            self.state[si] = SegmentState.RECLAIMING
            self.to_reclaim.append(si)

    def open_for(self, placement: int | None, allow_reserve: bool, planned: set) -> int | None:
        """The open segment of ``placement`` with room for one more extent (opening a free one,
        sealing a full one); ``None`` when no free segment can be had."""
        si = self.open.get(placement)
        if si is not None:
            if self.fit(self.segment_bytes - int(self.wp[si]), 1):
                return si
            self.seal(si, planned)
        si = self.take_free(allow_reserve)
        if si is None:
            return None
        # Allocate the whole segment (reclaim unit) before writing into it:
        # writes then never allocate, and a full file system shows here, with
        # nothing written; the puts that needed it get NO_SPACE. fallocate is
        # I/O: the metadata lock is released around it (readers must not wait
        # for it). The segment is claimed first (OPEN, no blocks yet); only
        # writers take free segments, and they are serialised by the owner's write lock.
        self.state[si] = SegmentState.OPEN
        # from the chain's start, as the trim: segment 0's first page is the label, which a
        # failed fallocate's punch-back must never take (ENOSPC would erase the tier's label)
        start = self.chain_start(si)
        err = self._unlocked(self._preallocate, si * self.segment_bytes + start, self.segment_bytes - start)
        if err is not None:
            self.state[si] = SegmentState.FREE
            self._st["preallocate_errors"] += 1
            self._short = self._holding()
            if self._warned_no_space == 0:
                _log.warning(
                    "segment %d: cannot allocate %d bytes (%s); treating as no space: the tier "
                    "works in the %d of its %d segments that hold space, evicting "
                    "its older blocks to make room (logged once; counted in preallocate_errors, "
                    'the daemon\'s tierstore_nvme_events_total{counter="preallocate_errors"} and '
                    "tierstore_nvme_usable_bytes)",
                    si,
                    self.segment_bytes,
                    err,
                    self._short,
                    self.n_segments,
                )
            self._warned_no_space += 1
            return None
        if self._short is not None and self._holding() > self._short:
            self._short = None  # more space than when the file system filled: it has room again
        self.state[si] = SegmentState.OPEN
        self.placement[si] = NO_PLACEMENT if placement is None else int(placement)
        self.wp[si] = self.chain_start(si)
        self.written[si] = 0
        self.live[si] = 0
        self.members[si] = array("i")
        self.open[placement] = si
        return si

    def _unlocked(self, fn, *args) -> OSError | None:
        """Run ``fn(*args)`` (an I/O) with the metadata lock released; the caller holds it
        and the owner's write lock. Returns the ``OSError`` raised, if any."""
        self._lock.release()
        try:
            fn(*args)
        except OSError as exc:
            return exc
        finally:
            self._lock.acquire()
        return None

    def plan_extents(self, groups: dict, allow_reserve: bool) -> tuple[list[ExtentPlan], dict]:
        """Lay out ``groups`` (``placement -> indices of blocks``) as extents appended to the
        open segment of each placement; ``(plans, leftover)``, ``leftover`` what did not fit.
        Segments sealed empty on the way are listed in :attr:`to_reclaim`."""
        plans: list[ExtentPlan] = []
        leftover: dict = {}
        planned: set[int] = set()
        self.to_reclaim = []
        for placement, idx in groups.items():
            pending = list(idx)
            while pending:
                si = self.open_for(placement, allow_reserve, planned)
                if si is None:
                    leftover[placement] = pending
                    break
                planned.add(si)
                k = self.fit(self.segment_bytes - int(self.wp[si]), len(pending))
                take, pending = pending[:k], pending[k:]
                seq = self.next_seq
                self.next_seq += 1
                if self.wp[si] == self.chain_start(si):
                    self.gen[si] = seq
                ext_off = si * self.segment_bytes + int(self.wp[si])
                self.wp[si] += fmt.extent_bytes_for(k, self.block_bytes)
                plans.append(ExtentPlan(si, ext_off, seq, int(self.gen[si]), placement, take))
        return plans, leftover

    def take_reclaims(self) -> list[int]:
        """The segments :meth:`plan_extents` sealed empty (cleared)."""
        out, self.to_reclaim = self.to_reclaim, []
        return out

    def rollback(self, first: dict[int, int]) -> None:
        """Move each segment's write pointer back to ``first[segment]`` (a device offset)."""
        for si, off in first.items():
            self.wp[si] = off - si * self.segment_bytes
            if self.wp[si] == self.chain_start(si):
                self.written[si] = 0

    # ------------------------------------------------------------ blocks in segments
    def committed(self, si: int, rows: np.ndarray, replaced: np.ndarray) -> None:
        """An extent of ``rows`` was written into ``si``; ``replaced`` offsets are retired copies."""
        k = rows.size
        self.written[si] += k
        self.ticks += 1
        self.touched[si] = self.ticks
        if replaced.size:  # a newer copy (GC copy-forward) retires the old one
            np.subtract.at(self.live, replaced // self.segment_bytes, 1)
        self.live[si] += k
        self.members[si].frombytes(rows.astype(np.int32).tobytes())

    def adopted(self, si: int, row: int) -> None:
        """Recovery found the current copy of ``row`` in ``si``."""
        self.live[si] += 1
        self.members[si].append(row)

    def release(self, si: int) -> bool:
        """One live block of ``si`` is gone; ``True`` if the segment became a sealed empty one,
        now ``RECLAIMING`` (the caller reclaims it)."""
        self.live[si] -= 1
        if self.live[si] == 0 and self.state[si] == SegmentState.SEALED:
            self.state[si] = SegmentState.RECLAIMING
            return True
        return False

    def touch(self, segments: np.ndarray) -> None:
        """A hit on ``segments`` (one tick for all)."""
        self.ticks += 1
        self.touched[segments] = self.ticks

    def live_rows(self, si: int, locator) -> np.ndarray:
        """Rows whose current copy lies in segment ``si``, in the locator's row order (copied
        forward in that order: ``HeldKeys.in_order``, the rows of a key table of its own; the
        shared table's row numbers depend on the block index too)
        (``locator``: a :class:`~tierstore.io.locator.BlockLocator`)."""
        rows = (
            np.frombuffer(self.members[si], dtype=np.int32).astype(np.int64)
            if self.members[si]
            else np.empty(0, dtype=np.int64)
        )
        if not rows.size:
            return rows
        base = si * self.segment_bytes
        return locator.table.in_order(locator.rows_in(np.unique(rows), base, base + self.segment_bytes))

    def victims(self, listener_attached: bool) -> list[int]:
        """Sealed segments in the order eviction considers them.

        With a listener (a cache): the segment policy's order. Without one (a
        plain store that must not lose acknowledged blocks):
        :class:`~tierstore.io.segment_policies.GreedyCompaction`."""
        sealed = np.flatnonzero(self.state == SegmentState.SEALED)
        if not sealed.size:
            return []
        policy = self.policy if listener_attached else _GREEDY
        stats = SegmentStats(self.live, self.written, self.touched, self.sealed_at)
        return policy.order(sealed, stats).tolist()

    def reset(self, si: int) -> None:
        """A reclaimed segment is erased: ``FREE``, empty."""
        self.state[si] = SegmentState.FREE
        self.wp[si] = self.chain_start(si)
        self.written[si] = 0
        self.members[si] = array("i")


_GREEDY = GreedyCompaction()


class RoomParts(NamedTuple):
    """What every room of :class:`~tierstore.io.segments.SegmentStorage` works on (its reader and
    writer), built once by the store.

    Attributes
    ----------
    engine : IOEngine
        The store's engine (reads, writes, trims and fdatasync go through it).
    locator : BlockLocator
        Where the blocks lie.
    segments : SegmentManager
        Segment states, write pointers, live and reader counts.
    keep_data : bool
        ``False``: the accounting mode (no payload is read, gathered or checksummed).
    counters : dict
        The store's counters.
    """

    engine: IOEngine
    locator: BlockLocator
    segments: SegmentManager
    keep_data: bool
    counters: dict


class SegmentRoom:
    """The base of a room of :class:`~tierstore.io.segments.SegmentStorage`: its :class:`RoomParts`
    and its own extent pipeline (staging buffers, copy threads); no lock of its own.

    Parameters
    ----------
    parts : RoomParts
        What every room works on.
    pipe : ExtentPipeline
        This room's pipeline (the store's read or write one).
    """

    def __init__(self, parts: RoomParts, pipe: ExtentPipeline) -> None:
        self.engine = parts.engine
        self._pipe = pipe
        self._loc = parts.locator
        self._segs = parts.segments
        self.keep_data = bool(parts.keep_data)
        self._st = parts.counters
