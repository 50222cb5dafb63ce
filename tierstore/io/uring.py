"""io_uring backend through the ``liburing`` PyPI package (readv/writev).

Each request is split into pieces of at most ``max_io_bytes`` and submitted as
``IORING_OP_READV``/``IORING_OP_WRITEV`` SQEs (``io_uring_prep_readv/writev``)
with at most ``iodepth`` in flight. The iovecs point straight into the caller's
page-aligned buffer (O_DIRECT needs aligned memory; liburing's ``prep_read``/
``prep_write`` copy into unaligned buffers, which O_DIRECT rejects with EINVAL).

Completions are reaped on demand (``IOFuture.get``/``done``) under one lock,
so no background thread competes for the GIL. Source: io_uring(7),
io_uring_prep_readv(3), liburing 2.x.
"""
from __future__ import annotations

import errno
import itertools
import os
import threading

import liburing as L

from .engine import (DEFAULT_BLOCK_SIZE_BYTES, DEFAULT_MAX_IO_BYTES, IOEngine, IOFuture,
                     ShortIOError)
from ._fileops import check_queue_args, open_direct, preallocate, punch_hole


class _Op:
    __slots__ = ("pending", "got", "want", "error", "what")

    def __init__(self, pieces: int, want: int, what: str):
        self.pending = pieces
        self.got = 0
        self.want = want
        self.error: OSError | None = None
        self.what = what


class UringEngine(IOEngine):
    """O_DIRECT file or block device through io_uring readv/writev.

    Parameters are those of :class:`tierstore.io.posix.PosixEngine`; ``iodepth``
    bounds SQEs in flight (the ring has ``2 * iodepth`` entries).

    Raises
    ------
    OSError
        If O_DIRECT open or ``io_uring_queue_init`` fails (e.g. io_uring disabled).
    """

    kind = "uring"

    def __init__(self, path: str, size_bytes: int, iodepth: int = 16,
                 max_io_bytes: int = DEFAULT_MAX_IO_BYTES,
                 block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES):
        super().__init__(size_bytes, block_size_bytes)
        check_queue_args(iodepth, max_io_bytes, block_size_bytes)
        self.path = str(path)
        self.iodepth = int(iodepth)
        self.max_io_bytes = int(max_io_bytes)
        self.fd, self.is_block_device = open_direct(self.path, size_bytes)
        self._ring = L.Ring()
        try:
            L.io_uring_queue_init(2 * self.iodepth, self._ring)
        except BaseException:
            os.close(self.fd)
            raise
        self._cqe = L.Cqe()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, tuple[_Op, int, object]] = {}  # id -> (op, want, iovec keepalive)

    # -------------------------------------------------------------- internals
    def _reap_one(self, block: bool) -> bool:
        if block:
            L.io_uring_wait_cqe(self._ring, self._cqe)
        else:
            try:
                L.io_uring_peek_cqe(self._ring, self._cqe)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return False
                raise
        c = self._cqe[0]
        if c is None:
            return False
        uid = c.user_data
        try:
            res = c.res
        except OSError as exc:  # the liburing wrapper raises for a negative cqe->res
            res = -(exc.errno or errno.EIO)
        L.io_uring_cqe_seen(self._ring, c)
        op, want, _keep = self._inflight.pop(uid)
        if res < 0:
            op.error = op.error or OSError(-res, f"io_uring {op.what}: {os.strerror(-res)}")
        elif res != want:
            op.error = op.error or ShortIOError(op.what, res, want)
            op.got += res
        else:
            op.got += res
        op.pending -= 1
        return True

    def _submit(self, offset: int, view: memoryview, nbytes: int, what: str) -> IOFuture:
        pieces = [(a, min(a + self.max_io_bytes, nbytes)) for a in range(0, nbytes, self.max_io_bytes)]
        op = _Op(len(pieces), nbytes, what)
        with self._lock:
            for a, b in pieces:
                while len(self._inflight) >= self.iodepth:
                    self._reap_one(block=True)
                sqe = L.io_uring_get_sqe(self._ring)
                while sqe is None:
                    L.io_uring_submit(self._ring)
                    self._reap_one(block=True)
                    sqe = L.io_uring_get_sqe(self._ring)
                iov = L.Iovec([view[a:b]])
                if what == "read":
                    L.io_uring_prep_readv(sqe, self.fd, iov, offset + a)
                else:
                    L.io_uring_prep_writev(sqe, self.fd, iov, offset + a)
                uid = next(self._ids)
                L.io_uring_sqe_set_data64(sqe, uid)
                self._inflight[uid] = (op, b - a, (iov, view))
                L.io_uring_submit(self._ring)

        def wait() -> int:
            with self._lock:
                while op.pending:
                    self._reap_one(block=True)
            if op.error is not None:
                raise op.error
            return op.got

        def poll() -> bool:
            with self._lock:
                while op.pending and self._reap_one(block=False):
                    pass
                return op.pending == 0
        return IOFuture(wait, poll)

    # ---------------------------------------------------------- backend hooks
    def _read_impl(self, offset, view, nbytes):
        return self._submit(offset, view, nbytes, "read")

    def _write_impl(self, offset, view, nbytes, placement):
        return self._submit(offset, view, nbytes, "write")

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
        with self._lock:
            while self._inflight:
                self._reap_one(block=True)
            L.io_uring_queue_exit(self._ring)
        os.close(self.fd)
