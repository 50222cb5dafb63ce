"""The executor: runs the index's plans through the handler table, in the order a plan needs.

It decides nothing. Order inside a store plan: victims leaving the last memory tier are offered
to the remote tier, then victims and new blocks go to NVMe in one batch, then memory victims are
copied down (lowest tier first), and only then do new bytes land in the slots given away; how far
it got is recorded in ``StorePlan.moved`` (and the victims' NVMe statuses in
``demote_statuses``), so a plan that fails midway is completed by what really happened. Loads copy
from memory first, then read NVMe through the storage's one read path, under the load's gate.

The ``run_*`` methods are synchronous and thread-safe as long as the plans they are given are
disjoint, which the index guarantees; ``KVStore`` calls them directly for ``wait=True`` and
through :meth:`Movers.submit` (the work queues) for ``wait=False``. Split execution (the node
store, where a client copies the new blocks into shared slots): :meth:`Movers.run_store_prelude`
(the victims leave), :meth:`Movers.run_store_epilogue` (new blocks to NVMe from their filled slots)
and :meth:`Movers.stage_load` (a load's sources into the slots a client reads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from operator import itemgetter
from typing import Any, Final, cast

from ..contract import LoadPlan, Medium, PromotePlan, StorePlan, Tier
from ..delegation import handed_to
from ..errors import Status
from ..io.copies import one_omp_thread
from ..io.pages import FragmentPlan
from ..tiers.memory import BlockPool
from ..tiers.storage import BlockStorage, RemoteBlockTier
from .batch import NvmeBatch, PlacementFor, add_new_blocks, demotion_batch, store_batch
from .gate import GateView, LoadGate
from .memory import MemoryHandler
from .nvme import NvmeHandler
from .queues import WorkQueues
from .remote import RemoteHandler
from .table import HandlerTable

MEMORY: Final = Medium.MEMORY
NVME: Final = Medium.NVME
REMOTE: Final = Medium.REMOTE


class Movers:
    """Bytes between engine memory, the memory tiers, the NVMe tier and the remote tier.

    Parameters
    ----------
    handlers : HandlerTable
        One handler per transfer kind.
    queues : WorkQueues
        The ``"load"`` and ``"store"`` queues of :meth:`submit`.

    Attributes
    ----------
    memory, nvme, remote : MemoryHandler, NvmeHandler or None, RemoteHandler or None
        The table's handlers.
    """

    QUEUES = WorkQueues.QUEUES

    def __init__(self, handlers: HandlerTable, queues: WorkQueues | None = None) -> None:
        self.handlers = handlers
        self.queues = queues if queues is not None else WorkQueues()
        self.memory: MemoryHandler = handlers[MEMORY, MEMORY]
        self.nvme: NvmeHandler | None = handlers.nvme
        self.remote: RemoteHandler | None = handlers.remote

    # ------------------------------------------------------------------ queues
    def submit(self, queue: str, fn: Callable[[], object]) -> Future[Any]:
        """Run ``fn`` on the ``"load"`` or ``"store"`` queue (see :meth:`WorkQueues.submit`)."""
        return self.queues.submit(queue, fn)

    def drain(self) -> None:
        """Wait for every call submitted so far."""
        self.queues.drain()

    def shutdown(self) -> None:
        """Finish submitted calls and refuse new ones (``StoreClosedError``)."""
        self.queues.shutdown()

    # ------------------------------------------------------------------ store
    def run_store(
        self, plan: StorePlan, sources: Sequence[FragmentPlan | None]
    ) -> tuple[dict[int, Status], dict[int, Status]]:
        """Execute a store plan.

        Parameters
        ----------
        plan : StorePlan
        sources : sequence of FragmentPlan or None
            Per key of the plan, the bytes to store (``None`` for keys the plan does not write).

        Returns
        -------
        nvme_statuses : dict
            ``i -> Status`` for every new block written to NVMe.
        demote_statuses : dict
            ``row -> Status`` for every victim written to NVMe.
        """
        nvme_st: dict[int, Status] = {}
        dem_st: dict[int, Status] = {}
        self._publish_lost(plan)
        if (plan.nvme_new or plan.nvme_demote) and self.nvme is not None:
            batch = store_batch(plan, sources, self.memory, self.nvme.placement_for)
            st = self.nvme.write(batch)
            k = batch.demotions
            for d, s in zip(plan.nvme_demote, st[:k]):
                dem_st[d.row] = s
            for (i, _), s in zip(plan.nvme_new, st[k:]):
                nvme_st[i] = s
        plan.moved, plan.demote_statuses = StorePlan.NVME_DONE, dem_st  # what a failure below must honour
        self.memory.copy_down(plan.copies)  # lowest tier first: each destination was freed above
        plan.moved = StorePlan.COPIES_DONE  # from here on new bytes overwrite given slots
        self.memory.gather(sources, plan.memory)
        return nvme_st, dem_st

    # ------------------------------------------------------------------ split store (node store)
    def run_store_prelude(self, plan: StorePlan) -> dict[int, Status]:
        """A store plan's first half when someone else copies the new blocks into their slots
        (split execution, :mod:`tierstore.node.tickets`): the victims leave their slots (lost
        ones offered to the remote tier, NVMe-bound ones written, memory ones copied down), so
        that the slots may be handed out. Returns the victims' NVMe statuses (``row -> Status``);
        ``plan.moved`` says how far it got, as for :meth:`run_store`."""
        dem_st = self._fill_victims(plan, mark=True)
        return dem_st

    def run_store_epilogue(
        self, plan: StorePlan, sources: Sequence[FragmentPlan | None]
    ) -> dict[int, Status]:
        """A store plan's second half: the new blocks bound for NVMe (``plan.nvme_new``) written
        from ``sources[i]`` (their slots, once filled), one batch; a key whose source is ``None``
        (its copy failed) is not written. Returns ``i -> Status`` of each write."""
        new = [(i, cls) for i, cls in plan.nvme_new if sources[i] is not None]
        if not new or self.nvme is None:
            return {}
        batch = add_new_blocks(
            NvmeBatch(),
            [plan.keys[i] for i, _ in new],
            [sources[i] for i, _ in new],
            [cls for _, cls in new],
            plan.ns,
            self.nvme.placement_for,
        )
        return {i: s for (i, _), s in zip(new, self.nvme.write(batch))}

    def stage_load(
        self, plan: LoadPlan, dests: Mapping[int, FragmentPlan]
    ) -> tuple[dict[int, Status], float | None]:
        """Copy the sources of the keys ``dests`` names into those destinations (split
        execution: a load's NVMe blocks into the slots a client then reads; ``dests[i]`` a
        ``FragmentPlan`` of a slot). Returns ``i -> Status`` and the seconds the NVMe part
        took (``None`` without NVMe reads)."""
        st: dict[int, Status] = {}
        given = {i: s for i in dests if (s := plan.sources[i]) is not None}
        nv = [i for i, s in given.items() if s[0] == Tier.NVME]
        mem = [(i, s[0], s[1]) for i, s in given.items() if s[0] != Tier.NVME]
        out = [Status.MISS] * len(plan.keys)
        self.memory.scatter({i: dests[i] for i, _t, _s in mem}, mem, None, out)
        st.update((i, out[i]) for i, _t, _s in mem)
        nvme_s = None
        if nv and self.nvme is not None:
            got, nvme_s = self.nvme.read([plan.keys[i] for i in nv], [dests[i] for i in nv])
            st.update(zip(nv, got))
        for i in dests:
            st.setdefault(i, Status.MISS)
        return st, nvme_s

    def run_flush(self, plan: StorePlan) -> dict[int, Status]:
        """Write a flush plan's memory-only blocks to NVMe."""
        if not plan.nvme_demote:
            return {}
        nvme: NvmeHandler = self.handlers[MEMORY, NVME]
        st = nvme.write(demotion_batch(plan.nvme_demote, self.memory, nvme.placement_for))
        return {d.row: s for d, s in zip(plan.nvme_demote, st)}

    # ------------------------------------------------------------------ load
    def run_load(
        self, plan: LoadPlan, dests: Sequence[FragmentPlan], gate: LoadGate | None = None
    ) -> tuple[list[Status], float | None]:
        """Copy each planned source into its destination.

        Returns per-key statuses and the seconds the NVMe part took (``None``
        without NVMe reads). A destination whose block is not ``OK`` is left
        untouched.
        """
        st = [Status.MISS] * len(plan.keys)
        nvme_idx: list[int] = []
        items: list[tuple[int, Tier, int]] = []
        srcs = plan.sources
        held = cast("list[tuple[Tier, int]]", srcs) if None not in srcs else None
        tiers = list(map(itemgetter(0), held)) if held is not None else None
        if (
            held is not None and tiers is not None and Tier.NVME not in tiers
        ):  # all in memory: items made in C
            items = list(zip(range(len(held)), tiers, map(itemgetter(1), held)))
        else:
            for i, src in enumerate(srcs):
                if src is None:
                    continue
                if src[0] == Tier.NVME:
                    nvme_idx.append(i)
                else:
                    items.append((i, src[0], src[1]))
        self.memory.scatter(dests, items, gate, st)
        nvme_s = None
        if nvme_idx and self.nvme is not None:
            got, nvme_s = self.nvme.read(
                [plan.keys[i] for i in nvme_idx],
                [dests[i] for i in nvme_idx],
                None if gate is None else gate.at(nvme_idx),
            )
            for i, s in zip(nvme_idx, got):
                st[i] = s
        return st, nvme_s

    def run_prefetch(self, plan: PromotePlan) -> list[bool]:
        """Copy each prefetched block from its source into its reserved slot
        (NVMe reads through the same read path as loads)."""
        self._victim_copies(plan)
        ok = [False] * len(plan.items)
        nv = []
        for j, ((_i, _r, tier, slot), (st, ss)) in enumerate(zip(plan.items, plan.sources)):
            if st == Tier.NVME:
                nv.append(j)
            else:
                self.memory.copy_slots([(st, ss, tier, slot)])
                ok[j] = True
        if nv and self.nvme is not None:
            got, _s = self.nvme.read(
                [plan.keys[plan.items[j][0]] for j in nv],
                [[self.memory.view(plan.items[j][2], plan.items[j][3])] for j in nv],
            )
            for j, s in zip(nv, got):
                ok[j] = s is Status.OK
        return ok

    def run_promote(
        self, plan: PromotePlan, loaded: Sequence[FragmentPlan] | Mapping[int, FragmentPlan]
    ) -> list[bool]:
        """Copy just-loaded blocks (read back from their destinations) into upper slots."""
        self._victim_copies(plan)
        return self.memory.promote(plan.items, loaded)

    def _victim_copies(self, plan: PromotePlan) -> None:
        """The slots' previous owners move down first (memory to memory only)."""
        self._publish_lost(plan.victims)
        plan.victims.moved = StorePlan.NVME_DONE  # a promotion writes nothing to NVMe
        self.memory.copy_down(plan.victims.copies)
        plan.victims.moved = StorePlan.COPIES_DONE

    # ------------------------------------------------------------------ remote
    # the remote handler's calls, found in the table at each call (ConfigError without one)
    remote_get = handed_to(lambda movers: movers.handlers[REMOTE, MEMORY], RemoteHandler.fetch)
    publish = handed_to(lambda movers: movers.handlers[MEMORY, REMOTE], RemoteHandler.publish)

    def after_release(self, slots: set[int], fn: Callable[[], object]) -> None:
        """Run ``fn`` once no late remote transfer holds any of these host slots
        (at once when none does, or without a remote tier)."""
        if self.remote is None:
            fn()
            return
        self.remote.after_release(slots, fn)

    def _publish_lost(self, plan: StorePlan) -> None:
        if plan.lost and self.remote is not None:
            self.remote.publish_lost(plan.lost, self.memory)

    def run_remote_fill(
        self, plan: StorePlan, dests: Sequence[FragmentPlan], gate: GateView | None = None
    ) -> tuple[list[Status], dict[int, Status], dict[int, Status], set[int]]:
        """Fetch a fill plan's blocks from the remote tier into their reserved
        slots and copy each verified block on into the engine's destination.

        ``plan`` is :meth:`BlockIndex.prepare_store` of remote hits (its victims
        move out first, as in :meth:`run_store`). A block whose slot is in the
        host tier is fetched zero-copy into that slot (the host pool is
        registered with the remote tier once); one bound for an HBM slot or
        NVMe only goes through a staging buffer. Only a verified block (status
        ``OK``) is copied to the destination (under ``gate`` when the load has a
        deadline: the load's, at the plan's keys' positions in it) and
        written to NVMe when the plan says so.

        Returns
        -------
        statuses : list of Status
            Per key of the plan, for the engine: ``OK`` delivered, else the
            remote tier's ``MISS`` or ``IO_ERROR`` (keys the plan does not
            write are ``MISS``: the caller fetches them).
        nvme_statuses : dict
            For :meth:`BlockIndex.complete_store`: ``i -> Status``; a block the
            remote tier did not deliver is ``IO_ERROR`` here, so the index
            forgets it and frees its slot.
        demote_statuses : dict
            ``row -> Status`` of the victims written to NVMe.
        held : set of int
            Host slots a timed-out transfer may still write: complete the plan
            only once :meth:`after_release` says they are free again.
        """
        remote: RemoteHandler = self.handlers[REMOTE, MEMORY]
        dem_st = self._fill_victims(plan)
        mem = {i: (t, s) for i, t, s in plan.memory}
        todo = plan.pending
        bufs = remote.fill_buffers([mem.get(i) for i in todo], self.memory)
        got = remote.get_into([plan.keys[i] for i in todo], bufs) if todo else []
        held = remote.held_of({mem[i][1] for i in todo if i in mem and mem[i][0] == Tier.HOST})
        out, nvme_st = self._deliver_fill(plan, dests, gate, mem, zip(todo, got, bufs), remote.zero_copy)
        return out, nvme_st, dem_st, held

    def _fill_victims(self, plan: StorePlan, mark: bool = False) -> dict[int, Status]:
        """A plan's victims leave before their slots are reused: lost ones offered to the
        remote tier, NVMe-bound ones written, memory ones copied down; their NVMe statuses.
        ``mark``: record the progress in ``plan.moved`` (as :meth:`run_store` does)."""
        self._publish_lost(plan)
        dem_st: dict[int, Status] = {}
        if plan.nvme_demote and self.nvme is not None:
            st = self.nvme.write(demotion_batch(plan.nvme_demote, self.memory, self.nvme.placement_for))
            dem_st = {d.row: s for d, s in zip(plan.nvme_demote, st)}
        if mark:
            plan.moved, plan.demote_statuses = StorePlan.NVME_DONE, dem_st
        self.memory.copy_down(plan.copies)
        if mark:
            plan.moved = StorePlan.COPIES_DONE
        return dem_st

    def _deliver_fill(
        self,
        plan: StorePlan,
        dests: Sequence[FragmentPlan],
        gate: GateView | None,
        mem: Mapping[int, tuple[Tier, int]],
        fetched: Iterable[tuple[int, Status, Any]],
        zero_copy: bool,
    ) -> tuple[list[Status], dict[int, Status]]:
        """Verified fetched blocks into their slots (unless fetched there), the destinations and,
        where the plan says so, NVMe (one batch); per key the engine's status, and the NVMe statuses."""
        out = [Status.MISS] * len(plan.keys)
        nvme_st: dict[int, Status] = {}
        nv_new = dict(plan.nvme_new)
        new: list[tuple[int, object]] = []
        with one_omp_thread():  # copies of the calling thread on one OpenMP thread (io.copies)
            for i, s, b in fetched:
                if s is not Status.OK:
                    nvme_st[i] = Status.IO_ERROR
                    out[i] = s
                    continue
                t, slot = mem.get(i, (None, -1))
                if t is not None and not (t == Tier.HOST and zero_copy):
                    self.memory.view(t, slot).copy_(b)
                if i in nv_new:
                    new.append((i, b))
                if gate is None:
                    dests[i].scatter(b, 0)
                    out[i] = Status.OK
                    continue
                with gate.enter([i]) as go:
                    if go:
                        dests[i].scatter(b, 0)
                        out[i] = Status.OK
        if new and self.nvme is not None:
            batch = add_new_blocks(
                NvmeBatch(),
                [plan.keys[i] for i, _ in new],
                [[b] for _, b in new],
                [nv_new[i] for i, _ in new],
                plan.ns,
                self.nvme.placement_for,
            )
            for (i, _), s in zip(new, self.nvme.write(batch)):
                nvme_st[i] = s
        return out, nvme_st


def make_movers(
    pools: Mapping[Tier, BlockPool],
    nvme: BlockStorage | None,
    placement_for: PlacementFor | None,
    remote: RemoteBlockTier | None,
) -> Movers:
    """The movers of a store: a handler per transfer kind its tiers need, and the work queues."""
    return Movers(
        HandlerTable(
            MemoryHandler(pools),
            NvmeHandler(nvme, placement_for) if nvme is not None else None,
            RemoteHandler(remote, pools.get(Tier.HOST)) if remote is not None else None,
        ),
        WorkQueues(),
    )
