"""Phase two of every plan: what the mover did becomes the index's state (the completion room).

:class:`Completion` applies a plan's outcome under the index lock: victims written to NVMe,
copied down or gone (:meth:`apply_victims`); new blocks made visible, or forgotten when their
write failed, with the rest of the chain (:meth:`complete_new`, :meth:`complete_failed`); a plan
the mover failed midway undone or completed by how far it got (:meth:`undo_store`,
:meth:`forget_new`); loads, promotions and flushes (``finish_*``). It also owns a row's end: a
row with no copy left is dropped (:meth:`forget_if_empty`), one still in use is hidden now and
freed by its last user (:meth:`doom`, :meth:`maybe_free_doomed`). It runs under the index lock
(``BlockIndex._lock``) and has none of its own; its ``idle`` condition is the index's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..contract import MEMORY_TIERS, LoadPlan, PromotePlan, StorePlan, Tier
from ..errors import InvariantError, Status
from ..metrics import Metrics
from ..policies.base import EvictionPolicy
from ..policies.cost import CostModel
from .introspect import EventLog
from .placement import Placement
from .rows import DOOMED, EVICT, EVICT_HBM, EVICT_HOST, IN, NVME_WRITING, ON_NVME, PENDING, RowTable

_STORE_COUNTER = {t: f"store_bytes_{t.name.lower()}" for t in Tier}


def _memory_by_tier(
    memory: list[tuple[int, Tier, int]], only: set[int] | None
) -> list[tuple[Tier, list[int], list[int]]]:
    """``(tier, positions, slots)`` per memory tier (in ``MEMORY_TIERS`` order) of a plan's
    ``(i, tier, slot)`` items whose ``i`` is in ``only`` (all when ``None``), in their order.
    All of one tier, the common case, is one C-level transposition."""
    if not memory:
        return []
    if only is None:
        ix, tiers, slots = zip(*memory)
        if tiers.count(tiers[0]) == len(tiers):
            return [(tiers[0], list(ix), list(slots))]
    out = []
    for t in MEMORY_TIERS:
        sel = [(i, s_) for i, tt, s_ in memory if tt == t and (only is None or i in only)]
        if sel:
            out.append((t, [i for i, _ in sel], [s_ for _, s_ in sel]))
    return out


def _leading_ok(statuses: Sequence[Status]) -> int:
    """Length of the leading run of ``OK`` in ``statuses`` (one C-level count when all are)."""
    n = len(statuses)
    if statuses.count(Status.OK) == n:
        return n
    lead = 0
    for s in statuses:
        if s is not Status.OK:
            break
        lead += 1
    return lead


class Completion:
    """Applies plan outcomes to the rows (called under the index lock).

    Parameters
    ----------
    rows : RowTable
    placement : Placement
        Its slot allocators, eviction policies and admission-rejected keys.
    metrics : Metrics
        The index's counters.
    events : EventLog
    idle : threading.Condition
        The index's condition on its lock; notified when a doomed row is freed.
    clock : callable
        Seconds, monotonic (the index's clock).
    tokens_per_block : int
    cost : CostModel
        Fed the measured NVMe load bandwidth.
    nvme_policy : EvictionPolicy or None
        The order of the NVMe-resident blocks (``eviction_granularity: block``); told of every
        NVMe copy made and forgotten here.
    """

    def __init__(
        self,
        rows: RowTable,
        placement: Placement,
        metrics: Metrics,
        events: EventLog,
        idle: threading.Condition,
        clock: Callable[[], float],
        tokens_per_block: int,
        cost: CostModel,
        nvme_policy: EvictionPolicy | None = None,
    ) -> None:
        self.nvme_policy = nvme_policy
        self.rows = rows
        self.placement = placement
        self.alloc = placement.alloc
        self.policies = placement.policies
        self.metrics = metrics
        self.events = events
        self._idle = idle
        self._clock = clock
        self.block_bytes = rows.block_bytes
        self.tokens_per_block = tokens_per_block
        self.cost = cost

    # ================================================================ phase two of each plan
    def finish_store(
        self,
        plan: StorePlan,
        nvme_statuses: dict,
        demote_statuses: dict,
        failed: bool,
        now: float,
        memory_statuses: dict | None = None,
    ) -> list[Status]:
        """Body of :meth:`BlockIndex.complete_store` (the plan is marked done and counted by the caller).

        ``memory_statuses`` (``i -> Status``, split execution): a new block whose bytes did not all
        reach its slot (a rank failed its copy) is not ``OK`` there and is forgotten like a failed
        NVMe write (its slot freed, the rest of its chain ``NO_SPACE``)."""
        if failed:
            if plan.moved == StorePlan.NOTHING_DONE:
                self.undo_store(plan)
            else:
                c: dict = {"store_failed_midway": 1}
                if not plan.victims_done:
                    self.apply_victims(
                        plan, now, c, plan.demote_statuses, copies_done=plan.moved >= StorePlan.COPIES_DONE
                    )
                self.forget_new(plan)
                self.metrics.add(c)
            return [s if s is not None else Status.IO_ERROR for s in plan.statuses]
        c = {}
        if not plan.victims_done:
            self.apply_victims(plan, now, c, demote_statuses)
        nv = dict(nvme_statuses)
        if memory_statuses:
            bad = {i: s for i, s in memory_statuses.items() if s is not Status.OK}
            nv.update(bad)
            copy_failed = sum(1 for s in bad.values() if s is Status.IO_ERROR)
            if copy_failed:
                c["store_copy_failed"] = copy_failed
        self.complete_new(plan, nv, now, c)
        self.metrics.add(c)
        return list(plan.statuses)  # type: ignore[arg-type]  # complete_new decided every pending one

    def finish_victims(self, plan: StorePlan, now: float) -> None:
        """Body of :meth:`BlockIndex.complete_victims`: what happened to a store plan's victims,
        applied before its new blocks complete (split execution, :mod:`tierstore.node.tickets`:
        the victims written to NVMe are readable there while a client copies the new blocks,
        not only once it reports). Needs the mover's victim moves done (``plan.moved`` at
        ``COPIES_DONE``); :meth:`finish_store` then skips the victims.

        Raises
        ------
        InvariantError
            For a plan completed already, or whose victims have not all moved.
        """
        if plan.done or plan.victims_done or plan.moved < StorePlan.COPIES_DONE:
            raise InvariantError("complete_victims: the plan is done, or its victims are not moved yet")
        c: dict = {}
        self.apply_victims(plan, now, c, plan.demote_statuses)
        plan.victims_done = True
        self.metrics.add(c)

    def finish_load(
        self, plan: LoadPlan, statuses: Sequence[Status], promote: bool, nvme_s: float | None
    ) -> list:
        """Body of :meth:`BlockIndex.complete_load`: release the holds, record the outcome. Returns the
        loaded blocks worth promoting, ``(i, row, source tier)``. Without an I/O error the holds
        are released for the whole call at once; a load with one goes block by block."""
        if Status.IO_ERROR in statuses:
            return self._finish_load_each(plan, statuses, promote, nvme_s)
        srcs = plan.sources
        if None in srcs:
            held = [i for i, src in enumerate(srcs) if src is not None]
            rows = np.asarray(plan.rows, dtype=np.int64)[held]
        else:  # every key held (the common case): no per-key pass to find them
            held = range(len(srcs))  # type: ignore[assignment]
            rows = np.asarray(plan.rows, dtype=np.int64)
        lead = _leading_ok(statuses)
        c: dict = {}
        nvme_ok = 0
        promos: list = []
        if held:
            # a key given twice was held twice
            if self.rows.count_down("readers", rows):
                raise InvariantError("readers went negative")
            tiers = [srcs[i][0] for i in held]  # type: ignore[index]  # held: not None
            for t in set(tiers):
                c[f"load_bytes_{t.label}"] = tiers.count(t) * self.block_bytes
            if Tier.NVME in tiers:
                nvme_ok = sum(1 for i, t in zip(held, tiers) if t == Tier.NVME and statuses[i] is Status.OK)
            if promote:
                rl = rows.tolist()
                flags = self.rows.flags
                promos = [
                    (i, r, t)
                    for i, r, t in zip(held, rl, tiers)
                    if t != Tier.HBM and statuses[i] is Status.OK and not flags[r] & DOOMED
                ]
            doomed = self.rows.doomed
            for r in [r for r in rows.tolist() if r in doomed] if doomed else ():
                self.maybe_free_doomed(r)
        self._count_load(c, lead, nvme_ok, nvme_s)
        return promos

    def _count_load(self, c: dict, lead: int, nvme_ok: int, nvme_s: float | None) -> None:
        # Metrics count the leading run only: that is what the engine uses.
        c["loaded_blocks"] = lead
        c["reused_tokens"] = lead * self.tokens_per_block
        c["nvme_read_bytes"] = nvme_ok * self.block_bytes
        self.metrics.add(c)
        if nvme_s is not None and nvme_ok:
            self.cost.observe_load("nvme", nvme_ok * self.block_bytes, nvme_s, nvme_ok)

    def _finish_load_each(
        self, plan: LoadPlan, statuses: Sequence[Status], promote: bool, nvme_s: float | None
    ) -> list:
        """:meth:`finish_load` block by block (a load with an I/O error: each failed NVMe block
        is dropped once its hold is released)."""
        c: dict = {}
        lead = _leading_ok(statuses)
        nvme_ok = 0
        promos: list = []
        readers, flags = self.rows.readers, self.rows.flags  # the table cannot grow in here
        for i, (r, src, st) in enumerate(zip(plan.rows, plan.sources, statuses)):
            if src is None:
                continue
            readers[r] -= 1
            if readers[r] < 0:
                raise InvariantError("readers went negative")
            t = src[0]
            c[f"load_bytes_{t.label}"] = c.get(f"load_bytes_{t.label}", 0) + self.block_bytes
            if st is Status.OK:
                if t == Tier.NVME:
                    nvme_ok += 1
                if promote and t != Tier.HBM and not flags[r] & DOOMED:
                    promos.append((i, r, t))
            elif st is Status.IO_ERROR:
                c["io_errors"] = c.get("io_errors", 0) + 1
                if t == Tier.NVME and flags[r] & ON_NVME:
                    flags[r] &= 0xFF ^ ON_NVME  # never serve it again
                    self._nvme_out(plan.keys[i])
                    self.forget_if_empty(r, plan.keys[i])
            self.maybe_free_doomed(r)
        self._count_load(c, lead, nvme_ok, nvme_s)
        return promos

    def finish_promote(self, plan: PromotePlan, ok: Sequence[bool], now: float) -> None:
        """Body of :meth:`BlockIndex.complete_promote`: the victims' fate, then each copy that landed."""
        c: dict = {}
        self.apply_victims(plan.victims, now, c, copies_done=plan.victims.moved >= StorePlan.COPIES_DONE)
        for (_i, r, t, s), good in zip(plan.items, ok):
            self.rows.readers[r] -= 1
            if good and not self.rows.flags[r] & DOOMED and self.rows.slot[t][r] < 0:
                self.rows.set_slot(r, t, s)
                key = self.rows.table.key_of(r)
                self.policies[t].on_insert(self.rows.view(r, key), now)
                src = "host" if self.rows.slot[Tier.HOST][r] >= 0 and t == Tier.HBM else "nvme"
                c[f"promotions_{src}_{t.label}"] = c.get(f"promotions_{src}_{t.label}", 0) + 1
                self.events.add("promoted", key, t)
            else:
                self.alloc[t].give(s)
            self.maybe_free_doomed(r)
        self.metrics.add(c)

    def finish_flush(self, plan: StorePlan, demote_statuses: dict[int, Status]) -> int:
        """Body of :meth:`BlockIndex.complete_flush`; returns blocks now on NVMe."""
        n = 0
        for d in plan.nvme_demote:
            self.rows.flags[d.row] &= 0xFF ^ NVME_WRITING
            self.rows.readers[d.row] -= 1
            if demote_statuses.get(d.row) in (Status.OK, Status.EXISTS):
                self.rows.flags[d.row] |= ON_NVME
                self.rows.stamp("nvme_at", d.row, self._clock())
                self._nvme_in([d.row], [d.key], self._clock())
                n += 1
            self.maybe_free_doomed(d.row)
        self.metrics.add({"flushed_blocks": n, "nvme_write_bytes": n * self.block_bytes})
        return n

    def complete_new(self, plan: StorePlan, nv: dict, now: float, c: dict) -> None:
        """Make a plan's new blocks visible (or forget them): the common case
        vectorised, failures and doomed rows one by one."""
        n = len(plan.statuses)
        every = plan.statuses.count(None) == n  # the call's blocks are all new (the common case)
        pending = list(range(n)) if every else plan.pending
        if not pending:
            return
        failed_from = (
            min((i for i in pending if i in nv and nv[i] not in (Status.OK, Status.EXISTS)), default=None)
            if nv
            else None
        )
        all_rows = np.array(plan.rows, dtype=np.int64) if every else None  # one conversion, indexed often
        prows = all_rows if every else [plan.rows[i] for i in pending]
        if failed_from is None and not (self.rows.flags[prows] & DOOMED).any():
            good = pending
        else:
            good = self.complete_failed(plan, pending, nv, failed_from, c)
            if not good:
                return
        in_good = None if len(good) == len(pending) else set(good)
        bb = self.block_bytes
        in_mem: set | None = set() if nv else None
        for t, ix, sl in _memory_by_tier(plan.memory, in_good):
            if all_rows is not None and len(ix) == n and ix == list(range(n)):  # every block of the call
                rows, kt, at = plan.rows, plan.keys, all_rows
            else:
                rows, kt = [plan.rows[i] for i in ix], [plan.keys[i] for i in ix]
                at = np.array(rows, dtype=np.int64)
            self.rows.slot[t][at] = sl
            self.rows.flags[at] |= IN[t]
            self.policies[t].on_insert_many(kt, self.rows.views(rows, kt), now)
            if in_mem is not None:
                in_mem.update(ix)
            c[_STORE_COUNTER[t]] = c.get(_STORE_COUNTER[t], 0) + len(ix) * bb
        every = every and len(good) == n
        rows_good = all_rows if every else [plan.rows[i] for i in good]
        self.rows.flags[rows_good] &= 0xFF ^ PENDING
        if nv:
            on_nvme = [i for i in good if i in nv]
            if on_nvme:
                self.rows.flags[[plan.rows[i] for i in on_nvme]] |= ON_NVME
                self.rows.stamp("nvme_at", [plan.rows[i] for i in on_nvme], now)
                self._nvme_in([plan.rows[i] for i in on_nvme], [plan.keys[i] for i in on_nvme], now)
                c["nvme_write_bytes"] = c.get("nvme_write_bytes", 0) + len(on_nvme) * bb
                only = sum(1 for i in on_nvme if in_mem is None or i not in in_mem)
                if only:
                    c["store_bytes_nvme"] = c.get("store_bytes_nvme", 0) + only * bb
        if self.placement.rejected:
            for i in good:
                self.placement.rejected.pop(plan.keys[i], None)
        if self.events.on:
            mem = {i: t for i, t, _ in plan.memory}
            for i in good:
                self.events.add("stored", plan.keys[i], mem.get(i, Tier.NVME))
        st = plan.statuses
        if every:
            st[:] = [Status.OK] * n
        else:
            for i in good:
                st[i] = Status.OK
        c["store_ok"] = c.get("store_ok", 0) + len(good)

    def complete_failed(
        self, plan: StorePlan, pending: list[int], nv: dict, failed_from: int | None, c: dict
    ) -> list[int]:
        """:meth:`complete_new` when a write failed or a row was doomed meanwhile:
        forget the failed blocks (and the rest of the chain after the first
        failure), free doomed rows. Returns the indices still to make visible."""
        mem = {i: (t, s) for i, t, s in plan.memory}
        good: list[int] = []
        for i in pending:
            r = plan.rows[i]
            doomed = bool(self.rows.flags[r] & DOOMED)
            ok = failed_from is None or i < failed_from
            if i in nv and nv[i] not in (Status.OK, Status.EXISTS):
                plan.statuses[i] = nv[i]
                ok = False
            elif not ok:
                plan.statuses[i] = Status.NO_SPACE
            if ok and not doomed:
                good.append(i)
                continue
            if i in mem:
                t, s_ = mem[i]
                self.alloc[t].give(s_)
            if doomed:
                plan.statuses[i] = plan.statuses[i] or Status.OK
                self.rows.doomed.discard(r)
                self.rows.release_row(r, self.alloc)
            else:
                self.rows.drop_new(r)
            name = "store_failed" if not ok else "store_doomed"
            c[name] = c.get(name, 0) + 1
        return good

    def apply_victims(
        self,
        plan: StorePlan,
        now: float,
        c: dict,
        demote_statuses: dict | None = None,
        copies_done: bool = True,
    ) -> None:
        """Record what happened to a plan's victims (under the lock): written to
        NVMe (by ``demote_statuses``), copied down into memory (if
        ``copies_done``; else their destination slots are freed), and gone
        from the tier they were evicted from."""
        demote_statuses = demote_statuses or {}
        # 1. victims written to NVMe
        for d in plan.nvme_demote:
            self.rows.flags[d.row] &= 0xFF ^ NVME_WRITING
            st = demote_statuses.get(d.row, Status.IO_ERROR)
            if st in (Status.OK, Status.EXISTS):
                self.rows.flags[d.row] |= ON_NVME
                self.rows.stamp("nvme_at", d.row, now)
                self._nvme_in([d.row], [d.key], now)
                c[f"demotions_{d.src.label}_nvme"] = c.get(f"demotions_{d.src.label}_nvme", 0) + 1
                c["nvme_write_bytes"] = c.get("nvme_write_bytes", 0) + self.block_bytes
                self.events.add("demoted", d.key, Tier.NVME)
            else:
                c[f"nvme_put_{st.value}"] = c.get(f"nvme_put_{st.value}", 0) + 1
        # 2. victims copied down into memory
        for d in plan.copies if copies_done else ():
            self.rows.set_slot(d.row, d.dst, d.dst_slot)
            self.policies[d.dst].on_insert(self.rows.view(d.row, d.key), now)
            c[f"demotions_{d.src.label}_{d.dst.label}"] = (
                c.get(f"demotions_{d.src.label}_{d.dst.label}", 0) + 1
            )
            self.events.add("demoted", d.key, d.dst)
        if not copies_done:  # each destination was a free slot or a victim's (given): free it
            for d in plan.copies:
                self.alloc[d.dst].give(d.dst_slot)
        # 3. victims leave their tier
        given = plan.given
        for r, t, s in plan.frees:
            self.rows.flags[r] &= 0xFF ^ EVICT[t]
            key = self.rows.table.key_of(r)
            self.policies[t].on_remove(key)
            if self.rows.slot[t][r] == s:
                self.rows.set_slot(r, t, -1)
            if (t, s) not in given:
                self.alloc[t].give(s)
            self.events.add("removed", key, t)
            self.forget_if_empty(r, key)

    def _nvme_in(self, rows: list[int], keys: list[bytes], now: float) -> None:
        """NVMe copies of ``rows`` were written: the NVMe policy (block mode) hears of them."""
        if self.nvme_policy is not None:
            self.nvme_policy.on_insert_many(keys, self.rows.views(rows, keys), now)

    def _nvme_out(self, key: bytes) -> None:
        if self.nvme_policy is not None:
            self.nvme_policy.on_remove(key)

    def forget_new(self, plan: StorePlan, given=frozenset()) -> None:
        """A failed plan's new blocks: their memory slots (fresh or a victim's) go
        back to the free lists, except those in ``given`` (``(tier, slot)`` pairs
        given back already), their rows are dropped."""
        mem = {i: (t, s) for i, t, s in plan.memory}
        for i in plan.pending:
            if i in mem:
                t, s = mem[i]
                if (t, s) not in given:
                    self.alloc[t].give(s)
            r = plan.rows[i]
            if r >= 0:
                if self.rows.flags[r] & DOOMED:
                    self.rows.doomed.discard(r)
                    self.rows.release_row(r, self.alloc)
                else:
                    self.rows.drop_new(r)
            plan.statuses[i] = Status.IO_ERROR

    def undo_store(self, plan: StorePlan) -> None:
        """The mover failed before anything was applied: release the plan's reservations."""
        given = plan.given
        for d in plan.nvme_demote:
            self.rows.flags[d.row] &= 0xFF ^ NVME_WRITING
        for r, t, _s in plan.frees:
            self.rows.flags[r] &= 0xFF ^ EVICT[t]
        for d in plan.copies:
            if (d.dst, d.dst_slot) not in given:
                self.alloc[d.dst].give(d.dst_slot)
        self.forget_new(plan, given)

    def forget_if_empty(self, row: int, key: bytes) -> None:
        """Drop the row when no copy is left (and nobody uses it)."""
        f = int(self.rows.flags[row])
        if f & (PENDING | NVME_WRITING):
            return
        if self.rows.slot[Tier.HBM][row] >= 0 or self.rows.slot[Tier.HOST][row] >= 0 or f & ON_NVME:
            return
        self.metrics.inc("dropped_blocks")
        self.events.add("dropped", key)
        if self.rows.refs[row] > 0 or self.rows.readers[row] > 0:
            self.doom(row, key)
            return
        self.rows.tokens.pop(row, None)
        self.rows.table.remove(key)
        self.rows.flags[row] = 0

    def doom(self, row: int, key: bytes) -> None:
        """Hide ``row`` now; its memory is freed when its last user goes."""
        if self.rows.flags[row] & DOOMED:
            return
        self.rows.flags[row] |= DOOMED
        self.rows.table.detach(key)
        self.rows.doomed.add(row)

    def maybe_free_doomed(self, row: int) -> None:
        if (
            row in self.rows.doomed
            and self.rows.refs[row] == 0
            and self.rows.readers[row] == 0
            and not self.rows.flags[row] & (PENDING | NVME_WRITING | EVICT_HBM | EVICT_HOST)
        ):
            self.rows.doomed.discard(row)
            self.rows.release_row(row, self.alloc)
            self._idle.notify_all()

    def remove_namespace(self, ns: bytes) -> tuple[int, list[int]]:
        """Hide every row of namespace ``ns`` (a known one); rows of stores in flight are doomed
        and discarded when their store completes. Returns ``(rows hidden, those still pending)``."""
        rt = self.rows
        rows = rt.table.rows()
        rows = rows[rt.ns[rows] == rt.namespaces.ids[ns]]
        keys = rt.table.keys_of(rows.tolist())
        pending = []
        for r, k in zip(rows.tolist(), keys):
            if rt.flags[r] & PENDING:
                rt.flags[r] |= DOOMED
                rt.table.detach(k)
                rt.doomed.add(r)
                pending.append(r)
            else:
                self.remove_row(r, k)
        return len(keys), pending

    def remove_keys(self, keys: Iterable[bytes]) -> int:
        """Remove the visible rows of ``keys``; returns how many there were."""
        n = 0
        for k in keys:
            r = self.rows.table.get(k)
            if r >= 0 and not self.rows.flags[r] & PENDING:
                self.remove_row(r, k)
                n += 1
        return n

    def remove_all(self) -> int:
        """Remove every visible row; returns how many there were."""
        rows = self.rows.table.rows()
        keys = self.rows.table.keys_of(rows.tolist())
        n = 0
        for r, k in zip(rows.tolist(), keys):
            if not self.rows.flags[r] & PENDING:
                self.remove_row(r, k)
                n += 1
        return n

    def remove_row(self, row: int, key: bytes) -> None:
        for t in MEMORY_TIERS:
            if self.rows.slot[t][row] >= 0 and not self.rows.flags[row] & EVICT[t]:
                self.policies[t].on_remove(key)
        if self.rows.flags[row] & ON_NVME:
            self._nvme_out(key)
        self.rows.flags[row] &= 0xFF ^ ON_NVME
        self.events.add("invalidated", key)
        if (
            self.rows.refs[row] > 0
            or self.rows.readers[row] > 0
            or self.rows.flags[row] & (EVICT_HBM | EVICT_HOST | NVME_WRITING)
        ):
            self.doom(row, key)
            return
        for t in MEMORY_TIERS:
            s = int(self.rows.slot[t][row])
            if s >= 0:
                self.alloc[t].give(s)
                self.rows.set_slot(row, t, -1)
        self.rows.tokens.pop(row, None)
        self.rows.table.remove(key)
        self.rows.flags[row] = 0
