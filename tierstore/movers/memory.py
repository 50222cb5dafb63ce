"""The memory handler: every copy between engine buffers and memory-tier slots, and between slots.

It knows the memory tiers' pools (``Mapping[Tier, BlockPool]``) and nothing else: no index, no
plan beyond the ``(tier, slot)`` items a plan carries. One copy each: a block is gathered straight
from the engine's pages into its slot and scattered straight back; a batch (``BlockRows``, the
engine's blocks as rows of one tensor; ``PageBatch``, blocks of an engine's page pool by id) moves
per tier with one copy per run of consecutive rows and slots, or one gather. Every memory copy
of the store passes through :meth:`MemoryHandler.view` or a batch's rows, and runs through a
:class:`~tierstore.io.copies.Copier` (one OpenMP thread per copying thread, a call's blocks
claimed by the caller and a few copy threads: copies that a busy host does not stall).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..contract import Demotion, Tier
from ..errors import Status
from ..io.copies import Copier, one_omp_thread, shared_copier
from ..io.pages import FragmentPlan
from ..tiers.memory import BlockPool
from .gate import LoadGate

#: ``(i, tier, slot)``: position ``i`` of a call and a memory slot.
Item = tuple[int, Tier, int]


def by_tier(items: Sequence[Item]) -> dict[Tier, tuple[list[int], list[int]]]:
    """``{tier: (positions, slots)}`` of ``(i, tier, slot)`` items, in their order."""
    if not items:
        return {}
    ix, tiers, slots = zip(*items)  # C-level transposition; one tier (the common case) is done
    if tiers.count(tiers[0]) == len(tiers):
        return {tiers[0]: (list(ix), list(slots))}
    out: dict[Tier, tuple[list[int], list[int]]] = {}
    for i, tier, slot in items:
        e = out.get(tier)
        if e is None:
            e = out[tier] = ([], [])
        e[0].append(i)
        e[1].append(slot)
    return out


#: Rows at least this long move one copy per run rather than through one numpy gather (which
#: copies each row twice; for small rows one C call beats a Python call per run).
_ROW_COPY_BYTES = 64 << 10
#: Runs of consecutive rows (on both sides) at least this long on average move one copy per run;
#: shorter ones (scattered host pages, fragmented slots) go through one gather.
_RUN_ROWS = 8


def run_start(ix: Sequence[int]) -> int | None:
    """``ix[0]`` when ``ix`` is ``ix[0], ix[0] + 1, ...`` (one run), else None (also when empty).

    One C-level list comparison (~1-2 us for 128 ids), no numpy call: most batches are one run
    (SGLang's allocator hands out consecutive host pages, a fresh host tier consecutive slots)."""
    n = len(ix)
    if not n:
        return None
    a = ix[0]
    if isinstance(ix, range):
        return a if ix.step == 1 or n == 1 else None
    if ix[-1] - a != n - 1:
        return None
    return a if (ix if isinstance(ix, list) else list(ix)) == list(range(a, a + n)) else None


def runs_of(dst_ix: Sequence[int], src_ix: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dst_start, src_start, length)`` of the maximal runs in which both index lists step by one."""
    a, b = run_start(dst_ix), run_start(src_ix)
    if a is not None and b is not None and len(dst_ix) == len(src_ix):  # one run: no numpy
        return [(a, b, len(dst_ix))]
    d = np.asarray(dst_ix, dtype=np.int64)
    s = np.asarray(src_ix, dtype=np.int64)
    cut = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((starts, [d.size])))
    return list(zip(d[starts].tolist(), s[starts].tolist(), lengths.tolist()))


def _copy_run(dst: torch.Tensor, src: torch.Tensor, run: tuple[int, int, int]) -> None:
    """``dst[a:a+k] = src[b:b+k]`` for ``run = (a, b, k)``."""
    a, b, k = run
    dst[a : a + k].copy_(src[b : b + k])


class MemoryHandler:
    """Copies between engine buffers and memory-tier slots (memory -> memory transfers).

    Parameters
    ----------
    pools : mapping of Tier to BlockPool
        The enabled memory tiers; slot ``s`` of tier ``t`` is ``pools[t].view(s)``
        (1-D ``uint8``, ``block_bytes`` long).
    copier : Copier, optional
        Runs the copies (default: the process's :func:`~tierstore.io.copies.shared_copier`).
    """

    def __init__(self, pools: Mapping[Tier, BlockPool], copier: Copier | None = None) -> None:
        self.pools = pools
        self.copier = copier if copier is not None else shared_copier()

    def _each(self, fn: Callable[[Any], object], items: Sequence[Any], block_bytes: int) -> None:
        """``fn(item)`` for every item, each a copy of ``block_bytes``, through the copier in
        pieces of at least its ``chunk_bytes`` (fewer hand-offs for small blocks)."""
        k = max(1, self.copier.chunk_bytes // max(1, block_bytes))
        pieces = [lambda part=items[a : a + k]: [fn(x) for x in part] for a in range(0, len(items), k)]
        self.copier.run(pieces, len(items) * block_bytes)

    def view(self, tier: Tier, slot: int) -> torch.Tensor:
        """A memory slot's bytes (1-D ``uint8``)."""
        return self.pools[tier].view(slot)

    def copy_down(self, copies: Sequence[Demotion]) -> None:
        """Slot to slot, in the given order (a plan lists them lowest tier first)."""
        if not copies:  # most plans: no OpenMP setting to change and restore
            return
        with one_omp_thread():  # in order: a later copy may read a slot an earlier one wrote
            for d in copies:
                self.view(d.dst, d.dst_slot).copy_(self.view(d.src, d.src_slot))

    def copy_slots(self, pairs: Sequence[tuple[Tier, int, Tier, int]]) -> None:
        """``(src_tier, src_slot, dst_tier, dst_slot)`` copies, in order (a prefetch from a memory tier)."""
        with one_omp_thread():
            for st, ss, dt, ds in pairs:
                self.view(dt, ds).copy_(self.view(st, ss))

    def gather(self, sources: Sequence[FragmentPlan | None], items: Sequence[Item]) -> None:
        """Engine bytes into slots: ``sources[i]`` into ``(tier, slot)`` for each item.

        A ``BlockRows`` or ``PageBatch`` (``sources.rows``) of more than one item moves per tier at
        once (:meth:`_move_rows`).
        """
        rows = getattr(sources, "rows", None)
        if rows is not None and len(items) > 1:
            self._move_rows(rows, items, to_slots=True, row_ids=sources.row_ids)  # type: ignore[attr-defined]
            return
        # items name given sources (never None)
        nbytes = sources[items[0][0]].nbytes if items else 0  # type: ignore[union-attr]
        self._each(lambda it: sources[it[0]].gather(self.view(it[1], it[2]), 0), items, nbytes)

    def scatter(
        self,
        dests: Sequence[FragmentPlan] | Mapping[int, FragmentPlan],
        items: Sequence[Item],
        gate: LoadGate | None,
        statuses: list[Status],
    ) -> None:
        """Slots into engine buffers: ``(tier, slot)`` into ``dests[i]``; ``statuses[i] = OK`` for each
        block delivered (under ``gate`` when the load has a deadline; a closed gate delivers nothing).

        Without a gate a ``BlockRows`` or ``PageBatch`` (``dests.rows``) moves per tier at once.
        """
        rows = getattr(dests, "rows", None) if gate is None else None
        if rows is not None:
            for i, _t, _s in items:
                statuses[i] = Status.OK
            if items:
                self._move_rows(rows, items, to_slots=False, row_ids=dests.row_ids)  # type: ignore[union-attr]
            return
        if gate is None:

            def one(it: Item) -> None:
                dests[it[0]].scatter(self.view(it[1], it[2]), 0)
                statuses[it[0]] = Status.OK

            self._each(one, items, dests[items[0][0]].nbytes if items else 0)
            return
        with one_omp_thread():
            for i, tier, slot in items:
                with gate.enter([i]) as go:
                    if go:
                        dests[i].scatter(self.view(tier, slot), 0)
                        statuses[i] = Status.OK

    def promote(
        self,
        items: Sequence[tuple[int, int, Tier, int]],
        loaded: Sequence[FragmentPlan] | Mapping[int, FragmentPlan],
    ) -> list[bool]:
        """Copy just-loaded blocks, read back from their destinations ``loaded[i]``, into upper
        slots: ``items[j] = (i, row, tier, slot)``; ``False`` where the read-back failed."""
        out = []
        with one_omp_thread():
            for i, _row, tier, slot in items:
                try:
                    loaded[i].gather(self.view(tier, slot), 0)
                    out.append(True)
                except (RuntimeError, ValueError):
                    out.append(False)
        return out

    def _move_rows(
        self, rows: torch.Tensor, items: Sequence[Item], to_slots: bool, row_ids: Sequence[int] | None = None
    ) -> None:
        """``rows[row_ids[i]]`` (``rows[i]`` without ``row_ids``) <-> slot ``slot`` of ``tier`` for every
        ``(i, tier, slot)``, per tier: one copy per run of consecutive rows and slots (split over
        the copier's threads when large), or for many short runs of small rows on the host one
        numpy gather (``dst[ix] = src[ix]``: torch's ``index_copy_`` runs per element on the CPU)."""
        for tier, (ix, sl) in by_tier(items).items():
            data = self.pools[tier].data
            if row_ids is not None:  # the pool's block of each position (C-level map)
                ix = list(map(row_ids.__getitem__, ix))
            slots = data if rows.dim() == 2 else data.view(data.shape[0], *rows.shape[1:])
            src, dst, src_ix, dst_ix = (rows, slots, ix, sl) if to_slots else (slots, rows, sl, ix)
            runs = runs_of(dst_ix, src_ix)
            row_bytes = data.shape[1]
            if len(runs) == 1:
                a, b, k = runs[0]
                self.copier.copy(dst[a : a + k], src[b : b + k])
            elif (
                len(runs) * _RUN_ROWS > len(ix)
                and row_bytes < _ROW_COPY_BYTES
                and src.device.type == dst.device.type == "cpu"
            ):
                dst.numpy()[np.asarray(dst_ix)] = src.numpy()[np.asarray(src_ix)]
            else:
                pieces = [functools.partial(_copy_run, dst, src, r) for r in runs]
                self.copier.run(pieces, len(ix) * row_bytes)
