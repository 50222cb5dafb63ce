"""The one NVMe batch builder: what a plan writes to NVMe, as the arguments of one ``put_fragments``.

Every NVMe write of the store is built here: a store plan's demoted victims and new blocks (victims
first, then new blocks in key order: the order the index's statuses are read back in), a flush
plan's victims, a remote fill's verified blocks. Each block carries the placement tag of its
lifetime class (``placement_for``, the FDP layer's class -> PID table; ``None`` without FDP) and
its namespace digest (32 zero bytes when the plan has none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..contract import Demotion, StorePlan
from ..fdp.lifetime import LifetimeClass
from ..io.pages import FragmentPlan
from .memory import MemoryHandler

#: ``f(LifetimeClass or None) -> placement tag or None`` (an FDP PID).
PlacementFor = Callable[[LifetimeClass | None], int | None]

NO_NAMESPACE = bytes(32)


@dataclasses.dataclass
class NvmeBatch:
    """The arguments of one
    :meth:`BlockStorage.put_fragments <tierstore.tiers.storage.BlockStorage.put_fragments>`.

    Attributes
    ----------
    keys : list of bytes
    fragments : list
        Per block, its source: a list of tensors (a memory slot) or a ``FragmentPlan``.
    placements : list of int or None
    ns_digests : list of bytes
        32 bytes each.
    demotions : int
        The first ``demotions`` blocks are victims (:func:`store_batch`), the rest new blocks.
    """

    keys: list[bytes] = dataclasses.field(default_factory=list)
    fragments: list[Any] = dataclasses.field(default_factory=list)
    placements: list[int | None] = dataclasses.field(default_factory=list)
    ns_digests: list[bytes] = dataclasses.field(default_factory=list)
    demotions: int = 0

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: bytes, fragments: Any, placement: int | None, ns: bytes) -> None:
        self.keys.append(key)
        self.fragments.append(fragments)
        self.placements.append(placement)
        self.ns_digests.append(ns or NO_NAMESPACE)


def _place(placement_for: PlacementFor | None, cls: LifetimeClass | None) -> int | None:
    return placement_for(cls) if placement_for is not None else None


def demotion_batch(
    demotes: Sequence[Demotion], memory: MemoryHandler, placement_for: PlacementFor | None
) -> NvmeBatch:
    """Victims written from their memory slot (``Demotion.src``, ``src_slot``) to NVMe."""
    batch = NvmeBatch()
    for d in demotes:
        batch.add(d.key, [memory.view(d.src, d.src_slot)], _place(placement_for, d.lifetime), d.ns)
    batch.demotions = len(batch)
    return batch


def add_new_blocks(
    batch: NvmeBatch,
    keys: Sequence[bytes],
    fragments: Sequence[Any],
    classes: Sequence[LifetimeClass | None],
    ns: bytes,
    placement_for: PlacementFor | None,
) -> NvmeBatch:
    """Append new blocks (``keys[j]`` from ``fragments[j]`` with lifetime class ``classes[j]``, all of
    namespace ``ns``) after what ``batch`` holds; returns ``batch``."""
    for k, frags, cls in zip(keys, fragments, classes):
        batch.add(k, frags, _place(placement_for, cls), ns)
    return batch


def store_batch(
    plan: StorePlan,
    sources: Sequence[FragmentPlan | None],
    memory: MemoryHandler,
    placement_for: PlacementFor | None,
) -> NvmeBatch:
    """A store plan's NVMe writes: its victims (``plan.nvme_demote``), then its new blocks
    (``plan.nvme_new``: key ``i`` from ``sources[i]``), one batch."""
    batch = demotion_batch(plan.nvme_demote, memory, placement_for)
    new = plan.nvme_new
    return add_new_blocks(
        batch,
        [plan.keys[i] for i, _ in new],
        [sources[i] for i, _ in new],
        [cls for _, cls in new],
        plan.ns,
        placement_for,
    )
