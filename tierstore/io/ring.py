"""The one io_uring of tierstore: three syscalls and three ``mmap``\\s, in ctypes.

No native extension is loaded: the ring is set up with ``io_uring_setup(2)``,
driven with ``io_uring_enter(2)`` (both called through libc's ``syscall(2)``,
reached with ``ctypes.CDLL(None)``, i.e. the libc the interpreter already
runs on), and its submission queue (SQ), completion queue (CQ) and SQE array
are ``mmap(2)``-ed from the ring fd. Nothing here depends on a CPU feature
beyond baseline x86-64. (Why not a binding: the ``liburing`` wheel that pip
resolved, 2026.3.30, is Zig-built and executes AVX-512 instructions in
``Ring.__new__``, which kills the process with SIGILL on CPUs without them,
and its ``SQE`` object cannot fill the 80-byte command area NVMe passthrough
needs; ``pyuring`` 0.3.3's ``uring_cmd128_sync(ctx, cmd_op, fd)`` leaves that
area zero too.)

Layouts and constants are those of linux ``include/uapi/linux/io_uring.h``
(``struct io_uring_sqe``, ``struct io_uring_cqe``, ``struct io_uring_params``
with ``io_sqring_offsets``/``io_cqring_offsets``, ``IORING_OP_*``,
``IORING_SETUP_*``, ``IORING_OFF_*``); the ring protocol (publish the SQ tail
after the SQEs, read CQEs up to the CQ tail, then publish the CQ head) is the
one io_uring(7) describes and liburing's ``src/queue.c`` implements.

Two sizes of ring (``Ring(..., sqe128=..., cqe32=...)``):

* SQE64/CQE16 (the default): file I/O -- ``IORING_OP_READV``/``WRITEV``
  (Linux >= 5.1), ``IORING_OP_READ``/``WRITE`` (>= 5.6), ``IORING_OP_NOP``.
* SQE128 | CQE32 (Linux >= 5.19): ``IORING_OP_URING_CMD`` with an 80-byte
  command at ``sqe->cmd`` (offset 48) and 16 bytes of result in ``big_cqe``,
  as NVMe passthrough on ``/dev/ngXnY`` requires (``tierstore.fdp.passthrough``).

Memory ordering. The kernel reads the SQ tail with acquire semantics and
writes the CQ tail with release semantics; user space must store the SQ tail
*after* the SQE bytes (release) and load CQEs *after* the CQ tail (acquire),
and must not store the CQ head before it has read the CQEs. liburing does this
with ``io_uring_smp_store_release``/``io_uring_smp_load_acquire``, which on
x86-64 are plain moves plus a compiler barrier, because x86-64 is TSO: stores
are not reordered with stores, loads not with loads, loads not with later
stores (Intel SDM vol. 3A, 9.2.2). Each access here is a separate call out of
the interpreter, so no compiler reorders them either. Other architectures need
real barriers, which Python cannot emit: :class:`Ring` refuses them with
:class:`IoUringUnavailable`, and ``open_engine("auto")`` uses posix there.

Threads. :class:`Ring` is single-threaded (its caller serialises every call).
:class:`RingQueue` makes one ring safe for many threads: one lock guards SQEs,
the CQ and the in-flight table; a thread that must wait for a completion
blocks in ``io_uring_enter`` *without* that lock (one thread at a time, the
"reaper"; others wait on a condition it signals), so no lock is held while I/O
is in progress and submitters never wait for another thread's I/O.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import platform
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..closing import Closing
from ..errors import InvariantError, TierStoreError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

try:  # the turn of a plain bench job in C (tierstore/io/_ringloop.c, built by setup.py; optional)
    from . import _ringloop

    _RINGLOOP_MISSING = ""
except ImportError as _exc:  # built without a C compiler: the Python turn runs instead
    _ringloop = None  # type: ignore[assignment]
    _RINGLOOP_MISSING = f"tierstore.io._ringloop is not built ({_exc})"

__all__ = [
    "IORING_OP_NOP",
    "IORING_OP_READV",
    "IORING_OP_WRITEV",
    "IORING_OP_READ",
    "IORING_OP_WRITE",
    "IORING_OP_URING_CMD",
    "IORING_SETUP_SQE128",
    "IORING_SETUP_CQE32",
    "URING_CMD_BYTES",
    "IoUringError",
    "IoUringUnavailable",
    "Ring",
    "RingQueue",
    "uring_available",
    "native_turn",
    "run_fixed_turns",
    "TurnResult",
    "SLOT_STATE_COLS",
    "TURN_LOG_COLS",
]

# --- include/uapi/linux/io_uring.h: enum io_uring_op
IORING_OP_NOP = 0
IORING_OP_READV = 1
IORING_OP_WRITEV = 2
IORING_OP_READ = 22
IORING_OP_WRITE = 23
IORING_OP_URING_CMD = 46
# --- io_uring_setup() flags
IORING_SETUP_SQE128 = 1 << 10  # SQEs are 128 bytes (Linux 5.19)
IORING_SETUP_CQE32 = 1 << 11  # CQEs are 32 bytes (Linux 5.19)
# --- io_uring_enter() flags
IORING_ENTER_GETEVENTS = 1 << 0
# --- io_uring_params.features
IORING_FEAT_SINGLE_MMAP = 1 << 0  # SQ and CQ rings share one mmap (Linux 5.4)
# --- mmap offsets
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000

#: Bytes of the command area of an SQE128 (``sqe->cmd``: offset 48 to 128).
URING_CMD_BYTES = 80
#: io_uring_setup / io_uring_enter syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl;
#: the same on every architecture since Linux 5.1, but only x86-64 is supported, see above).
_NR_SETUP, _NR_ENTER = 425, 426
_SUPPORTED_ARCH = ("x86_64", "amd64")

#: ``struct io_uring_sqe`` as one little-endian record of 64 bytes:
#: opcode u8 @0, flags u8 @1, ioprio u16 @2, fd s32 @4, off|addr2|cmd_op u64 @8,
#: addr u64 @16, len u32 @24, rw_flags u32 @28, user_data u64 @32, buf_index u16 @40,
#: personality u16 @42, file_index|write_stream s32 @44, addr3 u64 @48, __pad2 u64 @56.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
#: The first 48 bytes (everything before ``addr3``/``cmd``), for URING_CMD SQEs.
_SQE_HEAD48 = struct.Struct("<BBHiQQIIQHHi")
#: ``struct io_uring_cqe``: user_data u64, res s32, flags u32 (+ 16 bytes big_cqe with CQE32).
_CQE = struct.Struct("<QiI")
#: ``struct iovec``: iov_base, iov_len (x86-64: two 8-byte words).
_IOVEC = struct.Struct("<QQ")
_ZERO64 = bytes(64)

if (_SQE.size, _SQE_HEAD48.size, _CQE.size, _IOVEC.size) != (64, 48, 16, 16):
    raise ImportError("io_uring SQE/CQE/iovec record sizes do not match io_uring.h")


class IoUringError(TierStoreError, OSError):
    """An io_uring syscall failed (``errno`` and ``strerror`` set)."""

    def __str__(self) -> str:
        # the sentence alone (OSError's "[Errno 95] ..." prefix adds nothing to it)
        return self.strerror or OSError.__str__(self)


class IoUringUnavailable(IoUringError):
    """io_uring cannot be used in this process: wrong architecture, disabled by
    ``kernel.io_uring_disabled``, blocked by seccomp, or a kernel too old for
    the ring requested. ``strerror`` says which."""


class _Params(ctypes.Structure):
    """``struct io_uring_params`` (120 bytes) with ``io_sqring_offsets`` / ``io_cqring_offsets``."""

    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        # io_sqring_offsets
        ("sq_head", ctypes.c_uint32),
        ("sq_tail", ctypes.c_uint32),
        ("sq_ring_mask", ctypes.c_uint32),
        ("sq_ring_entries", ctypes.c_uint32),
        ("sq_flags", ctypes.c_uint32),
        ("sq_dropped", ctypes.c_uint32),
        ("sq_array", ctypes.c_uint32),
        ("sq_resv1", ctypes.c_uint32),
        ("sq_resv2", ctypes.c_uint64),
        # io_cqring_offsets
        ("cq_head", ctypes.c_uint32),
        ("cq_tail", ctypes.c_uint32),
        ("cq_ring_mask", ctypes.c_uint32),
        ("cq_ring_entries", ctypes.c_uint32),
        ("cq_overflow", ctypes.c_uint32),
        ("cq_cqes", ctypes.c_uint32),
        ("cq_flags", ctypes.c_uint32),
        ("cq_resv1", ctypes.c_uint32),
        ("cq_resv2", ctypes.c_uint64),
    ]


if ctypes.sizeof(_Params) != 120:
    raise ImportError("struct io_uring_params layout mismatch (expected 120 bytes)")


@functools.lru_cache(maxsize=1)
def _syscall() -> Callable[..., int]:
    """libc's ``syscall(2)`` from the running process (no library is loaded)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    # Integer arguments travel in the same registers whether a call is variadic
    # or not on x86-64 (SysV ABI 3.2.3), so fixed argtypes are correct here.
    fn.argtypes = [ctypes.c_long] * 7
    fn.restype = ctypes.c_long
    return fn


