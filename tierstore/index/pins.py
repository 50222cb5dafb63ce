"""Request references, pin leases and the per-namespace pin quota of the block index.

A request that looks blocks up with a ``request_id`` holds a reference on each (``ACTIVE``)
until :meth:`Pins.release`; a lease holds resident blocks (``PINNED``) until it expires or
:meth:`Pins.unpin`. A row's ``refs`` and ``pin_until`` (in :class:`~tierstore.index.rows.RowTable`)
are what victim choice and reclaim read; this room keeps who holds them. It runs under the
index lock it is given (``BlockIndex._lock``) and has none of its own.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..contract import Lease
from ..errors import InvariantError, QuotaExceeded
from ..metrics import Metrics
from ..units import check_duration_s
from .rows import IndexRoom, RowTable


class Pins(IndexRoom):
    """Who holds which rows: requests (references) and leases (pins).

    Parameters
    ----------
    rows, lock, clock
        As :class:`~tierstore.index.rows.IndexRoom`.
    metrics : Metrics
        The index's counters (``pins``, ``pin_expired``, ``aborted_requests``).
    quota_bytes : int
        Per-namespace cap on bytes held by leases.
    default_lease_s : float
        Lease when none is given.
    free_doomed : callable
        ``f(row)``: frees a doomed row once its last user went (the completion room's).
    """

    def __init__(
        self,
        rows: RowTable,
        lock: threading.RLock,
        clock: Callable[[], float],
        metrics: Metrics,
        quota_bytes: int,
        default_lease_s: float,
        free_doomed: Callable[[int], None],
    ) -> None:
        super().__init__(rows, lock, clock)
        self.metrics = metrics
        self.quota_bytes = quota_bytes
        self.default_lease_s = default_lease_s
        self._free_doomed = free_doomed
        self.requests: dict[object, list[int]] = {}  # request id -> rows it references
        self.leases: dict[int, Lease] = {}
        self.row_pins: dict[int, dict[int, float]] = {}  # row -> {lease id: expiry}
        self.pinned_bytes: dict[bytes, int] = {}  # namespace -> bytes its leases hold, a row once
        self.ns_rows: dict[bytes, dict[int, int]] = {}  # namespace -> {row: its leases holding it}
        self.lease_rows: dict[int, list[int]] = {}  # lease id -> the rows it holds
        #: (expiry_s, lease id) of every lease made, ended ones included until they reach the top or
        #: a compaction: :meth:`expire` pops only what is due instead of scanning every live lease
        self._expiry_heap: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)

    # ================================================================ references
    def reference(self, request_id: object, rows: list[int]) -> None:
        """Record that ``request_id`` holds ``rows`` (their ``refs`` were raised by the caller)."""
        self.requests.setdefault(request_id, []).extend(rows)

    def release(self, request_id: object) -> int:
        """Drop every reference ``request_id`` holds. Unknown ids are a no-op."""
        with self._lock:
            rows = self.requests.pop(request_id, [])
            doomed = self.rows.doomed
            if doomed and not doomed.isdisjoint(rows):  # rows to free once their last user goes
                refs = self.rows.refs
                for r in rows:
                    refs[r] -= 1
                    if refs[r] < 0:
                        raise InvariantError("ref_count went negative")
                    self._free_doomed(r)
            elif rows and self.rows.count_down("refs", np.asarray(rows, dtype=np.int64)):
                raise InvariantError("ref_count went negative")
            return len(rows)

    def cancel(self, request_id: object) -> int:
        """Abort a request: like :meth:`release`, counted as an abort."""
        self.metrics.inc("aborted_requests")
        return self.release(request_id)

    # ================================================================ leases
    def pin(self, ns: bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """Hold resident blocks until the lease expires or :meth:`unpin`.

        The namespace's quota counts each block once however many of its leases hold it: a
        block a live lease of ``ns`` already holds adds nothing (an overlapping pin, or a
        renewal: pin again, then unpin the old lease).

        Raises
        ------
        QuotaExceeded
            If the blocks not yet held by a lease of ``ns`` would exceed its quota (nothing is
            pinned then).
        ConfigError
            For a lease that is not a finite number of seconds in ``(0, MAX_DURATION_S]``
            (:func:`~tierstore.units.check_duration_s`).
        """
        lease_s = check_duration_s(self.default_lease_s if lease_s is None else lease_s, "lease_s")
        with self._lock:
            self.expire()
            rt = self.rows
            rows = [r for r in rt.table.get_many(keys).tolist() if r >= 0 and rt.top(r) is not None]
            nbytes = len(rows) * rt.block_bytes
            held = self.ns_rows.get(ns, {})
            more = len({r for r in rows if r not in held}) * rt.block_bytes
            used = self.pinned_bytes.get(ns, 0)
            if used + more > self.quota_bytes:
                raise QuotaExceeded(
                    f"pin of {nbytes} B ({more} B not pinned in this namespace yet) would exceed "
                    f"the namespace quota ({used} of {self.quota_bytes} B in use)"
                )
            lid = next(self._lease_ids)
            exp = self._clock() + lease_s
            tick = rt.tick(exp, up=True)  # before binding the column: it may rebase or widen it
            pin_until = rt.pin_until
            for r in rows:
                self.row_pins.setdefault(r, {})[lid] = exp
                pin_until[r] = max(pin_until[r], tick)
            lease = Lease(lid, ns, rt.table.keys_of(rows), exp, nbytes)
            self.leases[lid] = lease
            self._push_expiry(exp, lid)
            held = self.ns_rows.setdefault(ns, held)
            for r in rows:
                held[r] = held.get(r, 0) + 1
            self.lease_rows[lid] = rows
            self.pinned_bytes[ns] = used + more
            self.metrics.inc("pins")
            return lease

    def unpin(self, lease_id: int) -> bool:
        """End a lease early. Returns False for an unknown or expired lease."""
        with self._lock:
            return self.end_lease(lease_id)

    def live_leases(self) -> dict[int, Lease]:
        """Live leases by id (a copy)."""
        with self._lock:
            self.expire()
            return dict(self.leases)

    def end_lease(self, lease_id: int) -> bool:
        """End one lease (under the lock); False if it is unknown."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        rt = self.rows
        for r in rt.table.get_many(lease.keys).tolist():
            if r < 0:
                continue
            pins = self.row_pins.get(r)
            if pins is None:
                continue
            pins.pop(lease_id, None)
            if pins:
                # the row's pin_until is the latest expiry of its leases: only a lease that held it
                # can lower it, so the other leases are scanned then alone (O(1) for the others)
                ended = rt.tick(lease.expiry_s, up=True)  # may replace the column: bound after
                if ended >= rt.pin_until[r]:
                    rt.pin_until[r] = rt.tick(max(pins.values()), up=True)
            else:
                del self.row_pins[r]
                rt.pin_until[r] = 0
        held = self.ns_rows.get(lease.ns, {})
        freed = 0
        for r in self.lease_rows.pop(lease_id, ()):
            n = held.get(r, 0) - 1
            if n < 0:
                raise InvariantError(f"row {r} released by more leases of its namespace than held it")
            if n:
                held[r] = n
            else:
                del held[r]
                freed += 1
        if not held:
            self.ns_rows.pop(lease.ns, None)
        self.pinned_bytes[lease.ns] -= freed * self.rows.block_bytes
        if self.pinned_bytes[lease.ns] < 0:
            raise InvariantError("pinned bytes went negative")
        return True

    def expire(self) -> None:
        """End the leases whose time is up (under the lock).

        Pops the expiry heap while its earliest entry is due: O(k log n) for k due leases of n,
        not a scan of every live lease on each :meth:`pin` (a block held by 8,000 leases made a
        pin ~4x slower than at 2,000). An entry whose lease already ended is dropped.
        """
        now = self._clock()
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, lid = heapq.heappop(heap)
            if self.end_lease(lid):
                self.metrics.inc("pin_expired")

    def _push_expiry(self, expiry_s: float, lease_id: int) -> None:
        """Add a lease to the expiry heap; rebuild it from the live leases once ended ones dominate.

        Leases ended early (:meth:`unpin`) stay in the heap until their expiry; when the heap holds
        more than twice the live leases (plus 64), it is rebuilt from :attr:`leases` in O(n), so
        pin/unpin churn under long leases keeps the heap within a constant factor of the live set.
        """
        heap = self._expiry_heap
        heapq.heappush(heap, (expiry_s, lease_id))
        if len(heap) > 2 * len(self.leases) + 64:
            heap[:] = [(lease.expiry_s, lid) for lid, lease in self.leases.items()]
            heapq.heapify(heap)

    def end_namespace(self, ns: bytes | None = None) -> None:
        """End every lease of namespace ``ns`` (every lease for ``None``), under the lock."""
        for lid in [lid for lid, lease in self.leases.items() if ns is None or lease.ns == ns]:
            self.end_lease(lid)
