"""The one device abstraction of the NVMe tier: :class:`IOEngine`.

Modelled on CacheLib Navy's ``Device`` (cachelib/navy/common/Device.h): public,
non-virtual ``read``/``write``/``trim`` check alignment and bounds, count
statistics and then delegate to backend hooks ``_read_impl``/``_write_impl``/
``_trim_impl``. Calls return :class:`IOFuture` objects with ``get()``/``done()``
(the kvikio ``IOFuture`` style); a blocking call is ``engine.write(...).get()``.

Alignment rules (Linux open(2), "O_DIRECT": "the user buffer, the file offset
and the length of the I/O must all be multiples of the logical block size of
the file system"): ``offset``, ``len(buffer)`` and the buffer's address must be
multiples of ``block_size_bytes`` (4096 by default, the page size and the
logical block size of every current NVMe LBA format we target). A misaligned
call raises :class:`~tierstore.errors.AlignmentError` *before* any I/O; there is
never a silent fallback to buffered I/O. Callers pad and align instead
(:mod:`tierstore.io.batch` does it for them).

Observers (``add_observer``) receive ``on_write(offset_bytes, nbytes, placement)``
for every *completed* write and ``on_trim(offset_bytes, nbytes)`` for every
completed trim, in device byte units: the FTL model of :mod:`tierstore.fdp`
attaches there to measure write amplification from the exact LBA stream.
"""

from __future__ import annotations

import errno
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..closing import Closing
from ..errors import AlignmentError, ConfigError, TierStoreError

#: Default logical block size in bytes (Linux open(2) O_DIRECT alignment unit;
#: 4096 = x86-64 page size = common NVMe LBA format).
DEFAULT_BLOCK_SIZE_BYTES = 4096

#: Largest single I/O a backend submits; bigger requests are split into pieces
#: issued concurrently up to ``iodepth`` (fio's ``bs=1M`` default of the bench).
DEFAULT_MAX_IO_BYTES = 1 << 20


class ShortIOError(OSError):
    """A read or write transferred fewer bytes than asked (EIO semantics)."""

    def __init__(self, what: str, got: int, want: int):
        super().__init__(errno.EIO, f"short {what}: {got} of {want} bytes")
        self.got = got
        self.want = want


class IOObserver(Protocol):
    """What :meth:`IOEngine.add_observer` accepts."""

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None: ...

    def on_trim(self, offset_bytes: int, nbytes: int) -> None: ...


class IOFuture:
    """Result of an asynchronous transfer (kvikio ``IOFuture`` style).

    ``get()`` blocks until the transfer ends and returns the bytes moved, or
    raises the ``OSError`` the backend saw (EIO, ENOSPC, a :class:`ShortIOError`).
    ``done()`` polls. Completion callbacks run exactly once, in the thread that
    first observes the completion.
    """

    __slots__ = ("_wait", "_poll", "_lock", "_resolved", "_result", "_exc", "_callbacks")

    def __init__(self, wait: Callable[[], int], poll: Callable[[], bool] | None = None):
        self._wait = wait
        self._poll = poll
        self._lock = threading.Lock()
        self._resolved = False
        self._result = 0
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[bool], None]] = []

    @classmethod
    def completed(cls, nbytes: int) -> IOFuture:
        """A future that is already done with ``nbytes``."""
        return cls(lambda: nbytes, lambda: True)

    @classmethod
    def failed(cls, exc: BaseException) -> IOFuture:
        """A future that is already done with an error."""

        def _raise() -> int:
            raise exc

        return cls(_raise, lambda: True)

    def add_done_callback(self, fn: Callable[[bool], None]) -> None:
        """Run ``fn(ok)`` once the transfer resolves (immediately if it has)."""
        with self._lock:
            if not self._resolved:
                self._callbacks.append(fn)
                return
            ok = self._exc is None
        fn(ok)

    def _resolve(self) -> None:
        with self._lock:
            if self._resolved:
                return
            try:
                self._result = self._wait()
            except OSError as exc:
                self._exc = exc
            self._resolved = True
            callbacks, self._callbacks = self._callbacks, []
            ok = self._exc is None
        for fn in callbacks:
            fn(ok)

    def get(self) -> int:
        """Block until done; return bytes transferred.

        Raises
        ------
        OSError
            The backend's error (``errno`` set), including :class:`ShortIOError`.
        """
        self._resolve()
        if self._exc is not None:
            raise self._exc
        return self._result

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        if self._resolved:
            return True
        if self._poll is not None and self._poll():
            self._resolve()
            return True
        return False


class CompositeFuture(IOFuture):
    """Joins the futures of the pieces of one split request."""

    def __init__(self, parts: list[IOFuture], want: int, what: str):
        def wait() -> int:
            got = 0
            first: OSError | None = None
            for p in parts:
                try:
                    got += p.get()
                except OSError as exc:
                    first = first or exc
            if first is not None:
                raise first
            if got != want:
                raise ShortIOError(what, got, want)
            return got

        super().__init__(wait, lambda: all(p.done() for p in parts))


def buffer_address(mv: memoryview) -> int:
    """Address of the first byte of a contiguous buffer."""
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0


