"""The movers' work queues: ``"load"`` and ``"store"``, one worker thread each, FIFO.

A call (decide, move, record) submitted with ``wait=False`` runs on one of them and the caller
gets a :class:`concurrent.futures.Future` (SGLang's ``HiCacheController`` queues its transfers the
same way). Loads and prefetches never queue behind a store's NVMe writes. After
:meth:`WorkQueues.shutdown` a submit raises :class:`~tierstore.errors.StoreClosedError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import ConfigError, StoreClosedError


class WorkQueues:
    """The ``"load"`` and ``"store"`` queues (worker threads started on first use)."""

    #: The queues :meth:`submit` accepts.
    QUEUES = ("load", "store")

    def __init__(self) -> None:
        self._queues: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, queue: str, fn: Callable[[], object]) -> Future[Any]:
        """Run ``fn`` on queue ``queue`` (``"load"`` or ``"store"``, one worker
        thread each, FIFO); returns its Future.

        Raises
        ------
        ConfigError
            For an unknown queue.
        StoreClosedError
            After :meth:`shutdown` (the store is closing).
        """
        if queue not in self.QUEUES:
            raise ConfigError(f"queue={queue!r}: accepted values are {list(self.QUEUES)}")
        with self._lock:
            if self._stopped:
                raise StoreClosedError("the store is closed")
            pool = self._queues.get(queue)
            if pool is None:
                pool = self._queues[queue] = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"tierstore-{queue}"
                )
            return pool.submit(fn)

    def drain(self) -> None:
        """Wait for every call submitted so far."""
        with self._lock:
            pools = list(self._queues.values())
        for pool in pools:
            pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        """Finish submitted calls and refuse new ones."""
        with self._lock:
            self._stopped = True
            pools, self._queues = list(self._queues.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
