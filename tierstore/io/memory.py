"""Memory-backed device for tests: same alignment rules, instant completion,
trim zero-fills (as a punched hole or a deallocated NVMe LBA range reads back
zeros with DLFEAT=1), and fault injection for EIO/ENOSPC tests."""

from __future__ import annotations

import errno
import threading

from .engine import DEFAULT_BLOCK_SIZE_BYTES, IOEngine, IOFuture, alloc_aligned


class MemoryEngine(IOEngine):
    """A ``size_bytes`` device in anonymous page-aligned memory.

    Attributes
    ----------
    read_errors : list of (offset, length)
        Byte ranges whose reads fail with EIO (fault injection).
    write_limit_bytes : int or None
        Writes reaching past this device offset fail with ENOSPC.
    """

    kind = "memory"

    def __init__(self, size_bytes: int, block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES):
        super().__init__(size_bytes, block_size_bytes)
        self._keep, self._mem = alloc_aligned(size_bytes)
        self._mv = memoryview(self._keep)
        self._lock = threading.Lock()
        self.read_errors: list[tuple[int, int]] = []
        self.write_limit_bytes: int | None = None

    def _read_impl(self, offset, view, nbytes):
        for a, n in self.read_errors:
            if a < offset + nbytes and offset < a + n:
                return IOFuture.failed(OSError(errno.EIO, "injected read error"))
        with self._lock:
            view[:] = self._mv[offset : offset + nbytes]
        return IOFuture.completed(nbytes)

    def _write_impl(self, offset, view, nbytes, placement):
        if self.write_limit_bytes is not None and offset + nbytes > self.write_limit_bytes:
            return IOFuture.failed(OSError(errno.ENOSPC, "injected: no space left on device"))
        with self._lock:
            self._mv[offset : offset + nbytes] = view
        return IOFuture.completed(nbytes)

    def _trim_impl(self, offset, length):
        with self._lock:
            self._mem[offset : offset + length].zero_()
        return IOFuture.completed(length)

    def _sync_impl(self):
        return None

    def raw(self) -> memoryview:
        """The backing bytes (tests flip bits here)."""
        return self._mv

    def _close_impl(self):
        return None
