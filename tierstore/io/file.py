"""``FileEngine``: what every O_DIRECT file/block-device backend shares.

Opening (O_DIRECT, exclusive flock, sparse growth to the device size),
trim (punch hole / BLKDISCARD), preallocate (fallocate), sync (fdatasync)
and close live here once (helpers and their sources in :mod:`._fileops`);
a backend subclasses :class:`FileEngine` and implements only its submission
path: ``_start``/``_stop`` for its machinery (a thread pool, a ring) and
``_read_impl``/``_write_impl``. Alignment rules: see :mod:`.engine`.
"""

from __future__ import annotations

import os

from ._fileops import check_queue_args, open_direct, preallocate, punch_hole
from .engine import DEFAULT_BLOCK_SIZE_BYTES, DEFAULT_MAX_IO_BYTES, IOEngine, IOFuture


class FileEngine(IOEngine):
    """An O_DIRECT file or block device; subclasses submit the reads and writes.

    Parameters
    ----------
    path : str
        Regular file (created sparse, grown to ``size_bytes``) or block device.
    size_bytes : int
        Usable bytes, multiple of ``block_size_bytes``.
    iodepth : int
        Maximum I/Os in flight (fio ``iodepth``): posix worker threads, io_uring SQEs.
    max_io_bytes : int
        Largest single I/O; larger requests are split into pieces of this size
        (multiple of ``block_size_bytes``).
    block_size_bytes : int
        O_DIRECT alignment unit (open(2)).

    Raises
    ------
    ConfigError
        Bad ``iodepth``/``max_io_bytes``/sizes.
    OSError
        The file cannot be opened with O_DIRECT (EINVAL on tmpfs; never falls
        back to buffered I/O), a block device is smaller than ``size_bytes``
        (ENOSPC); or the backend's ``_start`` failed (the file is closed again).
    StoreLockedError
        Another store holds the file (:func:`._fileops.lock_exclusive`).
    """

    def __init__(
        self,
        path: str,
        size_bytes: int,
        iodepth: int = 16,
        max_io_bytes: int = DEFAULT_MAX_IO_BYTES,
        block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES,
    ):
        super().__init__(size_bytes, block_size_bytes)
        check_queue_args(iodepth, max_io_bytes, block_size_bytes)
        self.path = str(path)
        self.iodepth = int(iodepth)
        self.max_io_bytes = int(max_io_bytes)
        #: ``created``: this engine created the file; ``grown_from_bytes``: the size of an existing file
        #: it grew (else None). An owner whose tier then fails to open undoes either (``undo_open``).
        self.fd, self.is_block_device, self.created, self.grown_from_bytes = open_direct(
            self.path, size_bytes
        )
        try:
            self._start()
        except BaseException:
            if self.created:  # still locked: nobody else opened it
                os.unlink(self.path)
            os.close(self.fd)
            raise

    # ------------------------------------------------------- backend hooks
    def _start(self) -> None:
        """Set up the submission machinery (``self.fd`` is open)."""

    def _stop(self) -> None:
        """Wait for every I/O in flight and release the machinery (before the fd closes)."""

    # ------------------------------------------------------------- shared
    def _pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` byte ranges of at most ``max_io_bytes`` covering ``nbytes``."""
        m = self.max_io_bytes
        return [(a, min(a + m, nbytes)) for a in range(0, nbytes, m)]

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
        try:
            self._stop()
        finally:
            os.close(self.fd)


def undo_open(engine: object, path: str | None) -> None:
    """Leave ``path`` as it was before ``engine`` opened it, once the engine is closed and the tier
    that opened it failed to: a file the engine created is removed, an existing file it grew (an
    empty file given as the tier) gets its old size back. Other engines (memory, null, an engine
    the caller passed in) have neither mark and are left alone.

    Raises
    ------
    OSError
        The unlink or truncate failed (the caller is already raising the open's error).
    """
    if path is None:
        return
    if getattr(engine, "created", False):
        os.unlink(path)
    elif (grown_from := getattr(engine, "grown_from_bytes", None)) is not None:
        os.truncate(path, grown_from)
