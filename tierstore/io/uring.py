"""io_uring backend: ``IORING_OP_READV``/``WRITEV`` on the O_DIRECT fd, through
tierstore's own ctypes ring (:mod:`tierstore.io.ring`; no native library).

Each request is split into pieces of at most ``max_io_bytes``; each piece is
one READV/WRITEV SQE whose single ``struct iovec`` points straight into the
caller's aligned buffer (no copy: O_DIRECT needs the aligned memory itself),
with at most ``iodepth`` SQEs in flight. All pieces of a request are published
with one ``io_uring_enter`` when the ring has room.

Completions are reaped on demand (``IOFuture.get``/``done``): no background
thread competes for the GIL, and a waiting thread blocks in the kernel without
holding any lock (:class:`~tierstore.io.ring.RingQueue`). Sources: io_uring(7),
io_uring_prep_readv(3).

Availability: :func:`tierstore.io.ring.uring_available` is checked first; where
io_uring cannot be used (not x86-64, ``kernel.io_uring_disabled``, seccomp, a
kernel < 5.1) the constructor raises :class:`~tierstore.io.ring.IoUringUnavailable`
and ``open_engine("auto", ...)`` uses posix instead.
"""

from __future__ import annotations

import errno
import os

from .engine import IOFuture, ShortIOError, buffer_address
from .file import FileEngine
from .ring import IoUringUnavailable, Ring, RingQueue, uring_available


class _Op:
    """One request: its pieces' completions are counted here (under the queue's lock)."""

    __slots__ = ("pending", "got", "want", "error", "what", "view")

    def __init__(self, pieces: int, want: int, what: str, view: memoryview):
        self.pending = pieces
        self.got = 0
        self.want = want
        self.error: OSError | None = None
        self.what = what
        self.view: memoryview | None = view  # keeps the caller's buffer alive until every piece completes

    def piece_done(self, res: int, want: int, _big: bytes) -> None:
        if res < 0:
            if self.error is None:
                self.error = OSError(-res, f"io_uring {self.what}: {os.strerror(-res)}")
        else:
            self.got += res
        self.pending -= 1
        if not self.pending:
            self.view = None
            if self.error is None and self.got != self.want:  # a piece came back short (EOF)
                self.error = ShortIOError(self.what, self.got, self.want)

    def is_done(self) -> bool:
        return self.pending == 0


class UringEngine(FileEngine):
    """O_DIRECT file or block device through io_uring readv/writev.

    Parameters are those of :class:`tierstore.io.file.FileEngine`; ``iodepth``
    bounds SQEs in flight (the ring has ``iodepth`` SQ entries rounded up to a
    power of two, and twice that many CQ entries, so the CQ cannot overflow).

    Raises
    ------
    IoUringUnavailable
        io_uring cannot be used in this process (the reason is in the message);
        raised before the file is opened.
    IoUringError
        Setting up the ring failed otherwise (ENOMEM); the file is closed again.
    OSError
        As :class:`~tierstore.io.file.FileEngine` (O_DIRECT open, lock).
    """

    kind = "uring"

    def __init__(self, *args, **kwargs):
        ok, why = uring_available()
        if not ok:
            raise IoUringUnavailable(
                errno.ENOTSUP,
                f"ioengine=uring: {why}; use ioengine=posix (or auto, which falls back to posix)",
            )
        super().__init__(*args, **kwargs)

    def _start(self):
        self._queue = RingQueue(Ring(self.iodepth), self.iodepth)

    def _stop(self):
        self._queue.close()

    def _submit(self, write: bool, offset: int, view: memoryview, nbytes: int, what: str) -> IOFuture:
        addr = buffer_address(view)
        pieces = self._pieces(nbytes)
        op = _Op(len(pieces), nbytes, what, view)
        q = self._queue
        q.submit_rw(write, self.fd, [(addr + a, b - a, offset + a) for a, b in pieces], op.piece_done)

        def wait() -> int:
            if op.pending:
                q.wait_until(op.is_done)
            if op.error is not None:
                raise op.error
            return op.got

        def poll() -> bool:
            if op.pending:
                q.poll()
            return op.pending == 0

        return IOFuture(wait, poll)

    def _read_impl(self, offset, view, nbytes):
        return self._submit(False, offset, view, nbytes, "read")

    def _write_impl(self, offset, view, nbytes, placement):
        return self._submit(True, offset, view, nbytes, "write")
