"""The NVMe handler: memory <-> NVMe transfers through the storage interface, nothing else.

Writes are one :meth:`~tierstore.tiers.storage.BlockStorage.put_fragments` per
:class:`~tierstore.movers.batch.NvmeBatch`; reads one
:meth:`~tierstore.tiers.storage.BlockStorage.get_fragments`, the storage's single read path (loads
and prefetches alike), under the load's gate when it has a deadline. An ``OSError`` from the
storage is ``IO_ERROR`` for every block of the call: a miss, never wrong KV.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import Status
from ..tiers.storage import BlockStorage
from .batch import NvmeBatch, PlacementFor
from .gate import GateView


class NvmeHandler:
    """Memory -> NVMe and NVMe -> memory.

    Parameters
    ----------
    storage : BlockStorage
        The NVMe tier (a :class:`~tierstore.io.segments.SegmentStorage`).
    placement_for : callable or None
        ``f(LifetimeClass or None) -> int | None``: the placement tag (an FDP PID) of a lifetime
        class; only the FDP layer knows this table. ``None``: no placement tags.
    """

    def __init__(self, storage: BlockStorage, placement_for: PlacementFor | None = None) -> None:
        self.storage = storage
        self.placement_for = placement_for

    def write(self, batch: NvmeBatch) -> list[Status]:
        """Write ``batch`` (one ``put_fragments``); per block its status, ``IO_ERROR`` each on ``OSError``."""
        try:
            return list(
                self.storage.put_fragments(batch.keys, batch.fragments, batch.placements, batch.ns_digests)
            )
        except OSError:
            return [Status.IO_ERROR] * len(batch.keys)

    def read(
        self, keys: Sequence[bytes], dests: Sequence[Any], gate: GateView | None = None
    ) -> tuple[list[Status], float]:
        """Read ``keys[j]`` into ``dests[j]`` (a ``FragmentPlan`` or a list of tensors).

        With ``gate`` (the load's, at these blocks' positions in it: :meth:`LoadGate.at
        <tierstore.movers.gate.LoadGate.at>`), each copy into a destination runs under it. Returns
        per-key statuses (``IO_ERROR`` each on ``OSError``) and the seconds the call took.
        """
        t0 = time.perf_counter()
        try:
            if gate is None:
                got = list(self.storage.get_fragments(keys, dests))
            else:
                got = list(self.storage.get_fragments(keys, dests, gate=gate.enter))
        except OSError:
            got = [Status.IO_ERROR] * len(keys)
        return got, time.perf_counter() - t0
