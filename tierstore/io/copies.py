"""Copies whose speed does not depend on the machine's load: tierstore's own intra-op threading.

A torch ``copy_`` of more than 32k elements is an OpenMP parallel region; its closing barrier waits
for every thread of the team, so on a host whose CPUs are busy (tokenizers, schedulers, other
engines) one descheduled OpenMP thread stalls the copy for a scheduler slice. Measured on this
2-vCPU VM at load average 6 (``bench/core_bench.py --parts frag --busy``): a 2 MiB block copied
through its 64 strided per-layer views ran at 0.13-0.65 GB/s on torch's 2 OpenMP threads and
2.3-2.4 GB/s on one. So tierstore runs its copies on one OpenMP thread per copying thread, and
gets parallelism from a small bounded pool of its own copy threads that *claim* pieces of a call's
work: the calling thread copies too and never waits for a helper that has not started (a busy
host's descheduled helper just claims nothing), only for pieces already being copied.

``omp_set_num_threads`` sets the *calling thread's* OpenMP team size (the ``nthreads-var`` ICV
is per task); torch 2.13 CPU reads it per thread (``torch.get_num_threads()`` is
``omp_get_max_threads()``): measured, a thread that set 1 sees 1 while another thread still sees
2. tierstore sets it only on its own copy threads and, for the length of one call, on the
caller's thread (restored on exit); ``torch.set_num_threads`` (process-wide) is never called.
Without an OpenMP runtime in the process (other torch builds) copies run as torch decides.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..errors import ConfigError

#: A call that moves fewer bytes runs on the calling thread alone (a helper's wake-up costs
#: tens of microseconds, a 2 MiB block copy ~0.2-1 ms).
DEFAULT_SPLIT_BYTES = 4 << 20
#: Bytes per piece a single large copy is cut into (rows of its first dimension).
DEFAULT_CHUNK_BYTES = 2 << 20


def default_threads() -> int:
    """Threads that copy one call's blocks, the caller included: the CPUs, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch uses, if it is loaded."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


OMP_SET = _omp_set_num_threads()


def set_omp(n: int) -> None:
    """This thread's OpenMP team size for torch ops (no-op without an OpenMP runtime)."""
    if OMP_SET is not None:
        OMP_SET(n)


@contextlib.contextmanager
def one_omp_thread() -> Iterator[None]:
    """Meanwhile this thread's torch ops run on this thread only; its setting is restored on exit."""
    if OMP_SET is None:
        yield
        return
    n = torch.get_num_threads()  # also torch's lazy per-thread init, which would undo ours
    if n == 1:
        yield
        return
    OMP_SET(1)
    try:
        yield
    finally:
        OMP_SET(n)


def copy_thread_init() -> None:
    """Initializer of a copy thread: its torch ops run on this thread only."""
    torch.get_num_threads()  # torch's lazy per-thread init first
    set_omp(1)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, a: int, step: int) -> None:
    """One piece of a split copy: rows ``[a, a + step)`` of ``src`` into ``dst``."""
    dst[a : a + step].copy_(src[a : a + step])


class _Work:
    """One call's pieces, claimed one at a time by whoever is free (caller or helpers)."""

    __slots__ = ("pieces", "next", "running", "error", "cv")

    def __init__(self, pieces: Sequence[Callable[[], Any]]) -> None:
        self.pieces = pieces
        self.next = 0
        self.running = 0
        self.error: BaseException | None = None
        self.cv = threading.Condition(threading.Lock())

    def work(self) -> None:
        pieces, cv = self.pieces, self.cv
        while True:
            with cv:
                i = self.next
                if i >= len(pieces) or self.error is not None:
                    return
                self.next = i + 1
                self.running += 1
            try:
                pieces[i]()
            except BaseException as e:  # noqa: BLE001  handed to the caller, which raises it
                with cv:
                    self.error = self.error or e
            finally:
                with cv:
                    self.running -= 1
                    if not self.running:
                        cv.notify_all()

    def wait_claimed(self) -> None:
        """Until no piece is being copied (pieces nobody claimed were done by the caller)."""
        with self.cv:
            while self.running:
                self.cv.wait()
        if self.error is not None:
            raise self.error