def as_byte_view(buffer: Any) -> memoryview:
    """A flat ``'B'`` memoryview over a CPU buffer without copying.

    Accepts contiguous CPU ``torch.Tensor`` (any dtype), numpy arrays, ``mmap``,
    ``bytearray``, ``bytes`` and memoryviews.

    Raises
    ------
    AlignmentError
        For a non-contiguous or CUDA tensor (the POSIX backends need host memory).
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise AlignmentError(f"buffer on {buffer.device}: this backend needs a host buffer")
        if not buffer.is_contiguous():
            raise AlignmentError("buffer tensor is not contiguous")
        if buffer.numel() == 0:
            return memoryview(b"")
        t = buffer.reshape(-1).view(torch.uint8)
        return memoryview(t.numpy())
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise AlignmentError("buffer array is not C-contiguous")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    mv = memoryview(buffer)
    if not mv.contiguous:
        raise AlignmentError("buffer memoryview is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def alloc_aligned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Page-aligned anonymous host memory (``mmap``) and a uint8 tensor over it.

    mmap(2) returns page-aligned memory, which satisfies every O_DIRECT buffer
    alignment up to the page size. Keep the ``mmap`` object alive as long as the
    tensor is used.
    """
    size = max(int(nbytes), 1)
    size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    return m, t


