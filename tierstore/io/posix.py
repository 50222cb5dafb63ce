"""POSIX backend: ``os.preadv``/``os.pwritev`` on an O_DIRECT file descriptor,
with a thread pool providing queue depth (fio ``ioengine=psync`` x ``numjobs``).

A request larger than ``max_io_bytes`` is split into pieces issued in parallel
by ``iodepth`` worker threads (the GIL is released inside preadv/pwritev).
"""
from __future__ import annotations

import concurrent.futures as cf
import os

from .engine import (DEFAULT_BLOCK_SIZE_BYTES, DEFAULT_MAX_IO_BYTES, CompositeFuture, IOEngine,
                     IOFuture, ShortIOError)
from ._fileops import check_queue_args, open_direct, preallocate, punch_hole


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    r = os.preadv(fd, [view], offset)
    if r != view.nbytes:
        raise ShortIOError("read", r, view.nbytes)
    return r


def _pwrite_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    n = view.nbytes
    while done < n:
        r = os.pwritev(fd, [view[done:]], offset + done)
        if r <= 0:
            raise ShortIOError("write", done, n)
        done += r
        if done < n and done % 4096:
            # O_DIRECT cannot continue from an unaligned point; report short.
            raise ShortIOError("write", done, n)
    return done


class PosixEngine(IOEngine):
    """O_DIRECT file or block device through preadv/pwritev + a thread pool.

    Parameters
    ----------
    path : str
        Regular file (created sparse, grown to ``size_bytes``) or block device.
    size_bytes : int
        Usable bytes, multiple of ``block_size_bytes``.
    iodepth : int
        Worker threads = maximum I/Os in flight (fio ``iodepth``).
    max_io_bytes : int
        Largest single syscall; larger requests are split (multiple of block size).
    block_size_bytes : int
        O_DIRECT alignment unit (open(2)).

    Raises
    ------
    OSError
        If the file cannot be opened with O_DIRECT (EINVAL on tmpfs).
    """

    kind = "posix"

    def __init__(self, path: str, size_bytes: int, iodepth: int = 16,
                 max_io_bytes: int = DEFAULT_MAX_IO_BYTES,
                 block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES):
        super().__init__(size_bytes, block_size_bytes)
        check_queue_args(iodepth, max_io_bytes, block_size_bytes)
        self.path = str(path)
        self.iodepth = int(iodepth)
        self.max_io_bytes = int(max_io_bytes)
        self.fd, self.is_block_device = open_direct(self.path, size_bytes)
        self._pool = cf.ThreadPoolExecutor(max_workers=self.iodepth, thread_name_prefix="tierstore-io")

    def _split(self, fn, offset: int, view: memoryview, nbytes: int, what: str) -> IOFuture:
        if nbytes <= self.max_io_bytes:
            f = self._pool.submit(fn, self.fd, view, offset)
            return IOFuture(lambda: f.result(), f.done)
        parts = []
        for a in range(0, nbytes, self.max_io_bytes):
            b = min(a + self.max_io_bytes, nbytes)
            f = self._pool.submit(fn, self.fd, view[a:b], offset + a)
            parts.append(IOFuture(f.result, f.done))
        return CompositeFuture(parts, nbytes, what)

    def _read_impl(self, offset, view, nbytes):
        return self._split(_pread_full, offset, view, nbytes, "read")

    def _write_impl(self, offset, view, nbytes, placement):
        return self._split(_pwrite_full, offset, view, nbytes, "write")

    def _trim_impl(self, offset, length):
        try:
            punch_hole(self.fd, offset, length, self.is_block_device)
        except OSError as exc:
            return IOFuture.failed(exc)
        return IOFuture.completed(length)

    def _preallocate_impl(self, offset, length):
        preallocate(self.fd, offset, length, self.is_block_device)

    def _sync_impl(self):
        os.fdatasync(self.fd)

    def _close_impl(self):
        self._pool.shutdown(wait=True)
        os.close(self.fd)
