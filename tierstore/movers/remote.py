"""The remote handler: memory <-> the shared remote tier, and the host slots a late transfer holds.

At construction it registers the host tier's pool with the remote tier once (a CPU pool with
slots), so a fill lands zero-copy in its host slots; the tier then reports, through
``on_hold``/``on_release``, the byte ranges a transfer that outlived its deadline may still write.
Those slots are *held*: a plan using them completes only once :meth:`RemoteHandler.after_release`
says they are free again. The tier verifies every object (header, key, CRC-32C) before its status
is ``OK``; only verified bytes reach a destination, under the load's gate when it has a deadline.
Publication is asynchronous (the tier copies into its publish queue; a full queue drops, counted).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..contract import Tier
from ..errors import Status
from ..io.copies import one_omp_thread
from ..io.pages import FragmentPlan
from ..tiers.memory import BlockPool
from ..tiers.storage import RemoteBlockTier
from .gate import GateView
from .memory import MemoryHandler


class RemoteHandler:
    """Memory -> remote (publish) and remote -> memory (fetch, fill buffers).

    Parameters
    ----------
    tier : RemoteBlockTier
        The shared remote tier (a :class:`~tierstore.remote.mooncake.MooncakeTier`).
    host : BlockPool or None
        The host tier's pool, registered with ``tier`` when it is a CPU pool with slots.
    """

    def __init__(self, tier: RemoteBlockTier, host: BlockPool | None = None) -> None:
        self.tier = tier
        self.host = host
        self._slot_bytes = host.block_bytes if host is not None else 0  # of the registered host pool
        #: host-tier slots a timed-out remote transfer may still write (slot -> holds)
        self._held: dict[int, int] = {}
        self._waiters: list[tuple[set[int], Callable[[], object]]] = []
        self._lock = threading.Lock()
        self.zero_copy = False
        if host is not None and host.num_blocks and host.device.type == "cpu":
            # registered once: remote loads land straight in host-tier slots
            tier.register_memory(host.data, self._on_hold, self._on_release)
            self.zero_copy = True

    @property
    def held(self) -> frozenset[int]:
        """Host slots a late transfer may still write now."""
        with self._lock:
            return frozenset(self._held)

    def held_of(self, slots: set[int]) -> set[int]:
        """Those of ``slots`` a late transfer holds now."""
        with self._lock:
            return {s for s in slots if self._held.get(s)}

    # -------------------------------------------------------------- remote -> memory
    def get_into(self, keys: Sequence[bytes], bufs: Sequence[torch.Tensor]) -> list[Status]:
        """Fetch ``keys[j]`` into ``bufs[j]`` (verified bytes only); ``IO_ERROR`` each on ``OSError``."""
        try:
            return list(self.tier.get_into(list(keys), bufs))
        except OSError:
            return [Status.IO_ERROR] * len(keys)

    def fill_buffers(
        self, targets: Sequence[tuple[Tier, int] | None], memory: MemoryHandler
    ) -> list[torch.Tensor]:
        """Where each fetched block lands: its host slot itself when the pool is registered
        (zero-copy), else a staging buffer (an HBM slot, NVMe only, or no slot: ``None``)."""
        out = []
        for target in targets:
            if target is not None and target[0] == Tier.HOST and self.zero_copy:
                out.append(memory.view(*target))
            else:
                out.append(torch.empty(self.tier.block_bytes, dtype=torch.uint8))
        return out

    def fetch(
        self, keys: Sequence[bytes], dests: Sequence[FragmentPlan], gate: GateView | None = None
    ) -> list[Status]:
        """Fetch blocks into destination plans through private buffers.

        Only verified bytes are scattered, under ``gate`` when the load has a deadline (the load's
        gate at these blocks' positions in it); a block the gate refused is ``MISS``.
        """
        bufs = [torch.empty(p.nbytes, dtype=torch.uint8) for p in dests]
        try:
            st = list(self.tier.get_into(list(keys), bufs))
        except OSError:
            return [Status.IO_ERROR] * len(keys)
        with one_omp_thread():
            for j, (s, p, b) in enumerate(zip(st, dests, bufs)):
                if s is not Status.OK:
                    continue
                if gate is None:
                    p.scatter(b, 0)
                    continue
                with gate.enter([j]) as go:
                    if go:
                        p.scatter(b, 0)
                    else:
                        st[j] = Status.MISS
        return st

    # -------------------------------------------------------------- memory -> remote
    def publish(
        self, keys: Sequence[bytes], sources: Sequence[FragmentPlan], recent: bool = True
    ) -> list[Status]:
        """Queue blocks for the remote tier (asynchronous; returns at once).

        A source that is one contiguous host tensor goes as is (the tier copies
        it into its publish queue); other plans are gathered first. ``recent``:
        see :meth:`MooncakeTier.put <tierstore.remote.mooncake.MooncakeTier.put>`.
        """
        blocks = []
        for p in sources:
            frags = p.fragments
            if (
                p.strided is None
                and frags is not None
                and len(frags) == 1
                and isinstance(frags[0], torch.Tensor)
                and frags[0].device.type == "cpu"
                and frags[0].is_contiguous()
            ):
                blocks.append(frags[0])
            else:
                b = torch.empty(p.nbytes, dtype=torch.uint8)
                p.gather(b, 0)
                blocks.append(b)
        return list(self.tier.put(list(keys), blocks, recent=recent))

    def publish_lost(self, lost: Sequence[tuple[bytes, Tier, int]], memory: MemoryHandler) -> None:
        """Offer victims that leave their last tier (``StorePlan.lost``: ``(key, tier, slot)``) before
        their slots are reused: a copy into the publish queue, so the slot is free when this returns
        (a full queue drops and counts)."""
        if lost:
            self.tier.put(
                [k for k, _t, _s in lost], [memory.view(t, s) for _k, t, s in lost], copy=True, recent=False
            )  # its remote copy, if any, may have been evicted since

    # -------------------------------------------------------------- held slots
    def after_release(self, slots: set[int], fn: Callable[[], object]) -> None:
        """Run ``fn`` once no late remote transfer holds any of these host
        slots (at once when none does; otherwise on the remote tier's thread)."""
        with self._lock:
            if any(s in self._held for s in slots):
                self._waiters.append((set(slots), fn))
                return
        fn()

    def _on_hold(self, off: int, n: int) -> None:
        bb = self._slot_bytes
        with self._lock:
            for s in range(off // bb, (off + n - 1) // bb + 1):
                self._held[s] = self._held.get(s, 0) + 1

    def _on_release(self, off: int, n: int) -> None:
        bb = self._slot_bytes
        ready: list[tuple[set[int], Callable[[], object]]] = []
        with self._lock:
            for s in range(off // bb, (off + n - 1) // bb + 1):
                left = self._held.get(s, 0) - 1
                if left > 0:
                    self._held[s] = left
                else:
                    self._held.pop(s, None)
            keep: list[tuple[set[int], Callable[[], object]]] = []
            for slots, fn in self._waiters:
                (keep if any(s in self._held for s in slots) else ready).append((slots, fn))
            self._waiters = keep
        for _slots, fn in ready:
            fn()
