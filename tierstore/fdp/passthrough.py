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

Continued in ``docs/FDP.md`` (``tierstore/fdp/passthrough.py``).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import struct
from dataclasses import dataclass

from ..errors import AlignmentError, ConfigError
from ..io.ring import (  # noqa: F401
    IORING_OP_NOP,
    IORING_OP_URING_CMD,
    IORING_OP_WRITE,
    IORING_SETUP_CQE32,
    IORING_SETUP_SQE128,
    IoUringError,
    Ring,
    RingQueue,
)
from .discovery import max_transfer_bytes

__all__ = [
    "NVME_CMD_WRITE",
    "NVME_CMD_READ",
    "NVME_CMD_IO_MGMT_RECV",
    "NVME_CMD_IO_MGMT_SEND",
    "IOMR_MO_RUH_STATUS",
    "IOMS_MO_RUH_UPDATE",
    "DTYPE_DATA_PLACEMENT",
    "NVME_URING_CMD_IO",
    "IORING_OP_URING_CMD",
    "NvmeUringCmd",
    "NvmeStatusError",
    "write_cdw12",
    "write_cdw13",
    "build_write_cmd",
    "build_ruh_status_cmd",
    "encode_ruh_update_pids",
    "build_ruh_update_cmd",
    "IoUring",
    "IoUringError",
    "PassthroughWriter",
    "WritePath",
    "select_write_path",
    "ng_char_devices",
    "max_write_streams",
    "max_transfer_bytes",
]

# --- NVMe I/O opcodes (NVM Command Set Specification; linux include/linux/nvme.h enum nvme_opcode)
NVME_CMD_WRITE = 0x01
NVME_CMD_READ = 0x02
#: I/O Management Receive / Send (TP4146; libnvme ``enum nvme_io_opcode``:
#: ``nvme_cmd_io_mgmt_recv = 0x12``, ``nvme_cmd_io_mgmt_send = 0x1d``).
NVME_CMD_IO_MGMT_RECV = 0x12
NVME_CMD_IO_MGMT_SEND = 0x1D
#: Management operations: Reclaim Unit Handle Status (receive), Reclaim Unit Handle Update (send).
IOMR_MO_RUH_STATUS = 0x01
IOMS_MO_RUH_UPDATE = 0x01
#: Largest NLB of one Write (CDW12 bits 15:0, 0-based).
MAX_NLB = 0x10000
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
        return _NVME_URING_CMD.pack(
            self.opcode,
            self.flags,
            0,
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.metadata,
            self.addr,
            self.metadata_len,
            self.data_len,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
            self.timeout_ms,
            0,
        )

    @classmethod
    def unpack(cls, b: bytes) -> NvmeUringCmd:
        """Inverse of :meth:`pack`."""
        (op, fl, _r1, nsid, c2, c3, md, addr, mdl, dl, c10, c11, c12, c13, c14, c15, to, _r2) = (
            _NVME_URING_CMD.unpack(bytes(b[:NVME_URING_CMD_BYTES]))
        )
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


def build_write_cmd(
    nsid: int, slba: int, nlb: int, addr: int, lba_bytes: int, pid: int | None = None
) -> NvmeUringCmd:
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
    return NvmeUringCmd(
        opcode=NVME_CMD_WRITE,
        nsid=nsid,
        addr=addr,
        data_len=nlb * lba_bytes,
        cdw10=slba & 0xFFFFFFFF,
        cdw11=slba >> 32,
        cdw12=write_cdw12(nlb, pid is not None),
        cdw13=write_cdw13(pid),
    )


