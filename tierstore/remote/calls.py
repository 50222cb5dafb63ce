"""The call machinery of the Mooncake tier: call threads, registered staging slots, helpers.

Mooncake Store's error codes, :class:`RegisteredRegion` (memory registered for zero-copy
transfers), ``_Slots`` (a registered staging buffer cut into slots that return to the free
list only when the call using them has returned), ``_CallThreads`` (daemon threads that run
the calls a caller waits for), :class:`TierLink` (what the tier's parts, its
:class:`~tierstore.remote.publisher.Publisher` and :class:`~tierstore.remote.loader.Loader`,
use of it) and the small helpers the three share. Nothing here holds tier state; see
:mod:`tierstore.remote.mooncake`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .format import ObjectNamer
from .settings import MooncakeTuning, RemoteConfig

log = logging.getLogger("tierstore.remote.mooncake")

# Mooncake Store error codes (docs/source/troubleshooting/error-code.md,
# mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200  #: no segment space for the object
INVALID_PARAMS = -600  #: e.g. a get buffer smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  #: a remove within the object's read lease
LEASE_EXPIRED = -707  #: a get outlasted the object's read lease (slow transfer): a miss
TRANSFER_FAIL = -800  #: the transfer to/from a segment failed (its owner died)
RPC_FAIL = -900  #: the master is unreachable


@dataclasses.dataclass(eq=False, repr=False)
class RegisteredRegion:
    """Memory registered with the tier for zero-copy loads (see ``MooncakeTier.register_memory``).

    Attributes
    ----------
    tensor : torch.Tensor
        The registered memory, as the owner passed it.
    on_hold, on_release : callable
        The owner's ``f(offset, nbytes)`` callbacks (``RemoteBlockTier.register_memory``).
    base_ptr, nbytes : int
        Address and size of the region (set from ``tensor``).
    """

    tensor: torch.Tensor
    on_hold: Callable[[int, int], None]
    on_release: Callable[[int, int], None]
    base_ptr: int = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.base_ptr = self.tensor.data_ptr()
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def holds(self, ptr: int, n: int) -> bool:
        """Whether ``[ptr, ptr + n)`` lies inside the region."""
        return self.base_ptr <= ptr and ptr + n <= self.base_ptr + self.nbytes

    def hold(self, offset: int, n: int) -> None:
        """Call the owner's ``on_hold(offset, n)`` (an error it raises is logged, not raised)."""
        _callback(self.on_hold, offset, n)

    def release(self, offset: int, n: int) -> None:
        """Call the owner's ``on_release(offset, n)`` (an error it raises is logged, not raised)."""
        _callback(self.on_release, offset, n)


