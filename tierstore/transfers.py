"""Every call that moves bytes, as prepare → move → complete: :class:`Transfers`.

The index prepares a plan under its lock (:mod:`tierstore.index`), the movers run it with no
lock held (:mod:`tierstore.movers`), the index completes it with what really happened; the
remote tier's decisions are :class:`~tierstore.planner.RemotePlanner`'s. ``Transfers`` runs
the three for a store, a load (with the remote tier for local misses, a deadline, promotion,
background cleaning and the re-offer of local hits), a remote cache fill, a prefetch, an
eviction, a flush down to NVMe and an invalidation, in the caller's thread or on the movers'
``load``/``store`` queues (``wait=False``). :class:`tierstore.api.KVStore` checks the input,
calls it and shapes the results; it holds no plan and no decision. Split execution (the node
store: a client copies the bytes into or out of shared slots between the halves):
``store_prelude``/``store_epilogue`` and ``load_prelude``/``load_epilogue``, driven by
:class:`tierstore.node.tickets.PlanService`.

:class:`OpenCalls` is the store's open/closed state and the calls in progress (``close``
waits for them).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar

from .contract import LoadPlan, LookupResult, StorePlan, Tier
from .errors import Status, StoreClosedError
from .index import BlockIndex
from .io.pages import FragmentPlan
from .layout import KVLayout
from .movers import Movers
from .movers.gate import LoadGate
from .planner import RemotePlanner
from .tiers.storage import BlockStorage
from .units import check_duration_s

if TYPE_CHECKING:
    import numpy as np

    from .fdp.lifetime import LifetimeClass

_R = TypeVar("_R")


class OpenCalls:
    """A store's open/closed state and its calls in progress: after :meth:`close` began, a
    call that enters raises :class:`StoreClosedError`, and :meth:`close` waits for those
    that entered before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a plain Lock (C-level enter/exit): this runs on every call
        self._idle = threading.Event()  # set when close() began and no call is in progress
        self._active = 0
        self.closed = False

    def enter(self, what: str) -> None:
        """Count a call in; :class:`StoreClosedError` naming ``KVStore.<what>`` once closed."""
        with self._lock:
            if self.closed:
                raise StoreClosedError(f"KVStore.{what}: the store is closed")
            self._active += 1

    def leave(self) -> None:
        """Count a call out (wakes :meth:`close` after the last one)."""
        with self._lock:
            self._active -= 1
            if self.closed and not self._active:
                self._idle.set()

    def check(self, what: str) -> None:
        """:class:`StoreClosedError` naming ``KVStore.<what>`` once closed."""
        with self._lock:
            if self.closed:
                raise StoreClosedError(f"KVStore.{what}: the store is closed")

    def close(self) -> bool:
        """Refuse new calls and wait for those in progress; ``False`` if closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            busy = self._active > 0
        if busy:  # every store acknowledged by a call in progress is written down after this
            self._idle.wait()
        return True


@dataclasses.dataclass(eq=False, repr=False)
class Transfers:
    """Runs the store's plans: prepare (index) → move (movers) → complete (index).

    Parameters
    ----------
    index : BlockIndex
        Decides the plans and records their outcomes (under its lock).
    movers : Movers
        Move bytes (no lock held); their ``load`` and ``store`` queues run ``wait=False`` calls.
    planner : RemotePlanner or None
        The remote tier's decisions, ``None`` without a remote tier.
    storage : BlockStorage or None
        The NVMe tier, ``None`` without one.
    layout : KVLayout
        The store's layout.

    Attributes
    ----------
    calls : OpenCalls
        The store's open/closed state and its calls in progress (made here).
    """

    index: BlockIndex
    movers: Movers
    planner: RemotePlanner | None
    storage: BlockStorage | None
    layout: KVLayout
    calls: OpenCalls = dataclasses.field(default_factory=OpenCalls, init=False)

    def submit(self, kind: str, fn: Callable[[], _R]) -> Future[_R]:
        """Run ``fn`` on the movers' ``kind`` queue (``"load"`` or ``"store"``)."""
        return self.movers.submit(kind, fn)

    # -------------------------------------------------------------- lookup
    def lookup(
        self,
        keys: list[bytes],
        tokens: Sequence[np.ndarray] | None,
        request_id: object,
        num_prompt_tokens: int | None,
        digest: bytes | None,
    ) -> LookupResult:
        """The index's match of ``keys``, the NVMe regions it hit told, extended with the
        remote tier (``digest``: the namespace the keys belong to, or ``None``)."""
        res = self._touched(self.index.lookup(keys, tokens, request_id, num_prompt_tokens))
        return res if self.planner is None else self.planner.extend_lookup(res, keys, digest)

    def _touched(self, res: LookupResult) -> LookupResult:
        """Tell the NVMe region manager which of its regions were hit (region LRU)."""
        if self.storage is not None and Tier.NVME in res.tiers:
            self.storage.touch([k for k, t in zip(res.keys, res.tiers) if t == Tier.NVME])
        return res

    # -------------------------------------------------------------- store
    def store(
        self,
        digest: bytes,
        keys: list[bytes],
        sources: Sequence[FragmentPlan],
        lifetime: LifetimeClass | str | None,
        first: int,
        tokens: Sequence[np.ndarray] | None,
        wait: bool,
        publish: bool = True,
    ) -> list[Status] | Future[list[Status]]:
        """Store ``sources`` under ``keys`` (statuses, or a Future of them with ``wait=False``);
        blocks stored OK are offered to the remote tier."""

        def run() -> list[Status]:
            plan = self.index.prepare_store(digest, keys, lifetime, first, tokens)
            try:
                nvme_st, dem_st = self.movers.run_store(plan, sources)
            except BaseException:
                self.index.complete_store(plan, failed=True)
                raise
            st = self.index.complete_store(plan, nvme_st, dem_st)
            if publish and self.planner is not None and not self.planner.barred(digest):
                ok = [i for i, s in enumerate(st) if s is Status.OK]
                self._publish([keys[i] for i in ok], [sources[i] for i in ok], hits=0)
            return st

        return run() if wait else self.submit("store", run)

    def _publish(self, keys: list[bytes], sources: Sequence[FragmentPlan], hits: int) -> None:
        """Offer blocks to the shared remote tier (its admission rule decides);
        with ``remote.publish: evict`` blocks go there when evicted instead
        (:attr:`tierstore.index.StorePlan.lost`)."""
        if self.planner is None:
            return
        sel = self.planner.publishable(keys, hits)
        if sel:
            # a stored block missed remotely just now: publish it even if it was published before
            # (Mooncake may have evicted it since); a local hit re-offered is skipped if recent
            st = self.movers.publish([keys[j] for j in sel], [sources[j] for j in sel], recent=hits > 0)
            self.index.metrics.add(
                {
                    "remote_published_blocks": sum(s is Status.OK for s in st),
                    "remote_publish_dropped": sum(s is Status.REJECTED for s in st),
                }
            )

    # -------------------------------------------------------------- load
    def load(
        self,
        keys: list[bytes],
        plans: Sequence[FragmentPlan],
        promote: bool,
        wait: bool,
        timeout_s: float | None,
        finish: Callable[[list[Status]], _R],
        merge_wait_s: float,
    ) -> _R | Future[_R]:
        """Load ``keys`` into the destination ``plans``; ``finish(statuses)`` shapes the result.
        ``timeout_s`` is a deadline: blocks not delivered by then are ``MISS``."""
        if timeout_s is not None:
            timeout_s = check_duration_s(timeout_s, "timeout_s")
        gate = LoadGate(time.monotonic() + timeout_s) if timeout_s is not None else None

        def run() -> list[Status]:
            return self._run_load(keys, plans, promote, gate, merge_wait_s)

        if timeout_s is None or gate is None:
            return finish(run()) if wait else self.submit("load", lambda: finish(run()))
        fut = self.submit("load", run)

        def deadline() -> _R:
            try:
                return finish(fut.result(timeout=timeout_s))
            except cf.TimeoutError:
                delivered = gate.close()
                self.index.metrics.inc("load_timeouts")
                return finish([Status.OK if i in delivered else Status.MISS for i in range(len(keys))])

        if wait:
            return deadline()
        out: Future[_R] = Future()
        threading.Thread(
            target=lambda: out.set_result(deadline()), daemon=True, name="tierstore-deadline"
        ).start()
        return out

    def _run_load(
        self,
        keys: list[bytes],
        plans: Sequence[FragmentPlan],
        promote: bool,
        gate: LoadGate | None,
        merge_wait_s: float,
    ) -> list[Status]:
        """One load: NVMe/memory move → remote for misses → gate close → ``complete_load``
        (remote statuses are misses for the index) → promote → clean requests → the
        ``reused`` publish → latency record."""
        t0 = time.perf_counter_ns()
        plan = self.index.prepare_load(keys)
        if plan.waits:  # a delay hit: another load is reading some of these blocks from NVMe
            waits = plan.waits
            self.index.abort_load(plan)
            for ev in waits:
                ev.wait(merge_wait_s)
            self.index.metrics.inc("merged_loads", len(waits))
            plan = self.index.prepare_load(keys)  # they are in memory now if promoted
        try:
            st, nvme_s = self.movers.run_load(plan, plans, gate)
        except BaseException:
            self.index.complete_load(plan, [Status.IO_ERROR] * len(keys), promote=False)
            raise
        if self.planner is not None:
            missed = [i for i, src in enumerate(plan.sources) if src is None]
            if missed:
                got = self.remote_load(keys, plans, missed, gate)
                for i, s in zip(missed, got):
                    st[i] = s if s is not Status.MISS else st[i]
                self.index.metrics.add(
                    {
                        "remote_loaded_blocks": sum(s is Status.OK for s in got),
                        "remote_load_errors": sum(s is Status.IO_ERROR for s in got),
                    }
                )
        if gate is not None:
            delivered = gate.close()
            st = [s if (s is not Status.OK or i in delivered) else Status.MISS for i, s in enumerate(st)]
        # remote IO_ERRORs are misses for the index (the block is not local); without a remote
        # tier a key with no source is a MISS already
        index_st = st
        if self.planner is not None:
            index_st = [s if plan.sources[i] is not None else Status.MISS for i, s in enumerate(st)]
        promo = self.index.complete_load(plan, index_st, promote and gate is None, nvme_s)
        if promo is not None:
            try:
                ok = self.movers.run_promote(promo, plans)
            except BaseException:
                self.index.complete_promote(promo, [False] * len(promo.items))
                raise
            self.index.complete_promote(promo, ok)
        want = self.index.take_clean_requests()
        if want:
            self.clean_in_background(want)
        if self.planner is not None and self.planner.publishes_reused:
            local = [i for i, s in enumerate(st) if s is Status.OK and plan.sources[i] is not None]
            self._publish([keys[i] for i in local], [plans[i] for i in local], hits=1)
        # the slowest tier read (C-level: no Python frame a key; a source is a non-empty tuple)
        used = max(map(itemgetter(0), filter(None, plan.sources)), default=None)
        if used is not None:
            self.index.metrics.record_load_ns(used.label, time.perf_counter_ns() - t0)
        return st

    def remote_load(
        self, keys: list[bytes], plans: Sequence[FragmentPlan], missed: list[int], gate: LoadGate | None
    ) -> list[Status]:
        """Fetch locally missed blocks (positions ``missed`` of a load) from the
        shared remote tier; returns their statuses.

        Blocks a lookup found remotely under a known namespace are a cache fill:
        the index places them (:meth:`BlockIndex.prepare_store`), the movers
        fetch them straight into their host-tier slots and copy them on to
        the destinations (:meth:`Movers.run_remote_fill`), and the index makes
        them resident. Blocks of a key-level lookup without a namespace are
        fetched into their destinations only (they stay remote). A namespace
        invalidated by this store is never loaded from the remote tier
        (:meth:`RemotePlanner.plan_load`).
        """
        if self.planner is None:  # no remote tier
            return [Status.MISS] * len(missed)
        out: dict[int, Status] = {}
        rp = self.planner.plan_load(keys, missed)
        out.update((i, Status.MISS) for i in rp.barred)
        rest = rp.staged
        for d, ii in rp.fill.items():
            fill = self.index.prepare_store(d, [keys[i] for i in ii], None, ii[0])
            pending = set(fill.pending)
            try:
                got, nvme_st, dem_st, held = self.movers.run_remote_fill(
                    fill, [plans[i] for i in ii], None if gate is None else gate.at(ii)
                )
            except BaseException:
                self.index.complete_store(fill, failed=True)
                raise
            # a timed-out transfer may still write its slots: the index frees them only after it returns
            self.movers.after_release(
                held, functools.partial(self.index.complete_store, fill, nvme_st, dem_st)
            )
            self.index.metrics.add({"remote_fill_blocks": sum(got[j] is Status.OK for j in pending)})
            for j, i in enumerate(ii):
                if j in pending:
                    out[i] = got[j]
                else:  # stored meanwhile (EXISTS) or no room here (NO_SPACE): straight to the destination
                    rest.append(i)
        if rest:
            rest.sort()
            at = None if gate is None else gate.at(rest)
            out.update(
                zip(rest, self.movers.remote_get([keys[i] for i in rest], [plans[i] for i in rest], at))
            )
        return [out[i] for i in missed]

    # -------------------------------------------------------------- split execution (node store)
    def store_prelude(self, plan: StorePlan) -> None:
        """First half of a store whose new blocks someone else copies into their slots
        (:mod:`tierstore.node.tickets`): the victims leave (:meth:`Movers.run_store_prelude`) and
        the index records it (:meth:`BlockIndex.complete_victims`).
        On an exception the plan is completed as failed (a miss, never wrong KV) and it propagates."""
        try:
            self.movers.run_store_prelude(plan)
        except BaseException:
            self.index.complete_store(plan, failed=True)
            raise
        self.index.complete_victims(plan)  # victims on NVMe are readable there during the copies

    def store_epilogue(
        self,
        plan: StorePlan,
        sources: Sequence[FragmentPlan | None],
        copied: Sequence[Status | None],
        publish: bool = True,
    ) -> tuple[list[Status], set[int]]:
        """Second half, after :meth:`store_prelude` and the copies: the new blocks bound for NVMe
        are written from their slots (``sources[i]``) where ``copied[i]`` is ``OK`` (every rank
        copied its shard), then the index completes the plan; a key whose copy is another
        status is forgotten and its slot freed with that status (``memory_statuses``: a failed
        copy is ``IO_ERROR``, a key handed no slot ``NO_SPACE``). Blocks stored OK are offered
        to the remote tier when ``publish``.

        Returns
        -------
        statuses : list of Status
            Per key: ``OK``, ``EXISTS``, ``NO_SPACE`` or ``IO_ERROR``.
        durable : set of int
            Positions whose block is on NVMe now.
        """
        pending = plan.pending
        mem_st = {i: copied[i] for i in pending}
        publish = publish and self.planner is not None
        # a source is read only for an NVMe write or a publication: ``sources[i]`` is asked for
        # those keys alone (a slot's plan is built on demand: most stores write neither)
        srcs: list[FragmentPlan | None] = [None] * len(plan.keys)
        for i in range(len(plan.keys)) if publish else (i for i, _ in plan.nvme_new):
            if copied[i] is Status.OK and plan.statuses[i] is None:
                srcs[i] = sources[i]
        try:
            nvme_st = self.movers.run_store_epilogue(plan, srcs)
        except BaseException:
            self.index.complete_store(plan, failed=True)
            raise
        st = self.index.complete_store(plan, nvme_st, plan.demote_statuses, memory_statuses=mem_st)  # type: ignore[arg-type]  # None: not copied
        durable = {i for i, s in nvme_st.items() if st[i] is Status.OK and s in (Status.OK, Status.EXISTS)}
        if publish and self.planner is not None and not self.planner.barred(plan.ns):
            ok = [i for i, s in enumerate(st) if s is Status.OK and srcs[i] is not None]
            self._publish([plan.keys[i] for i in ok], [srcs[i] for i in ok], hits=0)  # type: ignore[misc]  # ok: given
        return st, durable

    def load_prelude(
        self, plan: LoadPlan, dests: Mapping[int, FragmentPlan]
    ) -> tuple[dict[int, Status], float | None]:
        """First half of a load whose blocks someone else copies out of slots: the sources of
        the keys ``dests`` names (NVMe blocks) copied into those slots (:meth:`Movers.stage_load`).
        On an exception the plan is completed (every key ``IO_ERROR``) and it propagates."""
        try:
            return self.movers.stage_load(plan, dests)
        except BaseException:
            self.index.complete_load(plan, [Status.IO_ERROR] * len(plan.keys), promote=False)
            raise

    def load_epilogue(
        self,
        plan: LoadPlan,
        statuses: Sequence[Status],
        loaded: Mapping[int, FragmentPlan],
        promote: bool = True,
        nvme_s: float | None = None,
    ) -> None:
        """Second half, after the copies out of the slots: the index releases the readers and
        records ``statuses`` (per key ``OK``, ``MISS`` or, for a source that failed to read,
        ``IO_ERROR``); blocks read from NVMe are promoted from their slots (``loaded[i]``)
        where the index plans it; the cleaning the index asked for is queued."""
        promo = self.index.complete_load(plan, statuses, promote, nvme_s)
        if promo is not None:
            items = [it for it in promo.items if it[0] in loaded]
            ok = [False] * len(promo.items)
            try:
                got = iter(self.movers.run_promote(dataclasses.replace(promo, items=items), loaded))
            except BaseException:
                self.index.complete_promote(promo, ok)
                raise
            ok = [next(got) if it[0] in loaded else False for it in promo.items]
            self.index.complete_promote(promo, ok)
        want = self.index.take_clean_requests()
        if want:
            self.clean_in_background(want)

    # -------------------------------------------------------------- prefetch, evict, flush
    def prefetch(self, keys: list[bytes], tier: Tier) -> Future[int]:
        """Bring the resident ``keys`` up to ``tier`` on the load queue; a Future of the count."""
        plan = self.index.prepare_prefetch(keys, tier)

        def run() -> int:
            if plan is None:
                return 0
            try:
                ok = self.movers.run_prefetch(plan)
            except BaseException:
                self.index.complete_promote(plan, [False] * len(plan.items))
                raise
            self.index.complete_promote(plan, ok)
            n = sum(ok)
            self.index.metrics.inc("prefetched_blocks", n)
            return n

        return self.submit("load", run)

    def clean_in_background(self, n: int) -> Future[Any] | None:
        """Write the ``n`` coldest memory-only blocks to NVMe on the store queue,
        so that promotions find victims that leave without an NVMe write; the Future of
        the blocks written (``None`` without NVMe or once the store is closing)."""
        if self.storage is None:
            return None

        def run() -> int:
            plan = self.index.prepare_flush(
                max(n, self.index.settings.evict_batch_blocks), coldest_first=True
            )
            if plan is None:
                return 0
            try:
                st = self.movers.run_flush(plan)
            except BaseException:
                self.index.complete_flush(plan, {})
                raise
            return self.index.complete_flush(plan, st)

        try:
            return self.submit("store", run)
        except StoreClosedError:  # closing: nothing to keep clean any more
            return None

    def evict(self, tier: Tier, n: int) -> int:
        """Evict ``n`` unprotected blocks of a memory tier now; ``n``, or 0 if that many cannot be found."""
        plan = self.index.prepare_evict(tier, n)
        if plan is None:
            return 0
        try:
            nvme_st, dem_st = self.movers.run_store(plan, [])
        except BaseException:
            self.index.complete_store(plan, failed=True)
            raise
        self.index.complete_store(plan, nvme_st, dem_st)
        return n

    def flush(self, timeout_s: float | None, max_bytes: int | None) -> int:
        """Write memory-only blocks to NVMe in batches of ``evict_batch_blocks * 8`` until
        ``timeout_s`` or ``max_bytes`` (checked between batches); returns blocks written."""
        if self.storage is None:
            return 0
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        budget = None if max_bytes is None else max(0, max_bytes) // self.layout.bytes_per_block
        batch = max(8, self.index.settings.evict_batch_blocks * 8)
        n = 0
        while (t_end is None or time.monotonic() < t_end) and (budget is None or n < budget):
            plan = self.index.prepare_flush(batch if budget is None else min(batch, budget - n))
            if plan is None:
                break
            try:
                st = self.movers.run_flush(plan)
            except BaseException:
                self.index.complete_flush(plan, {})
                raise
            done = self.index.complete_flush(plan, st)
            n += done
            if done == 0:
                break
        return n

    # -------------------------------------------------------------- removal
    def invalidate(self, digest: bytes) -> int:
        """Drop every block of a namespace, durably; returns blocks dropped."""
        if self.planner is not None:  # this store never serves the namespace from the shared tier again
            self.planner.tier.remove(self.planner.bar(digest))
        n = self.index.invalidate(digest)  # refuses stores of digest until end_invalidate
        try:
            if self.storage is not None:
                self.storage.invalidate_namespace(digest)
        finally:
            self.index.end_invalidate(digest)
        return n

    def remove(self, keys: list[bytes]) -> int:
        """Remove blocks by key from every tier; returns how many were resident."""
        n = self.index.remove(keys)
        if self.storage is not None:
            self.storage.delete(keys)
        return n

    def clear(self) -> int:
        """Remove every block."""
        n = self.index.clear()
        if self.storage is not None:
            self.storage.delete(self.storage.keys())
        return n


__all__ = ["OpenCalls", "Transfers"]
