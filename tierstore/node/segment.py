"""The node's shared segment: host-tier and staging slots that every engine process maps.

One sealed memfd per pool (issue 24). The service creates it (:meth:`Segment.create`) and hands
its fd to engine processes over ``SCM_RIGHTS`` (:class:`tierstore.node.protocol.FrameSocket`);
each maps it (:meth:`Segment.attach`), so bytes move with no copy beyond the engine's own
gather and scatter. Layout (little-endian)::

    [0, 4096)            header, struct <8sIIQQQ16s: magic b"TSNODE01", version, slot_bytes,
                         host_slots, staging_slots, slot_offset, boot_id
    [4096, slot_offset)  uint64 gen[slots]: bumped by the service each time it hands a slot out
    [slot_offset, end)   slots, slot_bytes apart: host slots [0, H), staging slots [H, H + S)

``slot_offset`` is 2 MiB aligned (a huge page) and ``slot_bytes = round_up(block_bytes, 4096)``.
A slot holds one logical block; the ranks of a tensor/pipeline-parallel engine own columns of it:
rank ``r`` writes bytes ``[off[r], off[r] + shard[r])`` of every slot (:class:`ColumnPool`, the
layout of vLLM's ``SharedOffloadRegion``). A load ticket carries the gens of its slots; a client
re-reads them after its copy and takes a mismatch as a miss (defence against bugs and service
restarts, not against hostile writers).

The memfd is sealed against shrink and grow (a holder cannot truncate it under another's
mapping, which would SIGBUS it) and against further seals; it is mode 0600, so a process of
another user cannot reopen it through ``/proc``. A read-only fd (:meth:`Segment.readonly_fd`)
maps read-only: the kernel refuses ``PROT_WRITE`` on an ``O_RDONLY`` fd (EACCES) and a write
through the mapping faults. A process of the same user (or root) can reopen ``/proc/self/fd/N``
read-write: read-only clients must run as another user for that to be a boundary. A mapping
belongs to the process that made it; a forked child is refused (:class:`SegmentError`) and
attaches its own. Linux only (memfd, seals, ``MADV_POPULATE_*``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..closing import Closing
from ..errors import LayoutError, TierStoreError
from ..tiers.memory import BlockPool

# fcntl(2) file sealing, include/uapi/linux/fcntl.h (F_LINUX_SPECIFIC_BASE = 1024, Linux >= 3.17);
# Python's fcntl has them where its C headers do.
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1024 + 9)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1024 + 10)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
#: seals every segment carries: fixed size, and no seal added or removed later
SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
# madvise(2), include/uapi/asm-generic/mman-common.h (Linux >= 5.14); Python 3.11's mmap lacks them
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# cudaHostRegister flags, CUDA runtime API (driver_types.h): cudaHostRegisterDefault,
# cudaHostRegisterReadOnly (CUDA >= 11.1; needed to register a PROT_READ mapping)
CUDA_HOST_REGISTER_DEFAULT = 0x00
CUDA_HOST_REGISTER_READ_ONLY = 0x08

MAGIC = b"TSNODE01"
VERSION = 1
#: magic, version, slot_bytes, host_slots, staging_slots, slot_offset, boot_id
HEADER = struct.Struct("<8sIIQQQ16s")
PAGE_BYTES = 4096
GEN_OFFSET = PAGE_BYTES
SLOT_ALIGN_BYTES = 2 << 20
#: slot_bytes is a u32 in the header
MAX_SLOT_BYTES = (1 << 32) - PAGE_BYTES
BOOT_ID_BYTES = 16
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # memfd names are <= 249 bytes (MFD_NAME_MAX_LEN)
_PREFAULT_CHUNK_BYTES = 8 << 20

_LIVE: weakref.WeakSet[Segment] = weakref.WeakSet()


def _mark_inherited() -> None:
    for seg in list(_LIVE):
        seg._inherited = True


os.register_at_fork(after_in_child=_mark_inherited)


class SegmentError(TierStoreError):
    """A shared segment cannot be created, attached or used: the kernel refused (the message
    names the call and errno), the fd is not a sealed tierstore segment (wrong magic, version,
    size or seals), another boot's segment, a closed segment, or a mapping inherited across
    ``fork``. Nothing was written."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SegmentHeader:
    """The segment's first page (see the module docstring for the layout).

    Attributes
    ----------
    slot_bytes : int
        Stride of the slot array in bytes: a multiple of 4096, ``<= MAX_SLOT_BYTES``.
    host_slots, staging_slots : int
        Slots of the host tier (``[0, H)``) and staging slots (``[H, H + S)``).
    slot_offset : int
        Byte offset of slot 0: 2 MiB aligned, after the gen array.
    boot_id : bytes
        16 random bytes drawn when the segment was created: a restarted service has another.
    version : int
        Layout version, :data:`VERSION`.
    """

    slot_bytes: int
    host_slots: int
    staging_slots: int
    slot_offset: int
    boot_id: bytes
    version: int = VERSION

    @property
    def slots(self) -> int:
        """Host plus staging slots."""
        return self.host_slots + self.staging_slots

    @property
    def segment_bytes(self) -> int:
        """Size of the memfd: ``slot_offset + slots * slot_bytes``."""
        return self.slot_offset + self.slots * self.slot_bytes

    @classmethod
    def for_blocks(
        cls, block_bytes: int, host_slots: int, staging_slots: int, boot_id: bytes
    ) -> SegmentHeader:
        """The geometry for ``host_slots + staging_slots`` blocks of ``block_bytes`` bytes.

        Raises
        ------
        LayoutError
            For ``block_bytes`` outside ``[1, MAX_SLOT_BYTES]``, negative or no slots, or a
            ``boot_id`` that is not 16 bytes.
        """
        if not 0 < block_bytes <= MAX_SLOT_BYTES:
            raise LayoutError(f"segment: block_bytes={block_bytes} must be in [1, {MAX_SLOT_BYTES}]")
        if host_slots < 0 or staging_slots < 0 or host_slots + staging_slots == 0:
            raise LayoutError(
                f"segment: host_slots={host_slots}, staging_slots={staging_slots}: "
                f"need >= 0 each and at least one slot"
            )
        if len(boot_id) != BOOT_ID_BYTES:
            raise LayoutError(f"segment: boot_id must be {BOOT_ID_BYTES} bytes, got {len(boot_id)}")
        slots = host_slots + staging_slots
        return cls(
            slot_bytes=_round_up(block_bytes, PAGE_BYTES),
            host_slots=host_slots,
            staging_slots=staging_slots,
            slot_offset=_round_up(GEN_OFFSET + 8 * slots, SLOT_ALIGN_BYTES),
            boot_id=bytes(boot_id),
        )

    def pack(self) -> bytes:
        """The header's ``HEADER.size`` bytes."""
        return HEADER.pack(
            MAGIC,
            self.version,
            self.slot_bytes,
            self.host_slots,
            self.staging_slots,
            self.slot_offset,
            self.boot_id,
        )

    @classmethod
    def unpack(cls, raw: bytes, size_bytes: int) -> SegmentHeader:
        """Parse and check the header of a segment of ``size_bytes`` bytes.

        Raises
        ------
        SegmentError
            Wrong magic or version, a geometry that is not this module's (slot stride, gen
            array, alignment), or a size other than the header's ``segment_bytes``.
        """
        if len(raw) < HEADER.size:
            raise SegmentError(f"segment header: {len(raw)} bytes, need {HEADER.size}")
        magic, version, slot_bytes, host, staging, slot_offset, boot_id = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise SegmentError(f"not a tierstore segment: magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise SegmentError(f"segment layout version {version}; this tierstore reads {VERSION}")
        hdr = cls(slot_bytes, host, staging, slot_offset, boot_id, version)
        if (
            slot_bytes == 0
            or slot_bytes % PAGE_BYTES
            or slot_offset % SLOT_ALIGN_BYTES
            or slot_offset < GEN_OFFSET + 8 * hdr.slots
            or hdr.segment_bytes != size_bytes
        ):
            raise SegmentError(
                f"segment header does not match its file: slot_bytes={slot_bytes}, "
                f"slots={host}+{staging}, slot_offset={slot_offset}, "
                f"{hdr.segment_bytes} bytes expected, the file has {size_bytes}"
            )
        return hdr


class Segment(Closing):
    """One process's mapping of a pool's shared segment.

    Made by :meth:`create` (the service: owns the memfd, writes the header, bumps gens) or
    :meth:`attach` (an engine process, from a handed-over fd). Slots are views of the mapping:
    :meth:`rows`, :meth:`host_rows` (for :meth:`BlockPool.from_tensor
    <tierstore.tiers.memory.BlockPool.from_tensor>`) and :meth:`column` (one rank's share).

    Attributes
    ----------
    header : SegmentHeader
        Geometry and boot id.
    block_bytes : int
        Bytes of a logical block (``<= header.slot_bytes``).
    owner : bool
        True in the process that created the memfd.
    writable : bool
        Whether this mapping is ``PROT_WRITE`` (False for a read-only fd).
    fd : int or None
        The memfd (owner only; an attached process closes its fd once mapped).
    pid : int
        The process that made the mapping.
    hugepages : bool
        Whether ``MADV_HUGEPAGE`` was accepted (effective only where
        ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it).
    """

    def __init__(
        self,
        mm: mmap.mmap,
        header: SegmentHeader,
        *,
        fd: int | None,
        owner: bool,
        writable: bool,
        block_bytes: int,
    ) -> None:
        self._mm = mm
        self.header = header
        self.fd = fd
        self.owner = owner
        self.writable = writable
        self.block_bytes = block_bytes
        self.pid = os.getpid()
        self._inherited = False
        self._closed = False
        self._cuda_ptr: int | None = None
        # numpy holds a buffer export on the mmap (torch.frombuffer does not): mmap.close()
        # then refuses while any view lives, so no tensor ever outlives its mapping
        self._np = np.frombuffer(mm, dtype=np.uint8)
        with warnings.catch_warnings():  # a read-only mapping: torch cannot mark tensors read-only
            warnings.filterwarnings(
                "ignore", message="The given NumPy array is not writable", category=UserWarning
            )
            self._bytes = torch.from_numpy(self._np)
        self._gens = np.frombuffer(mm, dtype="<u8", count=header.slots, offset=GEN_OFFSET)
        if not owner:
            self._gens.flags.writeable = False
        self.hugepages = False
        _LIVE.add(self)

    # -- making one -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        block_bytes: int,
        host_slots: int,
        staging_slots: int = 0,
        *,
        boot_id: bytes | None = None,
    ) -> Segment:
        """Create, size, seal and map a new segment (the service side).

        Parameters
        ----------
        name : str
            The pool's name (``[A-Za-z0-9._-]``, 1-200 characters); the memfd is
            ``tierstore-<name>`` in ``/proc/<pid>/fd``.
        block_bytes : int
            Bytes of one logical block (all ranks' shards); the slot stride rounds it up to 4096.
        host_slots, staging_slots : int
            Slots of the host tier and of staging (NVMe-bound or NVMe-read blocks without a
            host slot).
        boot_id : bytes, optional
            16 bytes; random by default.

        Raises
        ------
        LayoutError
            For a bad geometry (:meth:`SegmentHeader.for_blocks`).
        SegmentError
            For a bad name, or when the kernel refuses (no memfd, ENOMEM, EMFILE).
        """
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise SegmentError(f"segment name {name!r}: use 1-200 of A-Z a-z 0-9 . _ -")
        hdr = SegmentHeader.for_blocks(
            block_bytes,
            host_slots,
            staging_slots,
            secrets.token_bytes(BOOT_ID_BYTES) if boot_id is None else boot_id,
        )
        memfd_create = getattr(os, "memfd_create", None)
        if memfd_create is None:
            raise SegmentError("the shared segment needs Linux memfd_create (os.memfd_create)")
        try:
            fd = memfd_create(f"tierstore-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise SegmentError(f"memfd_create for segment {name!r}: {e}") from e
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, hdr.segment_bytes)
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, hdr.segment_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise SegmentError(f"segment {name!r} of {hdr.segment_bytes} bytes: {e}") from e
        mm[: HEADER.size] = hdr.pack()
        seg = cls(mm, hdr, fd=fd, owner=True, writable=True, block_bytes=block_bytes)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            seg.hugepages = True
        except OSError:  # THP for shmem compiled out or refused: 4 KiB pages, nothing else changes
            seg.hugepages = False
        return seg

    @classmethod
    def attach(cls, fd: int, *, block_bytes: int | None = None, boot_id: bytes | None = None) -> Segment:
        """Map a segment from an fd handed over by its owner (the engine side).

        Takes ownership of ``fd``: it is closed before this returns, mapped or not (the mapping
        keeps the memory). An ``O_RDONLY`` fd maps ``PROT_READ`` only.

        Parameters
        ----------
        fd : int
            The memfd received over ``SCM_RIGHTS``.
        block_bytes : int, optional
            Bytes of a logical block, from the service's ``Welcome`` (default: the slot stride).
        boot_id : bytes, optional
            The ``Welcome``'s boot id: the segment must be that boot's.

        Raises
        ------
        SegmentError
            When ``fd`` is not a regular file, lacks the shrink and grow seals (a holder could
            truncate it under this mapping: SIGBUS), cannot be mapped, has a bad header, or
            belongs to another boot; or ``block_bytes`` exceeds the slot stride.
        """
        try:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SegmentError(f"fd {fd} is not a memfd segment (mode {oct(st.st_mode)})")
                seals = fcntl.fcntl(fd, F_GET_SEALS)
                mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            except OSError as e:
                raise SegmentError(f"fd {fd} is not a sealed memfd segment: {e}") from e
            need = F_SEAL_SHRINK | F_SEAL_GROW
            if seals & need != need:
                raise SegmentError(
                    f"segment fd {fd} is not sealed against shrink and grow (seals "
                    f"{seals:#x}): another holder could truncate it under this mapping"
                )
            if st.st_size < PAGE_BYTES:
                raise SegmentError(f"segment fd {fd}: {st.st_size} bytes, smaller than its header page")
            writable = mode == os.O_RDWR
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            try:
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
            except OSError as e:
                raise SegmentError(f"cannot map segment fd {fd} ({st.st_size} bytes): {e}") from e
        finally:
            os.close(fd)
        try:
            hdr = SegmentHeader.unpack(mm[: HEADER.size], st.st_size)
            if boot_id is not None and hdr.boot_id != boot_id:
                raise SegmentError(
                    f"segment of boot {hdr.boot_id.hex()}, expected {bytes(boot_id).hex()}: "
                    f"the service restarted; connect again"
                )
            bb = hdr.slot_bytes if block_bytes is None else int(block_bytes)
            if not 0 < bb <= hdr.slot_bytes:
                raise SegmentError(f"block_bytes={bb} does not fit the segment's {hdr.slot_bytes}-byte slots")
        except SegmentError:
            mm.close()
            raise
        return cls(mm, hdr, fd=None, owner=False, writable=writable, block_bytes=bb)

    # -- what it holds ----------------------------------------------------------------------

    @property
    def size_bytes(self) -> int:
        """Bytes mapped (the memfd's size)."""
        return self.header.segment_bytes

    def _check(self) -> None:
        if self._inherited:
            raise SegmentError(
                f"this mapping of the segment was made by pid {self.pid} and inherited "
                f"across fork by pid {os.getpid()}: attach the segment in this process"
            )
        if self._closed:
            raise SegmentError("the segment is closed")

    def _check_coarse(self) -> None:
        if self.pid != os.getpid():  # a fork Python's at-fork hook did not see
            self._inherited = True
        self._check()

    def rows(self) -> torch.Tensor:
        """Every slot, host and staging: shape ``(slots, slot_bytes)``, ``uint8``, a view of the
        mapping (slot ``s`` at byte ``slot_offset + s * slot_bytes``).

        Raises
        ------
        SegmentError
            On a closed segment or in a forked child.
        """
        self._check_coarse()
        h = self.header
        return self._bytes[h.slot_offset : h.segment_bytes].view(h.slots, h.slot_bytes)

    def host_rows(self) -> torch.Tensor:
        """The host tier's slots for :meth:`BlockPool.from_tensor
        <tierstore.tiers.memory.BlockPool.from_tensor>`: shape ``(host_slots, block_bytes)``,
        ``uint8``, strides ``(slot_bytes, 1)``.

        Raises
        ------
        SegmentError
            On a closed segment or in a forked child.
        """
        return self.rows()[: self.header.host_slots, : self.block_bytes]

    def column(self, offset_bytes: int, shard_bytes: int, name: str = "host") -> ColumnPool:
        """One rank's share of every slot (see :class:`ColumnPool`).

        Raises
        ------
        LayoutError
            When ``[offset_bytes, offset_bytes + shard_bytes)`` is empty or leaves the block.
        SegmentError
            On a closed segment or in a forked child.
        """
        return ColumnPool(self, offset_bytes, shard_bytes, name)

    def gens_of(self, slots: np.ndarray | Sequence[int]) -> np.ndarray:
        """A copy of the generations of ``slots``: ``uint64``, one per slot.

        Raises
        ------
        IndexError
            For a slot outside ``[0, header.slots)``.
        SegmentError
            On a closed segment or in a forked child.
        """
        self._check()
        return self._gens[np.asarray(slots, dtype=np.int64)].copy()

    def bump_gens(self, slots: np.ndarray | Sequence[int]) -> np.ndarray:
        """Advance the generation of each of ``slots`` (the owner, when it hands slots out);
        returns their new generations (``uint64``).

        Raises
        ------
        SegmentError
            In a process that did not create the segment, on a closed one or after fork.
        """
        self._check()
        if not self.owner:
            raise SegmentError("only the segment's owner (the service) bumps slot generations")
        ix = np.asarray(slots, dtype=np.int64)
        np.add.at(self._gens, ix, np.uint64(1))
        return self._gens[ix].copy()

    def readonly_fd(self) -> int:
        """A new ``O_RDONLY | O_CLOEXEC`` fd of the memfd, for a client that may only read.

        The caller owns (hands over, then closes) it. Mapping it writable fails with EACCES.

        Raises
        ------
        SegmentError
            In a process that does not own the memfd, or when ``/proc/self/fd`` cannot be opened.
        """
        self._check_coarse()
        if self.fd is None:
            raise SegmentError("only the segment's owner holds its memfd")
        try:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentError(f"cannot reopen the segment read-only: {e}") from e

    # -- pre-faulting and CUDA --------------------------------------------------------------

    def prefault(self, method: str = "auto", chunk_bytes: int = _PREFAULT_CHUNK_BYTES) -> str:
        """Fault in every page of the mapping now, so no first copy pays for it.

        The service runs this once after :meth:`create` (a background thread may, in chunks of
        ``chunk_bytes``: each chunk is one ``madvise`` call). ``"madvise"`` asks the kernel
        (``MADV_POPULATE_WRITE``, or ``_READ`` on a read-only mapping; Linux >= 5.14);
        ``"touch"`` reads one byte of every page (a shmem read fault allocates the page and
        never changes its bytes, so it is safe while clients write); ``"auto"`` tries madvise
        and falls back to touching when the kernel lacks the advice (EINVAL).

        Returns
        -------
        str
            The method used: ``"madvise"`` or ``"touch"``.

        Raises
        ------
        SegmentError
            For an unknown method, a kernel refusal other than a missing advice (ENOMEM:
            the memory is not there), a closed segment, or in a forked child.
        """
        self._check_coarse()
        if method not in ("auto", "madvise", "touch"):
            raise SegmentError(f"prefault method {method!r}: use auto, madvise or touch")
        chunk = max(PAGE_BYTES, _round_up(chunk_bytes, PAGE_BYTES))
        size = self.size_bytes
        if method in ("auto", "madvise"):
            advice = MADV_POPULATE_WRITE if self.writable else MADV_POPULATE_READ
            for start in range(0, size, chunk):
                try:
                    self._mm.madvise(advice, start, min(chunk, size - start))
                except OSError as e:
                    if method == "auto" and start == 0 and e.errno == errno.EINVAL:
                        break  # an older kernel: no MADV_POPULATE_*
                    raise SegmentError(
                        f"madvise(MADV_POPULATE) of segment bytes [{start}, {start + chunk}): {e}"
                    ) from e
            else:
                return "madvise"
        for start in range(0, size, chunk):
            int(self._np[start : start + chunk : PAGE_BYTES].max())
        return "touch"

    def register_cuda(self) -> None:
        """Page-lock the whole mapping for CUDA DMA (``cudaHostRegister``; the ``gpu`` path).

        Host↔device copies of slot views then run as DMA from the registered pages, as from
        ``pin_memory`` tensors. A read-only mapping is registered with
        ``cudaHostRegisterReadOnly``. Undone by :meth:`unregister_cuda` or :meth:`close`.
        Idempotent.

        Raises
        ------
        SegmentError
            Without a CUDA device, or when the CUDA runtime refuses (the message carries
            ``cudaGetErrorString``); on a closed segment or in a forked child.
        """
        self._check_coarse()
        if self._cuda_ptr is not None:
            return
        if not torch.cuda.is_available():
            raise SegmentError("registering the segment with CUDA needs a CUDA device")
        cudart = torch.cuda.cudart()
        ptr = self._bytes.data_ptr()
        flags = CUDA_HOST_REGISTER_DEFAULT if self.writable else CUDA_HOST_REGISTER_READ_ONLY
        try:
            torch.cuda.check_error(int(cudart.cudaHostRegister(ptr, self.size_bytes, flags)))
        except RuntimeError as e:  # torch.cuda.CudaError
            raise SegmentError(f"cudaHostRegister of the segment ({self.size_bytes} bytes): {e}") from e
        self._cuda_ptr = ptr

    def unregister_cuda(self) -> None:
        """Undo :meth:`register_cuda` (``cudaHostUnregister``); nothing when not registered.

        Raises
        ------
        SegmentError
            When the CUDA runtime refuses.
        """
        if self._cuda_ptr is None or self._inherited:
            return
        ptr, self._cuda_ptr = self._cuda_ptr, None
        try:
            torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(ptr)))
        except RuntimeError as e:
            raise SegmentError(f"cudaHostUnregister of the segment: {e}") from e

    @property
    def cuda_registered(self) -> bool:
        """Whether :meth:`register_cuda` is in effect."""
        return self._cuda_ptr is not None

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister from CUDA, drop this object's views and unmap; the owner closes the memfd.

        Views handed out (:meth:`rows`, :class:`ColumnPool` tensors, pools over
        :meth:`host_rows`) keep the mapping alive until they go (the memory is never unmapped
        under a live view), but calls on them raise :class:`SegmentError` from now on.
        Idempotent. In a forked child it only forgets the inherited mapping (CUDA state and the
        memfd belong to the parent).
        """
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if not self._inherited:
            self.unregister_cuda()
        self._bytes = self._gens = self._np = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:  # views still exported: they hold the mmap, unmapped with the last one
            del mm
        if self.fd is not None and not self._inherited:
            os.close(self.fd)
        self.fd = None


class ColumnPool(BlockPool):
    """Rank ``r``'s column of a segment: a :class:`~tierstore.tiers.memory.BlockPool` whose slot
    ``s`` is bytes ``[offset_bytes, offset_bytes + shard_bytes)`` of segment slot ``s``.

    Slots are numbered over the whole segment (host and staging), as tickets number them. The
    pool allocates nothing; ``data`` and :meth:`view` check that the segment is open and not
    inherited across fork. A column of a read-only mapping has ``writable=False``: writing to it
    faults (SIGSEGV), so callers gather into writable columns only.

    Parameters
    ----------
    segment : Segment
        The mapping.
    offset_bytes : int
        First byte of this rank's shard within a slot (the prefix sum of lower ranks' shards,
        :func:`column_offsets`).
    shard_bytes : int
        Bytes of this rank's shard.
    name : str
        Tier name for messages and metrics.

    Attributes
    ----------
    data : torch.Tensor
        Shape ``(slots, shard_bytes)``, ``uint8``, strides ``(slot_bytes, 1)``: a view of the
        mapping.

    Raises
    ------
    LayoutError
        When the shard is empty or leaves the slot.
    SegmentError
        On a closed segment or in a forked child.
    """

    def __init__(self, segment: Segment, offset_bytes: int, shard_bytes: int, name: str = "host") -> None:
        slot_bytes = segment.header.slot_bytes
        if offset_bytes < 0 or shard_bytes <= 0 or offset_bytes + shard_bytes > segment.block_bytes:
            raise LayoutError(
                f"{name}: column [{offset_bytes}, {offset_bytes + shard_bytes}) does not fit "
                f"a {segment.block_bytes}-byte block ({slot_bytes}-byte slots)"
            )
        self.segment = segment
        self.offset_bytes = int(offset_bytes)
        self.name = name
        self.block_bytes = int(shard_bytes)
        self.num_blocks = segment.header.slots
        self.device = torch.device("cpu")
        self.writable = segment.writable
        self._rows = segment.rows()[:, offset_bytes : offset_bytes + shard_bytes]

    @property
    def data(self) -> torch.Tensor:
        """Every slot's shard (see the class docstring)."""
        self.segment._check()
        return self._rows

    def view(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s shard: a 1-D ``uint8`` view of ``shard_bytes``."""
        self.segment._check()
        return self._rows[slot]


def column_offsets(shard_bytes: Sequence[int]) -> list[int]:
    """Where each rank's shard starts within a slot: prefix sums of ``shard_bytes`` (ranks in
    ``(pp_rank, tp_rank)`` order, as the leader's shard table lists them).

    Raises
    ------
    LayoutError
        For an empty list or a shard of ``<= 0`` bytes.
    """
    if not len(shard_bytes):
        raise LayoutError("column_offsets: no ranks")
    out, at = [], 0
    for r, b in enumerate(shard_bytes):
        if int(b) <= 0:
            raise LayoutError(f"column_offsets: rank {r} has a shard of {b} bytes")
        out.append(at)
        at += int(b)
    return out