def _arch_supported() -> tuple[bool, str]:
    arch = platform.machine().lower()
    if arch in _SUPPORTED_ARCH:
        return True, ""
    return False, (
        f"the ctypes io_uring runs on x86-64 only (its ring head/tail accesses rely on x86-64 "
        f"TSO ordering); this machine is {platform.machine()!r}"
    )


def _sysctl_disabled() -> int | None:
    """``/proc/sys/kernel/io_uring_disabled`` (Linux 6.6): 0 on, 1 only for
    ``kernel.io_uring_group``/CAP_SYS_ADMIN, 2 off; ``None`` where absent."""
    try:
        with open("/proc/sys/kernel/io_uring_disabled", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _why_setup_failed(err: int, flags: int) -> str:
    s = f"io_uring_setup failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    disabled = _sysctl_disabled()
    if err == errno.EPERM and disabled:
        return s + f": kernel.io_uring_disabled={disabled}"
    if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
        return s + ": io_uring is blocked (seccomp, a container profile) or absent (Linux < 5.1)"
    if err == errno.EINVAL and flags & (IORING_SETUP_SQE128 | IORING_SETUP_CQE32):
        return s + ": this kernel lacks SQE128/CQE32 rings (Linux >= 5.19)"
    return s


class Ring(Closing):
    """One io_uring: the SQ, the CQ and the SQE array mapped into this process.

    Not thread-safe: one thread at a time calls it (or wrap it in :class:`RingQueue`).

    Parameters
    ----------
    entries : int
        Submission queue size; the kernel rounds it up to a power of two (1..32768).
        The CQ gets twice as many entries.
    sqe128 : bool
        128-byte SQEs (``IORING_SETUP_SQE128``, Linux >= 5.19), for ``IORING_OP_URING_CMD``.
    cqe32 : bool
        32-byte CQEs (``IORING_SETUP_CQE32``, Linux >= 5.19): 16 more bytes of result per completion.

    Attributes
    ----------
    sq_entries, cq_entries : int
        Sizes the kernel chose.
    sqe_bytes, cqe_bytes : int
        64 or 128; 16 or 32.

    Raises
    ------
    IoUringUnavailable
        Not x86-64, or io_uring_setup failed with EPERM/EACCES/ENOSYS (disabled,
        seccomp, old kernel), or EINVAL for SQE128/CQE32 on a kernel < 5.19.
    IoUringError
        Another setup or mmap failure (ENOMEM: e.g. RLIMIT_MEMLOCK on Linux < 5.12).
    """

    # the mapped rings and live views of their head/tail words: set by _map, dropped by close (a
    # closed ring is not used again, so the hot paths read them without a None check)
    _sq: mmap.mmap
    _cq: mmap.mmap
    _sqes: mmap.mmap
    _khead: ctypes.c_uint32
    _ktail: ctypes.c_uint32
    _kchead: ctypes.c_uint32
    _kctail: ctypes.c_uint32
    # fix_rw_slots' views of the SQE array and the SQ index array (None on a ring without fixed slots)
    _fixed_words: memoryview | None
    _fixed_bytes: memoryview | None
    _sq_index: memoryview | None

    def __init__(self, entries: int, *, sqe128: bool = False, cqe32: bool = False) -> None:
        self.fd = -1
        self._fixed_words = self._fixed_bytes = self._sq_index = None  # views set by fix_rw_slots
        self._n_fixed = 0
        ok, why = _arch_supported()
        if not ok:
            raise IoUringUnavailable(errno.ENOTSUP, why)
        if not 1 <= entries <= 32768:
            raise IoUringError(errno.EINVAL, f"entries={entries}: io_uring_setup takes 1..32768")
        p = _Params()
        p.flags = (IORING_SETUP_SQE128 if sqe128 else 0) | (IORING_SETUP_CQE32 if cqe32 else 0)
        fd = _syscall()(_NR_SETUP, entries, ctypes.addressof(p), 0, 0, 0, 0)
        if fd < 0:
            e = ctypes.get_errno()
            cls = (
                IoUringUnavailable
                if e in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EINVAL)
                else IoUringError
            )
            raise cls(e, _why_setup_failed(e, p.flags))
        self.fd = fd
        self.params = p
        self.features = p.features
        self.sq_entries, self.cq_entries = p.sq_entries, p.cq_entries
        self.sqe_bytes = 128 if sqe128 else 64
        self.cqe_bytes = 32 if cqe32 else 16
        self._drop_maps()
        try:
            self._map()
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        p = self.params
        sq_size = p.sq_array + p.sq_entries * 4
        cq_size = p.cq_cqes + p.cq_entries * self.cqe_bytes
        single = bool(p.features & IORING_FEAT_SINGLE_MMAP)
        if single:
            sq_size = cq_size = max(sq_size, cq_size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        try:
            self._sq = mmap.mmap(self.fd, sq_size, flags, prot, offset=IORING_OFF_SQ_RING)
            self._cq = (
                self._sq if single else mmap.mmap(self.fd, cq_size, flags, prot, offset=IORING_OFF_CQ_RING)
            )
            self._sqes = mmap.mmap(
                self.fd, p.sq_entries * self.sqe_bytes, flags, prot, offset=IORING_OFF_SQES
            )
        except OSError as exc:
            raise IoUringError(
                exc.errno or errno.ENOMEM, f"mmap of the io_uring rings failed: {exc}"
            ) from None
        u32 = ctypes.c_uint32
        # Live views of the kernel-shared head/tail words: .value is one 32-bit load or store.
        self._khead = u32.from_buffer(self._sq, p.sq_head)  # kernel advances: SQEs consumed
        self._ktail = u32.from_buffer(self._sq, p.sq_tail)  # we advance: SQEs published
        self._kchead = u32.from_buffer(self._cq, p.cq_head)  # we advance: CQEs consumed
        self._kctail = u32.from_buffer(self._cq, p.cq_tail)  # kernel advances: CQEs posted
        self._sq_mask = u32.from_buffer(self._sq, p.sq_ring_mask).value
        self._cq_mask = u32.from_buffer(self._cq, p.cq_ring_mask).value
        # The SQ index array maps ring slot i to SQE i once and for all (as liburing does).
        for i in range(p.sq_entries):
            struct.pack_into("<I", self._sq, p.sq_array + 4 * i, i)
        self._tail = self._ktail.value  # SQEs prepared (published up to _ktail)
        self._cqe_off = p.cq_cqes

    def _drop_maps(self) -> None:
        """No ring mapped (before :meth:`_map`, after :meth:`close`)."""
        self._khead = self._ktail = self._kchead = self._kctail = None  # type: ignore[assignment]
        self._sq = self._cq = self._sqes = None  # type: ignore[assignment]

    # ----------------------------------------------------------------- life
    def close(self) -> None:
        """Unmap and close the ring. Idempotent. Requests still in flight are
        cancelled by the kernel (their buffers must stay valid until then)."""
        maps = {id(x): x for x in (self._sqes, self._cq, self._sq) if x is not None}.values()
        for view in (self._fixed_words, self._fixed_bytes, self._sq_index):  # buffer exports go first:
            if view is not None:  # an mmap with them cannot close
                view.release()
        self._fixed_words = self._fixed_bytes = self._sq_index = None
        self._drop_maps()  # the head/tail views too
        for m in maps:
            m.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------ SQ side
    def sq_space_left(self) -> int:
        """Free SQE slots (not prepared and not yet consumed by the kernel)."""
        return self.sq_entries - self.sq_pending()

    def sq_pending(self) -> int:
        """SQEs prepared (published or not) that the kernel has not consumed yet."""
        return (self._tail - self._khead.value) & 0xFFFFFFFF

    def unpublish(self) -> list[int]:
        """Withdraw every SQE the kernel has not consumed; return their ``user_data``.

        Only valid while no ``io_uring_enter`` with ``to_submit`` > 0 runs
        concurrently (no SQPOLL here: the kernel takes SQEs only in that call).
        """
        head = self._khead.value
        uds = []
        i = head
        while i != self._tail:
            off = self._sqe_index(i) * self.sqe_bytes
            uds.append(struct.unpack_from("<Q", self._sqes, off + 32)[0])
            i = (i + 1) & 0xFFFFFFFF
        self._tail = head
        self._ktail.value = head
        return uds

    def _sqe_index(self, position: int) -> int:
        """The SQE that SQ ring position ``position`` names (itself unless fixed to slots)."""
        position &= self._sq_mask
        return position if self._sq_index is None else self._sq_index[position]

    def _sq_tail_for(self, n: int) -> int:
        """The SQ tail, once ``n`` more SQEs are known to fit; raises ``EBUSY`` (nothing queued) if not."""
        tail = self._tail
        if ((tail - self._khead.value) & 0xFFFFFFFF) + n > self.sq_entries:
            raise IoUringError(
                errno.EBUSY,
                f"submission queue has {self.sq_space_left()} free slots, not {n}: submit() first",
            )
        return tail

    def _slot(self) -> int:
        """Byte offset of the next free SQE; raises if the SQ is full."""
        if self.fd < 0:
            raise IoUringError(errno.EBADF, "ring is closed")
        if self._sq_index is not None:
            raise IoUringError(
                errno.EINVAL, "the ring's SQEs are fixed to slots (fix_rw_slots): use prep_fixed"
            )
        tail = self._tail
        if ((tail - self._khead.value) & 0xFFFFFFFF) >= self.sq_entries:
            raise IoUringError(errno.EBUSY, "submission queue full: submit() first")
        self._tail = (tail + 1) & 0xFFFFFFFF
        off = (tail & self._sq_mask) * self.sqe_bytes
        if self.sqe_bytes == 128:
            self._sqes[off + 64 : off + 128] = _ZERO64
        return off

    def _prep_rw(
        self, opcode: int, fd: int, addr: int, length: int, offset: int, user_data: int, ext: int = 0
    ) -> None:
        _SQE.pack_into(
            self._sqes, self._slot(), opcode, 0, 0, fd, offset, addr, length, 0, user_data, 0, 0, ext, 0, 0
        )

    def prep_rw_batch(
        self,
        opcodes: int | Sequence[int],
        fd: int,
        addrs: Sequence[int],
        nbytes: int,
        offsets: Sequence[int],
        user_data: Sequence[int],
    ) -> None:
        """Queue many read/write SQEs (``IORING_OP_READ``/``WRITE``/``READV``/``WRITEV``) in one call.

        Each is the SQE :meth:`prep_read`/:meth:`prep_write` (or the vectored calls) would queue;
        for a loop that publishes a batch per :meth:`submit` (``tierstore bench``'s io_uring jobs),
        the slots are checked once and the records packed without a call per SQE.

        Parameters
        ----------
        opcodes : int or sequence of int
            ``IORING_OP_*`` of every SQE, or one per SQE.
        fd : int
            File descriptor (O_DIRECT rules apply).
        addrs : sequence of int
            Buffer (or iovec array) address per SQE; the memory must stay valid until the
            completion is reaped.
        nbytes : int
            Bytes (or iovec count) of every SQE.
        offsets : sequence of int
            File offset in bytes per SQE.
        user_data : sequence of int
            Returned in each completion.

        Raises
        ------
        IoUringError
            EBADF on a closed ring; EINVAL on a ring of 128-byte SQEs (use the per-opcode calls
            there) or sequences of different lengths; EBUSY when the SQ has fewer free slots than
            SQEs given (nothing is queued then).
        """
        if self.fd < 0:
            raise IoUringError(errno.EBADF, "ring is closed")
        if self.sqe_bytes != 64 or self._sq_index is not None:
            raise IoUringError(errno.EINVAL, "prep_rw_batch needs a ring of 64-byte SQEs not fixed to slots")
        n = len(offsets)
        if len(addrs) != n or len(user_data) != n or (not isinstance(opcodes, int) and len(opcodes) != n):
            raise IoUringError(
                errno.EINVAL, "prep_rw_batch: opcodes, addrs, offsets and user_data differ in length"
            )
        tail = self._sq_tail_for(n)
        sqes, mask, pack = self._sqes, self._sq_mask, _SQE.pack_into
        if isinstance(opcodes, int):
            for addr, offset, ud in zip(addrs, offsets, user_data):
                pack(sqes, (tail & mask) << 6, opcodes, 0, 0, fd, offset, addr, nbytes, 0, ud, 0, 0, 0, 0, 0)
                tail += 1
        else:
            for op, addr, offset, ud in zip(opcodes, addrs, offsets, user_data):
                pack(sqes, (tail & mask) << 6, op, 0, 0, fd, offset, addr, nbytes, 0, ud, 0, 0, 0, 0, 0)
                tail += 1
        self._tail = tail & 0xFFFFFFFF

    def fix_rw_slots(self, opcode: int, fd: int, addrs: Sequence[int], nbytes: int) -> None:
        """Dedicate SQE ``i`` to slot ``i``: a read/write of ``nbytes`` at buffer ``addrs[i]`` on ``fd``.

        From then on the ring is driven with :meth:`prep_fixed`, which queues a slot's SQE by
        setting only its file offset (and opcode) and naming it in the SQ index array, the
        indirection ``struct io_sqring_offsets.array`` exists for (io_uring(7): "the submission
        queue ... an array of indices into the SQE array"); the other preparation calls are refused
        on this ring. Each SQE's ``user_data`` is its slot number. For a loop that reuses the same
        ``len(addrs)`` buffers for one kind of I/O (``tierstore bench``'s plain io_uring jobs), this
        is two stores per I/O instead of packing a 64-byte record.

        Parameters
        ----------
        opcode : int
            ``IORING_OP_READ`` or ``IORING_OP_WRITE`` (may be changed per I/O in :meth:`prep_fixed`).
        fd : int
            File descriptor (O_DIRECT rules apply).
        addrs : sequence of int
            Buffer address per slot (at most :attr:`sq_entries` slots); each buffer holds ``nbytes``
            and must stay valid until every completion of its slot is reaped.
        nbytes : int
            Bytes per I/O.

        Raises
        ------
        IoUringError
            EBADF on a closed ring; EINVAL on a ring of 128-byte SQEs, with SQEs still queued, with
            more slots than SQ entries, or when called twice.
        """
        if self.fd < 0:
            raise IoUringError(errno.EBADF, "ring is closed")
        if self.sqe_bytes != 64 or self._sq_index is not None or self.sq_pending():
            raise IoUringError(
                errno.EINVAL, "fix_rw_slots needs a ring of 64-byte SQEs, not fixed yet, with no SQE queued"
            )
        if not 0 < len(addrs) <= self.sq_entries:
            raise IoUringError(errno.EINVAL, f"{len(addrs)} slots for a ring of {self.sq_entries} SQEs")
        for i, addr in enumerate(addrs):
            _SQE.pack_into(self._sqes, i << 6, opcode, 0, 0, fd, 0, addr, nbytes, 0, i, 0, 0, 0, 0, 0)
        p = self.params
        self._n_fixed = len(addrs)
        self._fixed_words = memoryview(self._sqes).cast("Q")  # u64 word 1 of SQE i: off
        self._fixed_bytes = memoryview(self._sqes)  # byte 0 of SQE i: opcode
        self._sq_index = memoryview(self._sq)[p.sq_array : p.sq_array + 4 * p.sq_entries].cast("I")

    def prep_fixed(
        self, slots: Sequence[int], offsets: Sequence[int], opcodes: Sequence[int] | None = None
    ) -> None:
        """Queue the SQEs of ``slots`` (fixed by :meth:`fix_rw_slots`) at file ``offsets``.

        Parameters
        ----------
        slots : sequence of int
            Slot numbers; none may be in flight (its completion not yet reaped).
        offsets : sequence of int
            File offset in bytes per slot.
        opcodes : sequence of int, optional
            ``IORING_OP_READ``/``IORING_OP_WRITE`` per slot; ``None`` keeps each SQE's opcode.

        Raises
        ------
        IoUringError
            EINVAL on a ring not fixed to slots, a slot outside them, or sequences of different lengths;
            EBUSY when the SQ has fewer free entries than slots (nothing is queued then).
        """
        index = self._sq_index
        if index is None:
            raise IoUringError(errno.EINVAL, "prep_fixed needs fix_rw_slots first")
        n = len(slots)
        if len(offsets) != n or (opcodes is not None and len(opcodes) != n):
            raise IoUringError(errno.EINVAL, "prep_fixed: slots, offsets and opcodes differ in length")
        if n and (min(slots) < 0 or max(slots) >= self._n_fixed):
            raise IoUringError(errno.EINVAL, f"prep_fixed: slots must be 0..{self._n_fixed - 1}")
        tail = self._sq_tail_for(n)
        words, mask = self._fixed_words, self._sq_mask
        assert words is not None  # set with index by fix_rw_slots
        for slot, offset in zip(slots, offsets):
            words[(slot << 3) | 1] = offset
            index[tail & mask] = slot
            tail += 1
        if opcodes is not None:
            ops = self._fixed_bytes
            assert ops is not None  # set with index by fix_rw_slots
            for slot, op in zip(slots, opcodes):
                ops[slot << 6] = op
        self._tail = tail & 0xFFFFFFFF

    def prep_nop(self, user_data: int) -> None:
        """Queue an ``IORING_OP_NOP`` (completes with res 0)."""
        self._prep_rw(IORING_OP_NOP, -1, 0, 0, 0, user_data)

    def prep_readv(self, fd: int, iov_addr: int, nr_vecs: int, offset: int, user_data: int) -> None:
        """Queue ``IORING_OP_READV``: preadv(2) of ``nr_vecs`` ``struct iovec`` at ``iov_addr``.

        The iovec array and the buffers it names must stay valid until the
        completion is reaped. ``offset`` in bytes; O_DIRECT rules apply (open(2)).
        """
        self._prep_rw(IORING_OP_READV, fd, iov_addr, nr_vecs, offset, user_data)

    def prep_writev(self, fd: int, iov_addr: int, nr_vecs: int, offset: int, user_data: int) -> None:
        """Queue ``IORING_OP_WRITEV``: pwritev(2); as :meth:`prep_readv`."""
        self._prep_rw(IORING_OP_WRITEV, fd, iov_addr, nr_vecs, offset, user_data)

    def prep_read(self, fd: int, addr: int, nbytes: int, offset: int, user_data: int) -> None:
        """Queue ``IORING_OP_READ`` (Linux >= 5.6): pread(2) into ``nbytes`` at address ``addr``."""
        self._prep_rw(IORING_OP_READ, fd, addr, nbytes, offset, user_data)

    def prep_write(
        self, fd: int, addr: int, nbytes: int, offset: int, user_data: int, write_stream: int = 0
    ) -> None:
        """Queue ``IORING_OP_WRITE`` (Linux >= 5.6): pwrite(2) of ``nbytes`` at address ``addr``.

        ``write_stream`` (1..255; 0 = none) selects a block-layer write stream
        (``sqe->write_stream``, u8 at offset 44, Linux >= 6.16).

        Raises
        ------
        IoUringError
            EINVAL for ``write_stream`` outside 0..255.
        """
        if not 0 <= write_stream <= 255:
            raise IoUringError(errno.EINVAL, f"write_stream={write_stream}: the SQE field is 8 bits")
        self._prep_rw(IORING_OP_WRITE, fd, addr, nbytes, offset, user_data, write_stream)

    def prep_uring_cmd(self, fd: int, cmd_op: int, cmd: bytes, user_data: int) -> None:
        """Queue ``IORING_OP_URING_CMD``: ``cmd_op`` (u32 at offset 8) and ``cmd``
        (at most 80 bytes, zero-padded) in ``sqe->cmd`` at offset 48.

        Raises
        ------
        IoUringError
            EINVAL on a ring without SQE128, or a ``cmd`` longer than 80 bytes.
        """
        if self.sqe_bytes != 128:
            raise IoUringError(
                errno.EINVAL, "IORING_OP_URING_CMD with an 80-byte command needs an SQE128 ring"
            )
        if len(cmd) > URING_CMD_BYTES:
            raise IoUringError(errno.EINVAL, f"command of {len(cmd)} bytes > {URING_CMD_BYTES}")
        off = self._slot()
        _SQE_HEAD48.pack_into(
            self._sqes, off, IORING_OP_URING_CMD, 0, 0, fd, cmd_op & 0xFFFFFFFF, 0, 0, 0, user_data, 0, 0, 0
        )
        self._sqes[off + 48 : off + 48 + len(cmd)] = cmd
        if len(cmd) < URING_CMD_BYTES:
            self._sqes[off + 48 + len(cmd) : off + 128] = bytes(URING_CMD_BYTES - len(cmd))

    def sqe_bytes_at(self, index_from_tail: int = -1) -> bytes:
        """The bytes of a prepared SQE (``-1``: the last one), for tests."""
        off = self._sqe_index((self._tail + index_from_tail) & 0xFFFFFFFF) * self.sqe_bytes
        return bytes(self._sqes[off : off + self.sqe_bytes])

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        while True:
            r = _syscall()(_NR_ENTER, self.fd, to_submit, min_complete, flags, 0, 0)
            if r >= 0:
                return r
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise IoUringError(e, f"io_uring_enter failed: {os.strerror(e)}")
            if min_complete and self.cq_ready():
                return 0

    def submit(self, wait_nr: int = 0) -> int:
        """Publish the prepared SQEs and ``io_uring_enter`` them; with ``wait_nr``
        also wait until that many completions are in the CQ.

        Returns the number of SQEs the kernel consumed.

        Raises
        ------
        IoUringError
            io_uring_enter's errno (EINTR is retried). EAGAIN/EBUSY mean the
            kernel is short of resources or the CQ is overfull: reap, then retry.
        """
        tail = self._tail
        self._ktail.value = tail  # release: the SQE bytes are stored before this (x86-64 TSO)
        n = (tail - self._khead.value) & 0xFFFFFFFF
        if n == 0 and wait_nr == 0:
            return 0
        return self._enter(n, wait_nr, IORING_ENTER_GETEVENTS if wait_nr else 0)

    def wait(self, nr: int = 1) -> None:
        """Block until ``nr`` completions are in the CQ (``io_uring_enter`` GETEVENTS)."""
        self._enter(0, nr, IORING_ENTER_GETEVENTS)

    # ------------------------------------------------------------ CQ side
    def cq_ready(self) -> int:
        """Completions posted and not yet reaped."""
        return (self._kctail.value - self._kchead.value) & 0xFFFFFFFF

    def reap(self) -> list[tuple[int, int, bytes]]:
        """Take every posted completion: ``(user_data, res, big_cqe)`` in CQ order.

        ``res`` is the syscall-style result (bytes moved, or ``-errno``);
        ``big_cqe`` is the 16 extra bytes of a CQE32 (NVMe result dwords), else ``b""``.
        """
        head = self._kchead.value
        tail = self._kctail.value  # acquire: CQEs are loaded after this (x86-64 TSO)
        if head == tail:
            return []
        out = []
        cq, mask, cb, base = self._cq, self._cq_mask, self.cqe_bytes, self._cqe_off
        big = cb == 32
        while head != tail:
            off = base + (head & mask) * cb
            ud, res, _flags = _CQE.unpack_from(cq, off)
            out.append((ud, res, bytes(cq[off + 16 : off + 32]) if big else b""))
            head = (head + 1) & 0xFFFFFFFF
        self._kchead.value = head  # release: CQE slots may be reused by the kernel now
        return out

    def reap_results(self) -> list[tuple[int, int, int]]:
        """:meth:`reap` without the CQE32 bytes: ``(user_data, res, flags)`` of every posted completion,
        in CQ order (the 16-byte CQE's fields)."""
        head = self._kchead.value
        tail = self._kctail.value  # acquire: CQEs are loaded after this (x86-64 TSO)
        if head == tail:
            return []
        cq, mask, cb, base = self._cq, self._cq_mask, self.cqe_bytes, self._cqe_off
        n = (tail - head) & 0xFFFFFFFF
        first = head & mask
        if cb == 16 and first + n <= mask + 1:  # contiguous in the ring: unpacked in one call
            out = list(_CQE.iter_unpack(cq[base + first * 16 : base + (first + n) * 16]))
        else:
            unpack = _CQE.unpack_from
            out = []
            while head != tail:
                out.append(unpack(cq, base + (head & mask) * cb))
                head = (head + 1) & 0xFFFFFFFF
        self._kchead.value = tail  # release: CQE slots may be reused by the kernel now
        return out

    def submit_and_wait(self, wait_nr: int = 1) -> list[tuple[int, int, bytes]]:
        """:meth:`submit` with ``wait_nr``, then :meth:`reap`."""
        self.submit(wait_nr)
        return self.reap()

    def submit_reap_results(self, wait_nr: int = 1) -> list[tuple[int, int, int]]:
        """Submit every prepared SQE and wait for ``wait_nr`` completions in one ``io_uring_enter(2)``
        (``to_submit`` = the SQEs queued, ``min_complete`` = ``wait_nr``, ``IORING_ENTER_GETEVENTS``),
        then take every completion posted (:meth:`reap_results`).

        The call a loop that keeps a queue full makes once per turn (fio's io_uring engine with
        ``iodepth_batch_complete_min``): it returns as soon as ``wait_nr`` I/Os are done, with all
        that are done by then, and the caller refills as many.

        Parameters
        ----------
        wait_nr : int
            Completions to wait for; 0 waits for none. Must not exceed the I/Os in flight plus those
            queued, or the call blocks until a signal.

        Returns
        -------
        list of (int, int, int)
            ``(user_data, res, flags)`` of every completion posted when the wait ended, in CQ order
            (possibly more than ``wait_nr``; ``res`` is bytes moved or ``-errno``).

        Raises
        ------
        IoUringError
            io_uring_enter's errno (EINTR is retried; SQEs the kernel did not consume stay queued).
        """
        self.submit(wait_nr)
        return self.reap_results()


OnDone = Callable[[int, int, bytes], None]


class RingQueue:
    """Many threads submitting to and waiting on one :class:`Ring`.

    Each in-flight request occupies one of ``max_inflight`` slots (the slot
    index is its ``user_data``), which holds its completion callback and, for
    READV/WRITEV, its ``struct iovec`` (kept valid until the completion is
    reaped). Submitting when every slot is taken waits for a completion.

    Callbacks ``on_done(res, arg, big_cqe)`` run exactly once, in whichever
    thread reaps the completion, with the queue's lock held: they must be
    short and must not raise or call back into the queue.

    Parameters
    ----------
    ring : Ring
        The ring; the queue owns it from now on (:meth:`close` closes it).
    max_inflight : int
        Requests in flight at most (<= ``ring.sq_entries``, so the CQ, twice
        the SQ, can never overflow).

    Raises
    ------
    IoUringError
        EINVAL if ``max_inflight`` is outside 1..``ring.sq_entries``.
    """

    def __init__(self, ring: Ring, max_inflight: int) -> None:
        if not 1 <= max_inflight <= ring.sq_entries:
            raise IoUringError(errno.EINVAL, f"max_inflight={max_inflight}: 1..{ring.sq_entries}")
        self.ring = ring
        self.max_inflight = max_inflight
        self._cond = threading.Condition(threading.Lock())
        self._free = list(range(max_inflight - 1, -1, -1))
        self._cbs: list[tuple[OnDone, int] | None] = [None] * max_inflight
        self._iov = (ctypes.c_uint64 * (2 * max_inflight))()
        self._iov_addr = ctypes.addressof(self._iov)
        self._reaping = False
        self._closed = False

    @property
    def inflight(self) -> int:
        """Requests submitted and not yet reaped."""
        return self.max_inflight - len(self._free)

    # ------------------------------------------------------------- submit
    def submit_rw(
        self, write: bool, fd: int, pieces: Sequence[tuple[int, int, int]], on_done: OnDone
    ) -> None:
        """Queue one ``IORING_OP_READV``/``WRITEV`` per ``(addr, nbytes, offset)`` piece.

        ``on_done(res, nbytes, b"")`` follows for each piece. The memory at
        ``addr`` must stay valid until then. All pieces are published with as
        few ``io_uring_enter`` calls as the free slots allow.
        """
        opcode = IORING_OP_WRITEV if write else IORING_OP_READV
        iov, iov_addr = self._iov, self._iov_addr
        with self._cond:
            ring = self.ring
            for addr, nbytes, offset in pieces:
                slot = self._take_slot_locked()
                self._cbs[slot] = (on_done, nbytes)
                iov[2 * slot] = addr
                iov[2 * slot + 1] = nbytes
                ring._prep_rw(opcode, fd, iov_addr + 16 * slot, 1, offset, slot)
            self._flush_locked()

    def submit_cmd(self, fd: int, cmd_op: int, cmd: bytes, on_done: OnDone, arg: int = 0) -> None:
        """Queue one ``IORING_OP_URING_CMD``; ``on_done(res, arg, big_cqe)`` follows."""
        with self._cond:
            slot = self._take_slot_locked()
            self._cbs[slot] = (on_done, arg)
            try:
                self.ring.prep_uring_cmd(fd, cmd_op, cmd, slot)
            except BaseException:
                self._release_slot_locked(slot)
                raise
            self._flush_locked()

    def submit_nop(self, on_done: OnDone, arg: int = 0) -> None:
        """Queue one ``IORING_OP_NOP``; ``on_done(0, arg, ...)`` follows."""
        with self._cond:
            slot = self._take_slot_locked()
            self._cbs[slot] = (on_done, arg)
            self.ring.prep_nop(slot)
            self._flush_locked()

    # --------------------------------------------------------------- wait
    def wait_until(self, pred: Callable[[], bool]) -> None:
        """Block until ``pred()`` is true, reaping completions meanwhile.

        ``pred`` is evaluated with the queue's lock held (so it sees callbacks'
        effects atomically). No lock is held while this thread waits in the kernel.

        Raises
        ------
        InvariantError
            ``pred()`` is false and nothing is in flight (it could never become true).
        IoUringError
            io_uring_enter failed.
        """
        with self._cond:
            self._wait_locked(pred)

    def poll(self) -> int:
        """Reap whatever has completed, without blocking; returns how many."""
        with self._cond:
            if self._reaping:  # another thread is reaping for everyone
                return 0
            return self._dispatch_locked()

    def drain(self) -> None:
        """Wait until nothing is in flight."""
        self.wait_until(lambda: len(self._free) == self.max_inflight)

    def close(self) -> None:
        """Wait for every request, then close the ring. Idempotent."""
        if self._closed:
            return
        self.drain()
        with self._cond:
            self._closed = True
            self.ring.close()

    # ---------------------------------------------------------- internals
    def _take_slot_locked(self) -> int:
        if self._closed:
            raise IoUringError(errno.EBADF, "ring queue is closed")
        if not self._free:
            self._flush_locked()
            self._wait_locked(lambda: bool(self._free))
        return self._free.pop()

    def _release_slot_locked(self, slot: int) -> None:
        self._cbs[slot] = None
        self._free.append(slot)

    def _flush_locked(self) -> None:
        """Submit every prepared SQE. What the kernel refuses to take completes
        through its callback with ``-errno`` (so its future fails), never lingers."""
        ring = self.ring
        while ring.sq_pending():
            try:
                if ring.submit():
                    continue  # some taken; a bad SQE stops the kernel early (with an error CQE): go on
                err = errno.EIO
            except IoUringError as exc:
                err = exc.errno or errno.EIO
                if err in (errno.EAGAIN, errno.EBUSY) and self.inflight > ring.sq_pending():
                    # kernel short of resources / CQ backlog: let completions drain, retry
                    self._wait_for_one_locked()
                    continue
            self._fail_unsubmitted_locked(err)
            return

    def _fail_unsubmitted_locked(self, err: int) -> None:
        """Take back the SQEs the kernel has not consumed and complete them with ``-err``.

        Safe without SQPOLL: the kernel reads the SQ only inside io_uring_enter
        with ``to_submit`` > 0, which only this (lock-holding) thread makes.
        """
        ring = self.ring
        uds = ring.unpublish()
        for ud in uds:
            entry = self._cbs[ud]
            if entry is None:
                raise InvariantError(f"unsubmitted SQE with user_data={ud} that is not in flight")
            self._release_slot_locked(ud)
            entry[0](-err, entry[1], b"")
        self._cond.notify_all()

    def _dispatch_locked(self) -> int:
        done = self.ring.reap()
        cbs, free = self._cbs, self._free
        for ud, res, big in done:
            entry = cbs[ud]
            if entry is None:
                raise InvariantError(f"io_uring completion for user_data={ud} that is not in flight")
            cbs[ud] = None
            free.append(ud)
            entry[0](res, entry[1], big)
        if done:
            self._cond.notify_all()
        return len(done)

    def _wait_for_one_locked(self) -> None:
        """Reap at least one completion (or wait for the reaper to), lock held on entry and exit."""
        if self._reaping:
            self._cond.wait()
            return
        if self._dispatch_locked():
            return
        if not self.inflight:
            raise InvariantError("waiting for an io_uring completion with nothing in flight")
        self._reaping = True
        self._cond.release()
        try:
            self.ring.wait(1)  # no lock held while the I/O is in progress
        finally:
            self._cond.acquire()
            self._reaping = False
            self._cond.notify_all()  # whoever still waits re-checks, and one of them reaps next
        self._dispatch_locked()

    def _wait_locked(self, pred: Callable[[], bool]) -> None:
        while not pred():
            self._wait_for_one_locked()


@functools.lru_cache(maxsize=1)
def uring_available() -> tuple[bool, str]:
    """Whether this process can use io_uring: ``(True, "")`` or ``(False, reason)``.

    Checks ``TIERSTORE_IO_URING=0`` in the environment (an operator's switch,
    also how CI runs the suite as on a host without io_uring), the architecture
    (x86-64 only, see the module docstring), ``/proc/sys/kernel/io_uring_disabled``
    (Linux >= 6.6, through the setup error), and then sets up a 2-entry ring and
    completes one NOP through it, so a seccomp filter or an old kernel shows here
    rather than at first I/O. Cached for the process.
    """
    if os.environ.get("TIERSTORE_IO_URING", "").strip() == "0":
        return False, "TIERSTORE_IO_URING=0 in the environment"
    ok, why = _arch_supported()
    if not ok:
        return False, why
    try:
        with Ring(2) as ring:
            ring.prep_nop(0x7A)
            got = ring.submit_and_wait(1)
    except IoUringError as exc:
        return False, exc.strerror or str(exc)
    if [(ud, res) for ud, res, _ in got] != [(0x7A, 0)]:
        return False, f"io_uring NOP round trip returned {got!r}, expected one completion (0x7a, 0)"
    return True, ""


#: Columns of :func:`run_fixed_turns`' per-slot state (int64): busy, start_ns, offset, opcode, tag.
SLOT_STATE_COLS = 5
#: Columns of :func:`run_fixed_turns`' completion log (int64), in this order.
TURN_LOG_COLS = ("start_ns", "done_ns", "res", "offset", "opcode", "tag", "slot")


class TurnResult(NamedTuple):
    """What one :func:`run_fixed_turns` call did.

    ``reason``: 0 the offsets are used up or ``return_ns`` passed (I/Os may be in flight); 1 nothing
    in flight and nothing more issued (the deadline passed, or ``drain``); 2 an I/O failed
    (``err_res`` = -errno, at ``err_offset`` with ``err_opcode``; the I/Os then in flight were
    drained, not logged); 3 ``io_uring_enter`` failed (``err_res`` = -errno; I/Os may be in flight).
    ``enters``: the ``io_uring_enter`` calls the call made.
    """

    issued: int
    logged: int
    reason: int
    err_res: int
    err_offset: int
    err_opcode: int
    inflight: int
    enters: int


def native_turn() -> tuple[bool, str]:
    """Whether :func:`run_fixed_turns` can run: ``(True, "")``, or ``(False, why)`` when the C module
    ``tierstore.io._ringloop`` was not built (no C compiler when the package was installed)."""
    return (
        (True, "")
        if _ringloop is not None
        else (False, _RINGLOOP_MISSING or "tierstore.io._ringloop is absent")
    )


def _fixed_turn_layout(ring: Ring, state: Any) -> tuple[int, int, int, int, int, int, int, int, int]:
    """What ``_ringloop.run`` needs of ``ring``'s mmaps: the byte offsets of the SQ/CQ heads, tails,
    index array and CQEs, the two masks (their values) and ``sq_entries``; raises as
    :func:`run_fixed_turns` does for a ring it cannot drive."""
    if _ringloop is None:
        raise IoUringUnavailable(errno.ENOSYS, native_turn()[1])
    if (
        ring.fd < 0
        or ring._sq_index is None
        or ring.sqe_bytes != 64
        or ring.cqe_bytes != 16
        or ring._n_fixed != len(state)
    ):
        raise IoUringError(
            errno.EINVAL, "run_fixed_turns needs an open SQE64/CQE16 ring fixed to len(state) slots"
        )
    if ring.sq_pending():
        raise IoUringError(errno.EINVAL, "run_fixed_turns: SQEs queued from Python; submit them first")
    p = ring.params
    return (
        p.sq_head,
        p.sq_tail,
        ring._sq_mask,
        p.sq_array,
        p.cq_head,
        p.cq_tail,
        ring._cq_mask,
        p.cq_cqes,
        p.sq_entries,
    )


def run_fixed_turns(
    ring: Ring,
    state: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    opcodes: npt.NDArray[np.uint8] | None,
    tags: npt.NDArray[np.int64] | None,
    log: npt.NDArray[np.int64],
    *,
    deadline_ns: int,
    return_ns: int,
    wait_nr: int,
    drain: bool,
) -> TurnResult:
    """Drive a ring fixed to slots (:meth:`Ring.fix_rw_slots`) in C, without the GIL, turn after turn.

    Each turn queues an I/O in every free slot (in the order of ``offsets``), makes one
    ``io_uring_enter(2)`` that submits them and waits for ``wait_nr`` completions (fewer when fewer
    are in flight), reads the clock once and logs every completion posted: the turn of ``tierstore
    bench``'s Python loop (``tierstore.bench.iojobs._ring_clone``), with its clat (from before the
    submitting enter to after the reaping one). Source: ``tierstore/io/_ringloop.c``.

    Parameters
    ----------
    ring : Ring
        Fixed to ``depth`` slots, SQE64/CQE16, nothing queued by Python.
    state : numpy.ndarray, int64, shape (depth, 5)
        Per slot: busy, start_ns, offset, opcode, tag (:data:`SLOT_STATE_COLS`); zeros at first, then
        kept by the caller between calls (I/Os stay in flight across calls).
    offsets : numpy.ndarray, int64, shape (n,)
        File offsets in bytes, issued in this order.
    opcodes : numpy.ndarray of uint8, shape (n,), or None
        ``IORING_OP_READ``/``WRITE`` per I/O; ``None`` keeps each SQE's opcode.
    tags : numpy.ndarray of int64, shape (n,), or None
        Carried to the log with each I/O (a placement ID); ``None``: 0.
    log : numpy.ndarray, int64, shape (>= n + depth, 7)
        Filled with one row per completed I/O (:data:`TURN_LOG_COLS`), in completion order.
    deadline_ns : int
        ``time.perf_counter_ns`` value at and after which nothing is issued (0: none).
    return_ns : int
        Return after the first turn that ends at or after it, I/Os still in flight (0: none).
    wait_nr : int
        Completions each enter waits for (>= 1).
    drain : bool
        Issue nothing; wait for every I/O in flight.

    Returns
    -------
    TurnResult
        How many of ``offsets`` were issued, how many rows of ``log`` were filled, and why it returned.

    Raises
    ------
    IoUringUnavailable
        ``tierstore.io._ringloop`` was not built (:func:`native_turn` says why).
    IoUringError
        EINVAL: the ring is not fixed to slots, or has 128-byte SQEs / 32-byte CQEs.
    ValueError, TypeError
        Arrays of the wrong sizes, or not writable where written.
    """
    layout = _fixed_turn_layout(ring, state)
    try:
        mmaps = (ring._sq, ring._cq, ring._sqes, ring.fd, layout)
        got = TurnResult(
            *_ringloop.run(*mmaps, state, offsets, opcodes, tags, log, deadline_ns, return_ns, wait_nr, drain)
        )
    finally:
        ring._tail = ring._ktail.value  # C advanced the SQ tail
    return got
