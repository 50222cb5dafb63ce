"""Split execution: plans prepared by the index, bytes moved by a client, completed later.

In the node store (issue 24) the engine processes copy a block's bytes between their own memory
and a slot of the shared segment (:mod:`tierstore.node.segment`); the store decides, moves the
victims and the NVMe bytes, and records. :class:`PlanService` turns a store or load plan into a
:class:`Ticket` (per key a status, a segment slot and its generation), runs the plan's first half
(:meth:`Transfers.store_prelude <tierstore.transfers.Transfers.store_prelude>`: victims leave their
slots; :meth:`~tierstore.transfers.Transfers.load_prelude`: NVMe blocks staged into slots) and says
when the ticket is ready (:class:`Ready`, :meth:`PlanService.poll`); each rank of the engine copies
its column and reports (``complete_*``, the AND over ranks), then the second half runs (NVMe writes
from the slots, the index's ``complete_*``). Slots: the index's host tier is the segment's host
slots ``[0, H)``; a block with no host slot (bound for NVMe only, or read from NVMe) gets a staging
slot ``[H, H + S)`` from this service's allocator. A ticket's slots are never reused before it is
completed or aborted; one not completed within its lease (``lease_s``) is aborted by
:meth:`PlanService.expire`, or *quarantined* when its client may still be alive: a quarantined
store ticket keeps its slots (and its keys stay in flight) until :meth:`PlanService.abort`, once
the owner of those slots is known to be done. An aborted ticket's slots have their generations
bumped first, so a client that re-reads them after its copy sees a miss. Completing twice is
answered with the first outcome.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..contract import Tier
from ..errors import ConfigError, InvariantError, Status, StoreClosedError, TierStoreError
from ..io.pages import FragmentPlan
from ..tiers.memory import SlotAllocator
from ..transfers import Transfers
from .segment import Segment

PREPARING, READY, QUARANTINED, COMPLETING, DONE = "preparing", "ready", "quarantined", "completing", "done"


def _resolved(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class _SlotSources(Sequence):
    """A store ticket's slots as copy sources, ``[i]`` → slot ``slots[i]``'s ``FragmentPlan``
    (``None`` for a key handed no slot), each built when asked for."""

    def __init__(self, service: PlanService, slots: np.ndarray) -> None:
        self._service, self._slots = service, slots

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i):  # type: ignore[override]  # ints only
        s = int(self._slots[i])
        return self._service.slot_plan(s) if s >= 0 else None


class Flag:
    """A one-shot event: :meth:`set` once (later calls do nothing), :meth:`wait` by any number of
    threads. :class:`threading.Event`'s behaviour for a flag that is never cleared, for a lock's
    price: a ticket has two, and an ``Event`` (a ``Condition`` and its lock, built in Python)
    cost ~14 us to make on the 2-vCPU VM against ~0.1 us for a lock (``timeit``, session 38).

    The lock is held from creation until :meth:`set`; a waiter acquires it (with its timeout)
    and hands it on at once, so every waiter wakes.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def set(self) -> None:
        """Set the flag and wake every waiter (once; a repeated call, also a racing one, does nothing)."""
        with _FLAG_GUARD:
            if self._set:
                return
            self._set = True
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds (None: no limit) pass; whether it is set."""
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()
            return True
        return self._set


_FLAG_GUARD = threading.Lock()  # makes Flag.set's test-and-set atomic (held for two bytecodes)


class TicketError(TierStoreError):
    """A ticket operation that cannot be done: an unknown or foreign plan id, a report of the
    wrong length or kind, or a report before the ticket is ready (nothing is changed)."""


@dataclasses.dataclass(frozen=True)
class Ready:
    """A ticket became ready: its slots may be used now.

    Attributes
    ----------
    plan_id : int
    failed : tuple of int
        Positions of a load ticket's keys whose staging failed (an NVMe read error or a CRC
        mismatch): a miss, the client must not read their slots.
    """

    plan_id: int
    failed: tuple = ()


@dataclasses.dataclass(frozen=True)
class StoreResult:
    """A store ticket's outcome.

    Attributes
    ----------
    statuses : list of Status
        Per key: ``OK`` (kept), ``EXISTS``, ``NO_SPACE`` or ``IO_ERROR`` (not kept).
    durable : frozenset of int
        Positions whose block is on NVMe.
    """

    statuses: list
    durable: frozenset = frozenset()


@dataclasses.dataclass(eq=False)
class Ticket:
    """A prepared store or load that a client executes.

    Attributes
    ----------
    plan_id : int
    kind : {"store", "load"}
    keys : list of bytes
    statuses : list of Status
        Per key at hand-out: a store's ``OK`` (copy the block into ``slots[i]``), ``EXISTS`` or
        ``NO_SPACE``; a load's ``OK`` (copy out of ``slots[i]``) or ``MISS``. A load key whose
        staging fails becomes ``MISS`` when the ticket is ready (:attr:`failed`).
    slots : numpy.ndarray
        ``int32`` per key: its segment slot, -1 where the status is not ``OK``.
    gens : numpy.ndarray
        ``uint64`` per key: the slot's generation at hand-out (0 without a slot).
    ranks : int
        Reports that complete it (the AND over the engine's ranks).
    deadline_s : float
        When :meth:`PlanService.expire` aborts it (the service's clock).
    ready : bool
    failed : tuple of int
        A load's keys whose staging failed (known once ready).
    """

    plan_id: int
    kind: str
    keys: list
    statuses: list
    slots: np.ndarray
    gens: np.ndarray
    ranks: int
    deadline_s: float
    ready: bool = False
    failed: tuple = ()
    plan: object = dataclasses.field(default=None, repr=False)
    staged: dict = dataclasses.field(default_factory=dict, repr=False)  # position -> staging slot
    state: str = PREPARING
    reports: dict = dataclasses.field(default_factory=dict, repr=False)  # rank -> bool array
    outcome: object = None
    abort_wanted: bool = False
    quarantine_wanted: bool = False
    on_ready: Callable[[Ready], None] | None = dataclasses.field(default=None, repr=False)
    errors: dict = dataclasses.field(default_factory=dict, repr=False)  # load: position -> staging status
    readied: Flag = dataclasses.field(default_factory=Flag, repr=False)
    settled: Flag = dataclasses.field(default_factory=Flag, repr=False)
    nvme_s: float | None = None


def _all_missed(t: Ticket) -> list[Status]:
    """The outcome of a load ticket given up before its first half ran: every key a miss."""
    return [Status.MISS] * len(t.keys)


class PlanService:
    """Tickets over a store whose host tier is a shared segment's host slots.

    Parameters
    ----------
    transfers : Transfers
        The store's prepare/move/complete runner; its index has a host tier of exactly
        ``segment.header.host_slots`` slots whose pool is ``segment.host_rows()``, and no HBM tier.
    segment : Segment
        The owner's mapping (it bumps slot generations).
    lease_s : float
        A ticket not completed this long after it was prepared is aborted by :meth:`expire`.
    clock : callable
        Seconds, monotonic.

    Raises
    ------
    ConfigError
        For an index with an HBM tier or a host tier of another size than the segment's.
    """

    #: Outcomes of finished tickets kept to answer a repeated report.
    KEEP_FINISHED = 4096

    def __init__(
        self,
        transfers: Transfers,
        segment: Segment,
        lease_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transfers = transfers
        self.index = transfers.index
        self.segment = segment
        h = segment.header
        shape = self.index.shape
        if shape.hbm_blocks or shape.host_blocks != h.host_slots:
            raise ConfigError(
                f"split execution needs a store whose only memory tier is the segment's "
                f"{h.host_slots} host slots; the index has hbm={shape.hbm_blocks}, "
                f"host={shape.host_blocks} slots"
            )
        if lease_s <= 0:
            raise ConfigError(f"lease_s={lease_s}: must be > 0")
        self.host_slots = h.host_slots
        self.staging = SlotAllocator(h.staging_slots)
        self.lease_s = float(lease_s)
        self.clock = clock
        self._rows = segment.rows()[:, : segment.block_bytes]
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._finished: collections.OrderedDict[int, Ticket] = collections.OrderedDict()
        self._ready: collections.deque[Ready] = collections.deque()
        self._next_id = 1

    # ------------------------------------------------------------------ slots
    def slot_plan(self, slot: int, destination: bool = False) -> FragmentPlan:
        """Segment slot ``slot`` (host or staging) as one block's ``FragmentPlan``."""
        return FragmentPlan.of_bytes(self._rows[slot], destination=destination)

    def _take_staging(self, n: int) -> list[int]:
        with self._lock:
            got = self.staging.take(n)
        return [self.host_slots + s for s in got]

    def _register(self, t: Ticket) -> Ticket:
        with self._lock:
            t.plan_id = self._next_id
            self._next_id += 1
            self._tickets[t.plan_id] = t
        return t

    def _open(
        self,
        kind: str,
        plan,
        statuses: list[Status],
        slots: np.ndarray,
        gens_of: Callable[[np.ndarray], np.ndarray],
        ranks: int,
        staged: dict[int, int],
        on_ready: Callable[[Ready], None] | None,
    ) -> Ticket:
        """Register a ``kind`` (``"store"`` or ``"load"``) ticket of ``plan``, leased for ``lease_s``
        from now, with its slots' generations (:meth:`_slot_gens` by ``gens_of``), and count it in
        ``tickets_<kind>``."""
        gens = self._slot_gens(slots, gens_of)
        t = self._register(
            Ticket(
                0,
                kind,
                list(plan.keys),
                statuses,
                slots,
                gens,
                ranks,
                self.clock() + self.lease_s,
                plan=plan,
                staged=staged,
                on_ready=on_ready,
            )
        )
        self.index.metrics.inc("tickets_" + kind)
        return t

    def _start(
        self,
        t: Ticket,
        at_hand: bool,
        prelude: Callable[[Ticket, bool], None],
        abort: Callable[[Any], None],
        given_up: Callable[[Ticket], object],
    ) -> Ticket:
        """Run a new ticket's first half: ``prelude(t, False)`` in this thread when ``at_hand``, else
        ``prelude(t, True)`` on the movers' ``t.kind`` queue. A queue that refuses (the store is
        closing) gives the plan up (``abort(t.plan)``: nothing was moved), finishes the ticket with
        ``given_up(t)`` and raises what the queue raised."""
        if at_hand:
            prelude(t, False)
            return t
        try:
            self.transfers.submit(t.kind, lambda: prelude(t, True))
        except BaseException:
            abort(t.plan)
            self._finish(t, given_up(t))
            raise
        return t

    @staticmethod
    def _slot_gens(slots: np.ndarray, gens_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``uint64`` generation per key: ``gens_of(slots)`` where a key has a slot, 0 elsewhere."""
        have = slots >= 0
        if have.all() and len(slots):  # every key has a slot (the common case): no mask
            return np.asarray(gens_of(slots), dtype=np.uint64)
        gens = np.zeros(len(slots), dtype=np.uint64)
        if have.any():
            gens[have] = gens_of(slots[have])
        return gens

    # ------------------------------------------------------------------ store
    def prepare_store(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        lifetime=None,
        first_position: int = 0,
        tokens=None,
        *,
        ranks: int = 1,
        wait: bool = False,
        on_ready: Callable[[Ready], None] | None = None,
    ) -> Ticket:
        """Plan a store of ``keys`` and hand out a slot per new block.

        Parameters
        ----------
        ns, keys, lifetime, first_position, tokens :
            As :meth:`BlockIndex.prepare_store <tierstore.index.BlockIndex.prepare_store>`
            (32-byte namespace digest, chained block keys in chain order, ...).
        ranks : int
            Reports :meth:`complete_store` waits for (one per rank that copies a column).
        wait : bool
            Run the victims' NVMe writes in this thread and return a ready ticket; else they run
            on the store queue and the ticket's id comes out of :meth:`poll` when ready.
        on_ready : callable, optional
            Called with the :class:`Ready` instead (from the queue's thread; it must not block)
            when a ticket not ready at hand-out becomes ready.

        Returns
        -------
        Ticket
            A key with no slot to be had (no staging slot left, counted ``staging_full``) is
            ``NO_SPACE``, and so is the rest of its chain.
        """
        if ranks < 1:
            raise ConfigError(f"ranks={ranks}: must be >= 1")
        plan = self.index.prepare_store(ns, keys, lifetime, first_position, tokens)
        n = len(plan.keys)
        slots = np.full(n, -1, dtype=np.int32)
        host = {i: s for i, t, s in plan.memory if t == Tier.HOST}
        pending = plan.pending
        need = [i for i in pending if i not in host]
        got = self._take_staging(len(need)) if need else []
        staged = dict(zip(need, got))
        statuses = [s if s is not None else Status.OK for s in plan.statuses]
        cut = None
        if not need and len(host) == len(pending):  # each new block has its host slot: no cut
            slots[list(host)] = list(host.values())
            pending = []
        for i in pending:
            s = host.get(i, staged.get(i, -1))
            if s < 0 or cut is not None:
                cut = i if cut is None else cut
                statuses[i] = Status.NO_SPACE
                continue
            slots[i] = s
        if cut is not None:
            self.index.metrics.inc("staging_full", sum(1 for i in need if i not in staged))
        t = self._open("store", plan, statuses, slots, self.segment.bump_gens, ranks, staged, on_ready)
        at_hand = not plan.nvme_demote or wait
        return self._start(t, at_hand, self._store_prelude, self.index.abort_store, self._not_kept)

    @staticmethod
    def _not_kept(t: Ticket) -> StoreResult:
        """The outcome of a store ticket none of whose new blocks was kept."""
        return StoreResult([Status.IO_ERROR if s is Status.OK else s for s in t.statuses])

    def _store_prelude(self, t: Ticket, announce: bool) -> None:
        try:
            self.transfers.store_prelude(t.plan)
        except BaseException:  # the plan was completed as failed: nothing was kept
            self._finish(t, self._not_kept(t))
            raise
        self._became_ready(t, announce)

    def complete_store(
        self, plan_id: int, ok: Sequence[bool], rank: int = 0, *, wait: bool = True
    ) -> StoreResult | None | Future:
        """Report rank ``rank``'s copies into a store ticket's slots (``ok[i]``: key ``i``'s shard
        is in its slot; ignored for keys without a slot; a sequence of bools or ``u8`` bytes).

        Returns
        -------
        StoreResult or None, or a Future of it
            The outcome once every rank reported (the AND of their ``ok``); ``None`` while
            some have not. A repeated report (also after an abort) returns the outcome again.
            With ``wait=False`` a Future: the second half (NVMe writes of the blocks bound
            there, the index's completion) runs on the store queue, not in this thread.

        Raises
        ------
        TicketError
            For an unknown plan id, a load ticket, ``len(ok) != len(keys)``, a rank outside
            ``[0, ranks)``, or a ticket not ready yet.
        """
        t, and_ok = self._report(plan_id, "store", ok, rank, block=wait)
        if and_ok is None:
            state = t.state
            if wait or state != COMPLETING:  # done, or other ranks still to report
                out = t.outcome if state == DONE else None
                return out if wait else _resolved(out)
            return self._later(lambda: t.settled.wait() and t.outcome, lambda: t.outcome)
        if wait:
            return self._end_store(t, and_ok)
        return self._later(lambda: self._end_store(t, and_ok), lambda: self._end_store(t, and_ok))

    def _later(self, fn: Callable[[], object], inline: Callable[[], object]) -> Future:
        """``fn`` on the store queue; ``inline`` here when the queue is closed (the store is closing)."""
        try:
            return self.transfers.submit("store", fn)
        except StoreClosedError:
            return _resolved(inline())

    def _end_store(self, t: Ticket, and_ok, publish: bool = True) -> StoreResult:
        """The second half: a key with a slot is ``OK`` where every rank copied it, else
        ``IO_ERROR``; a key handed no slot stays ``NO_SPACE``."""
        sources = _SlotSources(self, t.slots)  # built only for the keys written to NVMe or published
        oks = np.asarray(and_ok).tolist()
        if all(oks) and t.statuses.count(Status.OK) == len(oks):  # every key OK and copied: no per-key pass
            copied = list(t.statuses)
        else:
            copied = [
                (Status.OK if ok else Status.IO_ERROR) if slot >= 0 else st
                for ok, slot, st in zip(oks, t.slots.tolist(), t.statuses)
            ]
        try:
            st, durable = self.transfers.store_epilogue(t.plan, sources, copied, publish)
        except BaseException:
            self._finish(t, self._not_kept(t))
            raise
        return self._finish(t, StoreResult(st, frozenset(durable)))

    # ------------------------------------------------------------------ load
    def prepare_load(
        self,
        keys: Sequence[bytes],
        *,
        ranks: int = 1,
        wait: bool = False,
        on_ready: Callable[[Ready], None] | None = None,
    ) -> Ticket:
        """Plan a load of ``keys``: a host-resident block is read from its host slot (the index
        holds it: never a victim before completion); an NVMe block is staged into a staging slot
        (on the load queue, or in this thread with ``wait``). A key not resident, or with no
        staging slot left (counted ``staging_full``), is ``MISS``. ``ranks`` and ``on_ready``
        as for :meth:`prepare_store`.

        Raises
        ------
        ConfigError
            For ``ranks < 1``.
        """
        if ranks < 1:
            raise ConfigError(f"ranks={ranks}: must be >= 1")
        plan = self.index.prepare_load(keys)
        n = len(plan.keys)
        slots = np.full(n, -1, dtype=np.int32)
        statuses = [Status.MISS] * n
        need = []
        for i, src in enumerate(plan.sources):
            if src is None:
                continue
            if src[0] == Tier.HOST:
                slots[i], statuses[i] = src[1], Status.OK
            else:
                need.append(i)
        got = self._take_staging(len(need)) if need else []
        staged = dict(zip(need, got))
        if len(got) < len(need):
            self.index.metrics.inc("staging_full", len(need) - len(got))
        for i, s in staged.items():
            slots[i], statuses[i] = s, Status.OK
        if got:
            self.segment.bump_gens(got)
        t = self._open("load", plan, statuses, slots, self.segment.gens_of, ranks, staged, on_ready)
        return self._start(t, not staged or wait, self._load_prelude, self.index.abort_load, _all_missed)

    def _load_prelude(self, t: Ticket, announce: bool) -> None:
        if t.staged:
            try:
                st, t.nvme_s = self.transfers.load_prelude(
                    t.plan, {i: self.slot_plan(s, destination=True) for i, s in t.staged.items()}
                )
            except BaseException:  # the plan was completed: every key a miss
                self._finish(t, [Status.IO_ERROR if s is Status.OK else s for s in t.statuses])
                raise
            failed = tuple(sorted(i for i, s in st.items() if s is not Status.OK))
            t.failed = failed
            t.errors = {i: st[i] for i in failed}
            for i in failed:
                t.statuses[i] = Status.MISS
        self._became_ready(t, announce)

    def complete_load(self, plan_id: int, ok: Sequence[bool], rank: int = 0) -> list[Status] | None:
        """Report rank ``rank``'s copies out of a load ticket's slots (``ok[i]``: key ``i`` was
        scattered and its generation matched). Once every rank reported, the index releases the
        readers (a key some rank did not copy is a miss; a staging read failure is
        ``IO_ERROR``, and the block's NVMe copy is forgotten) and the staging slots are freed.

        Returns
        -------
        list of Status or None
            Per key what the index recorded, once every rank reported; ``None`` before.

        Raises
        ------
        TicketError
            As :meth:`complete_store`.
        """
        t, and_ok = self._report(plan_id, "load", ok, rank)
        if and_ok is None:
            return t.outcome if t.state == DONE else None
        return self._end_load(t, and_ok)

    def _end_load(self, t: Ticket, and_ok) -> list[Status]:
        errors = t.errors
        st = []
        for i, s in enumerate(t.statuses):
            if i in errors:
                st.append(Status.IO_ERROR)
            elif s is Status.OK and and_ok[i]:
                st.append(Status.OK)
            else:
                st.append(Status.MISS)
        loaded = {i: self.slot_plan(s) for i, s in t.staged.items() if st[i] is Status.OK}
        try:
            self.transfers.load_epilogue(t.plan, st, loaded, promote=True, nvme_s=t.nvme_s)
        finally:
            self._finish(t, st)
        return st

    # ------------------------------------------------------------------ reports, abort, expiry
    def _report(self, plan_id: int, kind: str, ok: Sequence[bool], rank: int, block: bool = True):
        """Record one rank's report; ``(ticket, AND of ok)`` when this report completes the
        ticket (the caller then runs the second half), ``(ticket, None)`` otherwise (after the
        ticket's end when it is completing now and ``block``)."""
        with self._lock:
            t = self._tickets.get(plan_id) or self._finished.get(plan_id)
            if t is None:
                raise TicketError(f"plan {plan_id}: no such ticket (never handed out, or finished long ago)")
            if t.kind != kind:
                raise TicketError(f"plan {plan_id} is a {t.kind} ticket, reported as a {kind}")
            if len(ok) != len(t.keys):
                raise TicketError(f"plan {plan_id}: {len(ok)} results for {len(t.keys)} keys")
            if not 0 <= rank < t.ranks:
                raise TicketError(f"plan {plan_id}: rank {rank} outside [0, {t.ranks})")
            if t.state == QUARANTINED:
                raise TicketError(f"plan {plan_id} is quarantined (its client was given up): nothing is kept")
            if t.state in (COMPLETING, DONE):
                wait = t.state == COMPLETING
            else:
                if t.state == PREPARING:
                    raise TicketError(f"plan {plan_id}: not ready yet (its slots are not usable)")
                got = (
                    np.frombuffer(ok, dtype=np.uint8)
                    if isinstance(ok, (bytes, bytearray, memoryview))
                    else ok
                )
                t.reports.setdefault(rank, np.asarray(got, dtype=bool).copy())
                if len(t.reports) < t.ranks:
                    return t, None
                t.state = COMPLETING
                if t.ranks == 1:  # one rank (a solo session): its report is the AND
                    return t, t.reports[rank]
                return t, np.logical_and.reduce(list(t.reports.values()))
        if wait and block:
            t.settled.wait()
        return t, None

    def abort(self, plan_id: int) -> bool:
        """Give up a ticket (also a quarantined one): a store keeps none of its new blocks, a load
        delivers nothing; its slots' generations are bumped, then the slots are free again. The
        caller makes sure no client still copies *into* them (a store's slots; a client reading
        a load's slots sees the bumped generation: a miss). ``False`` for a ticket already
        completing or done (or unknown)."""
        with self._lock:
            t = self._tickets.get(plan_id)
            if t is None or t.state in (COMPLETING, DONE):
                return False
            if t.state == PREPARING:  # its first half is running: it ends the ticket when done
                t.abort_wanted = True
                return True
            t.state = COMPLETING
        self._abort(t)
        return True

    def _abort(self, t: Ticket) -> None:
        self.index.metrics.inc("tickets_aborted")
        have = t.slots[t.slots >= 0]
        if have.size:
            self.segment.bump_gens(have)
        none = np.zeros(len(t.keys), dtype=bool)
        if t.kind == "store":
            self._end_store(t, none, publish=False)
        else:
            self._end_load(t, none)

    def quarantine(self, plan_id: int) -> bool:
        """Take a ticket from its client, who may still be alive (its session ended, or it is
        past its lease): reports are refused from now on; a store ticket keeps its slots and
        its keys stay in flight until :meth:`abort` (the owner is known to be done), a load
        ticket is aborted at once (its readers see the bumped generations). ``False`` for a
        ticket already completing, done or quarantined (or unknown)."""
        with self._lock:
            t = self._tickets.get(plan_id)
            if t is None or t.state in (COMPLETING, DONE, QUARANTINED):
                return False
            if t.kind == "store":
                if t.state == PREPARING:  # quarantined once ready
                    t.quarantine_wanted = True
                else:
                    t.state = QUARANTINED
                    self.index.metrics.inc("tickets_quarantined")
                return True
        return self.abort(plan_id)

    def expire(self, now: float | None = None, quarantine: bool = False) -> int:
        """End every ticket past its lease: aborted (its client is gone), or with ``quarantine``
        (its client may still be alive) quarantined (:meth:`quarantine`); returns how many."""
        now = self.clock() if now is None else now
        with self._lock:
            late = [
                t.plan_id
                for t in self._tickets.values()
                if t.deadline_s <= now and t.state not in (COMPLETING, QUARANTINED)
            ]
        n = sum((self.quarantine if quarantine else self.abort)(p) for p in late)
        if n:
            self.index.metrics.inc("tickets_expired", n)
        return n

    def quarantined_slots(self) -> int:
        """Slots held by quarantined tickets (host and staging)."""
        with self._lock:
            return sum(int((t.slots >= 0).sum()) for t in self._tickets.values() if t.state == QUARANTINED)

    def _became_ready(self, t: Ticket, announce: bool) -> None:
        """The first half is done: the ticket's slots are usable (announced in :meth:`poll`
        when the caller was answered before), or it is aborted now if that was asked meanwhile."""
        tell = None
        with self._lock:
            abort = t.abort_wanted
            if not abort and t.quarantine_wanted:
                t.state, t.ready = QUARANTINED, True
                self.index.metrics.inc("tickets_quarantined")
            elif not abort:
                t.state, t.ready = READY, True
                if announce and t.on_ready is None:
                    self._ready.append(Ready(t.plan_id, t.failed))
                elif announce:
                    tell = t.on_ready
            else:
                t.state = COMPLETING
            t.readied.set()
        if abort:
            self._abort(t)
        elif tell is not None:
            tell(Ready(t.plan_id, t.failed))

    def _finish(self, t: Ticket, outcome) -> object:
        with self._lock:
            if t.state == DONE:
                return t.outcome
            self._give_staging_locked(t.staged.values())
            t.outcome, t.state = outcome, DONE
            self._tickets.pop(t.plan_id, None)
            self._finished[t.plan_id] = t
            while len(self._finished) > self.KEEP_FINISHED:
                self._finished.popitem(last=False)
        t.readied.set()
        t.settled.set()
        return outcome

    def _give_staging_locked(self, slots) -> None:
        for s in slots:
            self.staging.give(s - self.host_slots)

    # ------------------------------------------------------------------ queries
    def poll(self) -> list[Ready]:
        """Tickets that became ready since the last call, in order (those not ready when
        prepared: a ticket handed out ready is not announced again)."""
        with self._lock:
            out = list(self._ready)
            self._ready.clear()
        return out

    def wait_ready(self, plan_id: int, timeout_s: float | None = None) -> bool:
        """Wait until a ticket is ready (or finished); ``False`` on timeout."""
        with self._lock:
            t = self._tickets.get(plan_id) or self._finished.get(plan_id)
        if t is None:
            raise TicketError(f"plan {plan_id}: no such ticket")
        return t.readied.wait(timeout_s)

    def open_ids(self) -> list[int]:
        """Plan ids of the tickets prepared and not yet completed or aborted."""
        with self._lock:
            return list(self._tickets)

    def open_tickets(self) -> int:
        """Tickets prepared and not yet completed or aborted."""
        with self._lock:
            return len(self._tickets)

    def check_invariants(self) -> None:
        """Staging slots free plus those held by open tickets make the capacity, and no slot is
        held twice (then the index's own check).

        Raises
        ------
        InvariantError
        """
        with self._lock:
            held = [s for t in self._tickets.values() for s in t.staged.values()]
            if len(set(held)) != len(held):
                raise InvariantError("a staging slot is held by two tickets")
            if self.staging.free + len(held) != self.staging.capacity:
                raise InvariantError(
                    f"staging: {self.staging.free} free + {len(held)} held != {self.staging.capacity}"
                )
        self.index.check_invariants()
