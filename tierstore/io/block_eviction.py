"""Per-block eviction on the NVMe tier (``eviction_granularity: block``, issue 26): the room.

:class:`BlockEviction` is a room of :class:`~tierstore.io.segments.SegmentStorage` in block
mode. The store keeps at most ``live_budget`` blocks (``live_fraction`` of the blocks its
usable segments hold; the rest of the LBA space is slack for holes); before a put would pass
it, the listener (the block index) names victims in its NVMe eviction policy's order and the
store *retires* their slots: a ``BLOCK_DEAD`` record is staged in the
:class:`~tierstore.io.journal.Journal`, and once it is durable (:meth:`BlockEviction.commit`)
the slot waits in ``pending`` to be deallocated. Segments can fill below the budget (small
extents spend slots on headers; a reopen seals the segments it recovered): where region GC
would drop a segment full of live blocks or the newest one, :meth:`BlockEviction.free_segment`
evicts the listener's victims the same way until one empties; otherwise GC reclaims the holes.
:meth:`BlockEviction.take_trims` hands out runs of adjacent dead slots of at least
``trim_min_bytes`` (headers are never trimmed before the segment's reset: recovery walks the
chain through them). A hole is never rewritten: a segment is reused only after it is reset whole
(its last block gone; a ``SEGMENT_RESET`` record is durable before its trim).

Accounting, per non-free segment: ``written - live == dead + other_dead`` where ``dead`` is
the slots retired in this generation (``trimmed + len(pending) + staged``) and ``other_dead``
the slots dead without a record of their own (copies retired by GC copy-forward, recovery
leftovers), all covered by the segment's reset (:meth:`check`).

Locking: every method but :meth:`commit` runs under the store's metadata lock. :meth:`commit`
takes the journal lock (held across the journal's write and fdatasync, like the store's write
lock across a write) and the metadata lock only around the in-memory steps.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import ConfigError, InvariantError
from ..tiers.storage import RegionListener
from . import format as fmt
from .engine import IOEngine
from .journal import Journal, RecordKind
from .locator import BlockLocator
from .segment_manager import SegmentManager, SegmentState

__all__ = ["BlockEviction", "FORCE_TRIM_BYTES", "GRANULARITIES", "live_budget_for"]

#: The accepted ``eviction_granularity`` values.
GRANULARITIES = ("region", "block")

#: Pending dead bytes above which every run is trimmed, short or not (plan §2.5).
FORCE_TRIM_BYTES = 64 << 20


def live_budget_for(segs: SegmentManager, live_fraction: float) -> int:
    """:func:`live_budget` of a segment store's geometry."""
    return live_budget(
        segs.n_segments,
        segs.reserve,
        segs.segment_bytes,
        segs.block_bytes,
        segs.blocks_per_extent,
        live_fraction,
    )


def live_budget(
    n_segments: int,
    reserve: int,
    segment_bytes: int,
    block_bytes: int,
    blocks_per_extent: int,
    live_fraction: float,
) -> int:
    """``floor(live_fraction x usable blocks)``: usable = the blocks full extents pack into the
    segments beyond the reserve and one open segment (plan §2.1). Start-up (:func:`live_budget_for`)
    and ``serve --check`` compute it with this one function.

    Raises
    ------
    ConfigError
        ``live_fraction`` outside ``(0, 1]`` or a budget below one block.
    """
    if not 0.0 < live_fraction <= 1.0:
        raise ConfigError(f"live_fraction={live_fraction}: must be in (0, 1]")
    full = fmt.extent_bytes_for(blocks_per_extent, block_bytes)
    per = segment_bytes // full * blocks_per_extent + fmt.blocks_fitting(
        segment_bytes % full, blocks_per_extent, block_bytes
    )
    budget = int(live_fraction * (n_segments - reserve - 1) * per)
    if budget < 1:
        raise ConfigError(
            f"eviction_granularity='block' on {n_segments} segments with reserve "
            f"{reserve}: no block fits the live budget (give more segments)"
        )
    return budget


