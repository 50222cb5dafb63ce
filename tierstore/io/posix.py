"""POSIX backend: ``os.preadv``/``os.pwritev`` on an O_DIRECT file descriptor,
with a thread pool providing queue depth (fio ``ioengine=psync`` x ``numjobs``).

A request larger than ``max_io_bytes`` is split into pieces issued in parallel
by ``iodepth`` worker threads (the GIL is released inside preadv/pwritev).
"""

from __future__ import annotations

import concurrent.futures as cf
import os

from .engine import CompositeFuture, IOFuture, ShortIOError
from .file import FileEngine


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


class PosixEngine(FileEngine):
    """O_DIRECT file or block device through preadv/pwritev + a thread pool.

    Parameters and errors are those of :class:`tierstore.io.file.FileEngine`;
    ``iodepth`` is the number of worker threads (fio ``ioengine=psync`` x ``numjobs``).
    """

    kind = "posix"

    def _start(self):
        self._pool = cf.ThreadPoolExecutor(max_workers=self.iodepth, thread_name_prefix="tierstore-io")

    def _stop(self):
        self._pool.shutdown(wait=True)

    def _split(self, fn, offset: int, view: memoryview, nbytes: int, what: str) -> IOFuture:
        if nbytes <= self.max_io_bytes:
            f = self._pool.submit(fn, self.fd, view, offset)
            return IOFuture(lambda: f.result(), f.done)
        parts = []
        for a, b in self._pieces(nbytes):
            f = self._pool.submit(fn, self.fd, view[a:b], offset + a)
            parts.append(IOFuture(f.result, f.done))
        return CompositeFuture(parts, nbytes, what)

    def _read_impl(self, offset, view, nbytes):
        return self._split(_pread_full, offset, view, nbytes, "read")

    def _write_impl(self, offset, view, nbytes, placement):
        return self._split(_pwrite_full, offset, view, nbytes, "write")
