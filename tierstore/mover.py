"""The mover: executes the block index's plans; it decides nothing.

The index (:mod:`tierstore.index`) says *what* goes *where*; the mover copies
the bytes, without the index lock (vLLM's offloading handlers, SGLang's
``HiCacheController``):

* memory copies between an engine's buffers (fragment plans,
  :mod:`tierstore.io.pages`) and tier slots, and between tiers: one copy each
  (a block is gathered straight from the engine's pages into its slot, or into
  the NVMe staging extent, and scattered straight back);
* NVMe writes in **one batched put** per plan (new blocks and demoted victims
  together, each tagged with the placement of the lifetime class the index
  chose), and NVMe reads through the segment store's single read path (used
  by loads and prefetch alike);
* the order a plan needs: victims are written to NVMe before their slots are
  reused, and copied down into memory before new bytes land in theirs.

Asynchrony: :meth:`Mover.submit` runs a call (decide, move, record) on one of
two queues, ``"load"`` and ``"store"``, each a worker thread, and returns a
:class:`concurrent.futures.Future` (SGLang's ``HiCacheController`` queues its
transfers the same way). Loads and prefetches never queue behind a store's
NVMe writes. The ``run_*`` methods themselves are synchronous and
thread-safe as long as the plans they are given are disjoint, which the index
guarantees; :class:`tierstore.api.KVStore` calls them directly for
``wait=True`` and through :meth:`Mover.submit` for ``wait=False``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from .contract import LoadPlan, PromotePlan, StorePlan, Tier
from .errors import ConfigError, Status, StoreClosedError
from .fdp.lifetime import LifetimeClass
from .io.pages import FragmentPlan
from .tiers.memory import BlockPool
from .tiers.storage import BlockStorage


class LoadGate:
    """Makes "copy into the engine's buffer" and "give up at the deadline" exclusive.

    A load with a deadline hands this gate to every copy into its
    destinations. :meth:`close` (at the deadline) waits for a copy in progress
    and stops later ones; the late I/O then completes into nothing, and the
    caller reports those blocks as misses, so the engine recomputes them while
    its buffers are never written behind its back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = False
        self.delivered: set[int] = set()

    @contextlib.contextmanager
    def enter(self, indices: Sequence[int]):
        """Context manager yielding ``True`` if the copy of ``indices`` may proceed."""
        with self._lock:
            if self.closed:
                yield False
                return
            yield True
            self.delivered.update(indices)

    def close(self) -> set[int]:
        """Stop further copies; return the indices delivered so far."""
        with self._lock:
            self.closed = True
            return set(self.delivered)