class BlockEviction:
    """Dead slots, tombstones and trims of a segment store in block mode (module doc).

    Parameters
    ----------
    segs : SegmentManager
        The store's segments (geometry, ``gen``, ``state``, ``readers``).
    loc : BlockLocator
        The store's key -> slot map.
    engine : IOEngine
        Where dead slots are deallocated (:meth:`~tierstore.io.engine.IOEngine.trim_many`).
    slot_bytes : int
        Device bytes of one payload slot (a multiple of 4096).
    live_budget : int
        Most blocks the store keeps (>= 1).
    trim_min_bytes : int
        Shortest run of adjacent dead slots worth a deallocate command.
    journal : Journal
        Where tombstones and resets are made durable before a trim.
    lock : threading.Lock
        The store's metadata lock.
    counters : dict
        The store's counters (``block_evictions``, ``trimmed_bytes``, ... are kept there).
    """

    def __init__(
        self,
        segs: SegmentManager,
        loc: BlockLocator,
        engine: IOEngine,
        slot_bytes: int,
        live_budget: int,
        trim_min_bytes: int,
        journal: Journal,
        lock: threading.Lock,
        counters: dict,
    ) -> None:
        n = segs.n_segments
        self.segs = segs
        self.loc = loc
        self.engine = engine
        self.slot_bytes = int(slot_bytes)
        self.live_budget = int(live_budget)
        self.trim_min_bytes = int(trim_min_bytes)
        self.journal = journal
        self._lock = lock
        self._jlock = threading.Lock()
        self._st = counters
        self.dead = np.zeros(n, dtype=np.int64)  # slots retired (tombstoned) in this generation
        self.trimmed = np.zeros(n, dtype=np.int64)  # of those, slots whose deallocate was issued
        self.other_dead = np.zeros(n, dtype=np.int64)  # dead without a record (GC-superseded, recovery)
        self.pending: list[list[int]] = [[] for _ in range(n)]  # durable, not yet trimmed
        self._staged: list[tuple] = []  # records not yet durable, in order
        self._compact_check_bytes = 1 << 20  # look at compaction again once the journal is this big
        for name in (
            "block_evictions",
            "gc_evicted_blocks",
            "trimmed_bytes",
            "trim_ranges",
            "trim_calls",
            "journal_errors",
            "recovery_tombstoned_blocks",
            "recovery_stale_segments",
            "journal_mismatch",
            "segments_reset",
        ):
            counters.setdefault(name, 0)

    # ------------------------------------------------------------ flows (no lock held; write lock for puts)
    def make_room(self, groups: dict, status: list, listener: RegionListener | None, refused) -> list[int]:
        """Before a put of the blocks in ``groups`` (``placement -> indices``): evict the listener's
        victims (``pick_victims``) until the put fits the live budget; what still does not fit
        (the last indices) is taken out of ``groups`` and given ``refused`` in ``status``. The
        tombstones are committed. Returns the segments left empty (``RECLAIMING``)."""
        with self._lock:
            n_new = sum(len(v) for v in groups.values())
            over = len(self.loc) + n_new - self.live_budget
        pick = getattr(listener, "pick_victims", None)
        victims = list(pick(over)) if over > 0 and pick is not None else []
        with self._lock:
            empty = self.evict_keys(victims, "block_evictions")
            over = len(self.loc) + n_new - self.live_budget
            if over > 0:
                drop = set(sorted(i for v in groups.values() for i in v)[-over:])
                for p in list(groups):
                    groups[p] = [i for i in groups[p] if i not in drop]
                    if not groups[p]:
                        del groups[p]
                for i in drop:
                    status[i] = refused
                self._st["put_no_space"] += len(drop)
        self.commit()
        return empty

    def free_segment(self, want: int, listener: RegionListener | None) -> list[int]:
        """No segment is free for ``want`` more blocks although the store is within its live budget
        (extents of a few blocks spend more slots on headers than the budget counts, and a reopen
        seals the segments it recovered, tails unwritten): evict the listener's victims
        (``pick_victims``), in its order, ``want`` at a time, until a segment is left empty, at most
        two segments' worth of blocks. So a full tier evicts its least recently used blocks (after a
        reopen, the oldest recovered ones first), not the segment just written; what this does not
        free falls to region GC. The store calls it only where GC's first choice is full of live
        blocks or the newest sealed segment (``segments._gc_would_take_full_or_newest``): elsewhere
        scattered victims cost ~130 evictions per segment emptied (bench/README_frontier.md, s34).
        The tombstones are committed. Returns the segments left empty (``RECLAIMING``)."""
        pick = getattr(listener, "pick_victims", None)
        if pick is None or want <= 0:
            return []
        with self._lock:
            cap = 2 * max(1, int(self.segs.written.max()))
        empty: list[int] = []
        evicted = 0
        while not empty and evicted < cap:
            victims = list(pick(min(want, cap - evicted)))
            if not victims:
                break
            with self._lock:
                empty = self.evict_keys(victims, "block_evictions")
            evicted += len(victims)
        self.commit()
        return empty

    def flush_trims(self, force: bool = False) -> None:
        """Commit the staged records, then deallocate the runs :meth:`take_trims` hands out (the
        caller holds the store's write lock: no segment is rewritten meanwhile)."""
        if not self.commit():
            return
        with self._lock:
            ranges = self.take_trims(force)
        if not ranges:
            return
        try:
            self.engine.trim_many(ranges).get()
            err = 0
        except OSError:
            err = 1  # a dead slot left allocated: covered by its segment's reset
        with self._lock:
            self._st["trim_errors"] += err
            self._st["trim_calls"] += 1
            self._st["trim_ranges"] += len(ranges)
            self._st["trimmed_bytes"] += sum(n for _, n in ranges)

    def before_reset(self, si: int) -> bool:
        """Segment ``si`` is to be trimmed whole: its ``SEGMENT_RESET`` is made durable first.
        ``False``: the journal failed; the caller must not trim."""
        with self._lock:
            self.stage_reset(si)
        return self.commit()

    def recovered(self, tombstoned: list, stale: list, mismatch: int) -> None:
        """After recovery (nothing else runs): tombstoned slots wait for their (re-)trim, the
        other dead slots of each segment are covered by its reset."""
        for si, off in tombstoned:
            self.dead[si] += 1
            self.pending[si].append(off)
        used = self.segs.state != SegmentState.FREE
        self.other_dead[used] = (self.segs.written - self.segs.live - self.dead)[used]
        self._st["recovery_tombstoned_blocks"] += len(tombstoned)
        self._st["recovery_stale_segments"] += len(stale)
        self._st["journal_mismatch"] += mismatch

    def drop_over_budget(self) -> tuple[int, list[int]]:
        """After recovery (nothing else runs): a tier reopened with a smaller live budget (capacity
        or ``live_fraction``) keeps ``live_budget`` blocks, as the configuration says; the oldest
        recovered ones (lowest write sequence number: those the index, which adopts recovered
        blocks in write order, would evict first) are retired, counted in
        ``recovery_dropped_blocks``, and their tombstones committed. Returns ``(blocks dropped,
        segments left empty (RECLAIMING))``."""
        over = len(self.loc) - self.live_budget
        if over <= 0:
            return 0, []
        got = self.loc.scan()
        oldest = np.argsort(got.write_seqs, kind="stable")[:over]
        with self._lock:
            empty = self.evict_keys([got.keys[i] for i in oldest.tolist()], "recovery_dropped_blocks")
        self.commit()
        return over, empty

    # ------------------------------------------------------------ under the metadata lock
    def evict_keys(self, keys, counter: str) -> list[int]:
        """Retire the present ``keys`` (locator row, live count, tombstone); counted in
        ``counter``. Returns the segments left empty (now ``RECLAIMING``)."""
        empty: list[int] = []
        n = 0
        for k in keys:
            row = self.loc.row(k)
            if row < 0:
                continue
            off = self.loc.offsets(row)
            self.loc.remove([k])
            si = off // self.segs.segment_bytes
            self.retire(si, off, k)
            n += 1
            if self.segs.release(si):
                empty.append(si)
        self._st[counter] = self._st.get(counter, 0) + n
        return empty

    def retire(self, si: int, off: int, key: bytes) -> None:
        """The block ``key`` at payload offset ``off`` of segment ``si`` left the store (its
        locator row and live count are already gone): stage its tombstone."""
        self.dead[si] += 1
        self._staged.append((RecordKind.BLOCK_DEAD, si, int(self.segs.gen[si]), int(off), bytes(key)))

    def superseded(self, segments: np.ndarray) -> None:
        """Old copies in ``segments`` were retired by a newer copy (GC copy-forward)."""
        if segments.size:
            np.add.at(self.other_dead, segments, 1)

    def stage_reset(self, si: int) -> None:
        """Segment ``si`` (no live block) is about to be trimmed whole and freed."""
        self._staged.append((RecordKind.SEGMENT_RESET, si, int(self.segs.gen[si]), 0, bytes(32)))

    def cleared(self, si: int) -> None:
        """Segment ``si`` was reset: its dead slots are gone with it."""
        self.dead[si] = self.trimmed[si] = self.other_dead[si] = 0
        self.pending[si] = []
        self._st["segments_reset"] += 1

    def take_trims(self, force: bool = False) -> list[tuple[int, int]]:
        """Runs of adjacent durable dead slots to deallocate now, ``(device offset, bytes)``:
        each at least ``trim_min_bytes`` (every run when ``force`` or when more than
        :data:`FORCE_TRIM_BYTES` are pending). Segments being read or reclaimed wait."""
        segs, slot = self.segs, self.slot_bytes
        force = force or self.pending_bytes() > FORCE_TRIM_BYTES
        out: list[tuple[int, int]] = []
        for si, offs in enumerate(self.pending):
            if (
                not offs
                or segs.readers[si] > 0
                or segs.state[si] in (SegmentState.FREE, SegmentState.RECLAIMING)
            ):
                continue
            keep: list[int] = []
            for start, n in _runs(sorted(offs), slot):
                if force or n * slot >= self.trim_min_bytes:
                    out.append((start, n * slot))
                    self.trimmed[si] += n
                else:
                    keep.extend(range(start, start + n * slot, slot))
            self.pending[si] = keep
        return out

    def pending_bytes(self) -> int:
        return sum(len(p) for p in self.pending) * self.slot_bytes

    def stats(self) -> dict:
        """``live_budget_blocks``, ``dead_pending_bytes``, ``live_bytes`` (device bytes of the live
        slots), ``hole_blocks`` / ``hole_bytes`` (dead slots in segments not yet reset),
        ``journal_records``, ``journal_commits``."""
        holes = int(self.dead.sum() + self.other_dead.sum())
        return {
            "live_budget_blocks": self.live_budget,
            "dead_pending_bytes": self.pending_bytes(),
            "live_bytes": len(self.loc) * self.slot_bytes,
            "hole_blocks": holes,
            "hole_bytes": holes * self.slot_bytes,
            "journal_records": self.journal.stats["records_appended"],
            "journal_commits": self.journal.stats["commits"],
        }

    def check(self, live_offsets: np.ndarray) -> None:
        """The block-mode invariants (module doc); ``live_offsets``: payload offsets of every live block.

        Raises
        ------
        InvariantError
        """
        segs = self.segs
        staged = np.zeros(segs.n_segments, dtype=np.int64)
        for rec in self._staged:
            if rec[0] is RecordKind.BLOCK_DEAD and rec[2] == segs.gen[rec[1]]:
                staged[rec[1]] += 1
        for si in range(segs.n_segments):
            if segs.state[si] == SegmentState.FREE:
                continue
            holes = int(segs.written[si] - segs.live[si])
            if holes != self.dead[si] + self.other_dead[si]:
                raise InvariantError(
                    f"segment {si}: {holes} dead slots, but {int(self.dead[si])} retired + "
                    f"{int(self.other_dead[si])} superseded"
                )
            if self.trimmed[si] + len(self.pending[si]) + staged[si] > self.dead[si]:
                raise InvariantError(f"segment {si}: more slots trimmed or pending than retired")
        dead = np.array([o for p in self.pending for o in p], dtype=np.int64)
        if np.intersect1d(dead, live_offsets).size:
            raise InvariantError("a pending trim covers a live block")

    # ------------------------------------------------------------ journal (no lock held)
    def commit(self) -> bool:
        """Make every staged record durable; then their slots may be trimmed. ``False`` when the
        journal could not be written (counted in ``journal_errors``; nothing is trimmed then)."""
        with self._jlock:
            with self._lock:
                staged, self._staged = self._staged, []
            if not staged:
                return True
            for kind, si, gen, off, key in staged:
                self.journal.append(kind, si, gen, off, key)
            try:
                self.journal.commit()
                if self.journal.file_bytes() >= self._compact_check_bytes:  # not every commit: O(records)
                    if self.journal.should_compact():
                        self.journal.compact()
                    self._compact_check_bytes = max(1 << 20, 2 * self.journal.file_bytes())
            except OSError:
                with self._lock:
                    self._st["journal_errors"] += 1
                return False
            with self._lock:
                for kind, si, gen, off, _ in staged:
                    if (
                        kind is RecordKind.BLOCK_DEAD
                        and self.segs.gen[si] == gen
                        and self.segs.state[si] != SegmentState.FREE
                    ):
                        self.pending[si].append(off)
            return True


def _runs(offs: list[int], slot: int):
    """``(start, slots)`` of each run of adjacent slots in sorted ``offs``."""
    i = 0
    while i < len(offs):
        j = i
        while j + 1 < len(offs) and offs[j + 1] == offs[j] + slot:
            j += 1
        yield offs[i], j - i + 1
        i = j + 1
