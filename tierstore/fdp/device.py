"""FDP devices as the NVMe tier sees them: RUH Update and passthrough writes.

Discovery and the PID table are in :mod:`tierstore.fdp.discovery` (no torch,
so ``tierstore fdp`` starts quickly); their names are re-exported here.

* :class:`RuhUpdateShim` -- an I/O observer that gives the FTL model a
  Reclaim Unit Handle Update when a segment opens.
* :class:`PassthroughEngine` -- the real ``/dev/ngXnY`` engine: placed writes
  through NVMe passthrough (``IORING_OP_URING_CMD``, PID in DSPEC), each PID
  checked against RUH Status before the write is sent, RUH Update sent to the
  device when a segment opens; reads, deallocates and flushes on the matching
  block device. Run end to end against QEMU's emulated FDP namespace (TCG
  guest, ``tests/fdp/test_vm.py``), which models no garbage collection;
  **not verified on an FDP SSD**.

Continued in ``docs/FDP.md`` (``tierstore/fdp/device.py``): why RUH Update on segment open.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..io.engine import IOEngine, IOFuture
from ..io.factory import open_engine
from . import logpages as lp
from .discovery import FdpNamespace, discover_namespace, nvme_names, placement_policy
from .placement import PidTable

__all__ = [
    "placement_policy",
    "RuhUpdateShim",
    "PassthroughEngine",
    "NOT_VERIFIED_ON_HARDWARE",
    "FdpNamespace",
    "discover_namespace",
    "nvme_names",
]

#: Marker put into descriptions of the real-device path.
NOT_VERIFIED_ON_HARDWARE = (
    "run against QEMU's emulated FDP namespace (no garbage collection modelled); not verified on hardware"
)


class RuhUpdateShim:
    """I/O observer in front of an FTL model: RUH Update when a segment opens.

    Forwards every write/trim to ``target``; before the first write of a
    placement into another segment (whichever of the segment's extents comes
    first: a write pipeline may send later extents before the first) it calls
    ``ruh_update(placement)`` so the handle points at a fresh RU (TP4146 I/O
    Management Send, Reclaim Unit Handle Update), the rule
    :class:`PassthroughEngine` applies on a device. For a real device
    :class:`PassthroughEngine` sends the command itself and tells its
    observers through ``on_ruh_update``.

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
        self._segment_of: dict = {}  # placement -> the segment its handle's RU now takes

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        seg = offset_bytes // self.segment_bytes
        if self._segment_of.get(placement) != seg:  # the model ignores an update of an empty RU
            self.target.ruh_update(placement)
            self.ruh_updates += 1
            self._segment_of[placement] = seg
        self.target.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        self.target.on_trim(offset_bytes, nbytes)


