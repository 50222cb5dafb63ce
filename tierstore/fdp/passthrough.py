"""The FDP write path: NVMe passthrough over io_uring ``IORING_OP_URING_CMD``.

Three ways to write, picked by :func:`select_write_path`:

1. ``"uring_cmd"`` -- NVMe I/O passthrough on the generic character device
   ``/dev/ngXnY``: an io_uring set up with ``IORING_SETUP_SQE128 |
   IORING_SETUP_CQE32``; each SQE has opcode ``IORING_OP_URING_CMD`` (46),
   ``cmd_op = NVME_URING_CMD_IO`` and a ``struct nvme_uring_cmd`` in its
   80-byte command area (``sqe->cmd``, offset 48).  A placed write carries the
   PID in the Directive Specific field (this is what CacheLib's
   ``navy/common/FdpNvme.cpp`` ``prepFdpUringCmdSqe`` does):

   * CDW10/CDW11 = starting LBA low/high 32 bits;
   * CDW12 = ``(NLB - 1) | DTYPE << 20`` with DTYPE = 2 (Data Placement
     directive; NVM Command Set Spec 1.1 Write command, CDW12 bits 15:0 NLB
     0-based, bits 23:20 DTYPE; TP4146 / Base Spec 2.1 Directives);
   * CDW13 = ``DSPEC << 16`` with DSPEC = the PID (CDW13 bits 31:16).

2. ``"write_stream"`` -- the block-layer write streams of Linux >= 6.16
   (``/sys/block/<dev>/queue/max_write_streams`` > 0): an ordinary
   ``IORING_OP_WRITE`` with ``sqe->write_stream`` (u8, offset 44) = stream
   number 1..max_write_streams, which the nvme driver maps to the namespace's
   placement handles.

3. ``"none"`` -- neither is available: writes carry no placement, and
   :attr:`WritePath.status` says so (the bench prints it).

The ring is tierstore's one io_uring, :mod:`tierstore.io.ring` (ctypes over
``io_uring_setup``/``io_uring_enter`` and ``mmap``; layouts from linux
``include/uapi/linux/io_uring.h``), set up with ``SQE128 | CQE32``; this module
adds the NVMe command encoding (``include/uapi/linux/nvme_ioctl.h``). (The
``liburing`` PyPI package, 2026.3.30, cannot be used: its ``SQE`` object cannot
fill the 80-byte ``cmd`` area, and its Zig-built wheel executes AVX-512
instructions, killing the process with SIGILL on CPUs without them.)
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import struct
import threading
from dataclasses import dataclass

from ..errors import AlignmentError, ConfigError
from ..io.ring import (IORING_OP_NOP, IORING_OP_URING_CMD, IORING_OP_WRITE, IORING_SETUP_CQE32,  # noqa: F401
                       IORING_SETUP_SQE128, IoUringError, Ring, RingQueue)

__all__ = [
    "NVME_CMD_WRITE", "NVME_CMD_READ", "DTYPE_DATA_PLACEMENT", "NVME_URING_CMD_IO", "IORING_OP_URING_CMD",
    "NvmeUringCmd", "write_cdw12", "write_cdw13", "build_write_cmd", "IoUring", "IoUringError",
    "WritePath", "select_write_path", "ng_char_devices", "max_write_streams",
]

# --- NVMe I/O opcodes (NVM Command Set Specification; linux include/linux/nvme.h enum nvme_opcode)
NVME_CMD_WRITE = 0x01
NVME_CMD_READ = 0x02
#: Directive Type "Data Placement" = 2h (TP4146; CacheLib navy/common/FdpNvme.cpp writes DTYPE 2).
DTYPE_DATA_PLACEMENT = 0x2
CDW12_DTYPE_SHIFT = 20
CDW13_DSPEC_SHIFT = 16

# --- struct nvme_uring_cmd (linux include/uapi/linux/nvme_ioctl.h), 72 bytes:
#   u8 opcode @0; u8 flags @1; u16 rsvd1 @2; u32 nsid @4; u32 cdw2 @8; u32 cdw3 @12;
#   u64 metadata @16; u64 addr @24; u32 metadata_len @32; u32 data_len @36;
#   u32 cdw10..cdw15 @40..60; u32 timeout_ms @64; u32 rsvd2 @68
_NVME_URING_CMD = struct.Struct("<BBHIIIQQII6III")
NVME_URING_CMD_BYTES = 72


def _iowr(type_char: str, nr: int, size: int) -> int:
    """Linux ``_IOWR``: dir (3) << 30 | size << 16 | type << 8 | nr (include/uapi/asm-generic/ioctl.h)."""
    return (3 << 30) | (size << 16) | (ord(type_char) << 8) | nr


#: ``NVME_URING_CMD_IO = _IOWR('N', 0x80, struct nvme_uring_cmd)`` = 0xC0484E80.
NVME_URING_CMD_IO = _iowr("N", 0x80, NVME_URING_CMD_BYTES)

#: Byte offsets inside ``struct io_uring_sqe``.
SQE_OFF_OPCODE, SQE_OFF_FD, SQE_OFF_CMD_OP, SQE_OFF_ADDR, SQE_OFF_LEN = 0, 4, 8, 16, 24
SQE_OFF_USER_DATA, SQE_OFF_WRITE_STREAM, SQE_OFF_CMD = 32, 44, 48


@dataclass(frozen=True)
class NvmeUringCmd:
    """``struct nvme_uring_cmd`` (72 bytes; field order and widths from nvme_ioctl.h)."""

    opcode: int
    nsid: int
    addr: int = 0
    data_len: int = 0
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0
    flags: int = 0
    cdw2: int = 0
    cdw3: int = 0
    metadata: int = 0
    metadata_len: int = 0
    timeout_ms: int = 0

    def pack(self) -> bytes:
        """The 72 little-endian bytes the kernel reads from ``sqe->cmd``."""
        return _NVME_URING_CMD.pack(self.opcode, self.flags, 0, self.nsid, self.cdw2, self.cdw3,
                                    self.metadata, self.addr, self.metadata_len, self.data_len,
                                    self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
                                    self.timeout_ms, 0)

    @classmethod
    def unpack(cls, b: bytes) -> "NvmeUringCmd":
        """Inverse of :meth:`pack`."""
        (op, fl, _r1, nsid, c2, c3, md, addr, mdl, dl, c10, c11, c12, c13, c14, c15, to, _r2) = \
            _NVME_URING_CMD.unpack(bytes(b[:NVME_URING_CMD_BYTES]))
        return cls(op, nsid, addr, dl, c10, c11, c12, c13, c14, c15, fl, c2, c3, md, mdl, to)


def write_cdw12(nlb: int, placed: bool) -> int:
    """CDW12 of a Write: ``(nlb - 1) | (DTYPE 2 << 20 if placed)``; ``nlb`` in 1..65536 blocks."""
    if not 1 <= nlb <= 0x10000:
        raise ConfigError(f"nlb={nlb}: a single NVMe write moves 1..65536 logical blocks")
    return (nlb - 1) | ((DTYPE_DATA_PLACEMENT << CDW12_DTYPE_SHIFT) if placed else 0)


def write_cdw13(pid: int | None) -> int:
    """CDW13 of a Write: ``DSPEC (= PID) << 16``, 0 without placement."""
    if pid is None:
        return 0
    if not 0 <= pid <= 0xFFFF:
        raise ConfigError(f"pid={pid}: DSPEC is 16 bits")
    return pid << CDW13_DSPEC_SHIFT


def build_write_cmd(nsid: int, slba: int, nlb: int, addr: int, lba_bytes: int,
                    pid: int | None = None) -> NvmeUringCmd:
    """The ``nvme_uring_cmd`` of a Write of ``nlb`` blocks at ``slba`` from host address ``addr``.

    Parameters
    ----------
    nsid : int        namespace id (>= 1).
    slba : int        starting LBA.
    nlb : int         number of logical blocks (1..65536).
    addr : int        user buffer address (ctypes address).
    lba_bytes : int   logical block size, bytes; ``data_len = nlb * lba_bytes``.
    pid : int | None  placement identifier; ``None`` writes without a directive.
    """
    if nsid < 1:
        raise ConfigError(f"nsid={nsid}: namespace ids start at 1")
    return NvmeUringCmd(opcode=NVME_CMD_WRITE, nsid=nsid, addr=addr, data_len=nlb * lba_bytes,
                        cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                        cdw12=write_cdw12(nlb, pid is not None), cdw13=write_cdw13(pid))


# ------------------------------------------------------------------- io_uring
class IoUring(Ring):
    """The passthrough ring: :class:`tierstore.io.ring.Ring` with ``big=True``
    meaning ``SQE128 | CQE32`` (what ``IORING_OP_URING_CMD`` to the nvme driver needs).

    Single-threaded, as :class:`~tierstore.io.ring.Ring`; :class:`PassthroughWriter`
    wraps one in a :class:`~tierstore.io.ring.RingQueue` for concurrent writers.
    """

    def __init__(self, entries: int = 64, big: bool = True) -> None:
        super().__init__(entries, sqe128=big, cqe32=big)

    def prep_uring_cmd(self, fd: int, cmd: "NvmeUringCmd | bytes", user_data: int,  # type: ignore[override]
                       cmd_op: int = NVME_URING_CMD_IO) -> None:
        """Queue an ``IORING_OP_URING_CMD`` carrying ``cmd`` (a ``struct nvme_uring_cmd``; needs ``big=True``)."""
        super().prep_uring_cmd(fd, cmd_op, cmd.pack() if isinstance(cmd, NvmeUringCmd) else cmd, user_data)

    def prep_write(self, fd: int, addr: int, nbytes: int, offset_bytes: int, user_data: int,
                   write_stream: int = 0) -> None:
        """Queue an ``IORING_OP_WRITE``; ``write_stream`` (1..255) selects a block-layer write stream (Linux >= 6.16).

        Raises
        ------
        ConfigError
            ``write_stream`` outside 0..255 (the SQE field is 8 bits).
        """
        if not 0 <= write_stream <= 255:
            raise ConfigError(f"write_stream={write_stream}: the SQE field is 8 bits")
        super().prep_write(fd, addr, nbytes, offset_bytes, user_data, write_stream)


# ------------------------------------------------------------- path choice
def ng_char_devices(dev_root: str = "/dev") -> list[str]:
    """NVMe generic character devices ``/dev/ngXnY`` present on this host."""
    return sorted(p for p in glob.glob(os.path.join(dev_root, "ng*n*")) if re.search(r"/ng\d+n\d+$", p))


def max_write_streams(block_dev: str, sys_root: str = "/sys") -> int:
    """``/sys/block/<dev>/queue/max_write_streams`` (Linux >= 6.16), 0 when absent."""
    name = os.path.basename(block_dev)
    path = os.path.join(sys_root, "block", name, "queue", "max_write_streams")
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class WritePath:
    """The write path chosen for a device: ``mode`` in {"uring_cmd", "write_stream", "none"}.

    ``status`` is a one-line human string (the bench prints it).
    """

    mode: str
    device: str | None
    streams: int
    status: str


def select_write_path(block_dev: str | None = None, char_dev: str | None = None,
                      dev_root: str = "/dev", sys_root: str = "/sys") -> WritePath:
    """Pick passthrough (``/dev/ngXnY``), block-layer write streams, or no placement."""
    if char_dev is None and block_dev is not None:
        m = re.search(r"nvme(\d+)n(\d+)$", block_dev)
        if m:
            cand = os.path.join(dev_root, f"ng{m.group(1)}n{m.group(2)}")
            char_dev = cand if os.path.exists(cand) else None
    if char_dev is None and block_dev is None:
        ngs = ng_char_devices(dev_root)
        char_dev = ngs[0] if ngs else None
    if char_dev is not None and os.path.exists(char_dev):
        return WritePath("uring_cmd", char_dev, 0,
                         f"FDP placement via NVMe passthrough (IORING_OP_URING_CMD) on {char_dev}")
    if block_dev is not None:
        n = max_write_streams(block_dev, sys_root)
        if n > 0:
            return WritePath("write_stream", block_dev, n,
                             f"FDP placement via block-layer write streams on {block_dev} ({n} streams)")
    return WritePath("none", block_dev, 0,
                     "no FDP placement: no /dev/ng* passthrough device and no block-layer write streams; "
                     "writes carry no placement")


def check_aligned(offset_bytes: int, nbytes: int, lba_bytes: int) -> tuple[int, int]:
    """``(slba, nlb)`` for an LBA-aligned byte range; raise :class:`AlignmentError` otherwise."""
    if offset_bytes % lba_bytes or nbytes % lba_bytes or nbytes <= 0:
        raise AlignmentError(f"offset {offset_bytes} / length {nbytes} not multiples of the {lba_bytes}-byte LBA")
    return offset_bytes // lba_bytes, nbytes // lba_bytes


class PassthroughWriter:
    """Placed writes to ``/dev/ngXnY`` through an SQE128|CQE32 ring; thread-safe
    (one :class:`~tierstore.io.ring.RingQueue`, ``entries`` commands in flight at most).

    Parameters
    ----------
    char_dev : str   ``/dev/ngXnY``.
    nsid : int       namespace id.
    lba_bytes : int  logical block size, bytes.
    entries : int    ring size = commands in flight at most.

    Raises
    ------
    IoUringUnavailable
        io_uring, or SQE128/CQE32 rings (Linux >= 5.19), cannot be used here.
    """

    def __init__(self, char_dev: str, nsid: int, lba_bytes: int = 4096, entries: int = 64) -> None:
        ring = IoUring(entries, big=True)
        try:
            self.fd = os.open(char_dev, os.O_RDWR)
        except BaseException:
            ring.close()
            raise
        self.nsid = nsid
        self.lba_bytes = lba_bytes
        self.ring = ring
        self._queue = RingQueue(ring, min(entries, ring.sq_entries))

    def write(self, buf: ctypes.Array, offset_bytes: int, placement: int | None) -> int:
        """Write all of ``buf`` (a ctypes buffer) at ``offset_bytes`` with PID ``placement``; return NVMe status.

        Raises
        ------
        AlignmentError
            ``offset_bytes`` or the length is not a multiple of ``lba_bytes``.
        IoUringError
            The command failed (``-res`` of the CQE as errno).
        """
        slba, nlb = check_aligned(offset_bytes, ctypes.sizeof(buf), self.lba_bytes)
        cmd = build_write_cmd(self.nsid, slba, nlb, ctypes.addressof(buf), self.lba_bytes, placement)
        box: list[int] = []
        done = threading.Event()

        def on_done(res: int, _arg: int, _big: bytes) -> None:
            box.append(res)
            done.set()
        self._queue.submit_cmd(self.fd, NVME_URING_CMD_IO, cmd.pack(), on_done)
        self._queue.wait_until(done.is_set)
        res = box[0]
        if res < 0:
            raise IoUringError(-res, f"passthrough write failed: {os.strerror(-res)}")
        return res

    def close(self) -> None:
        """Wait for commands in flight, close the ring and the device."""
        self._queue.close()
        os.close(self.fd)
