"""The block index: it decides, it never moves bytes (ARCHITECTURE.md, "The two-phase contract").

Three tiers, fastest first: ``HBM`` (a device block pool), ``HOST`` (a pinned host block pool)
and ``NVME`` (the segment store). An *entry* is one full block of KV, keyed by its 32-byte
chained prefix hash (:mod:`tierstore.identity`); it may have copies in several tiers.

Every operation that moves bytes has two phases (vLLM's ``OffloadingManager``): ``prepare_*``
runs under the index lock and returns a *plan* (which block goes to which slot of which tier,
which victims leave, which are demoted and with which lifetime class); the mover executes it
without the lock; ``complete_*`` applies the outcome under the lock. A lookup never waits for a
copy or an I/O, and a block's placement is decided in one place (:meth:`BlockIndex.prepare_store`,
through :class:`~tierstore.index.placement.Placement`). A prepared plan that is never executed
leaks nothing once aborted (``abort_store``, ``abort_load``).

:class:`BlockIndex` holds the one lock (``_lock``, an RLock, and its ``_idle`` condition), the
count of plans in flight and the NVMe reads in flight (delay hits); its rooms run under that
lock: ``rows`` (:class:`~tierstore.index.rows.RowTable`), ``lookups`` (the lookup path),
``placement``, ``completion`` (phase two), ``pins`` (references and leases), ``listener`` (the
NVMe region manager's callbacks) and ``introspect``. *Residency* is separate from *request
references*: a block is ``ACTIVE`` (referenced), ``PINNED`` (an unexpired lease) or
``EVICTABLE``; one that is active, pinned, being read, stored or evicted is never a victim and is
copied forward on reclaim.

Exact-hit rule: only full blocks are stored and matched; a partial tail is recomputed and
counted in ``partial_tail_tokens``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..contract import MEMORY_TIERS, BlockState, Lease, LoadPlan, LookupResult, PromotePlan, StorePlan, Tier
from ..errors import ConfigError, InvariantError, Status
from ..fdp.lifetime import LifetimeClass, class_from_hint
from ..identity import check_chain_positions
from ..keytable import KeyTable
from ..metrics import Metrics
from ..policies.base import EvictionPolicy
from ..policies.cost import CostModel
from ..policies.lifetime import default_classify
from .completion import Completion
from .introspect import EventLog, Introspection
from .listener import NvmeListener
from .lookup import Lookups
from .pins import Pins
from .placement import Placement
from .rows import NO_HINT, PENDING, RowTable


@dataclasses.dataclass(frozen=True)
class IndexShape:
    """Slot counts of a :class:`BlockIndex` (``build.assemble`` computes them from the layout and
    the tiers' capacities).

    Parameters
    ----------
    block_bytes : int
        Bytes per block (every tier's slot size).
    tokens_per_block : int
    hbm_blocks, host_blocks : int
        Slots of the memory tiers (0 disables a tier).
    nvme_blocks : int or None
        Capacity of the NVMe tier in blocks (sizes the row arrays); ``None``: no NVMe tier.
    """

    block_bytes: int
    tokens_per_block: int
    hbm_blocks: int = 0
    host_blocks: int = 0
    nvme_blocks: int | None = None

    @property
    def nvme(self) -> bool:
        return self.nvme_blocks is not None

    def check(self, policies) -> None:
        """The checks that need both the shape and the policies (the policies' own values are
        validated by their model, :class:`~tierstore.config.PoliciesConfig`).

        Raises
        ------
        ConfigError
            For ``write_through`` without an NVMe tier, or when every tier is disabled.
        """
        if policies.write_policy == "write_through" and not self.nvme:
            raise ConfigError("write_policy='write_through' needs an NVMe tier")
        if self.hbm_blocks == 0 and self.host_blocks == 0 and not self.nvme:
            raise ConfigError("every tier is disabled: give a memory tier capacity or an NVMe tier")


@dataclasses.dataclass
class IndexRuntime:
    """The resolved objects of a :class:`BlockIndex` that a configuration file cannot carry.

    Parameters
    ----------
    clock : callable
        Seconds, monotonic. Tests pass a fake clock.
    classify : callable
        ``f(entry, now_s) -> LifetimeClass`` when a block is written to NVMe
        (:func:`tierstore.policies.lifetime.make_classifier`).
    admit : callable or None
        ``f(entry) -> bool``; ``False`` keeps a demoted block off flash (``None``: admit all).
    reinsert : callable or None
        ``f(entry, now_s) -> bool``: keep (copy forward) an evictable block when its NVMe region
        is evicted. ``None``: only blocks in use are kept.
    cost : CostModel
        Load-versus-recompute model for useful hits.
    remote_victims : bool
        List victims that would be lost in ``StorePlan.lost`` (the shared remote tier's
        ``publish: evict`` mode, :mod:`tierstore.remote`).
    nvme_policy : EvictionPolicy or None
        The order in which single NVMe blocks are evicted (``eviction_granularity: block``; a
        hit on any tier refreshes a block's NVMe copy). ``None``: the NVMe tier evicts regions.
    key_table : KeyTable or None
        The NVMe tier's key table, which the index then shares (one key and slot per block for
        both; the tier owns it). ``None``: the index keeps a table of its own.
    """

    clock: Callable[[], float] = time.monotonic
    classify: Callable = default_classify
    admit: Callable | None = None
    reinsert: Callable | None = None
    cost: CostModel = dataclasses.field(default_factory=CostModel)
    remote_victims: bool = False
    nvme_policy: EvictionPolicy | None = None
    key_table: KeyTable | None = None


def _new_blocks(keys: Sequence[bytes], rows: np.ndarray, statuses: list) -> list[int]:
    """Indices of the ``keys`` a store adds: not in the index (``rows[i] < 0``; doomed rows are
    detached from the key table, so a row found is live) and not given earlier in the call. The
    others' ``statuses[i]`` become ``EXISTS``."""
    n = len(keys)
    have = (rows >= 0).nonzero()[0].tolist()
    for i in have:
        statuses[i] = Status.EXISTS
    if len(have) == n:
        return []
    todo = list(range(n)) if not have else (rows < 0).nonzero()[0].tolist()
    tk = keys if len(todo) == n else [keys[i] for i in todo]
    if len(set(tk)) == len(tk):
        return todo
    seen: set = set()  # a key given twice in one call: its later copies exist already
    uniq = []
    for i in todo:
        if keys[i] in seen:
            statuses[i] = Status.EXISTS
        else:
            seen.add(keys[i])
            uniq.append(i)
    return uniq


#: A store of fewer keys finds or inserts each with one scalar probe (``RowTable.add_new``)
#: instead of a vectorised lookup and a batch insert (each ~20 numpy calls, and the lookup
#: still probes about a third of the keys one by one). On the 2-vCPU VM (session 36, interleaved,
#: load ~4, ``add`` per key): 32 new keys 90-200 us against 142-276 us; 64 a tie (232-349 against
#: 242-355); ``KeyTable.add_many`` takes another ~25 % off the scalar side.
SCALAR_STORE_KEYS = 80

#: A row's tier by its number (``RowTable.tops``).
_TIERS = (Tier.HBM, Tier.HOST, Tier.NVME)


def _hold_sources(rt: RowTable, plan: LoadPlan, reading: dict[int, threading.Event]) -> None:
    """Under the index lock: ``plan.sources`` of a new load plan, each source row held as a reader
    (``plan.rows[i]``: -1 for a key not resident); an NVMe source joins the read in flight of its
    row (``reading``, a delay hit: ``plan.waits``) or leads a new one (``plan.leads``). One gather
    of the rows' tiers and slots for the whole call; only NVMe sources are visited one by one."""
    rows = np.asarray(plan.rows, dtype=np.int64)
    tops = rt.tops(rows)  # -1: absent, pending, doomed or nothing readable
    t0 = int(tops[0]) if tops.size else -1
    if t0 >= 0 and bool((tops == t0).all()):  # every key held in one tier (the common case)
        rt.count_up("readers", rows)  # a key given twice is held twice, as it is released
        slots = rt.slot[_TIERS[t0]][rows].tolist() if t0 in MEMORY_TIERS else [-1] * rows.size
        plan.rows = rows.tolist()
        plan.sources = list(zip(itertools.repeat(_TIERS[t0], rows.size), slots))  # tuples made in C
    else:
        rows[tops < 0] = -1
        held = rows[tops >= 0]
        if held.size:
            rt.count_up("readers", held)
        slot = np.full(rows.size, -1, dtype=np.int64)
        for t in MEMORY_TIERS:
            sel = tops == t
            if sel.any():
                slot[sel] = rt.slot[t][rows[sel]]
        plan.rows = rows.tolist()
        plan.sources = [None if t < 0 else (_TIERS[t], s) for t, s in zip(tops.tolist(), slot.tolist())]
    for r in rows[tops == Tier.NVME].tolist():
        ev = reading.get(r)
        if ev is not None:
            plan.waits.append(ev)
        else:
            reading[r] = threading.Event()
            plan.leads.append(r)


class BlockIndex:
    """Block index, refcounts, pins, states, victim choice and placement decisions.

    Thread-safe: every method takes the index lock, and none holds it across a
    copy or an I/O. See the module doc for the two-phase contract.

    Parameters
    ----------
    shape : IndexShape
    policies : PoliciesConfig
        The policy names and limits (:class:`tierstore.config.PoliciesConfig`, read as is:
        ``eviction``, ``promotion``, ``write_policy``, ``evict_batch_blocks``, ``verify_tokens``,
        ``pin_quota_bytes``, ``default_lease_s``).
    runtime : IndexRuntime, optional

    Raises
    ------
    ConfigError
        From :meth:`IndexShape.check`.

    Attributes
    ----------
    rows, placement, completion, pins, listener, introspect, lookups
        The rooms (module doc); ``listener`` is what ``build`` hands the NVMe tier.
    """

    def __init__(self, shape: IndexShape, policies, runtime: IndexRuntime | None = None) -> None:
        shape.check(policies)
        self.shape = shape
        self.settings = policies
        self.runtime = runtime = runtime if runtime is not None else IndexRuntime()
        self.block_bytes = shape.block_bytes
        self.tokens_per_block = shape.tokens_per_block
        c = shape
        self.rows = RowTable(
            max(1024, c.hbm_blocks + c.host_blocks + (c.nvme_blocks or 0) + 64),
            c.block_bytes,
            {Tier.HBM: c.hbm_blocks, Tier.HOST: c.host_blocks},  # each tier's SlotAllocator (placement.py)
            runtime.key_table,
        )
        self.metrics = Metrics()
        self.placement = Placement(self.rows, self.metrics, shape, policies, runtime)
        self.tiers = self.placement.tiers
        self.policies = self.placement.policies
        self._alloc = self.placement.alloc
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._pending_plans = 0
        self._invalidating: dict[bytes, int] = {}  # namespace -> invalidations in progress
        self._reading: dict[int, threading.Event] = {}  # row -> its NVMe read in flight (delay hits)
        self.events = EventLog(self._lock)
        self._open_rooms(policies, runtime)

    def _open_rooms(self, policies, runtime: IndexRuntime) -> None:
        """The rooms that run under the index lock beside ``rows`` and ``placement`` (module doc)."""
        c = self.shape
        self.completion = Completion(
            self.rows,
            self.placement,
            self.metrics,
            self.events,
            self._idle,
            self._now,
            c.tokens_per_block,
            runtime.cost,
            runtime.nvme_policy,
        )
        self.pins = Pins(
            self.rows,
            self._lock,
            self._now,
            self.metrics,
            policies.pin_quota_bytes,
            policies.default_lease_s,
            self.completion.maybe_free_doomed,
        )
        self.listener = NvmeListener(
            self.rows,
            self._lock,
            self._now,
            runtime.reinsert,
            self.metrics,
            self.events,
            self.completion.forget_if_empty,
            runtime.nvme_policy,
        )
        self.introspect = Introspection(
            self.rows,
            self._lock,
            self._now,
            self.tiers,
            self._alloc,
            self.policies,
            self.pins,
            runtime.nvme_policy,
        )
        self.lookups = Lookups(
            self.rows,
            self._lock,
            self._now,
            self.placement,
            self.pins,
            self.listener,
            self.metrics,
            runtime.cost,
            policies.verify_tokens,
            c.tokens_per_block,
        )

    # ================================================================ helpers
    def _now(self) -> float:
        return self.runtime.clock()

    def _close(self, plan: StorePlan | LoadPlan | PromotePlan, call: str) -> None:
        """Under the index lock: ``plan`` is done and no longer pending.

        Raises
        ------
        InvariantError
            When ``plan`` was done already (``call`` names the second completion).
        """
        if plan.done:
            raise InvariantError(f"{call} called twice for one plan")
        plan.done = True
        self._pending_plans -= 1

    def _counted(self, choose: Callable[[], Any]) -> Any:
        """``choose()`` under the index lock; a plan it returns (not ``None``) is counted pending."""
        with self._lock:
            plan = choose()
            if plan is not None:
                self._pending_plans += 1
            return plan

    record_events = property(
        lambda self: self.events.on,
        lambda self, on: setattr(self.events, "on", bool(on)),
        doc="Whether events are recorded for :meth:`take_events` (tests turn it on).",
    )

    def take_events(self) -> list[tuple]:
        """Drain recorded events ``(kind, key, tier label)`` (``record_events`` must be on)."""
        return self.events.take()

    # ================================================================ queries
    def probe(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys resident. Takes no reference, touches no recency, counts no hit."""
        with self._lock:
            tops = self.rows.tops(self.rows.table.get_many(keys))
            miss = (tops < 0).nonzero()[0]
            return int(miss[0]) if miss.size else len(tops)

    def resident(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a readable copy exists. Touches nothing."""
        with self._lock:
            return (self.rows.tops(self.rows.table.get_many(keys)) >= 0).tolist()

    def lookup(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[np.ndarray] | None = None,
        request_id: object = None,
        num_prompt_tokens: int | None = None,
    ) -> LookupResult:
        """Longest resident prefix of ``keys``.

        Parameters
        ----------
        keys : sequence of bytes
            Chained hashes of the prompt's full blocks.
        tokens : sequence of numpy.ndarray, optional
            Token ids per block; compared with stored ids when ``verify_tokens`` is on.
        request_id : hashable, optional
            Each matched block gets a request reference (ACTIVE) until :meth:`release`.
        num_prompt_tokens : int, optional
            The prompt length, for the partial-tail metric.

        Returns
        -------
        LookupResult
        """
        now = self._now()
        with self._lock:
            return self.lookups.lookup(keys, tokens, request_id, num_prompt_tokens, now)

    # ================================================================ store
    def prepare_store(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        lifetime: LifetimeClass | str | None = None,
        first_position: int = 0,
        tokens: Sequence[np.ndarray] | None = None,
    ) -> StorePlan:
        """Decide where each new block goes (phase one of a store).

        Parameters
        ----------
        ns : bytes
            32-byte namespace digest.
        keys : sequence of bytes
            Chained block keys, in chain order.
        lifetime : LifetimeClass or str, optional
            Engine hint (``"system"``, ``"conversation"``, ``"query"``).
        first_position : int
            Chain position of ``keys[0]``.
        tokens : sequence of numpy.ndarray, optional
            Token ids per block (kept with ``verify_tokens``).

        Returns
        -------
        StorePlan
            Keys already stored or in flight are ``EXISTS``; a block that fits
            nowhere is ``NO_SPACE``, and so is every later block of the chain
            (they would be unreachable).

        Raises
        ------
        LayoutError
            ``first_position`` is not an int, is negative, or puts a block past int32's range.
        """
        n = len(keys)
        check_chain_positions(first_position, n)
        hint = class_from_hint(lifetime)
        hint_i = NO_HINT if hint is None else int(hint)
        now = self._now()
        plan = StorePlan(list(keys), [None] * n, [-1] * n, ns=ns)
        with self._lock:
            if ns in self._invalidating:  # its durable record is being written: nothing new now
                plan.statuses = [Status.REJECTED] * n
                self._pending_plans += 1
                self.metrics.inc("store_rejected_invalidating", n)
                return plan
            nid = self.rows.namespaces.intern(ns)
            if n < SCALAR_STORE_KEYS:  # one scalar probe a key finds or inserts it
                todo, new = self.rows.add_new(keys, nid, first_position, hint_i, now, plan.statuses)
            else:  # one vectorised lookup, then one batch insert of the new keys
                todo = _new_blocks(keys, self.rows.table.get_many(keys), plan.statuses)
                tk = keys if len(todo) == n else [keys[i] for i in todo]
                new = []
                if todo:
                    new = self.rows.new_rows(
                        tk, nid, np.asarray(todo, dtype=np.int64) + first_position, hint_i, now
                    ).tolist()
            if todo:
                if len(todo) == n:
                    plan.rows = new
                else:
                    for i, r in zip(todo, new):
                        plan.rows[i] = r
                if self.settings.verify_tokens and tokens is not None:
                    for i, r in zip(todo, new):
                        self.rows.tokens[r] = np.asarray(tokens[i], dtype=np.int64).copy()
                self.placement.place(plan, todo, now)
            self._pending_plans += 1
            if n - len(todo):
                self.metrics.inc("store_exists", sum(1 for s in plan.statuses if s is Status.EXISTS))
        return plan

    def prepare_evict(self, tier: Tier, n: int) -> StorePlan | None:
        """Plan the eviction of ``n`` unprotected blocks of memory tier ``tier``
        now (demoted like any victim; all or nothing). ``None`` if ``n`` such
        blocks do not exist. Execute it like a store plan."""
        if tier not in self._alloc or n <= 0:
            return None
        return self._counted(lambda: self.placement.evict(tier, n, self._now()))

    def abort_store(self, plan: StorePlan) -> None:
        """Release a prepared store that will not be executed (nothing leaks)."""
        if not plan.done:
            self.complete_store(plan, failed=True)

    def complete_store(
        self,
        plan: StorePlan,
        nvme_statuses: dict[int, Status] | None = None,
        demote_statuses: dict[int, Status] | None = None,
        failed: bool = False,
        memory_statuses: dict[int, Status] | None = None,
    ) -> list[Status]:
        """Apply a store's outcome (phase two).

        Parameters
        ----------
        plan : StorePlan
        nvme_statuses : dict, optional
            ``i -> Status`` of each ``plan.nvme_new`` write.
        demote_statuses : dict, optional
            ``row -> Status`` of each ``plan.nvme_demote`` write.
        failed : bool
            The mover raised. The new blocks are forgotten. What happened to the
            victims depends on how far the mover got (``plan.moved``): before
            its NVMe batch, nothing happened and they keep their copies; after
            it, their NVMe writes count (``plan.demote_statuses``) and they
            leave their tier, since later copies may have overwritten their
            slots; their copies down into memory count only if the mover
            finished them. A miss, never wrong KV.
        memory_statuses : dict, optional
            ``i -> Status`` of each new block's copy into its slot by a client (split execution);
            not ``OK``: forgotten like a failed NVMe write.

        Returns
        -------
        list of Status
            Per key: ``OK``, ``EXISTS``, ``NO_SPACE`` or ``IO_ERROR``.
        """
        nvme_statuses = nvme_statuses or {}
        demote_statuses = demote_statuses or {}
        now = self._now()
        with self._lock:
            self._close(plan, "complete_store")
            out = self.completion.finish_store(
                plan, nvme_statuses, demote_statuses, failed, now, memory_statuses
            )
            self._idle.notify_all()
            return out

    def complete_victims(self, plan: StorePlan) -> None:
        """Apply a store plan's victims first (split execution, :meth:`Completion.finish_victims`)."""
        with self._lock:
            self.completion.finish_victims(plan, self._now())

    # ================================================================ load
    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Choose each key's source copy and hold it (phase one of a load).

        ``sources[i]`` is ``(tier, slot)``; ``None`` for a key not resident.
        Each held row is never a victim until :meth:`complete_load`.
        """
        with self._lock:
            plan = LoadPlan(list(keys), self.rows.table.get_many(keys), [])  # type: ignore[arg-type]  # listed by _hold_sources
            _hold_sources(self.rows, plan, self._reading)
            self._pending_plans += 1
            return plan

    def abort_load(self, plan: LoadPlan) -> None:
        """Release a prepared load that moved nothing (no metrics are counted)."""
        with self._lock:
            if plan.done:
                raise InvariantError("load plan completed twice")
            plan.done = True
            self._pending_plans -= 1
            for r, src in zip(plan.rows, plan.sources):
                if src is not None:
                    self.rows.readers[r] -= 1
                    self.completion.maybe_free_doomed(r)
            self._end_reads(plan)
            self._idle.notify_all()

    def _end_reads(self, plan: LoadPlan | PromotePlan) -> None:
        for r in plan.leads:
            ev = self._reading.pop(r, None)
            if ev is not None:
                ev.set()

    def complete_load(
        self, plan: LoadPlan, statuses: Sequence[Status], promote: bool = True, nvme_s: float | None = None
    ) -> PromotePlan | None:
        """Release a load's holds and record its outcome (phase two).

        Parameters
        ----------
        plan : LoadPlan
        statuses : sequence of Status
            Per key, what the mover delivered (``OK``, ``MISS``, ``IO_ERROR``).
        promote : bool
            Whether to plan copies of loaded blocks into a faster memory tier.
        nvme_s : float, optional
            Seconds the NVMe part took (feeds the cost model's bandwidth).

        Returns
        -------
        PromotePlan or None
            Copies the mover makes from the loaded bytes, then passes to
            :meth:`complete_promote`.
        """
        now = self._now()
        with self._lock:
            self._close(plan, "complete_load")
            promote = promote and self.settings.promotion != "none"
            promos = self.completion.finish_load(plan, statuses, promote, nvme_s)
            self._idle.notify_all()
            promo = self.placement.plan_promotions(promos, now) if promos else None
            if promo is None:
                self._end_reads(plan)
            else:  # followers wait until the promoted copies are in place
                self._pending_plans += 1
                promo.leads = plan.leads
            return promo

    def prepare_prefetch(self, keys: Sequence[bytes], target: Tier) -> PromotePlan | None:
        """Plan copies of resident blocks up to memory tier ``target`` (a prefetch).

        Blocks already in ``target`` or faster are skipped; a slot is taken
        only if free or held by a block with a lower copy (no cascade). The
        sources are held until :meth:`complete_promote`.

        Raises
        ------
        ConfigError
            If ``target`` is not an enabled memory tier.
        """
        if target not in self._alloc:
            raise ConfigError(
                f"prefetch target {Tier(target).label!r}: accepted values are "
                f"{[t.label for t in self._alloc]} (enabled memory tiers)"
            )
        now = self._now()
        return self._counted(lambda: self.placement.reserve_prefetch(keys, target, now))

    def complete_promote(self, plan: PromotePlan, ok: Sequence[bool]) -> None:
        """Apply promotions: ``ok[j]`` says whether item ``j``'s copy landed
        (the victims' copies down, executed first, always did)."""
        now = self._now()
        with self._lock:
            self._close(plan, "complete_promote")
            self._end_reads(plan)
            self.completion.finish_promote(plan, ok, now)
            self._idle.notify_all()

    # ================================================================ flush (clean shutdown)
    def take_clean_requests(self) -> int:
        """Blocks the index would like cleaned (written to NVMe) in the background, and reset."""
        with self._lock:
            n, self.placement.clean_wanted = self.placement.clean_wanted, 0
            return n

    def prepare_flush(self, max_blocks: int, coldest_first: bool = False) -> StorePlan | None:
        """Plan NVMe writes of up to ``max_blocks`` blocks that live only in memory.

        Used at a clean shutdown so that a restart finds them, and in the
        background to keep clean victims for promotions (``coldest_first``:
        least recently used first). Returns ``None`` when nothing is left to write.
        Each block is read from a readable memory copy (host first); a block whose
        only memory copy is a victim of a store in flight is skipped.
        """
        if Tier.NVME not in self.tiers:
            return None
        now = self._now()
        return self._counted(lambda: self.placement.pick_flush(max_blocks, coldest_first, now))

    def complete_flush(self, plan: StorePlan, demote_statuses: dict[int, Status]) -> int:
        """Apply a flush; returns blocks now on NVMe."""
        with self._lock:
            plan.done = True
            self._pending_plans -= 1
            n = self.completion.finish_flush(plan, demote_statuses)
            self._idle.notify_all()
            return n

    # ================================================================ references and pins
    def release(self, request_id: object) -> int:
        """Drop every reference ``request_id`` holds (:meth:`Pins.release`)."""
        return self.pins.release(request_id)

    def cancel(self, request_id: object) -> int:
        """Abort a request (:meth:`Pins.cancel`)."""
        return self.pins.cancel(request_id)

    def pin(self, ns: bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """Hold resident blocks until the lease expires or :meth:`unpin` (:meth:`Pins.pin`)."""
        return self.pins.pin(ns, keys, lease_s)

    def unpin(self, lease_id: int) -> bool:
        """End a lease early (:meth:`Pins.unpin`)."""
        return self.pins.unpin(lease_id)

    @property
    def leases(self) -> dict[int, Lease]:
        """Live leases by id (a copy)."""
        return self.pins.live_leases()

    # ================================================================ removal
    def invalidate(self, ns: bytes) -> int:
        """Hide every block of namespace ``ns`` now; in-use blocks are freed on
        release and in-flight stores of it are discarded when they complete.
        Waits until those stores are done, so that the caller's durable
        invalidation record follows them. Until :meth:`end_invalidate`, stores
        of ``ns`` are refused (``REJECTED``): one prepared between this call and
        the durable record would be written before the record, so a restart
        would drop a block the index acknowledged. Returns the blocks removed."""
        with self._lock:
            self._invalidating[ns] = self._invalidating.get(ns, 0) + 1
            if ns not in self.rows.namespaces.ids:
                return 0
            n, pending = self.completion.remove_namespace(ns)
            self.pins.end_namespace(ns)
            while any(self.rows.flags[r] & PENDING and r in self.rows.doomed for r in pending):
                self._idle.wait()
            return n

    def end_invalidate(self, ns: bytes) -> None:
        """The durable record of an :meth:`invalidate` of ``ns`` is written (or failed): stores
        of ``ns`` are taken again."""
        with self._lock:
            left = self._invalidating.get(ns, 0) - 1
            if left > 0:
                self._invalidating[ns] = left
            else:
                self._invalidating.pop(ns, None)

    def remove(self, keys: Iterable[bytes]) -> int:
        """Remove blocks by key (in-use blocks are hidden now and freed on release).
        Returns the number that were resident."""
        with self._lock:
            return self.completion.remove_keys(keys)

    def clear(self) -> int:
        """Remove every block (in-use blocks are doomed and freed on release)."""
        with self._lock:
            n = self.completion.remove_all()
            self.pins.end_namespace()
            return n

    # ================================================================ introspection
    def state_of(self, key: bytes) -> BlockState | None:
        """Ownership state of a visible block, or ``None`` if not resident."""
        return self.introspect.state_of(key)

    def tiers_of(self, key: bytes) -> list[Tier]:
        """Tiers holding a readable copy of ``key`` (empty if not resident)."""
        return self.introspect.tiers_of(key)

    def references(self) -> dict[object, int]:
        """``request_id -> blocks referenced`` of every open request."""
        return self.introspect.references()

    def block_info(self, key: bytes) -> dict | None:
        """A visible block's index record as a dict, or ``None``."""
        return self.introspect.block_info(key)

    def memory_slot(self, key: bytes, tier: Tier) -> int:
        """Slot of ``key`` in a memory tier, or -1."""
        return self.introspect.memory_slot(key, tier)

    def __len__(self) -> int:
        return len(self.rows.table)

    def resident_blocks(self) -> dict[str, int]:
        """Blocks with a copy in each tier."""
        return self.introspect.resident_blocks()

    def bytes_per_tier(self) -> dict[str, int]:
        """Resident bytes per tier."""
        return self.introspect.bytes_per_tier()

    def namespaces(self) -> dict[bytes, int]:
        """Visible blocks per namespace digest."""
        return self.introspect.namespaces()

    def keys_of_namespace(self, ns: bytes) -> list[bytes]:
        """Visible keys of namespace ``ns``."""
        return self.introspect.keys_of_namespace(ns)

    def nbytes(self) -> int:
        """Bytes of per-block metadata (key table and row arrays)."""
        return self.rows.nbytes()

    def in_flight(self) -> int:
        """Prepared plans not yet completed."""
        with self._lock:
            return self._pending_plans

    def check_invariants(self, quiescent: bool = False) -> None:
        """Verify that slots, policies, references and flags agree (:meth:`Introspection.check_invariants`;
        ``quiescent``: also that no plan is in flight and nothing is held).

        Raises
        ------
        InvariantError
        """
        with self._lock:
            self.introspect.check_invariants(quiescent, self._pending_plans)