class Copier:
    """Runs a call's copies: on the calling thread below ``split_bytes``, else also on up to
    ``threads - 1`` copy threads of its own; every copying thread uses one OpenMP thread.

    Parameters
    ----------
    threads : int, optional
        Threads that copy one call, the caller included (default :func:`default_threads`:
        the CPUs, at most 4); 1 copies on the caller only.
    split_bytes : int
        Calls that move fewer bytes run on the calling thread alone (4 MiB).
    chunk_bytes : int
        A single copy larger than this is cut into pieces of about this size (2 MiB).

    Raises
    ------
    ConfigError
        If a value is not positive.
    """

    def __init__(
        self,
        threads: int | None = None,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        threads = default_threads() if threads is None else int(threads)
        if threads < 1 or split_bytes < 1 or chunk_bytes < 1:
            raise ConfigError(
                f"copy threads={threads}, split_bytes={split_bytes}, chunk_bytes={chunk_bytes}:"
                " must be positive"
            )
        self.threads = threads
        self.split_bytes = int(split_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, pieces: Sequence[Callable[[], Any]], nbytes: int = 0, *, split: bool | None = None) -> None:
        """Call every piece once (each a copy, or other work that releases the GIL).

        ``nbytes`` (all pieces together) decides whether helpers take part
        (``>= split_bytes``), unless ``split`` says. Pieces must be independent (any
        order, concurrently). The first exception a piece raises is raised here once no
        piece is running; pieces not yet started are skipped.
        """
        if split is None:
            split = nbytes >= self.split_bytes
        with one_omp_thread():
            if len(pieces) < 2 or not split or self.threads < 2:
                for p in pieces:
                    p()
                return
            work = _Work(pieces)
            pool = self._helpers()
            for _ in range(min(self.threads - 1, len(pieces) - 1)):
                pool.submit(work.work)
            work.work()
            work.wait_claimed()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, cut along the first dimension into pieces of ~``chunk_bytes``
        when the shapes match and it is large (see :meth:`run`)."""
        nbytes = dst.numel() * dst.element_size()
        rows = dst.shape[0] if dst.dim() else 1
        if nbytes < self.split_bytes or dst.shape != src.shape or rows < 2 or self.threads < 2:
            with one_omp_thread():
                dst.copy_(src)
            return
        step = max(1, self.chunk_bytes * rows // nbytes)
        pieces: list[Callable[[], Any]] = [
            functools.partial(_copy_rows, dst, src, a, step) for a in range(0, rows, step)
        ]
        self.run(pieces, nbytes)

    def _helpers(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self.threads - 1, thread_name_prefix="tierstore-copy", initializer=copy_thread_init
                    )
                pool = self._pool
        return pool

    def close(self) -> None:
        """Stop the copy threads (a later call starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_SHARED: Copier | None = None
_SHARED_LOCK = threading.Lock()


def shared_copier() -> Copier:
    """The process's default :class:`Copier` (defaults; its copy threads start on first use
    and are shared by every store in the process, so their number stays bounded)."""
    global _SHARED
    if _SHARED is None:
        with _SHARED_LOCK:
            if _SHARED is None:
                _SHARED = Copier()
    return _SHARED


def configure(
    threads: int | None = None, split_bytes: int = DEFAULT_SPLIT_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Copier:
    """Replace the process's default :class:`Copier` (see its parameters) for stores built
    afterwards; the old one's copy threads stop once its calls are done. Returns the new one.

    Raises
    ------
    ConfigError
        If a value is not positive.
    """
    global _SHARED
    new = Copier(threads, split_bytes, chunk_bytes)
    with _SHARED_LOCK:
        old, _SHARED = _SHARED, new
    if old is not None:
        old.close()
    return new
