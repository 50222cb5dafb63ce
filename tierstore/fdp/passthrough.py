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

Why ctypes: the ``liburing`` PyPI package (checked: 2026.3.30) has
``IORING_SETUP_SQE128`` and ``io_uring_prep_uring_cmd128(sqe, cmd_op, fd)``
(marked "Coded but not tested") but its ``SQE`` object exposes only
``fd, flags, ioprio, len, opcode, personality, user_data`` -- there is no way
to fill the 80-byte ``cmd`` area with a ``struct nvme_uring_cmd``.  So
:class:`IoUring` talks to the kernel ABI directly (``io_uring_setup`` /
``io_uring_enter`` syscalls, ``mmap`` of the rings), with layouts from linux
``include/uapi/linux/io_uring.h`` and ``include/uapi/linux/nvme_ioctl.h``.
"""
from __future__ import annotations

import ctypes
import glob
import mmap
import os
import platform
import re
import struct
from dataclasses import dataclass

from ..errors import AlignmentError, ConfigError, TierStoreError

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

# --- io_uring ABI (linux include/uapi/linux/io_uring.h)
IORING_OP_NOP = 0
IORING_OP_WRITE = 23
IORING_OP_URING_CMD = 46
IORING_SETUP_SQE128 = 1 << 10
IORING_SETUP_CQE32 = 1 << 11
IORING_ENTER_GETEVENTS = 1 << 0
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
_SYSCALLS = {"x86_64": (425, 426), "aarch64": (425, 426)}   # io_uring_setup, io_uring_enter
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
class IoUringError(TierStoreError, OSError):
    """io_uring setup or submission failed (carries errno)."""


class _Params(ctypes.Structure):
    """``struct io_uring_params`` (120 bytes) with ``io_sqring_offsets`` / ``io_cqring_offsets``."""

    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                # io_sqring_offsets
                ("sq_head", ctypes.c_uint32), ("sq_tail", ctypes.c_uint32), ("sq_ring_mask", ctypes.c_uint32),
                ("sq_ring_entries", ctypes.c_uint32), ("sq_flags", ctypes.c_uint32), ("sq_dropped", ctypes.c_uint32),
                ("sq_array", ctypes.c_uint32), ("sq_resv1", ctypes.c_uint32), ("sq_user_addr", ctypes.c_uint64),
                # io_cqring_offsets
                ("cq_head", ctypes.c_uint32), ("cq_tail", ctypes.c_uint32), ("cq_ring_mask", ctypes.c_uint32),
                ("cq_ring_entries", ctypes.c_uint32), ("cq_overflow", ctypes.c_uint32), ("cq_cqes", ctypes.c_uint32),
                ("cq_flags", ctypes.c_uint32), ("cq_resv1", ctypes.c_uint32), ("cq_user_addr", ctypes.c_uint64)]


if ctypes.sizeof(_Params) != 120:
    raise ImportError("struct io_uring_params layout mismatch (expected 120 bytes)")


class IoUring:
    """A minimal io_uring over raw syscalls; ``big=True`` sets SQE128 | CQE32 (needed for NVMe passthrough).

    Ring memory is accessed through ``mmap`` objects; on x86-64 (TSO) plain
    stores give the release ordering liburing's ``io_uring_smp_store_release``
    provides, which is why this class refuses other architectures for passthrough use.
    """

    def __init__(self, entries: int = 64, big: bool = True) -> None:
        arch = platform.machine()
        if arch not in _SYSCALLS:
            raise IoUringError(f"io_uring via ctypes is implemented for {sorted(_SYSCALLS)}, not {arch}")
        self._setup_nr, self._enter_nr = _SYSCALLS[arch]
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        p = _Params()
        p.flags = (IORING_SETUP_SQE128 | IORING_SETUP_CQE32) if big else 0
        fd = self._libc.syscall(self._setup_nr, ctypes.c_uint(entries), ctypes.byref(p))
        if fd < 0:
            e = ctypes.get_errno()
            raise IoUringError(e, f"io_uring_setup failed: {os.strerror(e)}")
        self.fd = fd
        self.params = p
        self.sqe_bytes = 128 if big else 64
        self.cqe_bytes = 32 if big else 16
        sq_size = p.sq_array + p.sq_entries * 4
        cq_size = p.cq_cqes + p.cq_entries * self.cqe_bytes
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._sq = mmap.mmap(fd, sq_size, flags, prot, offset=IORING_OFF_SQ_RING)
        self._cq = self._sq if p.features & IORING_FEAT_SINGLE_MMAP else \
            mmap.mmap(fd, cq_size, flags, prot, offset=IORING_OFF_CQ_RING)
        self._sqes = mmap.mmap(fd, p.sq_entries * self.sqe_bytes, flags, prot, offset=IORING_OFF_SQES)
        self._sq_mask = struct.unpack_from("<I", self._sq, p.sq_ring_mask)[0]
        self._cq_mask = struct.unpack_from("<I", self._cq, p.cq_ring_mask)[0]
        self._pending = 0

    def close(self) -> None:
        """Unmap and close the ring."""
        if self.fd >= 0:
            self._sqes.close()
            if self._cq is not self._sq:
                self._cq.close()
            self._sq.close()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "IoUring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _u32(self, m: mmap.mmap, off: int) -> int:
        return struct.unpack_from("<I", m, off)[0]

    def _get_sqe(self) -> tuple[int, int]:
        p = self.params
        head = self._u32(self._sq, p.sq_head)
        tail = self._u32(self._sq, p.sq_tail) + self._pending
        if tail - head >= p.sq_entries:
            raise IoUringError(0, "submission queue full")
        idx = tail & self._sq_mask
        off = idx * self.sqe_bytes
        self._sqes[off:off + self.sqe_bytes] = bytes(self.sqe_bytes)
        struct.pack_into("<I", self._sq, p.sq_array + 4 * idx, idx)
        self._pending += 1
        return idx, off

    def prep_nop(self, user_data: int) -> None:
        """Queue an ``IORING_OP_NOP``."""
        _, off = self._get_sqe()
        struct.pack_into("<B", self._sqes, off + SQE_OFF_OPCODE, IORING_OP_NOP)
        struct.pack_into("<Q", self._sqes, off + SQE_OFF_USER_DATA, user_data)

    def prep_uring_cmd(self, fd: int, cmd: NvmeUringCmd, user_data: int, cmd_op: int = NVME_URING_CMD_IO) -> None:
        """Queue an ``IORING_OP_URING_CMD`` carrying ``cmd`` (needs ``big=True``)."""
        if self.sqe_bytes != 128:
            raise IoUringError(0, "NVMe passthrough needs an SQE128 ring (IoUring(big=True))")
        _, off = self._get_sqe()
        struct.pack_into("<B", self._sqes, off + SQE_OFF_OPCODE, IORING_OP_URING_CMD)
        struct.pack_into("<i", self._sqes, off + SQE_OFF_FD, fd)
        struct.pack_into("<I", self._sqes, off + SQE_OFF_CMD_OP, cmd_op)
        struct.pack_into("<Q", self._sqes, off + SQE_OFF_USER_DATA, user_data)
        self._sqes[off + SQE_OFF_CMD:off + SQE_OFF_CMD + NVME_URING_CMD_BYTES] = cmd.pack()

    def prep_write(self, fd: int, addr: int, nbytes: int, offset_bytes: int, user_data: int,
                   write_stream: int = 0) -> None:
        """Queue an ``IORING_OP_WRITE``; ``write_stream`` (1..255) selects a block-layer write stream (Linux >= 6.16)."""
        if not 0 <= write_stream <= 255:
            raise ConfigError(f"write_stream={write_stream}: the SQE field is 8 bits")
        _, off = self._get_sqe()
        struct.pack_into("<B", self._sqes, off + SQE_OFF_OPCODE, IORING_OP_WRITE)
        struct.pack_into("<i", self._sqes, off + SQE_OFF_FD, fd)
        struct.pack_into("<Q", self._sqes, off + SQE_OFF_CMD_OP, offset_bytes)
        struct.pack_into("<Q", self._sqes, off + SQE_OFF_ADDR, addr)
        struct.pack_into("<I", self._sqes, off + SQE_OFF_LEN, nbytes)
        struct.pack_into("<Q", self._sqes, off + SQE_OFF_USER_DATA, user_data)
        struct.pack_into("<B", self._sqes, off + SQE_OFF_WRITE_STREAM, write_stream)

    def sqe_bytes_at(self, index_from_tail: int = -1) -> bytes:
        """Bytes of a queued, not yet submitted SQE (for tests); -1 = last queued."""
        tail = self._u32(self._sq, self.params.sq_tail) + self._pending + index_from_tail
        off = (tail & self._sq_mask) * self.sqe_bytes
        return bytes(self._sqes[off:off + self.sqe_bytes])

    def submit_and_wait(self, wait_nr: int = 1) -> list[tuple[int, int, bytes]]:
        """Submit queued SQEs, wait for ``wait_nr`` completions; return ``(user_data, res, extra)`` per CQE.

        ``extra`` is the CQE32 big_cqe area (16 bytes; NVMe result dwords) or b"".
        """
        p = self.params
        n = self._pending
        if n:
            tail = self._u32(self._sq, p.sq_tail)
            struct.pack_into("<I", self._sq, p.sq_tail, (tail + n) & 0xFFFFFFFF)
            self._pending = 0
        ret = self._libc.syscall(self._enter_nr, ctypes.c_int(self.fd), ctypes.c_uint(n),
                                 ctypes.c_uint(wait_nr), ctypes.c_uint(IORING_ENTER_GETEVENTS),
                                 ctypes.c_void_p(None), ctypes.c_size_t(0))
        if ret < 0:
            e = ctypes.get_errno()
            raise IoUringError(e, f"io_uring_enter failed: {os.strerror(e)}")
        out = []
        head = self._u32(self._cq, p.cq_head)
        tail = self._u32(self._cq, p.cq_tail)
        while head != tail:
            off = p.cq_cqes + (head & self._cq_mask) * self.cqe_bytes
            ud, res, _flags = struct.unpack_from("<QiI", self._cq, off)
            extra = bytes(self._cq[off + 16:off + self.cqe_bytes]) if self.cqe_bytes == 32 else b""
            out.append((ud, res, extra))
            head = (head + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self._cq, p.cq_head, head)
        return out


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
    """Placed writes to ``/dev/ngXnY`` through :class:`IoUring` (one outstanding batch at a time).

    Parameters
    ----------
    char_dev : str   ``/dev/ngXnY``.
    nsid : int       namespace id.
    lba_bytes : int  logical block size, bytes.
    """

    def __init__(self, char_dev: str, nsid: int, lba_bytes: int = 4096, entries: int = 64) -> None:
        self.fd = os.open(char_dev, os.O_RDWR)
        self.nsid = nsid
        self.lba_bytes = lba_bytes
        self.ring = IoUring(entries, big=True)

    def write(self, buf: ctypes.Array, offset_bytes: int, placement: int | None) -> int:
        """Write all of ``buf`` (a ctypes buffer) at ``offset_bytes`` with PID ``placement``; return NVMe status."""
        slba, nlb = check_aligned(offset_bytes, ctypes.sizeof(buf), self.lba_bytes)
        cmd = build_write_cmd(self.nsid, slba, nlb, ctypes.addressof(buf), self.lba_bytes, placement)
        self.ring.prep_uring_cmd(self.fd, cmd, user_data=1)
        (ud, res, _extra), = self.ring.submit_and_wait(1)
        if res < 0:
            raise IoUringError(-res, f"passthrough write failed: {os.strerror(-res)}")
        return res

    def close(self) -> None:
        """Close the ring and the device."""
        self.ring.close()
        os.close(self.fd)
