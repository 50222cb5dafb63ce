"""Opening O_DIRECT files/devices and reclaiming space (punch hole / discard).

Sources: open(2) (O_DIRECT), fallocate(2) (``FALLOC_FL_PUNCH_HOLE`` must be
OR-ed with ``FALLOC_FL_KEEP_SIZE``; values 0x02 and 0x01 from
<linux/falloc.h>), ioctl BLKDISCARD = _IO(0x12, 119) from <linux/fs.h>.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import struct
import time

FALLOC_FL_KEEP_SIZE = 0x01   # <linux/falloc.h>
FALLOC_FL_PUNCH_HOLE = 0x02  # <linux/falloc.h>
BLKDISCARD = 0x1277          # _IO(0x12, 119), <linux/fs.h>
BLKGETSIZE64 = 0x80081272    # _IOR(0x12, 114, size_t), <linux/fs.h>

#: libc as already mapped into the interpreter (``CDLL(None)``, as :mod:`tierstore.io.ring`): no library
#: search (``ctypes.util.find_library`` runs ``ldconfig -p`` in a subprocess) and nothing new loaded
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


def check_queue_args(iodepth: int, max_io_bytes: int, block_size_bytes: int) -> None:
    """Validate a file engine's queue depth and largest I/O.

    Raises
    ------
    ConfigError
        ``iodepth < 1``, or ``max_io_bytes`` not a positive multiple of the block size.
    """
    from ..errors import ConfigError
    if iodepth < 1:
        raise ConfigError(f"iodepth={iodepth}: must be >= 1")
    if max_io_bytes < block_size_bytes or max_io_bytes % block_size_bytes:
        raise ConfigError(f"max_io_bytes={max_io_bytes}: must be a multiple of {block_size_bytes}")


def lock_exclusive(fd: int, path: str, timeout_s: float) -> None:
    """flock(2) ``LOCK_EX`` on the open file description, waiting up to ``timeout_s``.

    Why: one writer per store, and crash safety after kill -9. io_uring requests
    still in flight when a process dies complete *after* it is reaped (the ring
    is torn down asynchronously), but each holds a reference to the open file
    description, and a flock is released only when the last reference goes. So
    a new opener that gets the lock knows no write of a dead predecessor can
    land afterwards on space it is about to reuse.

    Raises
    ------
    OSError
        EWOULDBLOCK if another live process holds the store after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not warned:
                logging.getLogger("tierstore.io").warning(
                    "%s is locked by another process; waiting up to %.0f s", path, timeout_s)
                warned = True
            if time.monotonic() >= deadline:
                raise OSError(errno.EWOULDBLOCK, f"{path}: locked by another process "
                              f"(flock LOCK_EX) for more than {timeout_s} s") from None
            time.sleep(0.01)


def open_direct(path: str, size_bytes: int, create: bool = True,
                lock_timeout_s: float = 30.0) -> tuple[int, bool]:
    """Open ``path`` read-write with O_DIRECT, lock it exclusively, and grow a
    regular file to ``size_bytes``.

    Returns ``(fd, is_block_device)``. The file is sparse (ftruncate), so space
    is allocated on first write and ENOSPC surfaces at write time.

    Raises
    ------
    OSError
        EINVAL if the file system refuses O_DIRECT: never falls back to
        buffered I/O. EWOULDBLOCK if another process holds the store.
    """
    flags = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    fd = os.open(path, flags, 0o644)
    try:
        lock_exclusive(fd, path, lock_timeout_s)
        st = os.fstat(fd)
        is_blk = stat.S_ISBLK(st.st_mode)
        if is_blk:
            buf = fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8)
            dev_size = struct.unpack("<Q", buf)[0]
            if dev_size < size_bytes:
                raise OSError(errno.ENOSPC, f"{path}: device has {dev_size} bytes < {size_bytes}")
        elif st.st_size < size_bytes:
            os.ftruncate(fd, size_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, is_blk


def preallocate(fd: int, offset: int, length: int, is_block_device: bool) -> None:
    """Allocate a byte range of a regular file ahead of writes: fallocate(2)
    mode 0 with ``FALLOC_FL_KEEP_SIZE`` (unwritten extents, reads return zeros).

    O_DIRECT writes into a hole make the file system allocate blocks inside
    the write (on ext4 an io_uring write into a hole cannot be issued
    non-blocking and is punted to a worker); allocating a whole segment (a
    reclaim unit) first takes that out of the write path, and an out-of-space
    condition surfaces here, before any of the segment's data is written.
    Block devices need nothing. A file system without fallocate(2)
    (EOPNOTSUPP) keeps the sparse behaviour.

    Raises
    ------
    OSError
        ENOSPC/EDQUOT/EFBIG (the part allocated before the failure is punched
        back out), or another errno from fallocate(2).
    """
    if is_block_device or length <= 0:
        return
    rc = _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length)
    if rc == 0:
        return
    e = ctypes.get_errno()
    if e in (errno.EOPNOTSUPP, errno.ENOSYS):
        return
    try:
        punch_hole(fd, offset, length, False)
    except OSError:
        pass
    raise OSError(e, f"fallocate offset={offset} length={length}: {os.strerror(e)}")


def punch_hole(fd: int, offset: int, length: int, is_block_device: bool) -> None:
    """Deallocate a byte range: fallocate(PUNCH_HOLE|KEEP_SIZE) or BLKDISCARD.

    Raises ``OSError`` with the kernel's errno.
    """
    if is_block_device:
        fcntl.ioctl(fd, BLKDISCARD, struct.pack("<QQ", offset, length))
        return
    rc = _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fallocate(PUNCH_HOLE) offset={offset} length={length}: {os.strerror(e)}")
