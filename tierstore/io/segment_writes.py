"""The segment store's write path: extents filled, written, acknowledged, indexed; segments trimmed.

:class:`SegmentWriter` is a room of :class:`~tierstore.io.segments.SegmentStorage` and holds no
lock of its own. :meth:`SegmentWriter.write` runs under the store's write lock (one writer at a
time, held across write I/O) and takes the store's metadata lock only to settle what was written;
:meth:`SegmentWriter.finish_reclaim` waits on the metadata lock's condition for a segment's reads
to end and trims it outside the lock.

The blocks of planned extents (:meth:`~tierstore.io.segment_manager.SegmentManager.plan_extents`)
are gathered into staging buffers (:mod:`tierstore.io.batch`), with the extent header of
:mod:`tierstore.io.format`, and written; an extent is acknowledged (``OK``) only after fdatasync.
A failed extent breaks its segment's chain: later extents of that segment in the same call are not
acknowledged either, and the write pointer is rolled back (recovery stops at a hole). ENOSPC,
EFBIG and EDQUOT are ``NO_SPACE``, other errors ``IO_ERROR``.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import InvariantError, Status
from . import format as fmt
from .batch import ExtentPipeline
from .block_eviction import BlockEviction
from .copies import one_omp_thread
from .pages import FragmentPlan
from .segment_manager import ExtentPlan, RoomParts, SegmentRoom, SegmentState

__all__ = ["SegmentWriter"]

_NOSPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_log = logging.getLogger(__name__)


def _consecutive_rows(plans: Sequence[FragmentPlan]) -> torch.Tensor | None:
    """``rows[i:i + k]`` when ``plans`` are the plans of rows ``i .. i + k - 1``
    of one :class:`~tierstore.io.pages.BlockRows` (one copy moves them all), else None."""
    first = getattr(plans[0], "row_of", None) if plans else None
    if first is None or len(plans) < 2:
        return None
    rows, i0 = first
    for j, p in enumerate(plans):
        r = getattr(p, "row_of", None)
        if r is None or r[0] is not rows or r[1] != i0 + j:
            return None
    return rows[i0 : i0 + len(plans)]


def _extent_filler(
    p: ExtentPlan, keys, frags, nss, block_bytes: int, keep_data: bool, pipe: ExtentPipeline
) -> Callable[[torch.Tensor], int]:
    """``fill(buf)``: lay out the extent of ``p`` in the staging buffer (header, payloads,
    padding) and record its entries in ``p.entries``; returns the bytes used."""
    slot = fmt.block_slot_bytes(block_bytes)
    bb = block_bytes

    def fill(buf: torch.Tensor) -> int:
        mv = buf.numpy().data  # a memoryview of the staging buffer
        hb = fmt.header_bytes_for(len(p.idx))
        jobs = [(i, hb + j * slot) for j, i in enumerate(p.idx)]
        end = hb + len(jobs) * slot
        if not keep_data:  # accounting mode: the real header, payload and padding unwritten
            p.entries = [fmt.BlockEntry(keys[i], nss[i], pos, bb, 0) for i, pos in jobs]
            fmt.encode_header(mv, p.seq, p.gen, p.ext_off, end - hb, p.placement, p.entries)
            return end
        # Copies back to back (see ExtentPipeline.gather_blocks), then CRC-32C
        # on the copy threads (crc32c releases the GIL).
        mine = [frags[i] for i in p.idx]
        k = len(mine)
        rows = _consecutive_rows(mine)
        if rows is not None:  # rows i..i+k of one BlockRows: one strided copy, on one OpenMP thread
            with one_omp_thread():
                buf.as_strided((k, bb), (slot, 1), buf.storage_offset() + hb).copy_(rows)
        else:
            pipe.gather_blocks(mine, buf, [pos for _, pos in jobs])
        if slot > bb:
            with one_omp_thread():
                buf.as_strided((k, slot - bb), (slot, 1), buf.storage_offset() + hb + bb).zero_()

        def one(job) -> fmt.BlockEntry:
            i, pos = job
            return fmt.BlockEntry(keys[i], nss[i], pos, bb, fmt.payload_crc(keys[i], mv[pos : pos + bb]))

        entries = pipe.map(one, jobs)
        fmt.encode_header(mv, p.seq, p.gen, p.ext_off, end - hb, p.placement, entries)
        p.entries = entries
        return end

    return fill


class SegmentWriter(SegmentRoom):
    """Writes the extents of a segment store and returns its segments to the clean pool (module doc).

    Parameters
    ----------
    parts : RoomParts
        The store's engine (trims and fdatasync go through it), locator (a written extent's blocks
        are committed to it), segment manager (write pointers, live counts and segment states),
        ``keep_data`` (``False``: the accounting mode, payloads neither gathered nor checksummed)
        and counters (written bytes, put outcomes, reclaimed segments, trim errors).
    pipe : ExtentPipeline
        The store's write pipeline (staging buffers, copy threads).
    readers_done : threading.Condition
        The condition of the store's metadata lock: held (``with``) to change metadata, waited on
        until a segment's reads end (the store notifies it when a read unpins its segments).
    block_bytes : int
        Bytes of every block.

    Attributes
    ----------
    blk : BlockEviction or None
        Block mode's eviction (told what a commit supersedes, asked before a segment is reset);
        set by the store once its journal is open.
    """

    def __init__(
        self, parts: RoomParts, pipe: ExtentPipeline, readers_done: threading.Condition, block_bytes: int
    ):
        super().__init__(parts, pipe)
        self._readers_done = readers_done
        self._lock = readers_done  # entering a Condition takes its lock: the metadata lock
        self.block_bytes = int(block_bytes)
        self.blk: BlockEviction | None = None

    def write(self, plans: list[ExtentPlan], keys, frags, nss, status, gc: bool) -> None:
        """Fill and write the extents of ``plans``, then settle them (:meth:`_settle`): ``status[i]``
        of each block they carry becomes ``OK``, ``NO_SPACE`` or ``IO_ERROR``. Segments the plan
        emptied are reclaimed (:meth:`finish_reclaim`)."""
        to_reclaim = self._segs.take_reclaims()
        if not plans:
            for si in to_reclaim:
                self.finish_reclaim(si)
            return
        try:
            bb, keep, pipe = self.block_bytes, self.keep_data, self._pipe
            results = pipe.write_extents(
                (p.ext_off, _extent_filler(p, keys, frags, nss, bb, keep, pipe), p.placement) for p in plans
            )
        except BaseException:
            # Nothing of this call is acknowledged: give the planned space back so
            # that no hole is left in a segment's chain (recovery stops at one).
            with self._lock:
                self._segs.rollback({p.seg: p.ext_off for p in reversed(plans)})
            raise
        self._settle(plans, results, status, gc, to_reclaim)

    def _settle(
        self, plans: list[ExtentPlan], results: list, status, gc: bool, to_reclaim: list[int]
    ) -> None:
        """Acknowledge the written extents (fdatasync first), fail the others with ``NO_SPACE`` or
        ``IO_ERROR``, roll write pointers back past a failure, and reclaim emptied segments."""
        # A failed extent breaks its segment's chain: later extents of the same
        # segment in this batch are not acknowledged either; roll the pointer back.
        first_fail: dict[int, int] = {}
        for p, r in zip(plans, results):
            if isinstance(r, BaseException):
                first_fail[p.seg] = min(first_fail.get(p.seg, p.ext_off), p.ext_off)
        sync_err: OSError | None = None
        if len(first_fail) < len({p.seg for p in plans}):
            try:
                self.engine.sync()
            except OSError as exc:
                sync_err = exc
        errs = [r for r in results if isinstance(r, BaseException)] + ([sync_err] if sync_err else [])
        if errs:  # outside the lock: the cause of the IO_ERROR / NO_SPACE statuses, once per call
            _log.warning(
                "segment store: %d of %d extents not acknowledged: %r",
                len(first_fail) or len(plans),
                len(plans),
                errs[0],
            )
        with self._lock:
            for p, r in zip(plans, results):
                failed = isinstance(r, BaseException) or (
                    p.seg in first_fail and p.ext_off >= first_fail[p.seg]
                )
                if failed or sync_err is not None:
                    err = r if isinstance(r, BaseException) else sync_err
                    st = (
                        Status.NO_SPACE
                        if isinstance(err, OSError) and err.errno in _NOSPACE_ERRNOS
                        else Status.IO_ERROR
                    )
                    for i in p.idx:
                        status[i] = st
                    self._st["put_no_space" if st is Status.NO_SPACE else "put_io_error"] += len(p.idx)
                    continue
                self._commit(p, gc)
                for i in p.idx:
                    status[i] = Status.OK
            if first_fail or sync_err is not None:
                every = {p.seg: p.ext_off for p in reversed(plans)}
                self._segs.rollback(first_fail if sync_err is None else every)
            for p in plans:  # old copies replaced by GC may leave dead sealed segments
                if self._segs.state[p.seg] == SegmentState.SEALED and self._segs.live[p.seg] == 0:
                    self._segs.state[p.seg] = SegmentState.RECLAIMING
                    to_reclaim.append(p.seg)
        for si in to_reclaim:
            self.finish_reclaim(si)

    def _commit(self, p: ExtentPlan, gc: bool) -> None:
        """Index the blocks of a written extent (under the metadata lock), vectorised:
        keys of one extent are distinct (a put drops duplicates)."""
        ents = p.entries
        self._st["extents_written"] += 1
        rows, replaced = self._loc.commit(p.ext_off, p.seq, ents)
        self._segs.committed(p.seg, rows, replaced)
        if self.blk is not None:
            self.blk.superseded(replaced // self._segs.segment_bytes)
        self._st["gc_bytes_written" if gc else "user_bytes_written"] += sum(e.length_bytes for e in ents)
        if not gc:
            self._st["put_blocks_ok"] += len(ents)

    def finish_reclaim(self, si: int) -> None:
        """Wait for reads of segment ``si`` to end, trim it and return it to the clean pool.

        Raises
        ------
        InvariantError
            The segment still has live blocks or is not being reclaimed.
        """
        segs, seg_b = self._segs, self._segs.segment_bytes
        with self._lock:
            while segs.readers[si] > 0:
                self._readers_done.wait()
            if segs.live[si] != 0:
                raise InvariantError(f"reclaiming segment {si} with {int(segs.live[si])} live blocks")
            if segs.state[si] != SegmentState.RECLAIMING:
                raise InvariantError(f"segment {si} reclaimed while {SegmentState(int(segs.state[si])).name}")
        start = segs.chain_start(si)  # segment 0's label stays
        try:  # block mode: its SEGMENT_RESET is durable first, else it is not trimmed
            if self.blk is None or self.blk.before_reset(si):
                self.engine.trim(si * seg_b + start, seg_b - start).get()
            trim_failed = False
        except OSError:
            trim_failed = True  # still reusable: recovery ignores stale extents by segment_gen/seq
        with self._lock:
            if trim_failed:
                self._st["trim_errors"] += 1
            if self.blk is not None:
                self.blk.cleared(si)
            segs.reset(si)
            self._st["segments_reclaimed"] += 1
