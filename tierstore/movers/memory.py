"""The memory handler: every copy between engine buffers and memory-tier slots, and between slots.

It knows the memory tiers' pools (``Mapping[Tier, BlockPool]``) and nothing else: no index, no
plan beyond the ``(tier, slot)`` items a plan carries. One copy each: a block is gathered straight
from the engine's pages into its slot and scattered straight back; a :class:`~tierstore.io.pages.
BlockRows` batch (the engine's blocks as rows of one tensor) is one slice copy or one
``index_copy_`` per tier. Every memory copy of the store passes through :meth:`MemoryHandler.view`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..contract import Demotion, Tier
from ..errors import Status
from ..io.pages import FragmentPlan
from ..tiers.memory import BlockPool
from .gate import LoadGate

#: ``(i, tier, slot)``: position ``i`` of a call and a memory slot.
Item = tuple[int, Tier, int]


def by_tier(items: Sequence[Item]) -> dict[Tier, tuple[list[int], list[int]]]:
    """``{tier: (positions, slots)}`` of ``(i, tier, slot)`` items, in their order."""
    out: dict[Tier, tuple[list[int], list[int]]] = {}
    for i, tier, slot in items:
        e = out.get(tier)
        if e is None:
            e = out[tier] = ([], [])
        e[0].append(i)
        e[1].append(slot)
    return out


def _consecutive(ix: list[int]) -> bool:
    return ix == list(range(ix[0], ix[0] + len(ix)))


class MemoryHandler:
    """Copies between engine buffers and memory-tier slots (memory -> memory transfers).

    Parameters
    ----------
    pools : mapping of Tier to BlockPool
        The enabled memory tiers; slot ``s`` of tier ``t`` is ``pools[t].view(s)``
        (1-D ``uint8``, ``block_bytes`` long).
    """

    def __init__(self, pools: Mapping[Tier, BlockPool]) -> None:
        self.pools = pools

    def view(self, tier: Tier, slot: int) -> torch.Tensor:
        """A memory slot's bytes (1-D ``uint8``)."""
        return self.pools[tier].view(slot)

    def copy_down(self, copies: Sequence[Demotion]) -> None:
        """Slot to slot, in the given order (a plan lists them lowest tier first)."""
        for d in copies:
            self.view(d.dst, d.dst_slot).copy_(self.view(d.src, d.src_slot))

    def copy_slots(self, pairs: Sequence[tuple[Tier, int, Tier, int]]) -> None:
        """``(src_tier, src_slot, dst_tier, dst_slot)`` copies, in order (a prefetch from a memory tier)."""
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
        for i, tier, slot in items:
            sources[i].gather(self.view(tier, slot), 0)  # type: ignore[union-attr]  # items name given sources

    def scatter(self, dests: Sequence[FragmentPlan], items: Sequence[Item], gate: LoadGate | None,
                statuses: list[Status]) -> None:
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
        for i, tier, slot in items:
            if gate is None:
                dests[i].scatter(self.view(tier, slot), 0)
                statuses[i] = Status.OK
                continue
            with gate.enter([i]) as go:
                if go:
                    dests[i].scatter(self.view(tier, slot), 0)
                    statuses[i] = Status.OK

    def promote(self, items: Sequence[tuple[int, int, Tier, int]],
                loaded: Sequence[FragmentPlan]) -> list[bool]:
        """Copy just-loaded blocks, read back from their destinations ``loaded[i]``, into upper
        slots: ``items[j] = (i, row, tier, slot)``; ``False`` where the read-back failed."""
        out = []
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
                dst[dst_ix[0]:dst_ix[0] + len(dst_ix)].copy_(src[src_ix[0]:src_ix[0] + len(src_ix)])
                continue
            picked = src.index_select(0, torch.tensor(src_ix, device=src.device))
            dst.index_copy_(0, torch.tensor(dst_ix, device=dst.device), picked.to(dst.device))
