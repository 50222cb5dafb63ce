"""FDP devices as the NVMe tier sees them: placement tables, RUH Update, passthrough writes.

* :func:`placement_policy` -- the lifetime class -> PID table from a device's
  RUH Status (real, or the simulated device's), honouring fio-style ``plids``
  (indices into the RUH Status list).
* :class:`RuhUpdateShim` -- an I/O observer that issues a Reclaim Unit Handle
  Update when a segment opens, so every segment starts a fresh RU.
* :class:`PassthroughEngine` -- the real ``/dev/ngXnY`` engine: placed writes
  through NVMe passthrough (``IORING_OP_URING_CMD``, PID in DSPEC), reads,
  deallocates and flushes on the matching block device. **Not verified on
  hardware**: written against the kernel and NVMe interfaces; this host has no
  NVMe device.

Why RUH Update on segment open
------------------------------
A segment is sealed when its tail cannot take one more extent, so a few KiB
at its end stay unwritten. A device fills its RUs in write order and knows
nothing of segments, so without help the next segment's first pages land in
the previous RU's tail; the offset drifts, and soon every RU holds the end of
one segment and the start of the next: trimming one segment leaves valid pages
in two RUs and the device's GC copies them. I/O Management Send, *Reclaim Unit
Handle Update* (TP4146) points a handle at a fresh RU; issued at the first write
of each segment, every segment starts a fresh RU. A conventional drive has no
such command and the drift stays -- that is part of what placement buys.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Any, Sequence

from ..errors import ConfigError
from ..io.engine import IOEngine, IOFuture
from ..io.factory import open_engine
from .lifetime import LifetimeClass
from .logpages import RuhStatus
from .placement import PlacementPolicy, split_pid

__all__ = ["placement_policy", "RuhUpdateShim", "PassthroughEngine", "NOT_VERIFIED_ON_HARDWARE"]

#: Marker put into descriptions of the real-device path.
NOT_VERIFIED_ON_HARDWARE = "not verified on hardware"


def placement_policy(ruh_status: RuhStatus, rgif: int, plids: Sequence[int] = ()) -> PlacementPolicy:
    """The class -> PID table for a device.

    Parameters
    ----------
    ruh_status : RuhStatus
        The device's RUH Status (I/O Management Receive, TP4146).
    rgif : int
        Reclaim Group Identifier Format of the active configuration.
    plids : sequence of int
        Indices into the RUH Status list for LONG, MEDIUM, SHORT (cycled), as
        fio's ``plids=``; empty: the table of :mod:`tierstore.fdp.placement`.

    Raises
    ------
    ConfigError
        An index outside the RUH Status list.
    """
    handles = None
    if plids:
        descs = ruh_status.descs
        for i in plids:
            if not 0 <= i < len(descs):
                raise ConfigError(f"plids: index {i} outside the device's {len(descs)} RUH Status entries")
        picks = [split_pid(descs[plids[j % len(plids)]].pid, rgif)[1] for j in range(3)]
        handles = {LifetimeClass.LONG: picks[0], LifetimeClass.MEDIUM: picks[1], LifetimeClass.SHORT: picks[2]}
    return PlacementPolicy.from_ruh_status(ruh_status, rgif, 0, class_handles=handles)


class RuhUpdateShim:
    """I/O observer in front of an FDP device: RUH Update when a segment opens.

    Forwards every write/trim to ``target``; before a write that starts at a
    segment boundary (``offset_bytes % segment_bytes == 0``, the first extent
    of a freshly opened segment) it calls ``ruh_update(placement)`` so the
    handle points at a fresh RU (TP4146 I/O Management Send, Reclaim Unit
    Handle Update).

    Parameters
    ----------
    target : object
        Has ``on_write``, ``on_trim`` and ``ruh_update(placement)``.
    segment_bytes : int
        Segment (= RU) size.
    """

    def __init__(self, target: Any, segment_bytes: int) -> None:
        self.target = target
        self.segment_bytes = int(segment_bytes)
        self.ruh_updates = 0

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        if offset_bytes % self.segment_bytes == 0:
            self.target.ruh_update(placement)
            self.ruh_updates += 1
        self.target.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        self.target.on_trim(offset_bytes, nbytes)


class PassthroughEngine(IOEngine):
    """Real FDP namespace: reads/trims on the block device, placed writes by passthrough.

    **Not verified on hardware** (no NVMe device on the development host).
    Writes go through :class:`tierstore.fdp.passthrough.PassthroughWriter` on
    ``/dev/ngXnY`` with the PID in DSPEC; reads, deallocates and flushes use the
    matching block device ``/dev/nvmeXnY`` through the ``posix`` engine (O_DIRECT).

    Parameters
    ----------
    char_dev : str
        ``/dev/ngXnY``.
    size_bytes : int
        Bytes of the namespace to use.
    nsid : int
        Namespace id.
    lba_bytes : int
        Logical block size.

    Raises
    ------
    ConfigError
        ``char_dev`` is not an NVMe generic character device name.
    """

    kind = "fdp-passthrough"

    def __init__(self, char_dev: str, size_bytes: int, nsid: int, lba_bytes: int = 4096) -> None:
        from .passthrough import PassthroughWriter
        super().__init__(size_bytes, lba_bytes)
        m = re.search(r"ng(\d+)n(\d+)$", char_dev)
        if m is None:
            raise ConfigError(f"device={char_dev!r}: expected an NVMe generic character device /dev/ngXnY")
        self.block_dev = os.path.join(os.path.dirname(char_dev), f"nvme{m.group(1)}n{m.group(2)}")
        self._rw = open_engine("posix", self.block_dev, size_bytes)
        self._writer = PassthroughWriter(char_dev, nsid, lba_bytes)

    def _read_impl(self, offset, view, nbytes):
        return self._rw._read_impl(offset, view, nbytes)

    def _write_impl(self, offset, view, nbytes, placement):
        buf = (ctypes.c_char * nbytes).from_buffer(view)
        try:
            self._writer.write(buf, offset, placement)
        except OSError as exc:
            return IOFuture.failed(exc)
        return IOFuture.completed(nbytes)

    def _trim_impl(self, offset, length):
        return self._rw._trim_impl(offset, length)

    def _sync_impl(self):
        return self._rw._sync_impl()

    def _close_impl(self):
        self._writer.close()
        self._rw.close()
