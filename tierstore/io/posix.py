"""POSIX backend: ``os.preadv``/``os.pwritev`` on an O_DIRECT file descriptor,
with worker threads providing queue depth (fio ``ioengine=psync`` x ``numjobs``).

A request larger than ``max_io_bytes`` is split into pieces issued in parallel
by ``iodepth`` worker threads (the GIL is released inside preadv/pwritev).

Pieces reach the workers, and their completions the waiting caller, through
eventfds (:class:`EventfdWorkers`): ``os.eventfd_write``/``os.eventfd_read``
release the GIL around the wake-up and the wait. A ``concurrent.futures`` pool
wakes its worker (``SimpleQueue.put``) and its waiter (a ``Condition``) with the
GIL held: on a busy host the woken thread preempts the waker, which then holds
the GIL descheduled and stalls every other thread of the process, a lookup
included (issue 25 item 4: 111-258 of the 537 submits of a 256 MiB demotion run
were preempted so, up to 3.6-9.9 ms; ``bench/README_core.md``).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

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


#: Eventfds of threads that ended, for the next thread that waits. Never closed: a worker's late
#: wake-up (the waiter saw its piece done before the worker wrote) must never reach a reused fd.
_free_wakers: list[int] = []


class _Waker:
    """A thread's eventfd for being woken with the GIL released (given back when the thread ends)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = _free_wakers.pop() if _free_wakers else os.eventfd(0, os.EFD_CLOEXEC)

    def __del__(self, free: list[int] = _free_wakers) -> None:  # bound here: at exit globals are gone
        free.append(self.fd)


_wakers = threading.local()


def _waker() -> int:
    w = getattr(_wakers, "w", None)
    if w is None:
        w = _wakers.w = _Waker()
    return w.fd


class _Job:
    """One piece handed to a worker; the worker wakes its waiter through the waiter's eventfd."""

    __slots__ = ("fn", "args", "waiter", "finished", "result", "exc")

    def __init__(self, fn: Callable[..., int], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.waiter = -1
        self.finished = False
        self.result = 0
        self.exc: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 -- handed to the waiter, raised by wait()
            self.exc = exc
        self.fn = self.args = None  # type: ignore[assignment]  # the buffer is not kept
        self.finished = True
        if self.waiter >= 0:  # set before `finished` was seen False: the waiter sleeps or will read
            os.eventfd_write(self.waiter, 1)  # the GIL is released around the wake-up

    def wait(self) -> int:
        """Block (GIL released) until the piece ran; its bytes, or its exception raised."""
        if not self.finished:
            fd = self.waiter = _waker()
            while not self.finished:  # a token left by an earlier job's late wake-up: read again
                os.eventfd_read(fd)
        if self.exc is not None:
            raise self.exc
        return self.result

    def done(self) -> bool:
        return self.finished


class EventfdWorkers:
    """Up to ``max_workers`` threads (started as needed) that run submitted pieces.

    ``submit`` wakes a worker with ``os.eventfd_write`` on a semaphore eventfd and the
    worker wakes the waiter the same way (:class:`_Job`): no thread is woken with the
    GIL held. ``shutdown`` lets the pieces already submitted run, then stops the workers.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._max, self._name = max_workers, name
        self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_SEMAPHORE)
        self._jobs: collections.deque[_Job | None] = collections.deque()
        self._lock = threading.Lock()  # the counters below; never held across a wake-up
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., int], *args: Any) -> _Job:
        """Run ``fn(*args)`` on a worker; the returned job's ``wait()`` gives its result."""
        job = _Job(fn, args)
        with self._lock:  # claim an idle worker, or start one while under max_workers
            if self._closed:
                raise RuntimeError("cannot submit I/O after the engine closed")
            start = self._idle <= 0 and len(self._threads) < self._max
            if start:
                t = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            else:
                self._idle -= 1
            self._jobs.append(job)
            os.eventfd_write(self._efd, 1)  # under the lock: shutdown closes the fd under it
        return job

    def _work(self) -> None:
        while True:
            os.eventfd_read(self._efd)  # one piece (or the stop sentinel) each
            job = self._jobs.popleft()
            if job is None:
                return
            job.run()
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Run what was submitted, stop and join the workers, close the eventfd."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._jobs.append(None)
                os.eventfd_write(self._efd, 1)
        for t in self._threads:
            t.join()
        with self._lock:
            os.close(self._efd)


class PosixEngine(FileEngine):
    """O_DIRECT file or block device through preadv/pwritev + a thread pool.

    Parameters and errors are those of :class:`tierstore.io.file.FileEngine`;
    ``iodepth`` is the number of worker threads (fio ``ioengine=psync`` x ``numjobs``).
    """

    kind = "posix"

    def _start(self):
        self._pool = EventfdWorkers(self.iodepth, "tierstore-io")

    def _stop(self):
        self._pool.shutdown()

    def _split(self, fn, offset: int, view: memoryview, nbytes: int, what: str) -> IOFuture:
        if nbytes <= self.max_io_bytes:
            j = self._pool.submit(fn, self.fd, view, offset)
            return IOFuture(j.wait, j.done)
        parts = []
        for a, b in self._pieces(nbytes):
            j = self._pool.submit(fn, self.fd, view[a:b], offset + a)
            parts.append(IOFuture(j.wait, j.done))
        return CompositeFuture(parts, nbytes, what)

    def _read_impl(self, offset, view, nbytes):
        return self._split(_pread_full, offset, view, nbytes, "read")

    def _write_impl(self, offset, view, nbytes, placement):
        return self._split(_pwrite_full, offset, view, nbytes, "write")
