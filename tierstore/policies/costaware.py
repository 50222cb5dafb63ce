"""Cost-aware eviction: keep what saves the most prefill per byte held.

Score of a resident block (higher = keep)::

    value = P_reuse(horizon_s) * saved_prefill_s / (size_bytes + reload_s * bandwidth_bytes_per_s)

* ``P_reuse`` -- probability of at least one reuse within ``horizon_s``, with
  reuses modelled as a Poisson process whose rate is the Laplace-smoothed hit
  rate over the block's life, ``lam = (hits + 1) / max(age_s, horizon_s)``:
  ``P_reuse = 1 - exp(-lam * horizon_s)`` (Poisson arrivals; the "+1" is
  Laplace's rule of succession, so a brand-new block is not scored zero).
* ``saved_prefill_s`` -- the block's marginal recompute time at its chain
  position ``p`` (``T`` tokens per block), from the cost model:
  ``prefill_s((p + 1) T) - prefill_s(p T)`` (with a quadratic attention term,
  deeper blocks cost more to recompute).
* ``reload_s`` -- what getting it back costs if it is evicted: the load time
  from the next tier (``reload_tier``), converted to bytes at that tier's
  bandwidth so numerator and denominator have one unit (seconds per byte).

Continued in ``docs/POLICIES.md`` (``tierstore/policies/costaware.py``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from ..errors import ConfigError
from .base import EntryInfo, EvictionPolicy
from .cost import CostModel


class CostAwarePolicy(EvictionPolicy):
    """Cost-aware victim selection with GDSF aging (see module doc for the formula).

    Parameters
    ----------
    cost : CostModel or None
        Prefill and load-time model (default: :class:`CostModel` defaults).
    horizon_s : float
        Reuse horizon of ``P_reuse``, seconds.
    tokens_per_block : int
        Tokens per block, for the prefill term.
    reload_tier : str
        Tier a victim would be reloaded from (``"nvme"`` by default).
    """

    name = "cost"

    def __init__(
        self,
        cost: CostModel | None = None,
        horizon_s: float = 300.0,
        tokens_per_block: int = 512,
        reload_tier: str = "nvme",
    ) -> None:
        if horizon_s <= 0 or tokens_per_block < 1:
            raise ConfigError(
                f"CostAwarePolicy: horizon_s and tokens_per_block must be positive "
                f"(got {horizon_s}, {tokens_per_block})"
            )
        self.cost = cost or CostModel()
        self.horizon_s = float(horizon_s)
        self.tokens_per_block = int(tokens_per_block)
        self.reload_tier = reload_tier
        self.inflation = 0.0  # GDS "L"
        self._scale: float | None = None
        self._prio: dict[bytes, tuple[float, int]] = {}  # key -> (priority, seq) of its live heap item
        self._heap: list[tuple[float, int, int, bytes]] = []  # (priority, -position, seq, key)
        self._seq = itertools.count()
        self._picked: set[bytes] = set()

    def value(self, entry: EntryInfo, now_s: float) -> float:
        """``P_reuse * saved_prefill_s / (size_bytes + reload_s * bandwidth)`` (seconds per byte)."""
        age_s = max(0.0, now_s - entry.created_s)
        lam = (entry.hits + 1) / max(age_s, self.horizon_s)
        p_reuse = 1.0 - math.exp(-lam * self.horizon_s)
        pos = max(0, int(getattr(entry, "position", 0)))
        t = self.tokens_per_block
        saved_s = self.cost.prefill_s((pos + 1) * t) - self.cost.prefill_s(pos * t)
        reload_s = self.cost.load_s(self.reload_tier, entry.size_bytes)
        denom = entry.size_bytes + reload_s * self.cost.bandwidth_bytes_per_s[self.reload_tier]
        return p_reuse * saved_s / max(denom, 1.0)

    def _push(self, entry: EntryInfo, now_s: float) -> None:
        v = self.value(entry, now_s)
        if self._scale is None:
            self._scale = 1.0 / v if v > 0 else 1.0
        prio = round(self.inflation + v * self._scale, 9)  # rounding: float noise must not break ties
        seq = next(self._seq)
        self._prio[entry.key] = (prio, seq)
        heapq.heappush(self._heap, (prio, -max(0, int(getattr(entry, "position", 0))), seq, entry.key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # drop stale items
            self._heap = [it for it in self._heap if self._prio.get(it[3], (None, -1))[1] == it[2]]
            heapq.heapify(self._heap)

    def on_insert(self, entry: EntryInfo, now_s: float) -> None:
        self._push(entry, now_s)

    def on_access(self, entry: EntryInfo, now_s: float) -> None:
        if entry.key in self._prio:
            self._push(entry, now_s)

    def on_remove(self, key: bytes) -> None:
        self._prio.pop(key, None)
        self._picked.discard(key)

    def evict(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        if n <= 0:
            return []
        picked: list[tuple] = []
        held: list[tuple] = []
        while self._heap and len(picked) < n and (max_scan is None or len(picked) + len(held) < max_scan):
            item = heapq.heappop(self._heap)
            key = item[3]
            if self._prio.get(key, (None, -1))[1] != item[2] or key in self._picked:
                continue  # stale
            if protected(key):
                held.append(item)
            else:
                picked.append(item)
        for item in held:
            heapq.heappush(self._heap, item)
        if len(picked) < n:
            for item in picked:
                heapq.heappush(self._heap, item)
            return []
        self._picked.update(it[3] for it in picked)
        self.inflation = max(self.inflation, max(it[0] for it in picked))
        return [it[3] for it in picked]

    def __len__(self) -> int:
        return len(self._prio)
