"""The memory handler: every copy between engine buffers and memory-tier slots, and between slots.

It knows the memory tiers' pools (``Mapping[Tier, BlockPool]``) and nothing else: no index, no
plan beyond the ``(tier, slot)`` items a plan carries. One copy each: a block is gathered straight
from the engine's pages into its slot and scattered straight back; a :class:`~tierstore.io.pages.
BlockRows` batch (the engine's blocks as rows of one tensor) is one slice copy or one
``index_copy_`` per tier. Every memory copy of the store passes through :meth:`MemoryHandler.view`,
and runs through a :class:`~tierstore.io.copies.Copier` (one OpenMP thread per copying thread, a
call's blocks claimed by the caller and a few copy threads: copies that a busy host does not stall).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


#: Rows at least this long move one copy each rather than through ``index_select`` +
#: ``index_copy_`` (which copies twice; for tiny rows one C call beats per-row Python).
_ROW_COPY_BYTES = 64 << 10


def _consecutive(ix: list[int]) -> bool:
    return ix == list(range(ix[0], ix[0] + len(ix)))


def _copy_row(dst: torch.Tensor, src: torch.Tensor, pair: tuple[int, int]) -> None:
    """``dst[pair[1]] = src[pair[0]]``: one row of a row move."""
    dst[pair[1]].copy_(src[pair[0]])


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

        A ``BlockRows`` batch (``sources.rows``) of more than one item is one copy per tier.
        """
        rows = getattr(sources, "rows", None)
        if rows is not None and len(items) > 1:
            self._move_rows(rows, items, to_slots=True)
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

        Without a gate a ``BlockRows`` batch (``dests.rows``) is one copy per tier.
        """
        rows = getattr(dests, "rows", None) if gate is None else None
        if rows is not None:
            for i, _t, _s in items:
                statuses[i] = Status.OK
            if items:
                self._move_rows(rows, items, to_slots=False)
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

    def _move_rows(self, rows: torch.Tensor, items: Sequence[Item], to_slots: bool) -> None:
        """``rows[i]`` <-> slot ``slot`` of ``tier`` for every ``(i, tier, slot)``: one copy per tier
        (a slice copy for consecutive runs, else ``index_copy_``)."""
        for tier, (ix, sl) in by_tier(items).items():
            data = self.pools[tier].data
            src, dst, src_ix, dst_ix = (rows, data, ix, sl) if to_slots else (data, rows, sl, ix)
            if _consecutive(ix) and _consecutive(sl):
                self.copier.copy(
                    dst[dst_ix[0] : dst_ix[0] + len(dst_ix)], src[src_ix[0] : src_ix[0] + len(src_ix)]
                )
                continue
            if data.shape[1] >= _ROW_COPY_BYTES:  # large rows: one copy each, no staging copy
                self._each(functools.partial(_copy_row, dst, src), list(zip(src_ix, dst_ix)), data.shape[1])
                continue
            with one_omp_thread():
                picked = src.index_select(0, torch.tensor(src_ix, device=src.device))
                dst.index_copy_(0, torch.tensor(dst_ix, device=dst.device), picked.to(dst.device))