class IOEngine(Closing):
    """A byte-addressed device of ``size_bytes`` with O_DIRECT alignment rules.

    Parameters
    ----------
    size_bytes : int
        Device size; every I/O must satisfy ``0 <= offset`` and
        ``offset + nbytes <= size_bytes``.
    block_size_bytes : int
        Alignment unit for offset, length and buffer address (4096 default;
        Linux open(2) O_DIRECT rule).

    Raises
    ------
    ConfigError
        If ``block_size_bytes`` is not a power of two or ``size_bytes`` is not a
        multiple of it.
    """

    kind = "abstract"

    def __init__(self, size_bytes: int, block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES):
        if block_size_bytes <= 0 or block_size_bytes & (block_size_bytes - 1):
            raise ConfigError(f"block_size_bytes={block_size_bytes}: must be a power of two")
        if size_bytes <= 0 or size_bytes % block_size_bytes:
            raise ConfigError(
                f"size_bytes={size_bytes}: must be a positive multiple of block_size_bytes={block_size_bytes}"
            )
        self.size_bytes = int(size_bytes)
        self.block_size_bytes = int(block_size_bytes)
        self._observers: list[IOObserver] = []
        self._stats_lock = threading.Lock()
        self._stats = {
            "bytes_read": 0,
            "bytes_written": 0,
            "bytes_trimmed": 0,
            "read_ops": 0,
            "write_ops": 0,
            "trim_ops": 0,
            "read_errors": 0,
            "write_errors": 0,
            "trim_errors": 0,
        }
        self._placement_bytes: dict[int | None, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ public
    def add_observer(self, obs: IOObserver) -> None:
        """Attach an observer called for every completed write and trim."""
        self._observers.append(obs)

    def remove_observer(self, obs: IOObserver) -> None:
        """Detach an observer added with :meth:`add_observer`."""
        self._observers.remove(obs)

    def read(self, offset: int, buffer: Any) -> IOFuture:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``.

        Parameters
        ----------
        offset : int
            Byte offset, multiple of ``block_size_bytes``.
        buffer : writable buffer
            Contiguous host buffer (or a device buffer for the kvikio backend)
            whose address and size are multiples of ``block_size_bytes``.

        Returns
        -------
        IOFuture
            ``get()`` returns the bytes read or raises ``OSError``.

        Raises
        ------
        AlignmentError
            Misaligned offset, length or address, or out of bounds.
        """
        view, nbytes = self._check(offset, buffer, writable=True)
        fut = self._read_impl(offset, view, nbytes)
        fut.add_done_callback(lambda ok: self._count("read", nbytes, ok))
        return fut

    def write(self, offset: int, buffer: Any, placement: int | None = None) -> IOFuture:
        """Write ``buffer`` at ``offset``; same alignment rules as :meth:`read`.

        ``placement`` is an opaque stream tag (an FDP placement identifier for
        backends that support it) recorded in the per-placement byte counters
        and passed to observers.
        """
        view, nbytes = self._check(offset, buffer, writable=False)
        fut = self._write_impl(offset, view, nbytes, placement)

        def done(ok: bool) -> None:
            self._count("write", nbytes, ok)
            if ok:
                with self._stats_lock:
                    self._placement_bytes[placement] = self._placement_bytes.get(placement, 0) + nbytes
                for obs in list(self._observers):
                    obs.on_write(offset, nbytes, placement)

        fut.add_done_callback(done)
        return fut

    def trim(self, offset: int, length: int) -> IOFuture:
        """Deallocate ``[offset, offset + length)`` (punch a hole / TRIM).

        Reads of a trimmed range return zeros. Offset and length must be
        multiples of ``block_size_bytes``.
        """
        self._check_range(offset, length)
        return self._trim_observed(offset, length)

    def trim_many(self, ranges: Sequence[tuple[int, int]]) -> IOFuture:
        """Deallocate several ranges with one call (``(offset, length)`` pairs, bytes).

        NVMe Dataset Management carries up to 256 ranges in one command (NVM
        Command Set Specification, Dataset Management, Number of Ranges); the
        caller collects the dead ranges of one flush and hands them over at once.
        Every range is checked before any is trimmed, so a bad range trims
        nothing. This base implementation issues one ``_trim_impl`` per range
        (a backend with a multi-range command may override it); statistics and
        observers see each range as if :meth:`trim` had been called for it.

        Parameters
        ----------
        ranges : sequence of (int, int)
            ``(offset, length)`` in bytes, each a multiple of
            ``block_size_bytes`` and inside the device; zero-length ranges are skipped.

        Returns
        -------
        IOFuture
            ``get()`` returns the total bytes trimmed, or raises the first
            range's ``OSError`` (the other ranges are still issued and counted).

        Raises
        ------
        AlignmentError
            A misaligned or out-of-bounds range (nothing is trimmed).
        """
        todo = [(int(o), int(n)) for o, n in ranges]
        for o, n in todo:
            self._check_range(o, n)
        parts = [self._trim_observed(o, n) for o, n in todo if n]
        return CompositeFuture(parts, sum(n for _, n in todo), "trim")

    def _trim_observed(self, offset: int, length: int) -> IOFuture:
        """``_trim_impl`` plus the statistics and observer calls of one checked range."""
        fut = self._trim_impl(offset, length)

        def done(ok: bool) -> None:
            self._count("trim", length, ok)
            if ok:
                for obs in list(self._observers):
                    obs.on_trim(offset, length)

        fut.add_done_callback(done)
        return fut

    def preallocate(self, offset: int, length: int) -> None:
        """Reserve space for ``[offset, offset + length)`` before writing it
        (fallocate(2) on files; nothing on block devices and in memory).

        Offset and length must be multiples of ``block_size_bytes``.

        Raises
        ------
        OSError
            ENOSPC (or another errno) if the space cannot be allocated; then
            nothing of the range stays allocated.
        """
        self._check_range(offset, length)
        self._preallocate_impl(offset, length)

    def sync(self) -> None:
        """Make completed writes durable (fdatasync(2)); raises ``OSError``."""
        self._sync_impl()

    def stats(self) -> dict:
        """Counters: bytes/ops/errors per direction and ``bytes_by_placement``."""
        with self._stats_lock:
            out = dict(self._stats)
            out["bytes_by_placement"] = {
                ("none" if k is None else k): v for k, v in self._placement_bytes.items()
            }
        out["kind"] = self.kind
        out["block_size_bytes"] = self.block_size_bytes
        out["size_bytes"] = self.size_bytes
        return out

    def alloc_buffer(self, nbytes: int) -> tuple[Any, torch.Tensor]:
        """Aligned staging memory suited to this backend: ``(keepalive, uint8 tensor)``."""
        return alloc_aligned(nbytes)

    def close(self) -> None:
        """Release the device. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close_impl()

    # ----------------------------------------------------------------- helpers
    def _count(self, what: str, nbytes: int, ok: bool) -> None:
        key = {"read": "bytes_read", "write": "bytes_written", "trim": "bytes_trimmed"}[what]
        with self._stats_lock:
            if ok:
                self._stats[key] += nbytes
                self._stats[f"{what}_ops"] += 1
            else:
                self._stats[f"{what}_errors"] += 1

    def _check_range(self, offset: int, nbytes: int) -> None:
        if self._closed:
            raise TierStoreError(f"{self.kind} engine is closed")
        bs = self.block_size_bytes
        if offset % bs or nbytes % bs:
            raise AlignmentError(
                f"offset={offset} nbytes={nbytes}: both must be multiples of {bs} (O_DIRECT, open(2))"
            )
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise AlignmentError(
                f"offset={offset} nbytes={nbytes}: outside device of {self.size_bytes} bytes"
            )

    def _check(self, offset: int, buffer: Any, writable: bool) -> tuple[Any, int]:
        view = as_byte_view(buffer)
        if writable and view.readonly:
            raise AlignmentError("read destination buffer is read-only")
        nbytes = view.nbytes
        self._check_range(offset, nbytes)
        addr = buffer_address(view)
        if addr % self.block_size_bytes:
            raise AlignmentError(
                f"buffer address {addr:#x} is not a multiple of "
                f"{self.block_size_bytes} (O_DIRECT, open(2)); use alloc_aligned()"
            )
        return view, nbytes

    # ----------------------------------------------------------- backend hooks
    def _read_impl(self, offset: int, view: Any, nbytes: int) -> IOFuture:
        raise NotImplementedError

    def _write_impl(self, offset: int, view: Any, nbytes: int, placement: int | None) -> IOFuture:
        raise NotImplementedError

    def _trim_impl(self, offset: int, length: int) -> IOFuture:
        raise NotImplementedError

    def _preallocate_impl(self, offset: int, length: int) -> None:
        return None

    def _sync_impl(self) -> None:
        raise NotImplementedError

    def _close_impl(self) -> None:
        return None