class PassthroughEngine(IOEngine):
    """Real FDP namespace: reads/trims on the block device, placed writes by passthrough.

    Writes go through :class:`tierstore.fdp.passthrough.PassthroughWriter` on
    ``/dev/ngXnY`` with the PID in DSPEC, split at the controller's MDTS; reads,
    deallocates and flushes use the matching block device ``/dev/nvmeXnY``
    through the ``posix`` engine (O_DIRECT). Writes are synchronous: the pieces
    of one write are in flight together, and the write's future is complete
    when it returns (so observers see writes and RUH Updates in device order).

    Every PID is checked against ``pid_table`` before anything is sent
    (:class:`ConfigError`, raised from :meth:`write`); ``None`` writes without
    a placement directive (the device uses placement handle 0).

    With ``ruh_update_segment_bytes``, the first write of a PID into another
    segment (whichever of the segment's extents comes first) is preceded, once
    every earlier write of that PID has completed, by a Reclaim Unit Handle Update of its PID,
    unless the handle's RU holds nothing yet (module doc; at open, the RUH Status
    says which handles an earlier run left partly written). Observers with an
    ``on_ruh_update(placement)`` method hear of each update sent, before the write.

    Parameters
    ----------
    char_dev : str
        ``/dev/ngXnY``.
    size_bytes : int
        Bytes of the namespace to use.
    nsid : int
        Namespace id.
    lba_bytes : int
        Logical block size (Identify Namespace).
    pid_table : PidTable, optional
        The namespace's PIDs; ``None`` checks nothing (only for tests of the encoding).
    max_transfer_bytes : int, optional
        Bytes of one command at most (MDTS).
    ruh_update_segment_bytes : int, optional
        Segment size; ``None``: never send RUH Update.
    ru_nominal_bytes : int, optional
        RUNS of the active configuration (needed with ``ruh_update_segment_bytes``).

    Raises
    ------
    ConfigError
        ``char_dev`` is not an NVMe generic character device name.
    """

    kind = "fdp-passthrough"

    def __init__(
        self,
        char_dev: str,
        size_bytes: int,
        nsid: int,
        lba_bytes: int = 4096,
        *,
        pid_table: PidTable | None = None,
        max_transfer_bytes: int | None = None,
        ruh_update_segment_bytes: int | None = None,
        ru_nominal_bytes: int | None = None,
    ) -> None:
        from .passthrough import PassthroughWriter

        if re.search(r"ng\d+n\d+$", char_dev) is None:
            raise ConfigError(f"device={char_dev!r}: expected an NVMe generic character device /dev/ngXnY")
        if ruh_update_segment_bytes is not None and not ru_nominal_bytes:
            raise ConfigError("ruh_update_segment_bytes needs ru_nominal_bytes (the configuration's RUNS)")
        super().__init__(size_bytes, max(4096, lba_bytes))
        self.block_dev = nvme_names(char_dev)[1]
        self.lba_bytes = int(lba_bytes)
        self.pid_table = pid_table
        self.segment_bytes = ruh_update_segment_bytes
        self.ru_nominal_bytes = ru_nominal_bytes
        self._rw = open_engine("posix", self.block_dev, size_bytes)
        try:
            self._writer = PassthroughWriter(
                char_dev, nsid, self.lba_bytes, max_transfer_bytes=max_transfer_bytes
            )
        except BaseException:
            self._rw.close()
            raise
        self._ruh_lock = threading.Lock()
        # Writes past their RUH Update step and not yet seen by the observers, per PID: a
        # segment's RUH Update waits for them, so the device switches RU after every earlier
        # write of that PID landed and observers (an FTL model) see writes and updates in
        # device order (a lagging observer once put 1.8 MB of one RU after its update).
        self._inflight: dict[int, int] = {}
        self._inflight_cv = threading.Condition(self._ruh_lock)
        self._segment_of: dict[int, int] = {}  # PID -> the segment its handle's RU now takes
        self._counted = threading.local()
        self._since_update: dict[int, int] = {}
        self._ruh = {"ruh_updates_sent": 0, "ruh_updates_skipped": 0, "ruh_update_unwritten_bytes": 0}
        if self.segment_bytes is not None:
            # A handle whose RU another run left partly written must be switched at our first segment too.
            try:
                for d in self.ruh_status().descs:
                    if d.ruamw_blocks * self.lba_bytes < self.ru_nominal_bytes:
                        self._since_update[d.pid] = self.ru_nominal_bytes - d.ruamw_blocks * self.lba_bytes
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------ FDP commands
    def ruh_status(self) -> lp.RuhStatus:
        """RUH Status now, through the passthrough ring (sized from the PID table)."""
        n = len(self.pid_table) if self.pid_table is not None else 128
        raw = self._writer.ruh_status_bytes(lp.ruh_status_bytes_for(n))
        have = int.from_bytes(raw[14:16], "little")
        if have > n:
            raw = self._writer.ruh_status_bytes(lp.ruh_status_bytes_for(have))
        return lp.parse_ruh_status(raw)

    def ruh_update(self, pids: Sequence[int]) -> None:
        """Send a Reclaim Unit Handle Update of ``pids`` (each checked against the PID table)."""
        pids = [self._check_pid(p) for p in pids]
        self._writer.ruh_update(pids)
        with self._ruh_lock:
            for p in pids:
                self._since_update[p] = 0

    def _check_pid(self, pid: int | None) -> int | None:
        if self.pid_table is not None:
            return self.pid_table.check(pid, "placement")
        if pid is not None and not 0 <= pid <= 0xFFFF:
            raise ConfigError(f"placement={pid}: a PID is 16 bits")
        return pid

    def _maybe_ruh_update(self, pid: int, segment: int) -> None:
        """RUH Update before the first write of ``pid`` into ``segment`` (any of its extents:
        a write pipeline may send a segment's later extents before its first), once every
        earlier write of ``pid`` has landed, unless the handle's RU is still empty."""
        with self._ruh_lock:
            while self._segment_of.get(pid) != segment and self._inflight.get(pid, 0):
                self._inflight_cv.wait()
            if self._segment_of.get(pid) == segment:  # this segment's update is done
                return
            self._segment_of[pid] = segment
            if self._since_update.get(pid, 0) == 0:
                self._ruh["ruh_updates_skipped"] += 1
                return
            st = self.ruh_status()
            ruamw = next((d.ruamw_blocks for d in st.descs if d.pid == pid), None)
            if ruamw is None:
                raise ConfigError(f"placement={pid:#x}: RUH Status no longer lists it")
            if ruamw * self.lba_bytes >= self.ru_nominal_bytes:
                self._since_update[pid] = 0
                self._ruh["ruh_updates_skipped"] += 1
                return
            self._writer.ruh_update([pid])
            self._since_update[pid] = 0
            self._ruh["ruh_updates_sent"] += 1
            self._ruh["ruh_update_unwritten_bytes"] += ruamw * self.lba_bytes
        for obs in list(self._observers):
            hook = getattr(obs, "on_ruh_update", None)
            if hook is not None:
                hook(pid)

    # ------------------------------------------------------------ engine hooks
    def _read_impl(self, offset, view, nbytes):
        return self._rw._read_impl(offset, view, nbytes)

    def _write_impl(self, offset, view, nbytes, placement):
        placement = self._check_pid(placement)  # raises before anything is sent
        if self.segment_bytes and placement is not None:
            try:
                self._maybe_ruh_update(placement, offset // self.segment_bytes)
            except OSError as exc:
                return IOFuture.failed(exc)
        buf = (ctypes.c_char * nbytes).from_buffer(view)
        if placement is not None:
            with self._ruh_lock:
                self._inflight[placement] = self._inflight.get(placement, 0) + 1
            self._counted.pid = placement  # write() takes it off after the observers saw it
        try:
            self._writer.write(buf, offset, placement)
        except OSError as exc:
            return IOFuture.failed(exc)
        if placement is not None:
            with self._ruh_lock:
                self._since_update[placement] = self._since_update.get(placement, 0) + nbytes
        return IOFuture.completed(nbytes)

    def write(self, offset: int, buffer, placement: int | None = None) -> IOFuture:
        """:meth:`IOEngine.write`; the write counts as in flight for its PID's next RUH
        Update until the observers have seen it (it completes before this returns)."""
        self._counted.pid = None
        try:
            fut = super().write(offset, buffer, placement)
            # The write has completed (it is synchronous); resolve its future now, so the
            # observers hear of it here, in device order, not whenever the caller reaps it.
            fut.done()
            return fut
        finally:
            pid, self._counted.pid = self._counted.pid, None
            if pid is not None:
                with self._ruh_lock:
                    self._inflight[pid] -= 1
                    self._inflight_cv.notify_all()

    def _trim_impl(self, offset, length):
        return self._rw._trim_impl(offset, length)

    def _sync_impl(self):
        return self._rw._sync_impl()

    def stats(self) -> dict:
        """:meth:`IOEngine.stats` plus the RUH Update counters."""
        out = super().stats()
        with self._ruh_lock:
            out.update(self._ruh)
        return out

    def _close_impl(self):
        try:
            self._writer.close()
        finally:
            self._rw.close()