class Mover:
    """Bytes between engine memory, the memory tiers and the NVMe tier.

    Parameters
    ----------
    pools : dict of Tier to BlockPool
        Memory of the enabled memory tiers (slot ``s`` is ``pools[t].view(s)``).
    nvme : BlockStorage or None
        The NVMe tier (a :class:`~tierstore.io.segments.SegmentStorage`).
    placement_of : callable or None
        ``f(LifetimeClass) -> int | None``: the placement tag (an FDP PID) of a
        lifetime class; only the FDP layer knows this table.
    remote : MooncakeTier or None
        The shared remote tier (:mod:`tierstore.remote`).
    """

    def __init__(self, pools: dict[Tier, BlockPool], nvme: BlockStorage | None,
                 placement_of: Callable[[LifetimeClass | None], int | None] | None = None,
                 remote=None) -> None:
        self.pools = pools
        self.nvme = nvme
        self.placement_of = placement_of
        self.remote = remote
        self._queues: dict[str, ThreadPoolExecutor] = {}
        self._queue_lock = threading.Lock()
        self._stopped = False
        #: host-tier slots a timed-out remote transfer may still write (slot -> holds)
        self._held: dict[int, int] = {}
        self._held_waiters: list[tuple[set, Callable[[], None]]] = []
        self._held_lock = threading.Lock()
        self._host_zero_copy = False
        host = pools.get(Tier.HOST)
        if remote is not None and host is not None and host.num_blocks and host.device.type == "cpu":
            # registered once: remote loads land straight in host-tier slots
            remote.register_memory(host.data, self._on_hold, self._on_release)
            self._host_zero_copy = True

    #: The queues :meth:`submit` accepts.
    QUEUES = ("load", "store")

    def submit(self, queue: str, fn: Callable[[], object]) -> Future:
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
        with self._queue_lock:
            if self._stopped:
                raise StoreClosedError("the store is closed")
            pool = self._queues.get(queue)
            if pool is None:
                pool = self._queues[queue] = ThreadPoolExecutor(max_workers=1,
                                                                thread_name_prefix=f"tierstore-{queue}")
            return pool.submit(fn)

    def drain(self) -> None:
        """Wait for every call submitted so far."""
        with self._queue_lock:
            pools = list(self._queues.values())
        for pool in pools:
            pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        """Finish submitted calls and refuse new ones."""
        with self._queue_lock:
            self._stopped = True
            pools, self._queues = list(self._queues.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)

    def view(self, tier: Tier, slot: int) -> torch.Tensor:
        """A memory slot's bytes (1-D ``uint8``)."""
        return self.pools[tier].view(slot)

    def _pid(self, cls: LifetimeClass | None) -> int | None:
        return self.placement_of(cls) if self.placement_of is not None else None

    # ------------------------------------------------------------------ store
    def run_store(self, plan: StorePlan, sources: Sequence[FragmentPlan | None]
                  ) -> tuple[dict[int, Status], dict[int, Status]]:
        """Execute a store plan.

        Parameters
        ----------
        plan : StorePlan
        sources : sequence of FragmentPlan or None
            Per key of the plan, the bytes to store (``None`` for keys the plan
            does not write).

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
            keys, frags, pls, nss = [], [], [], []
            for d in plan.nvme_demote:
                keys.append(d.key)
                frags.append([self.view(d.src, d.src_slot)])
                pls.append(self._pid(d.lifetime))
                nss.append(d.ns or bytes(32))
            for i, cls in plan.nvme_new:
                keys.append(plan.keys[i])
                frags.append(sources[i])
                pls.append(self._pid(cls))
                nss.append(plan.ns or bytes(32))
            st = self._put(keys, frags, pls, nss)
            k = len(plan.nvme_demote)
            for d, s in zip(plan.nvme_demote, st[:k]):
                dem_st[d.row] = s
            for (i, _), s in zip(plan.nvme_new, st[k:]):
                nvme_st[i] = s
        plan.moved, plan.demote_statuses = StorePlan.NVME_DONE, dem_st  # what a failure below must honour
        for d in plan.copies:  # lowest tier first: each destination was freed above
            self.view(d.dst, d.dst_slot).copy_(self.view(d.src, d.src_slot))
        plan.moved = StorePlan.COPIES_DONE  # from here on new bytes overwrite given slots
        rows = getattr(sources, "rows", None)
        if rows is not None and len(plan.memory) > 1:
            self._rows_to_slots(rows, plan.memory)
        else:
            for i, tier, slot in plan.memory:
                sources[i].gather(self.view(tier, slot), 0)
        return nvme_st, dem_st

    def _by_tier(self, items) -> dict:
        out: dict = {}
        for i, tier, slot in items:
            e = out.get(tier)
            if e is None:
                e = out[tier] = ([], [])
            e[0].append(i)
            e[1].append(slot)
        return out

    @staticmethod
    def _run(ix: list[int]) -> bool:
        return ix == list(range(ix[0], ix[0] + len(ix)))

    def _rows_to_slots(self, rows: torch.Tensor, items) -> None:
        """Copy ``rows[i]`` into slot ``slot`` of ``tier`` for every ``(i, tier, slot)``:
        one copy per tier (a slice copy for consecutive runs, else ``index_copy_``)."""
        for tier, (ix, sl) in self._by_tier(items).items():
            data = self.pools[tier].data
            if self._run(ix) and self._run(sl):
                data[sl[0]:sl[0] + len(sl)].copy_(rows[ix[0]:ix[0] + len(ix)])
                continue
            src = rows.index_select(0, torch.tensor(ix, device=rows.device))
            data.index_copy_(0, torch.tensor(sl, device=data.device), src.to(data.device))

    def _slots_to_rows(self, rows: torch.Tensor, items) -> None:
        """The inverse of :meth:`_rows_to_slots` (a load into :class:`~tierstore.io.pages.BlockRows`)."""
        for tier, (ix, sl) in self._by_tier(items).items():
            data = self.pools[tier].data
            if self._run(ix) and self._run(sl):
                rows[ix[0]:ix[0] + len(ix)].copy_(data[sl[0]:sl[0] + len(sl)])
                continue
            src = data.index_select(0, torch.tensor(sl, device=data.device))
            rows.index_copy_(0, torch.tensor(ix, device=rows.device), src.to(rows.device))

    def _put(self, keys, frags, pls, nss) -> list[Status]:
        try:
            return list(self.nvme.put_fragments(keys, frags, pls, nss))
        except OSError:
            return [Status.IO_ERROR] * len(keys)

    def run_flush(self, plan: StorePlan) -> dict[int, Status]:
        """Write a flush plan's memory-only blocks to NVMe."""
        if not plan.nvme_demote:
            return {}
        st = self._put([d.key for d in plan.nvme_demote], [[self.view(d.src, d.src_slot)] for d in plan.nvme_demote],
                       [self._pid(d.lifetime) for d in plan.nvme_demote], [d.ns or bytes(32) for d in plan.nvme_demote])
        return {d.row: s for d, s in zip(plan.nvme_demote, st)}

    # ------------------------------------------------------------------ load
    def run_load(self, plan: LoadPlan, dests: Sequence[FragmentPlan],
                 gate: LoadGate | None = None) -> tuple[list[Status], float | None]:
        """Copy each planned source into its destination.

        Returns per-key statuses and the seconds the NVMe part took (``None``
        without NVMe reads). A destination whose block is not ``OK`` is left
        untouched.
        """
        n = len(plan.keys)
        st = [Status.MISS] * n
        nvme_idx: list[int] = []
        rows = getattr(dests, "rows", None) if gate is None else None
        batch: list | None = [] if rows is not None else None
        for i, src in enumerate(plan.sources):
            if src is None:
                continue
            tier, slot = src
            if tier == Tier.NVME:
                nvme_idx.append(i)
                continue
            if batch is not None:
                batch.append((i, tier, slot))
                st[i] = Status.OK
                continue
            if gate is None:
                dests[i].scatter(self.view(tier, slot), 0)
                st[i] = Status.OK
                continue
            with gate.enter([i]) as go:
                if go:
                    dests[i].scatter(self.view(tier, slot), 0)
                    st[i] = Status.OK
        if batch:
            self._slots_to_rows(rows, batch)
        nvme_s = None
        if nvme_idx and self.nvme is not None:
            t0 = time.perf_counter()
            sub_gate = None
            if gate is not None:
                sub_gate = (lambda idx: gate.enter([nvme_idx[j] for j in idx]))
            try:
                got = self._get([plan.keys[i] for i in nvme_idx], [dests[i] for i in nvme_idx], sub_gate)
            except OSError:
                got = [Status.IO_ERROR] * len(nvme_idx)
            nvme_s = time.perf_counter() - t0
            for i, s in zip(nvme_idx, got):
                st[i] = s
        return st, nvme_s

    def _get(self, keys, dests, gate) -> list[Status]:
        if gate is None:
            return list(self.nvme.get_fragments(keys, dests))
        return list(self.nvme.get_fragments(keys, dests, gate=gate))

    def run_prefetch(self, plan: PromotePlan) -> list[bool]:
        """Copy each prefetched block from its source into its reserved slot
        (NVMe reads through the same read path as loads)."""
        self._victim_copies(plan)
        ok = [False] * len(plan.items)
        nv = []
        for j, ((i, _r, tier, slot), (st, ss)) in enumerate(zip(plan.items, plan.sources)):
            if st == Tier.NVME:
                nv.append(j)
            else:
                self.view(tier, slot).copy_(self.view(st, ss))
                ok[j] = True
        if nv and self.nvme is not None:
            try:
                got = self._get([plan.keys[plan.items[j][0]] for j in nv],
                                [[self.view(plan.items[j][2], plan.items[j][3])] for j in nv], None)
            except OSError:
                got = [Status.IO_ERROR] * len(nv)
            for j, s in zip(nv, got):
                ok[j] = s is Status.OK
        return ok

    def _victim_copies(self, plan: PromotePlan) -> None:
        """The slots' previous owners move down first (memory to memory only)."""
        self._publish_lost(plan.victims)
        plan.victims.moved = StorePlan.NVME_DONE  # a promotion writes nothing to NVMe
        for d in plan.victims.copies:
            self.view(d.dst, d.dst_slot).copy_(self.view(d.src, d.src_slot))
        plan.victims.moved = StorePlan.COPIES_DONE

    def run_promote(self, plan: PromotePlan, loaded: Sequence[FragmentPlan]) -> list[bool]:
        """Copy just-loaded blocks (read back from their destinations) into upper slots."""
        self._victim_copies(plan)
        out = []
        for i, _row, tier, slot in plan.items:
            try:
                loaded[i].gather(self.view(tier, slot), 0)
                out.append(True)
            except (RuntimeError, ValueError):
                out.append(False)
        return out

    # ------------------------------------------------------------------ remote
    def remote_get(self, keys: Sequence[bytes], dests: Sequence[FragmentPlan],
                   gate: LoadGate | None = None, indices: Sequence[int] | None = None) -> list[Status]:
        """Fetch blocks from the remote tier into destination plans.

        The remote tier verifies each object (header, key, CRC-32C) into a
        private buffer; only verified bytes are scattered, under ``gate`` when
        the load has a deadline (``indices`` are the blocks' positions in it).
        """
        bufs = [torch.empty(p.nbytes, dtype=torch.uint8) for p in dests]
        try:
            st = list(self.remote.get_into(list(keys), bufs))
        except OSError:
            return [Status.IO_ERROR] * len(keys)
        idx = list(indices) if indices is not None else list(range(len(keys)))
        for j, (s, p, b) in enumerate(zip(st, dests, bufs)):
            if s is not Status.OK:
                continue
            if gate is None:
                p.scatter(b, 0)
                continue
            with gate.enter([idx[j]]) as go:
                if go:
                    p.scatter(b, 0)
                else:
                    st[j] = Status.MISS
        return st

    def run_remote_fill(self, plan: StorePlan, dests: Sequence[FragmentPlan], gate: LoadGate | None = None,
                        indices: Sequence[int] | None = None
                        ) -> tuple[list[Status], dict[int, Status], dict[int, Status], set[int]]:
        """Fetch a fill plan's blocks from the remote tier into their reserved
        slots and copy each verified block on into the engine's destination.

        ``plan`` is :meth:`BlockIndex.prepare_store` of remote hits (its
        victims move out first, as in :meth:`run_store`). A block whose slot is
        in the host tier is fetched zero-copy into that slot (the host pool is
        registered with the remote tier once, at construction); one bound for
        an HBM slot or NVMe only goes through the remote tier's staging buffer.
        The remote tier verifies every object (magic, version, key, length,
        CRC-32C) before its status is ``OK``; only then is it copied to the
        destination (under ``gate`` when the load has a deadline; ``indices``
        are the blocks' positions in that load) and written to NVMe when the
        plan says so.

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
        nvme_st: dict[int, Status] = {}
        dem_st: dict[int, Status] = {}
        self._publish_lost(plan)
        if plan.nvme_demote and self.nvme is not None:  # victims leave before their slots are reused
            st_ = self._put([d.key for d in plan.nvme_demote], [[self.view(d.src, d.src_slot)] for d in plan.nvme_demote],
                            [self._pid(d.lifetime) for d in plan.nvme_demote],
                            [d.ns or bytes(32) for d in plan.nvme_demote])
            dem_st = {d.row: s for d, s in zip(plan.nvme_demote, st_)}
        for d in plan.copies:
            self.view(d.dst, d.dst_slot).copy_(self.view(d.src, d.src_slot))
        mem = {i: (t, s) for i, t, s in plan.memory}
        todo = plan.pending
        bufs = []
        for i in todo:
            t, s = mem.get(i, (None, -1))
            if t == Tier.HOST and self._host_zero_copy:
                bufs.append(self.view(t, s))
            else:
                bufs.append(torch.empty(self.remote.block_bytes, dtype=torch.uint8))
        try:
            got = list(self.remote.get_into([plan.keys[i] for i in todo], bufs)) if todo else []
        except OSError:
            got = [Status.IO_ERROR] * len(todo)
        host_slots = {mem[i][1] for i in todo if i in mem and mem[i][0] == Tier.HOST}
        with self._held_lock:
            held = {s for s in host_slots if self._held.get(s)}
        out = [Status.MISS] * len(plan.keys)
        idx = list(indices) if indices is not None else list(range(len(plan.keys)))
        nv_new = dict(plan.nvme_new)
        nv_keys, nv_frags, nv_pls, nv_idx = [], [], [], []
        for i, s, b in zip(todo, got, bufs):
            if s is not Status.OK:
                nvme_st[i] = Status.IO_ERROR
                out[i] = s
                continue
            t, slot = mem.get(i, (None, -1))
            if t is not None and not (t == Tier.HOST and self._host_zero_copy):
                self.view(t, slot).copy_(b)
            if i in nv_new:
                nv_keys.append(plan.keys[i])
                nv_frags.append([b])
                nv_pls.append(self._pid(nv_new[i]))
                nv_idx.append(i)
            if gate is None:
                dests[i].scatter(b, 0)
                out[i] = Status.OK
                continue
            with gate.enter([idx[i]]) as go:
                if go:
                    dests[i].scatter(b, 0)
                    out[i] = Status.OK
        if nv_keys and self.nvme is not None:
            for i, s in zip(nv_idx, self._put(nv_keys, nv_frags, nv_pls, [plan.ns or bytes(32)] * len(nv_keys))):
                nvme_st[i] = s
        return out, nvme_st, dem_st, held

    def _on_hold(self, off: int, n: int) -> None:
        bb = self.pools[Tier.HOST].block_bytes
        with self._held_lock:
            for s in range(off // bb, (off + n - 1) // bb + 1):
                self._held[s] = self._held.get(s, 0) + 1

    def _on_release(self, off: int, n: int) -> None:
        bb = self.pools[Tier.HOST].block_bytes
        ready = []
        with self._held_lock:
            for s in range(off // bb, (off + n - 1) // bb + 1):
                left = self._held.get(s, 0) - 1
                if left > 0:
                    self._held[s] = left
                else:
                    self._held.pop(s, None)
            keep = []
            for slots, fn in self._held_waiters:
                (keep if any(s in self._held for s in slots) else ready).append((slots, fn))
            self._held_waiters = keep
        for _slots, fn in ready:
            fn()

    def after_release(self, slots: set[int], fn: Callable[[], None]) -> None:
        """Run ``fn`` once no late remote transfer holds any of these host
        slots (at once when none does; otherwise on the remote tier's thread)."""
        with self._held_lock:
            if any(s in self._held for s in slots):
                self._held_waiters.append((set(slots), fn))
                return
        fn()

    def _publish_lost(self, plan: StorePlan) -> None:
        """Offer the plan's lost victims (``StorePlan.lost``) to the remote tier
        before their slots are reused: a copy into its publish queue, so the
        slot is free when this returns (asynchronous publication; a full queue
        drops and counts)."""
        if plan.lost and self.remote is not None:
            self.remote.put([k for k, _t, _s in plan.lost], [self.view(t, s) for _k, t, s in plan.lost], copy=True,
                            recent=False)  # its remote copy, if any, may have been evicted since

    def publish(self, keys: Sequence[bytes], sources: Sequence[FragmentPlan], recent: bool = True) -> list[Status]:
        """Queue blocks for the remote tier (asynchronous; returns at once).

        A source that is one contiguous host tensor goes as is (the tier copies
        it into its publish queue); other plans are gathered first. ``recent``:
        see :meth:`MooncakeTier.put <tierstore.remote.mooncake.MooncakeTier.put>`.
        """
        blocks = []
        for p in sources:
            frags = p.fragments
            if p.strided is None and frags is not None and len(frags) == 1 and isinstance(frags[0], torch.Tensor) \
                    and frags[0].device.type == "cpu" and frags[0].is_contiguous():
                blocks.append(frags[0])
            else:
                b = torch.empty(p.nbytes, dtype=torch.uint8)
                p.gather(b, 0)
                blocks.append(b)
        return list(self.remote.put(list(keys), blocks, recent=recent))
