"""Fixed-size block pools in memory: the HBM tier (L1) and the host tier (L2).

A pool is one ``uint8`` tensor of shape ``(num_blocks, block_bytes)``; which
slots are free is the block index's business, kept by a :class:`SlotAllocator`
(SGLang's split of "allocator" and "device pool": one owner per resource). The HBM pool lives on ``cuda``
when CUDA is present, otherwise on
the CPU as a stand-in that runs the same code. The host pool is allocated with
``pin_memory=True`` when CUDA is present (so host<->device copies are DMA), and
plain otherwise (``pin_memory=True`` raises without a CUDA driver).

Slots are handed out lowest-first at the start, so tests see deterministic slot ids.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from array import array

import torch

from ..errors import ConfigError, LayoutError


def cuda_available() -> bool:
    """True when torch sees a usable CUDA device."""
    try:
        return torch.cuda.is_available()
    except RuntimeError:
        return False


#: madvise(2) advice ``MADV_POPULATE_WRITE`` (include/uapi/asm-generic/mman-common.h, Linux >= 5.14;
#: Python 3.11's mmap module lacks the constant)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: bytes per madvise call of :meth:`BlockPool.prefault` (as the node segment's prefault)
PREFAULT_CHUNK_BYTES = 8 << 20


def _madvise():
    """libc's ``madvise(void *addr, size_t length, int advice)`` through ctypes, or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class BlockPool:
    """A pool of ``num_blocks`` slots of ``block_bytes`` bytes each.

    Parameters
    ----------
    name : str
        Tier name (``"hbm"`` or ``"host"``), used in messages and metrics.
    num_blocks : int
        Slots in the pool (>= 0).
    block_bytes : int
        Bytes per slot.
    device : str or torch.device
        Where the pool tensor lives.
    pin_memory : bool
        Page-lock a CPU pool (only valid when CUDA is present).

    Attributes
    ----------
    data : torch.Tensor
        Shape ``(num_blocks, block_bytes)``, dtype ``uint8``.
    """

    def __init__(
        self,
        name: str,
        num_blocks: int,
        block_bytes: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if num_blocks < 0 or block_bytes <= 0:
            raise LayoutError(f"{name}: num_blocks={num_blocks}, block_bytes={block_bytes} are invalid")
        self.name = name
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        try:
            self.data = torch.empty(
                (num_blocks, block_bytes),
                dtype=torch.uint8,
                device=self.device,
                pin_memory=pin_memory and self.device.type == "cpu",
            )
        except (RuntimeError, AssertionError) as exc:  # no CUDA driver, or out of memory
            what = "pinned host" if pin_memory and self.device.type == "cpu" else str(self.device)
            raise ConfigError(
                f"{name}: cannot allocate {num_blocks} x {block_bytes} bytes of {what} "
                f"memory: {str(exc).splitlines()[0]}"
            ) from exc

    @classmethod
    def from_tensor(cls, name: str, rows: torch.Tensor) -> BlockPool:
        """A pool over memory that exists already: slot ``s`` is ``rows[s]``; nothing is allocated.

        The node service's host tier is the rows of its shared segment
        (:meth:`tierstore.node.segment.Segment.host_rows`), which engine processes map
        too; the pool aliases that memory, so a copy into a slot is visible to them.

        Parameters
        ----------
        name : str
            Tier name, as for the constructor.
        rows : torch.Tensor
            Shape ``(num_blocks, block_bytes)``, dtype ``uint8``, any device. Each row is
            contiguous (``stride(1) == 1``); rows may be further apart than ``block_bytes``
            (a slot stride rounded up to pages) but never overlap (``stride(0) >=
            block_bytes``). The caller keeps the memory alive as long as the pool.

        Raises
        ------
        LayoutError
            For another dtype or rank, an empty row, non-contiguous rows or overlapping rows.
        """
        if rows.dtype != torch.uint8 or rows.dim() != 2:
            raise LayoutError(
                f"{name}: rows must be a 2-D uint8 tensor, got {tuple(rows.shape)} {rows.dtype}"
            )
        num_blocks, block_bytes = rows.shape
        if block_bytes <= 0:
            raise LayoutError(f"{name}: rows of {block_bytes} bytes are invalid")
        if block_bytes > 1 and rows.stride(1) != 1:
            raise LayoutError(f"{name}: each row must be contiguous, got strides {rows.stride()}")
        if num_blocks > 1 and rows.stride(0) < block_bytes:
            raise LayoutError(f"{name}: rows of {block_bytes} bytes {rows.stride(0)} bytes apart overlap")
        pool = cls.__new__(cls)
        pool.name = name
        pool.block_bytes = int(block_bytes)
        pool.num_blocks = int(num_blocks)
        pool.device = rows.device
        pool.data = rows
        return pool

    def prefault(self, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> bool:
        """Fault in every page of a CPU pool now, so that no put pays for it.

        A ``torch.empty`` pool that is not page-locked gets its pages from the kernel on
        first touch: a first copy into a 2 MiB slot took 1.16 ms where a copy into a
        touched one took 0.14 ms (2-core VM, 2026-12-04, ``bench/README_server.md``).
        ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) allocates the pages without
        changing a byte, so it is safe while slots are in use; the range is rounded out to
        whole pages, which stay in the pool's own mapping.

        Parameters
        ----------
        chunk_bytes : int
            Bytes per ``madvise`` call.

        Returns
        -------
        bool
            ``True`` if the pages were populated; ``False`` for a pool not on the CPU, an
            empty one, or a kernel (or libc) without the advice (then the pages still
            come on first touch, as before).

        Raises
        ------
        OSError
            A kernel refusal other than a missing advice (``ENOMEM``: the memory is not there).
        """
        d = self.data
        n = (d.shape[0] - 1) * d.stride(0) + d.shape[1] if d.numel() else 0  # rows may be apart
        fn = _madvise() if self.device.type == "cpu" and n else None
        if fn is None:
            return False
        page = mmap.PAGESIZE
        lo = self.data.data_ptr() // page * page
        hi = -(-(self.data.data_ptr() + n) // page) * page
        chunk = max(page, chunk_bytes // page * page)
        for start in range(lo, hi, chunk):
            if fn(start, min(chunk, hi - start), MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if start == lo and err in (errno.EINVAL, errno.ENOSYS):
                    return False  # an older kernel: no MADV_POPULATE_WRITE
                raise OSError(err, f"{self.name}: madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        return True

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes: a 1-D ``uint8`` view of ``block_bytes``."""
        return self.data[slot]


class SlotAllocator:
    """Free slots of one memory pool: a stack of indices (4 bytes a slot).

    Parameters
    ----------
    num_slots : int
        Slots of the pool; all free at first, handed out lowest first.
    """

    __slots__ = ("capacity", "_free")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise LayoutError(f"num_slots={num_slots}: must be >= 0")
        self.capacity = int(num_slots)
        self._free = array("i", range(num_slots - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when the pool runs out)."""
        k = min(n, len(self._free))
        if k <= 0:
            return []
        out = self._free[len(self._free) - k :][::-1].tolist()  # the order of k pops
        del self._free[len(self._free) - k :]
        return out

    def give(self, slot: int) -> None:
        """Return a slot."""
        self._free.append(slot)

    @property
    def free(self) -> int:
        """Slots free now."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Slots in use now."""
        return self.capacity - len(self._free)
