"""Opening O_DIRECT files/devices and reclaiming space (punch hole / discard).

Sources: open(2) (O_DIRECT), fallocate(2) (``FALLOC_FL_PUNCH_HOLE`` must be
OR-ed with ``FALLOC_FL_KEEP_SIZE``; values 0x02 and 0x01 from
<linux/falloc.h>), ioctl BLKDISCARD = _IO(0x12, 119) from <linux/fs.h>.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time

from . import format as fmt

FALLOC_FL_KEEP_SIZE = 0x01  # <linux/falloc.h>
FALLOC_FL_PUNCH_HOLE = 0x02  # <linux/falloc.h>
BLKDISCARD = 0x1277  # _IO(0x12, 119), <linux/fs.h>
BLKGETSIZE64 = 0x80081272  # _IOR(0x12, 114, size_t), <linux/fs.h>

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


def lock_holder_pid(fd: int, proc_locks: str = "/proc/locks") -> int | None:
    """PID of the process holding a flock(2) on the file open as ``fd``, from
    ``/proc/locks`` (proc(5); Linux prints ``major:minor:inode`` of the file,
    major and minor in hex). ``None`` when no holder is listed or the list
    cannot be read; a PID of another PID namespace shows as 0 and is ``None``.
    """
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open(proc_locks, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2147126 0 EOF"; "1: -> FLOCK ..." is a waiter
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                pid = int(parts[4])
            except ValueError:
                return None
            return pid if pid > 0 else None
    return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (a zombie is dead: it holds nothing
    but its exit status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


#: Seconds a held lock whose holder /proc/locks does not list is tried again before it is
#: refused: the holder may be releasing it (a killed process's last reference going).
UNSEEN_HOLDER_RETRY_S = 1.0


def lock_exclusive(fd: int, path: str, timeout_s: float) -> None:
    """flock(2) ``LOCK_EX`` on the open file description; fails at once when a
    live process holds it.

    Why: one writer per store, and crash safety after kill -9. io_uring requests
    still in flight when a process dies complete *after* it is reaped (the ring
    is torn down asynchronously), but each holds a reference to the open file
    description, and a flock is released only when the last reference goes. So
    a new opener that gets the lock knows no write of a dead predecessor can
    land afterwards on space it is about to reuse.

    The holder's PID comes from ``/proc/locks`` (:func:`lock_holder_pid`): a
    live holder (another store, in this process or another) is refused at
    once; a holder that has died (its last writes still landing) is waited
    for, up to ``timeout_s``. A held lock with no holder listed is tried again
    for up to :data:`UNSEEN_HOLDER_RETRY_S` (it is being released) before it is refused.

    Raises
    ------
    StoreLockedError
        Another live process (or store of this process) holds ``path``, the
        holder cannot be identified, or a dead holder's lock outlived ``timeout_s``.
    """
    from ..errors import StoreLockedError

    deadline = time.monotonic() + timeout_s
    #: how long a lock with no visible holder is retried (the race above), at most timeout_s
    unseen_until = time.monotonic() + min(UNSEEN_HOLDER_RETRY_S, timeout_s)
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        pid = lock_holder_pid(fd)
        if pid == os.getpid():
            raise StoreLockedError(
                f"{path}: already open in this process (pid {pid}) by another store; close "
                "it first, or give this store another NVMe path"
            ) from None
        if pid is None and time.monotonic() < unseen_until:
            # no holder listed: the lock went between our try and the read of /proc/locks (a
            # killed holder's last io_uring reference dropping); try again before judging
            time.sleep(0.01)
            continue
        if pid is None:
            raise StoreLockedError(
                f"{path}: in use by another process (flock held; its PID is not visible "
                "here, e.g. another container); stop it, or give this store another NVMe "
                "path"
            ) from None
        if process_alive(pid):
            raise StoreLockedError(
                f"{path}: in use by process {pid} (another tierstore store or daemon holds "
                "its lock); stop it, or give this store another NVMe path"
            ) from None
        if not warned:
            logging.getLogger("tierstore.io").warning(
                "%s: locked by process %d, which has exited; waiting up to %.0f s for its last writes",
                path,
                pid,
                timeout_s,
            )
            warned = True
        if time.monotonic() >= deadline:
            raise StoreLockedError(
                f"{path}: still locked {timeout_s:.0f} s after its holder, process {pid}, exited"
            ) from None
        time.sleep(0.01)


def open_direct(
    path: str, size_bytes: int, create: bool = True, lock_timeout_s: float = 30.0
) -> tuple[int, bool, bool, int | None]:
    """Open ``path`` read-write with O_DIRECT, lock it exclusively, and grow a
    regular file to ``size_bytes``.

    Returns ``(fd, is_block_device, created, grown_from_bytes)``: ``created`` when this call
    created the file; ``grown_from_bytes``, the size of an existing file this call grew (else
    ``None``), so that an owner whose open then fails can give the file its size back. The file is
    sparse (ftruncate), so space is allocated on first write and ENOSPC surfaces at write time.
    A file found empty (or created) gets :data:`.format.UNLABELLED_PAGE` at byte 0, made durable
    before it is grown (:func:`mark_unlabelled`).

    A file this call created is removed again when sizing it fails (a size
    the file system refuses, EFBIG): a failed open leaves nothing behind.

    Raises
    ------
    OSError
        EINVAL if the file system refuses O_DIRECT: never falls back to
        buffered I/O; EFBIG/ENOSPC for a size the file or device cannot have.
    StoreLockedError
        Another process holds the store (:func:`lock_exclusive`).
    """
    flags = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC
    created = False
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            fd = os.open(path, flags)
        except OSError:
            # some file systems (tmpfs before Linux 6.6) create the file, then refuse O_DIRECT
            with contextlib.suppress(OSError):
                if os.stat(path).st_size == 0:
                    os.unlink(path)
            raise
    else:
        fd = os.open(path, flags)
    locked = marked = False
    grown_from = None
    try:
        lock_exclusive(fd, path, lock_timeout_s)
        locked = True
        st = os.fstat(fd)
        is_blk = stat.S_ISBLK(st.st_mode)
        if is_blk:
            buf = fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8)
            dev_size = struct.unpack("<Q", buf)[0]
            if dev_size < size_bytes:
                raise OSError(errno.ENOSPC, f"{path}: device has {dev_size} bytes < {size_bytes}")
        elif st.st_size < size_bytes:
            if st.st_size == 0:
                marked = True  # from here on the file is not as it was found
                mark_unlabelled(fd, direct=True)
            os.ftruncate(fd, size_bytes)
            grown_from = None if created else st.st_size
    except BaseException:
        if marked and not created:  # a user's empty file: empty again
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)
        if created and locked:  # unlocked: another opener may have it by now
            os.unlink(path)
        raise
    return fd, is_blk, created, grown_from


def mark_unlabelled(fd: int, direct: bool) -> None:
    """Write :data:`.format.UNLABELLED_PAGE` at byte 0 of an empty regular file and make it durable
    (fdatasync), before the file is grown: a crash before the tier's label is written then leaves
    a file that says it is tierstore's, not a sparse file like any other (``truncate -s``).

    Parameters
    ----------
    fd : int
        The file, empty, open for writing (``direct``: with O_DIRECT, so the page is written
        from page-aligned memory).

    Raises
    ------
    OSError
        The write or fdatasync failed (ENOSPC, EIO).
    """
    buf = mmap.mmap(-1, fmt.ALIGN_BYTES)  # page-aligned (O_DIRECT)
    try:
        buf.write(fmt.UNLABELLED_PAGE)
        n = os.pwrite(fd, buf if direct else fmt.UNLABELLED_PAGE, 0)
        if n != fmt.ALIGN_BYTES:
            raise OSError(errno.EIO, f"short write of the unlabelled page: {n} of {fmt.ALIGN_BYTES} bytes")
        os.fdatasync(fd)
    finally:
        buf.close()


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
