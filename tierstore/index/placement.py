"""Where blocks go: slots, victims and their fate, promotions, flushes (the index's placement room).

:class:`Placement` owns the memory tiers' slot allocators and eviction policies, the SSD
admission policy and the lifetime classifier, and makes every placement decision of a plan:
a new block's tier (``write_back``: the fastest memory tier with room, then NVMe;
``write_through``: NVMe, plus a memory copy where room is cheap), the victims that make room and
each victim's fate (dropped when a lower copy exists, moved down into the next memory tier, or
written to NVMe when admitted), the lifetime class of every NVMe write (:meth:`nvme_lifetime`,
the one place it is decided), promotions and prefetches (never an NVMe write) and the blocks a
flush writes. It changes rows (flags, holds) but completes nothing. It runs under the index
lock (``BlockIndex._lock``) and has none of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..contract import MEMORY_TIERS, Demotion, PromotePlan, StorePlan, Tier
from ..errors import Status
from ..fdp.lifetime import LifetimeClass
from ..metrics import Metrics
from ..policies.base import EvictionPolicy, make_policy
from ..policies.lifetime import default_classify, default_classify_many
from ..tiers.memory import SlotAllocator
from .rows import DOOMED, EVICT, EVICT_HBM, EVICT_HOST, NVME_WRITING, ON_NVME, PENDING, RowTable

if TYPE_CHECKING:
    from .core import IndexRuntime, IndexShape

#: LifetimeClass by value (a vectorised classification back to the enum).
_CLASSES = tuple(LifetimeClass)


def choose_victims(
    evict: Callable[[int, Callable[[Any], bool], int | None], list],
    n: int,
    batch: int,
    protected: Callable[[Any], bool],
    max_scan: int | None,
    upto: Callable[[int, Callable[[Any], bool], int | None], list] | None = None,
) -> list:
    """Up to ``max(n, batch)`` victims: a batch when the policy has one, else ``n``, else as many
    of ``n`` as it gives one at a time (fewer than ``n`` evictable: a partial answer).

    Parameters
    ----------
    evict : callable
        ``evict(count, protected, max_scan) -> list``: the eviction policy's choice of up to
        ``count`` coldest keys that ``protected`` does not keep, looking at ``max_scan`` at most
        (``None``: all); an empty list when it cannot give ``count``.
    n : int
        Victims needed.
    batch : int
        Victims worth taking at once (``evict_batch_blocks``).
    protected : callable
        ``protected(key) -> bool``: a key that must not be chosen.
    max_scan : int or None
        As ``evict``'s; one-at-a-time picks widen it by the keys already taken.
    upto : callable, optional
        The policy's :meth:`~tierstore.policies.base.EvictionPolicy.evict_upto`
        (``upto(count, protected, max_scan)``) when its ``evict_is_prefix``: the whole
        answer from one call, the same victims in the same order. Without it, a failed batch
        and a failed ``n`` are each a scan of the policy's order, and each one-at-a-time pick
        scans it again from its coldest end past every protected key, under the index lock
        (a 256-block store into a 64-slot tier: 16-19 ms one pick at a time; 13 scans of the
        tier in halving runs, 1.5 ms CPU; one vectorised pass now, 0.15 ms; issue 25 item 4).
    """
    want = max(n, batch)
    if upto is not None:
        got = upto(want, protected, max_scan)
        return got if len(got) == want else got[:n]  # evict(want) refused: evict(n), else the picks
    victims = evict(want, protected, max_scan) if want > n else []
    if not victims:
        victims = evict(n, protected, max_scan)
    if not victims:
        taken: set = set()
        one = lambda k: protected(k) or k in taken  # noqa: E731
        while len(victims) < n:
            v = evict(1, one, None if max_scan is None else max_scan + len(taken))
            if not v:
                break
            taken.update(v)
            victims.extend(v)
    return victims


class Protector:
    """Never a victim: a key in ``extra``, absent from the index, or protected at ``now``
    (:meth:`RowTable.protected`). Called per key, or per chunk of keys with :meth:`many`."""

    __slots__ = ("extra", "now", "rows")

    def __init__(self, rows: RowTable, extra: set | None, now: float) -> None:
        self.rows = rows
        self.extra = extra
        self.now = now

    def __call__(self, key: bytes) -> bool:
        if self.extra is not None and key in self.extra:
            return True
        row = self.rows.table.get(key)
        return row < 0 or self.rows.protected(row, self.now)

    def many(self, keys: list[bytes]) -> np.ndarray:
        """``bool`` per key of ``keys`` (one key-table probe and one row test per call)."""
        p = self.rows.protected_many(self.rows.table.get_many(keys), self.now)
        if self.extra:
            extra = self.extra
            p |= np.fromiter((k in extra for k in keys), dtype=bool, count=len(keys))
        return p


class Placement:
    """Placement decisions of the block index (called under its lock).

    Parameters
    ----------
    rows : RowTable
    metrics : Metrics
        The index's counters (evictions, admission rejections, refused stores).
    shape : IndexShape
        The memory tiers' slots (a tier of 0 slots is disabled) and whether an NVMe tier exists.
    policies : PoliciesConfig
        ``eviction`` (of the memory tiers, :func:`tierstore.policies.make_policy`),
        ``write_policy``, ``promotion`` and ``evict_batch_blocks`` (victims taken per eviction
        round: batches demotions to NVMe).
    runtime : IndexRuntime
        ``admit`` and ``classify`` (of a block written to NVMe), and ``remote_victims`` (list
        victims that would be lost in ``StorePlan.lost``).
    """

    #: Bound on the remembered admission-rejected keys (32 B each).
    REJECTED_KEYS_MAX = 1 << 18
    #: Coldest blocks of the last memory tier a promotion looks at for a victim
    #: that has an NVMe copy (leaves without a write); none among them: no slot.
    CHEAP_SCAN_BLOCKS = 64
    #: New NVMe blocks of a store classified in one vectorised pass from this many on (numpy's
    #: fixed cost per call is ~10 us; a view and a call cost ~3 us a block).
    VECTOR_MIN_BLOCKS = 8

    def __init__(
        self, rows: RowTable, metrics: Metrics, shape: IndexShape, policies, runtime: IndexRuntime
    ) -> None:
        self.rows = rows
        self.metrics = metrics
        hbm_blocks, host_blocks = shape.hbm_blocks, shape.host_blocks
        self.tiers: list[Tier] = [t for t, n in ((Tier.HBM, hbm_blocks), (Tier.HOST, host_blocks)) if n] + (
            [Tier.NVME] if shape.nvme else []
        )
        self.alloc: dict[Tier, SlotAllocator] = {}
        if hbm_blocks:
            self.alloc[Tier.HBM] = SlotAllocator(hbm_blocks)
        if host_blocks:
            self.alloc[Tier.HOST] = SlotAllocator(host_blocks)
        self.policies: dict[Tier, EvictionPolicy] = {t: make_policy(policies.eviction) for t in self.alloc}
        self.write_policy = policies.write_policy
        self.promotion = policies.promotion
        self.evict_batch_blocks = policies.evict_batch_blocks
        self.admit = runtime.admit
        self.classify = runtime.classify
        self.remote_victims = runtime.remote_victims
        self.rejected: dict[bytes, None] = {}  # keys admission kept off NVMe (bounded, oldest first out)
        self.clean_wanted = 0  # promotions that found only dirty victims

    def place(self, plan: StorePlan, todo: list[int], now: float) -> None:
        """Decide the tier of each new block ``todo`` of ``plan`` (its rows exist, ``PENDING``)."""
        if self.write_policy == "write_through":
            self._place_write_through(plan, todo, now)
        else:
            self._place_write_back(plan, todo, now)

    def protector(self, extra: set | None, now: float) -> Protector:
        """``f(key) -> bool``: never a victim (in ``extra``, absent, or protected now)."""
        return Protector(self.rows, extra, now)

    def lower_memory(self, tier: Tier) -> Tier | None:
        """The memory tier a victim of ``tier`` moves down into, if any."""
        if tier == Tier.HBM and Tier.HOST in self.alloc:
            return Tier.HOST
        return None

    def has_lower_copy(self, row: int, tier: Tier) -> bool:
        """Whether ``row`` keeps a readable copy below ``tier`` (dropping it there loses nothing)."""
        f = int(self.rows.flags[row])
        if tier == Tier.HBM and self.rows.slot[Tier.HOST][row] >= 0 and not f & EVICT_HOST:
            return True
        return bool(f & ON_NVME)

    def nvme_lifetime(self, row: int, key: bytes, now: float) -> LifetimeClass:
        """The one place a block's lifetime class (hence its FDP placement) is decided."""
        c = self.classify(self.rows.view(row, key), now)
        self.rows.nvme_class[row] = int(c)
        return c

    def _nvme_new(self, plan: StorePlan, todo: list[int], now: float) -> None:
        """The new blocks ``todo`` of ``plan`` go to NVMe (``plan.nvme_new``), each with its
        lifetime class (:meth:`nvme_lifetime`); with the default classifier, one vectorised pass
        over their rows (``default_classify_many``) instead of a view and a call per block."""
        if self.classify is not default_classify or len(todo) < self.VECTOR_MIN_BLOCKS:
            for i in todo:
                plan.nvme_new.append((i, self.nvme_lifetime(plan.rows[i], plan.keys[i], now)))
            return
        rows = np.asarray([plan.rows[i] for i in todo], dtype=np.int64)
        c = default_classify_many(self.rows.hint[rows], self.rows.hits[rows])
        self.rows.nvme_class[rows] = c
        plan.nvme_new.extend(zip(todo, map(_CLASSES.__getitem__, c.tolist())))

    def _place_write_back(self, plan: StorePlan, todo: list[int], now: float) -> None:
        left = todo
        for t in self.tiers:
            if not left:
                break
            if t == Tier.NVME:
                self._nvme_new(plan, left, now)
                left = []
                break
            slots = self.reserve(t, len(left), plan, None, now)
            plan.memory.extend(zip(left, itertools.repeat(t), slots))
            left = left[len(slots) :]
        if left:  # fits nowhere: this block and the rest of the chain
            self.refuse(plan, left)

    def _place_write_through(self, plan: StorePlan, todo: list[int], now: float) -> None:
        self._nvme_new(plan, todo, now)
        left = todo
        for t in MEMORY_TIERS:  # cache a copy where room is free or cheap (victims with a lower copy)
            if t not in self.alloc or not left:
                continue
            slots = self.reserve(t, len(left), plan, None, now, cheap_only=True)
            plan.memory.extend(zip(left, itertools.repeat(t), slots))
            left = left[len(slots) :]

    def refuse(self, plan: StorePlan, idx: list[int]) -> None:
        """The blocks ``idx`` fit nowhere: they and every later block of the chain are ``NO_SPACE``."""
        first = min(idx)
        for i in range(first, len(plan.keys)):
            if plan.statuses[i] is None:
                plan.statuses[i] = Status.NO_SPACE
                if plan.rows[i] >= 0:
                    self.rows.drop_new(plan.rows[i])
                    plan.rows[i] = -1
        plan.memory = [m for m in plan.memory if plan.statuses[m[0]] is None]
        plan.nvme_new = [m for m in plan.nvme_new if plan.statuses[m[0]] is None]
        self.metrics.inc(
            "store_no_space",
            len(plan.keys) - first - sum(1 for s in plan.statuses[first:] if s is Status.EXISTS),
        )

    def reserve(
        self, tier: Tier, n: int, plan: StorePlan, protect: set | None, now: float, cheap_only: bool = False
    ) -> list[int]:
        """Up to ``n`` slots of memory tier ``tier`` for ``plan``: free ones, then
        victims' (:meth:`victimize`; a batch of ``evict_batch_blocks`` at least,
        so demotions to NVMe go out together). ``protect``: keys never to take
        as victims; ``None`` is the plan's own keys (and victims chosen so far)."""
        slots = self.alloc[tier].take(n)
        need = n - len(slots)
        if need <= 0:
            return slots
        if protect is None:
            if plan.protect is None:
                plan.protect = set(plan.keys)
            protect = plan.protect
        vrows = self.victimize(
            tier, need, plan, protect, now, cheap_only, batch=1 if cheap_only else self.evict_batch_blocks
        )
        given = [int(self.rows.slot[tier][r]) for r in vrows[:need]]
        plan.given.update((tier, s) for s in given)
        return slots + given

    def victimize(
        self,
        tier: Tier,
        n: int,
        plan: StorePlan,
        protect: set,
        now: float,
        cheap_only: bool = False,
        batch: int = 1,
    ) -> list[int]:
        """Choose ``n`` (up to ``max(n, batch)``) victims in ``tier`` and decide each
        one's fate: dropped when it has a lower copy, else demoted to the next
        memory tier (recursively making room there) or to NVMe (if admitted),
        else lost. Every victim's slot is freed (or given on) when ``plan``
        completes. Returns the victims' rows (fewer than ``n`` when fewer are
        evictable)."""
        policy = self.policies[tier]
        prot: Callable[[bytes], bool] = self.protector(protect, now)
        lower = self.lower_memory(tier)
        scan = None
        if cheap_only and lower is None:  # no NVMe writes: only victims with a lower copy
            inner = prot
            prot = lambda k: inner(k) or not self.has_lower_copy(self.rows.table.get(k), tier)  # noqa: E731
            scan = self.CHEAP_SCAN_BLOCKS  # among the coldest few (a full scan per promotion was O(tier))
        victims = choose_victims(
            lambda m, p, s: policy.evict(m, p, now, max_scan=s),
            n,
            batch,
            prot,
            scan,
            (lambda m, p, s: policy.evict_upto(m, p, now, max_scan=s)) if policy.evict_is_prefix else None,
        )
        if not victims:
            return []
        vrows = self.rows.table.get_many(victims).tolist()
        demote: list[tuple[int, bytes]] = []
        for k, r in zip(victims, vrows):
            self.rows.flags[r] |= EVICT[tier]
            protect.add(k)
            if not self.has_lower_copy(r, tier):
                demote.append((r, k))
        if demote and lower is not None:
            dst = self.reserve(lower, len(demote), plan, protect, now, cheap_only)
            for (r, k), s in zip(demote, dst):
                plan.copies.append(Demotion(r, k, tier, int(self.rows.slot[tier][r]), lower, s))
            demote = demote[len(dst) :]
            if cheap_only and demote:  # these would need NVMe writes: they stay where they are
                back = {r for r, _ in demote}
                for r, k in demote:
                    self.rows.flags[r] &= 0xFF ^ EVICT[tier]
                    protect.discard(k)
                vrows = [r for r in vrows if r not in back]
                demote = []
        self.metrics.inc(f"evictions_{tier.label}", len(vrows))
        for r in vrows:
            plan.frees.append((r, tier, int(self.rows.slot[tier][r])))
        if demote and Tier.NVME in self.tiers:
            self._demote_to_nvme(tier, demote, plan, now)
        elif demote and self.remote_victims:
            plan.lost.extend((k, tier, int(self.rows.slot[tier][r])) for r, k in demote)
        return vrows

    def _demote_to_nvme(
        self, tier: Tier, demote: list[tuple[int, bytes]], plan: StorePlan, now: float
    ) -> None:
        """Victims of ``tier`` without a lower copy go to NVMe when admitted (``plan.nvme_demote``,
        with their lifetime class); a rejected one is remembered in ``rejected`` (bounded), counted,
        and, with ``remote_victims``, listed in ``plan.lost``."""
        admit = self.admit
        for r, k in demote:
            if admit is not None and not admit(self.rows.view(r, k)):
                self.rejected[k] = None
                self.metrics.add(
                    {"admission_rejected_blocks": 1, "admission_rejected_bytes": self.rows.block_bytes}
                )
                if self.remote_victims:
                    plan.lost.append((k, tier, int(self.rows.slot[tier][r])))
                continue
            plan.nvme_demote.append(self._nvme_write(r, k, tier, now))
        while len(self.rejected) > self.REJECTED_KEYS_MAX:
            self.rejected.pop(next(iter(self.rejected)))

    def _nvme_write(self, r: int, key: bytes, tier: Tier, now: float) -> Demotion:
        """Row ``r``'s copy in memory ``tier`` as an NVMe write (its lifetime class, its namespace),
        the row marked ``NVME_WRITING`` until the write completes."""
        self.rows.flags[r] |= NVME_WRITING
        return Demotion(
            r,
            key,
            tier,
            int(self.rows.slot[tier][r]),
            Tier.NVME,
            -1,
            self.nvme_lifetime(r, key, now),
            self.rows.namespaces.digests[int(self.rows.ns[r])],
        )

    def plan_promotions(self, promos: list, now: float) -> PromotePlan | None:
        """Reserve faster slots for just-loaded blocks. A promotion never writes
        to NVMe: it takes a free slot, or a victim's that has a lower copy or
        fits in the next memory tier (that copy is part of the plan)."""
        plan = PromotePlan([])
        protect = {self.rows.table.key_of(r) for _, r, _ in promos}
        full: set = set()  # tiers where no slot was found: later blocks of this call skip them
        for i, r, src in promos:
            upper = [t for t in self.alloc if t < src and self.rows.slot[t][r] < 0]
            if not upper:
                continue
            dst = upper[0] if self.promotion == "top" else upper[-1]
            got = [] if dst in full else self.reserve(dst, 1, plan.victims, protect, now, cheap_only=True)
            if not got:
                # every candidate victim is dirty (lives only in memory): ask for a
                # background clean so that later promotions find clean victims. The
                # search is not repeated for the rest of this load (under the lock,
                # each one scans the tier's policy order: it was O(tier) per block)
                full.add(dst)
                self.clean_wanted += 1
                continue
            self.rows.count_up("readers", r)  # held until the copy lands
            plan.items.append((i, r, dst, got[0]))
        if not plan.items and not plan.victims.frees:
            return None
        return plan

    def evict(self, tier: Tier, n: int, now: float) -> StorePlan | None:
        """A plan evicting ``n`` unprotected blocks of memory tier ``tier`` (all or nothing), or ``None``."""
        plan = StorePlan([], [], [])
        if not self.victimize(tier, n, plan, set(), now):
            return None
        return plan

    def reserve_prefetch(self, keys: Sequence[bytes], target: Tier, now: float) -> PromotePlan | None:
        """Slots in memory tier ``target`` for the resident ``keys`` not there or faster yet (free, or a
        victim's with a lower copy); each source held. ``None`` if there is nothing to copy."""
        rows = self.rows.table.get_many(keys).tolist()
        plan = PromotePlan([], keys=list(keys))
        protect = set(keys)
        for i, r in enumerate(rows):
            top = self.rows.top(r) if r >= 0 else None
            if top is None or top <= target or self.rows.slot[target][r] >= 0:
                continue
            got = self.reserve(target, 1, plan.victims, protect, now, cheap_only=True)
            if not got:
                break
            self.rows.count_up("readers", r)
            plan.items.append((i, r, target, got[0]))
            plan.sources.append((top, int(self.rows.slot[top][r]) if top != Tier.NVME else -1))
        if not plan.items and not plan.victims.frees:
            return None
        return plan

    def pick_flush(self, max_blocks: int, coldest_first: bool, now: float) -> StorePlan | None:
        """A plan writing to NVMe up to ``max_blocks`` blocks that live only in memory (each read from
        a readable memory copy, host first; held until the flush completes), or ``None``."""
        rows = self.rows.table.held_rows()
        if not rows.size:
            return None
        f = self.rows.flags[rows]
        # only a readable copy is a source: a copy being evicted (_EVICT_*) belongs to a store
        # plan in flight, which hands its slot on (to a new block, or to a victim moving down)
        # and overwrites it without the lock; gathered from there, another block's bytes would
        # be written to NVMe under this key, with a valid checksum. Such a row is skipped: its
        # plan decides its fate (moved down, written to NVMe, or dropped and counted).
        mem = ((self.rows.slot[Tier.HBM][rows] >= 0) & ((f & EVICT_HBM) == 0)) | (
            (self.rows.slot[Tier.HOST][rows] >= 0) & ((f & EVICT_HOST) == 0)
        )
        rows = rows[mem & ((f & (ON_NVME | PENDING | DOOMED | NVME_WRITING)) == 0)]
        # in the index's row order (ties of the coldest-first order too): the ascending rows of a
        # key table of its own, close to age order (HeldKeys.in_order; shared rows are no order)
        rows = self.rows.table.in_order(rows)
        if coldest_first:
            rows = rows[np.argsort(self.rows.last[rows], kind="stable")]
        rows = rows[:max_blocks]
        if not rows.size:
            return None
        plan = StorePlan([], [], [])
        for r in rows.tolist():
            key = self.rows.table.key_of(r)
            t = Tier.HOST if self.rows.readable(r, Tier.HOST) else Tier.HBM
            self.rows.count_up("readers", r)
            plan.nvme_demote.append(self._nvme_write(r, key, t, now))
        return plan
