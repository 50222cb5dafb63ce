"""A device that accounts for writes and keeps no data: :class:`NullEngine`.

For experiments whose question is *where bytes would go*, not what they are:
replaying a trace at a real block size (Llama-3.1-8B: 64 MiB per 512-token
block) onto the FTL model, or indexing ten million blocks to measure metadata
memory, on a machine without that much disk or RAM. Every write, trim and
sync succeeds and is counted (and observed, so an FTL model attached with
:meth:`~tierstore.io.engine.IOEngine.add_observer` sees the same write stream
a real device would); nothing is stored.

Reads fail with ``EIO`` unless they cover only bytes that were never written
(those read back as zeros, as deallocated LBAs do with DLFEAT=1): a store on
this engine therefore reports ``IO_ERROR`` for a block's payload, never wrong
bytes. Recovery finds no extents (a fresh device each time).
"""

from __future__ import annotations

import errno

from .engine import DEFAULT_BLOCK_SIZE_BYTES, IOEngine, IOFuture


class NullEngine(IOEngine):
    """A ``size_bytes`` device that keeps nothing.

    Parameters
    ----------
    size_bytes : int
        Device size in bytes (multiple of ``block_size_bytes``).
    block_size_bytes : int
        Alignment unit (4096).
    """

    kind = "null"

    def __init__(self, size_bytes: int, block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES):
        super().__init__(size_bytes, block_size_bytes)
        self._written_any = False

    def _read_impl(self, offset, view, nbytes):
        if self._written_any:
            return IOFuture.failed(OSError(errno.EIO, "null engine keeps no data"))
        view[:nbytes] = bytes(nbytes)
        return IOFuture.completed(nbytes)

    def _write_impl(self, offset, view, nbytes, placement):
        self._written_any = True
        return IOFuture.completed(nbytes)

    def _trim_impl(self, offset, length):
        return IOFuture.completed(length)

    def _sync_impl(self):
        return None

    def _close_impl(self):
        return None
