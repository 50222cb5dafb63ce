"""The segment store's read path: coalesced reads, CRC checks, scatter into destinations.

:class:`SegmentReader` is a room of :class:`~tierstore.io.segments.SegmentStorage`
and holds no lock of its own. :meth:`SegmentReader.pin` and
:meth:`SegmentReader.unpin` run under the store's metadata lock (a segment with
reads in flight is never trimmed); :meth:`SegmentReader.read` runs without it,
under the store's read lock (one user of the read pipeline at a time), and
never waits for a writer. :meth:`SegmentReader.forget_bad` runs under the
metadata lock again.

Blocks are read in device order, neighbours (at most 64 KiB apart) coalesced
into reads of up to ``extent_bytes``. A block is scattered into its
destination only after its payload CRC-32C matched (:func:`tierstore.io.format.payload_crc`);
a failed coalesced read is retried block by block; a block whose read fails or
whose CRC does not match is ``IO_ERROR`` and reported in ``bad``. With a
``gate`` (a caller's deadline), a scatter the gate refuses leaves those blocks
``MISS`` and their destinations untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import Status
from . import format as fmt
from .batch import ExtentPipeline
from .engine import alloc_aligned
from .pages import FragmentPlan
from .segment_manager import RoomParts, SegmentRoom

__all__ = ["SegmentReader"]

#: A found block: ``(payload device offset, index in the call's keys, payload CRC-32C)``.
Found = tuple[int, int, int]


class SegmentReader(SegmentRoom):
    """Reads blocks of a segment store (module doc).

    Parameters
    ----------
    parts : RoomParts
        The store's engine (single-block retries read through it), locator, segment manager (its
        per-segment reader counts are raised by :meth:`pin`), ``keep_data`` (``False``: the
        accounting mode; a present block is ``OK`` with no read) and counters (``corrupt_blocks``
        is counted here).
    pipe : ExtentPipeline
        The store's read pipeline (staging buffers, copy threads).
    read_lock : threading.Lock
        The store's read lock, taken around each use of ``pipe``.
    extent_bytes : int
        Largest coalesced read.
    """

    def __init__(
        self, parts: RoomParts, pipe: ExtentPipeline, read_lock: threading.Lock, extent_bytes: int
    ) -> None:
        super().__init__(parts, pipe)
        self._read_lock = read_lock
        self.extent_bytes = int(extent_bytes)
        self.block_bytes = self._segs.block_bytes
        self._slot_bytes = self._loc.slot_bytes

    def pin(self, keys: list[bytes]) -> list[Found]:
        """The present ``keys``, their segments marked as being read (under the metadata lock)."""
        found = self._loc.find(keys)
        for off, _, _ in found:
            self._segs.readers[off // self._segs.segment_bytes] += 1
        return found

    def unpin(self, found: list[Found]) -> None:
        """Undo :meth:`pin` (under the metadata lock; the caller wakes reclaimers waiting)."""
        for off, _, _ in found:
            self._segs.readers[off // self._segs.segment_bytes] -= 1

    def read(
        self,
        keys: list[bytes],
        found: list[Found],
        dests: list[FragmentPlan],
        status: list[Status],
        gate: Callable[[list[int]], Any] | None,
    ) -> list[tuple[bytes, int]]:
        """Read the ``found`` blocks into ``dests`` (by index), setting ``status[i]`` to ``OK`` or
        ``IO_ERROR``; returns ``(key, offset)`` of each block whose read or CRC failed."""
        bad: list[tuple[bytes, int]] = []
        if not self.keep_data:  # accounting mode: present blocks are hits, no bytes move
            for _, i, _ in found:
                status[i] = Status.OK
            found = []
        runs = self._runs(sorted(found))
        with self._read_lock:
            self._read_runs(keys, runs, dests, status, bad, gate)
        return bad

    def forget_bad(self, bad: list[tuple[bytes, int]]) -> tuple[list[bytes], list[int]]:
        """Forget blocks whose read failed, if the locator still points at the bad copy (under
        the metadata lock): ``(keys dropped, segments left empty, now RECLAIMING)``."""
        dropped = []
        empty = []
        for key, off in bad:
            self._st["corrupt_blocks"] += 1
            if not self._loc.remove_at(key, off, off + 1):
                continue
            dropped.append(key)
            if self._segs.release(off // self._segs.segment_bytes):
                empty.append(off // self._segs.segment_bytes)
        return dropped, empty

    def _read_runs(self, keys, runs, dests, status, bad, gate) -> None:
        def consume(r: int, view, err) -> None:
            start, _, members = runs[r]
            if err is not None:
                for off, i, crc in members:
                    self._read_one(keys[i], off, crc, dests[i], status, i, bad, gate)
                return
            mv = memoryview(view.numpy())
            bb = self.block_bytes
            oks = self._pipe.map(
                lambda m: fmt.payload_crc(keys[m[1]], mv[m[0] - start : m[0] - start + bb]) == m[2], members
            )
            good = [m for m, ok in zip(members, oks) if ok]
            for (off, i, _), ok in zip(members, oks):
                if not ok:
                    bad.append((keys[i], off))
                    status[i] = Status.IO_ERROR
            self._scatter(view, [(off - start, i) for off, i, _ in good], dests, status, gate)

        self._pipe.read_extents([(start, length) for start, length, _ in runs], consume)

    def _scatter(self, view, items, dests, status, gate) -> None:
        if not items:
            return
        if gate is None:
            self._pipe.scatter_blocks(view, [rel for rel, _ in items], [dests[i] for _, i in items])
            for _, i in items:
                status[i] = Status.OK
            return
        with gate([i for _, i in items]) as go:
            if not go:
                return
            self._pipe.scatter_blocks(view, [rel for rel, _ in items], [dests[i] for _, i in items])
            for _, i in items:
                status[i] = Status.OK

    def _runs(self, members: list[tuple[int, int, int]]) -> list[tuple[int, int, list]]:
        """Coalesce sorted ``(offset, index, crc)`` into reads of at most ``extent_size_bytes``."""
        cap = self.extent_bytes
        slot = self._slot_bytes
        runs: list[tuple[int, int, list]] = []
        cur: list = []
        start = end = 0
        for m in members:
            off = m[0]
            b_end = off + slot
            if cur and off >= end and b_end - start <= cap and off - end <= 64 * 1024:
                cur.append(m)
                end = b_end
                continue
            if cur:
                runs.append((start, end - start, cur))
            cur, start, end = [m], off, b_end
        if cur:
            runs.append((start, end - start, cur))
        return runs

    def _read_one(self, key, off, crc, dest: FragmentPlan, status, i, bad, gate) -> None:
        keep, buf = alloc_aligned(self._slot_bytes)
        try:
            self.engine.read(off, buf[: self._slot_bytes]).get()
        except OSError:
            bad.append((key, off))
            status[i] = Status.IO_ERROR
            return
        if fmt.payload_crc(key, memoryview(keep)[: self.block_bytes]) != crc:
            bad.append((key, off))
            status[i] = Status.IO_ERROR
            return
        self._scatter(buf, [(0, i)], {i: dest}, status, gate)
        del keep