def build_ruh_status_cmd(nsid: int, addr: int, data_len: int) -> NvmeUringCmd:
    """I/O Management Receive, MO 01h (Reclaim Unit Handle Status) into ``data_len`` bytes at ``addr``.

    Parameters
    ----------
    nsid : int        namespace id (>= 1).
    addr : int        host buffer address (ctypes address), ``data_len`` bytes.
    data_len : int    bytes to receive: a positive multiple of 4 (CDW11 NUMD
                      counts dwords, 0-based); 16 + 32 per descriptor holds them all.

    Raises
    ------
    ConfigError
        ``nsid`` < 1 or ``data_len`` not a positive multiple of 4.
    """
    if nsid < 1:
        raise ConfigError(f"nsid={nsid}: namespace ids start at 1")
    if data_len <= 0 or data_len % 4 or data_len // 4 - 1 > 0xFFFFFFFF:
        raise ConfigError(f"data_len={data_len}: must be a positive multiple of 4 (NUMD counts dwords)")
    return NvmeUringCmd(
        opcode=NVME_CMD_IO_MGMT_RECV,
        nsid=nsid,
        addr=addr,
        data_len=data_len,
        cdw10=IOMR_MO_RUH_STATUS,
        cdw11=data_len // 4 - 1,
    )


def encode_ruh_update_pids(pids: list[int] | tuple[int, ...]) -> bytes:
    """The data buffer of a Reclaim Unit Handle Update: each PID as a little-endian u16.

    Raises
    ------
    ConfigError
        No PIDs, more than 65536 (MOS is 16 bits), or a PID outside 0..0xFFFF.
    """
    pids = [int(p) for p in pids]
    if not 1 <= len(pids) <= 0x10000:
        raise ConfigError(f"RUH Update names {len(pids)} PIDs: 1..65536 (MOS = count - 1 is 16 bits)")
    for p in pids:
        if not 0 <= p <= 0xFFFF:
            raise ConfigError(f"pid={p}: placement identifiers are 16 bits")
    return struct.pack(f"<{len(pids)}H", *pids)


def build_ruh_update_cmd(nsid: int, npids: int, addr: int) -> NvmeUringCmd:
    """I/O Management Send, MO 01h (Reclaim Unit Handle Update) of ``npids`` PIDs at ``addr``.

    ``addr`` holds :func:`encode_ruh_update_pids` (2 bytes per PID);
    CDW10 = ``MO | (npids - 1) << 16``; ``data_len = 2 * npids``.
    """
    if nsid < 1:
        raise ConfigError(f"nsid={nsid}: namespace ids start at 1")
    if not 1 <= npids <= 0x10000:
        raise ConfigError(f"npids={npids}: 1..65536")
    return NvmeUringCmd(
        opcode=NVME_CMD_IO_MGMT_SEND,
        nsid=nsid,
        addr=addr,
        data_len=2 * npids,
        cdw10=IOMS_MO_RUH_UPDATE | ((npids - 1) << 16),
    )


class NvmeStatusError(IoUringError):
    """The controller completed a passthrough command with a non-zero NVMe status.

    For ``IORING_OP_URING_CMD`` on the nvme driver, a CQE ``res`` > 0 is the
    NVMe status field (Status Code Type << 8 | Status Code; linux
    ``drivers/nvme/host/ioctl.c`` ``nvme_uring_task_cb`` passes
    ``nvme_req(req)->status``), a negative ``res`` a host errno.

    Attributes
    ----------
    nvme_status : int
        The status field (e.g. 0x2 Invalid Field in Command, 0x4002 with DNR).
    """

    def __init__(self, nvme_status: int, what: str) -> None:
        self.nvme_status = int(nvme_status)
        sct, sc = (self.nvme_status >> 8) & 0x7, self.nvme_status & 0xFF
        super().__init__(errno.EIO, f"{what}: NVMe status {self.nvme_status:#x} (SCT {sct:#x}, SC {sc:#x})")