class TierLink(Protocol):
    """What a part of :class:`~tierstore.remote.mooncake.MooncakeTier` (its publisher, its
    loader) uses of the tier: its settings, its one lock and the condition its threads wait
    on, its counters, its connection state and its Mooncake calls. A part keeps its own state
    and its own slots; it reads the state fields and changes the counters under ``_lock``.
    The tier subclasses it: :meth:`_call` and :meth:`_call_here`, the call machinery, are
    implemented here, the rest by the tier."""

    config: RemoteConfig
    tuning: MooncakeTuning
    block_bytes: int
    object_bytes: int
    _timeout_s: float
    _lock: threading.Lock
    _work: threading.Condition
    _counters: dict[str, int]
    _errors: collections.Counter
    _corrupt: collections.Counter
    _state: str
    _closed: bool
    _client: Any
    _namer: ObjectNamer
    _calls: _CallThreads
    _inflight_calls: int
    _direct: dict[object, list]  # publisher calls in progress: [start_s, what, reported]

    def _bump(self, name: str, n: int = 1) -> None: ...

    def _degrade(self, reason: str, *, count: str | None = None, code: int | None = None) -> None: ...

    def _usable(self) -> Any: ...

    def _call(
        self,
        what: str,
        fn: Callable,
        *args: Any,
        on_timeout: Callable[[], None] | None = None,
        on_late: Callable[[], None] | None = None,
    ) -> Any:
        """Run ``fn(*args)`` on a call thread; wait at most ``timeout_s``.

        Returns the result, or :data:`_NO_RESULT` after a timeout or an
        exception (the tier is then degraded). Memory the call may write into:
        after an exception ``on_late`` runs at once; after a timeout
        ``on_timeout`` runs at once and ``on_late`` when the call finally returns.
        """
        with self._lock:
            self._inflight_calls += 1
        fut = self._calls.submit(fn, *args)

        def done(_f: cf.Future) -> None:
            with self._lock:
                self._inflight_calls -= 1

        fut.add_done_callback(done)
        try:
            return fut.result(self._timeout_s)
        except cf.TimeoutError:
            if on_timeout is not None:
                on_timeout()
            if on_late is not None:
                fut.add_done_callback(lambda _f: on_late())
            self._degrade(f"{what} took more than {self._timeout_s:.1f} s", count="timeouts")
            return _NO_RESULT
        except Exception as e:  # noqa: BLE001 (a raising client is a failed call, counted)
            if on_late is not None:
                on_late()
            self._degrade(f"{what} raised {type(e).__name__}: {e}", count="call_exceptions")
            return _NO_RESULT

    def _call_here(self, what: str, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` on this (publisher) thread, watched by the prober.

        The publisher has no caller waiting on it, so it calls Mooncake
        directly (one thread hand-off less per batch). A call running longer
        than ``timeout_s`` marks the tier degraded from the prober
        (:meth:`_watchdog`); its memory is released only when it returns.
        Returns the result, or :data:`_NO_RESULT` after an exception.
        """
        token = object()
        with self._lock:
            self._inflight_calls += 1
            self._direct[token] = [time.monotonic(), what, False]
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (a raising client is a failed call, counted)
            self._degrade(f"{what} raised {type(e).__name__}: {e}", count="call_exceptions")
            return _NO_RESULT
        finally:
            with self._lock:
                self._inflight_calls -= 1
                del self._direct[token]

    def _check_keys(self, keys: Sequence[bytes], bufs: Sequence[torch.Tensor], what: str) -> None: ...

    def _remove_later(self, names: Sequence[str]) -> None: ...


class _Slots:
    """A registered staging buffer cut into equal slots, with a free list.

    A slot handed to a Mooncake call returns to the free list only when that
    call has returned (never on a timeout), so a late write cannot land in a
    slot that holds another block.
    """

    def __init__(self, n: int, slot_bytes: int) -> None:
        self.n = n
        self.slot_bytes = slot_bytes
        # zeros, not empty: fault the pages in now, not inside the first transfer
        self.buf = torch.zeros(n * slot_bytes, dtype=torch.uint8)
        self.base_ptr = self.buf.data_ptr()
        self._free = list(range(n - 1, -1, -1))
        self._cond = threading.Condition()

    def take(self, k: int, wait_s: float = 0.0) -> list[int]:
        """Up to ``k`` free slots; waits up to ``wait_s`` for the first one."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            got = self._free[-k:] if k < len(self._free) else list(self._free)
            del self._free[len(self._free) - len(got) :]
            return got

    def give(self, idxs: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(idxs)
            self._cond.notify_all()

    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def ptr(self, i: int, offset: int = 0) -> int:
        return self.base_ptr + i * self.slot_bytes + offset

    def view(self, i: int, offset: int, n: int) -> torch.Tensor:
        s = i * self.slot_bytes + offset
        return self.buf[s : s + n]


class _CallThreads:
    """Daemon threads that run Mooncake calls and hand back futures.

    Daemon threads, not a ``ThreadPoolExecutor``: the executor joins its
    threads at interpreter exit, so one hung native call would hang the exit.
    """

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        self.busy = 0
        self._lock = threading.Lock()
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            del item
            if fut.set_running_or_notify_cancel():
                with self._lock:
                    self.busy += 1
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 (handed to the waiter, which counts it)
                    fut.set_exception(e)
                finally:
                    with self._lock:
                        self.busy -= 1
            # drop the call's references now: an idle thread must not own the last
            # reference to tier memory (see MooncakeTier.close)
            del fut, fn, args

    def stop(self, join_timeout_s: float) -> None:
        """Let every thread end, and wait up to ``join_timeout_s`` for those not
        stuck in a call."""
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + join_timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


#: What ``TierLink._call`` returns when a call gave no result.
_NO_RESULT = object()


class _CallFailed(Exception):
    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


def _memcpy(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """One memcpy(3) with the GIL released (ctypes foreign call).

    Not ``Tensor.copy_``: torch splits a copy over its OpenMP threads, whose
    spin-waits collapse when the CPUs are shared with Mooncake's transfer
    threads (measured here: 2 MiB copies at 0.19 GB/s with ``copy_`` vs 3.5 GB/s
    with memcpy on a loaded 2-core machine).
    """
    ctypes.memmove(dst_ptr, src_ptr, nbytes)


def _probe_call(client, name: str) -> bool:
    if client.health_check() != 0:
        return False
    res = client.batch_is_exist([name])
    return bool(res) and res[0] in (0, 1)


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception as e:  # noqa: BLE001 (closing a broken client: nothing left to save)
        log.debug("mooncake client close raised %r", e)


def _close_late_client(fut: cf.Future) -> None:
    if fut.exception() is None:
        _close_quietly(fut.result())


def _callback(fn: Callable[[int, int], None], off: int, n: int) -> None:
    try:
        fn(off, n)
    except Exception:  # the owner's callback must not kill a tier thread
        log.exception("mooncake tier: region callback failed")