# ------------------------------------------------------------------- io_uring
class IoUring(Ring):
    """The passthrough ring: :class:`tierstore.io.ring.Ring` with ``big=True``
    meaning ``SQE128 | CQE32`` (what ``IORING_OP_URING_CMD`` to the nvme driver needs).

    Single-threaded, as :class:`~tierstore.io.ring.Ring`; :class:`PassthroughWriter`
    wraps one in a :class:`~tierstore.io.ring.RingQueue` for concurrent writers.
    """

    def __init__(self, entries: int = 64, big: bool = True) -> None:
        super().__init__(entries, sqe128=big, cqe32=big)

    def prep_nvme_cmd(
        self, fd: int, cmd: NvmeUringCmd | bytes, user_data: int, cmd_op: int = NVME_URING_CMD_IO
    ) -> None:
        """Queue an ``IORING_OP_URING_CMD`` carrying ``cmd`` (a ``struct nvme_uring_cmd``; needs
        ``big=True``).

        A convenience over :meth:`~tierstore.io.ring.Ring.prep_uring_cmd`, whose
        signature ``(fd, cmd_op, cmd, user_data)`` this class keeps unchanged, so a
        :class:`~tierstore.io.ring.RingQueue` over this ring calls the same method as
        over any other.
        """
        self.prep_uring_cmd(fd, cmd_op, cmd.pack() if isinstance(cmd, NvmeUringCmd) else cmd, user_data)

    def prep_write(
        self, fd: int, addr: int, nbytes: int, offset_bytes: int, user_data: int, write_stream: int = 0
    ) -> None:
        """Queue an ``IORING_OP_WRITE``; ``write_stream`` (1..255) selects a block-layer write stream (Linux
        >= 6.16).

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


def select_write_path(
    block_dev: str | None = None, char_dev: str | None = None, dev_root: str = "/dev", sys_root: str = "/sys"
) -> WritePath:
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
        return WritePath(
            "uring_cmd",
            char_dev,
            0,
            f"FDP placement via NVMe passthrough (IORING_OP_URING_CMD) on {char_dev}",
        )
    if block_dev is not None:
        n = max_write_streams(block_dev, sys_root)
        if n > 0:
            return WritePath(
                "write_stream",
                block_dev,
                n,
                f"FDP placement via block-layer write streams on {block_dev} ({n} streams)",
            )
    return WritePath(
        "none",
        block_dev,
        0,
        "no FDP placement: no /dev/ng* passthrough device and no block-layer write streams; "
        "writes carry no placement",
    )


def check_aligned(offset_bytes: int, nbytes: int, lba_bytes: int) -> tuple[int, int]:
    """``(slba, nlb)`` for an LBA-aligned byte range; raise :class:`AlignmentError` otherwise."""
    if offset_bytes % lba_bytes or nbytes % lba_bytes or nbytes <= 0:
        raise AlignmentError(
            f"offset {offset_bytes} / length {nbytes} not multiples of the {lba_bytes}-byte LBA"
        )
    return offset_bytes // lba_bytes, nbytes // lba_bytes


class PassthroughWriter:
    """NVMe passthrough on ``/dev/ngXnY`` through an SQE128|CQE32 ring: placed writes,
    RUH Status and RUH Update. Thread-safe (one :class:`~tierstore.io.ring.RingQueue`,
    ``entries`` commands in flight at most).

    A write larger than ``max_transfer_bytes`` (the controller's MDTS, see
    :func:`max_transfer_bytes`) or than 65536 logical blocks is sent as several
    commands with the same PID, all in flight together.

    Parameters
    ----------
    char_dev : str   ``/dev/ngXnY``.
    nsid : int       namespace id.
    lba_bytes : int  logical block size, bytes (Identify Namespace LBA format).
    entries : int    ring size = commands in flight at most.
    max_transfer_bytes : int, optional
        Bytes of one command at most; ``None``: 65536 logical blocks.

    Raises
    ------
    IoUringUnavailable
        io_uring, or SQE128/CQE32 rings (Linux >= 5.19), cannot be used here.
    """

    def __init__(
        self,
        char_dev: str,
        nsid: int,
        lba_bytes: int = 4096,
        entries: int = 64,
        max_transfer_bytes: int | None = None,
    ) -> None:
        if lba_bytes <= 0 or lba_bytes & (lba_bytes - 1):
            raise ConfigError(f"lba_bytes={lba_bytes}: must be a power of two")
        ring = IoUring(entries, big=True)
        try:
            self.fd = os.open(char_dev, os.O_RDWR)
        except BaseException:
            ring.close()
            raise
        self.char_dev = char_dev
        self.nsid = nsid
        self.lba_bytes = lba_bytes
        cap = MAX_NLB * lba_bytes
        self.max_transfer_bytes = max(lba_bytes, min(cap, max_transfer_bytes or cap) // lba_bytes * lba_bytes)
        self.ring = ring
        self._queue = RingQueue(ring, min(entries, ring.sq_entries))

    def _run(self, cmds: list[NvmeUringCmd], what: str) -> None:
        """Submit ``cmds`` together and wait for all; raise the first failure."""
        box: list[int] = []
        n = len(cmds)

        def on_done(res: int, _arg: int, _big: bytes) -> None:
            box.append(res)

        for c in cmds:
            self._queue.submit_cmd(self.fd, NVME_URING_CMD_IO, c.pack(), on_done)
        self._queue.wait_until(lambda: len(box) == n)
        for res in box:
            if res < 0:
                raise IoUringError(-res, f"{what} failed: {os.strerror(-res)}")
            if res > 0:
                raise NvmeStatusError(res, what)

    def write(self, buf: ctypes.Array, offset_bytes: int, placement: int | None) -> int:
        """Write all of ``buf`` (a ctypes buffer) at ``offset_bytes`` with PID ``placement``; return 0.

        Raises
        ------
        AlignmentError
            ``offset_bytes`` or the length is not a multiple of ``lba_bytes``.
        IoUringError
            A command failed (host errno); :class:`NvmeStatusError` when the
            controller returned a non-zero status.
        """
        nbytes = ctypes.sizeof(buf)
        check_aligned(offset_bytes, nbytes, self.lba_bytes)
        base = ctypes.addressof(buf)
        step = self.max_transfer_bytes
        cmds = []
        for pos in range(0, nbytes, step):
            n = min(step, nbytes - pos)
            cmds.append(
                build_write_cmd(
                    self.nsid,
                    (offset_bytes + pos) // self.lba_bytes,
                    n // self.lba_bytes,
                    base + pos,
                    self.lba_bytes,
                    placement,
                )
            )
        self._run(cmds, f"passthrough write of {nbytes} bytes at {offset_bytes} (pid {placement})")
        return 0

    def ruh_status_bytes(self, data_len: int) -> bytes:
        """RUH Status (I/O Management Receive, MO 01h), ``data_len`` bytes as the controller returned them."""
        data_len = -(-int(data_len) // 4) * 4
        buf = (ctypes.c_char * data_len)()
        self._run([build_ruh_status_cmd(self.nsid, ctypes.addressof(buf), data_len)], "RUH Status")
        return bytes(buf)

    def ruh_update(self, pids: list[int] | tuple[int, ...]) -> None:
        """Reclaim Unit Handle Update (I/O Management Send, MO 01h) of ``pids``.

        Raises
        ------
        ConfigError
            An empty list or a PID outside 16 bits.
        NvmeStatusError
            The controller refused it (e.g. Invalid Field for a PID it does not know).
        """
        data = encode_ruh_update_pids(pids)
        buf = ctypes.create_string_buffer(data, max(len(data), 4))
        self._run(
            [build_ruh_update_cmd(self.nsid, len(data) // 2, ctypes.addressof(buf))],
            f"RUH Update of PIDs {[hex(p) for p in pids]}",
        )

    def close(self) -> None:
        """Wait for commands in flight, close the ring and the device."""
        self._queue.close()
        os.close(self.fd)
