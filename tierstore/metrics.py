"""Counters and latency histograms of the tier manager.

Counter meanings (all cumulative since construction):

* ``lookups`` / ``lookup_hits``: lookups, and lookups that matched >= 1 block.
* ``lookup_blocks`` / ``hit_blocks``: full blocks asked for / matched (resident hits).
* ``useful_blocks``: matched blocks that the cost model says are worth loading.
* ``loaded_blocks``: blocks actually delivered to the engine (useful hits that landed).
* ``matched_tokens`` / ``reused_tokens``: tokens in matched / loaded blocks.
* ``partial_tail_tokens``: tokens of partial last blocks (never shareable, always
  recomputed: the exact-hit rule) -- the internal fragmentation of requests.
* ``evictions`` per tier, ``demotions`` (tier -> tier), ``promotions``,
  ``dropped_blocks`` (left the cache entirely), ``store_*`` outcomes,
  ``io_errors``, ``verify_mismatch`` (token verification caught a collision),
  ``merged_loads`` (delay-hit merges).

Load latency is an HdrHistogram (Gil Tene's HdrHistogram, 3 significant digits)
in nanoseconds.
"""

from __future__ import annotations

import collections
import threading

from hdrh.histogram import HdrHistogram

TIERS = ("hbm", "host", "nvme")


class Metrics:
    """Thread-safe counters plus per-tier load-latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        # 1 ns .. 1000 s, 3 significant digits
        self.load_latency_ns = {t: HdrHistogram(1, 1_000_000_000_000, 3) for t in TIERS + ("all",)}

    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self.counters[name] += n

    def add(self, counts: dict) -> None:
        """Add several counters at once (one lock round trip)."""
        with self._lock:  # a plain loop: ``Counter.update`` adds its Mapping check and a call a key
            c = self.counters
            for k, v in counts.items():
                c[k] += v

    def record_load_ns(self, tier: str, ns: int) -> None:
        """Record one load's latency in ns under ``tier`` and ``all``."""
        ns = max(1, int(ns))
        with self._lock:
            self.load_latency_ns[tier].record_value(ns)
            self.load_latency_ns["all"].record_value(ns)

    def latency_percentiles_ns(
        self, tier: str = "all", pcts: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
    ) -> dict[str, float]:
        """Percentiles of load latency, keys like ``"p50"``, in ns (0 when empty), ``count`` and ``mean``."""
        h = self.load_latency_ns[tier]
        with self._lock:
            out: dict[str, float] = {
                f"p{p:g}": int(h.get_value_at_percentile(p)) if h.get_total_count() else 0 for p in pcts
            }
            out["count"] = int(h.get_total_count())
            out["mean"] = float(h.get_mean_value()) if h.get_total_count() else 0.0
        return out

    def snapshot(self) -> dict:
        """A copy of every counter plus derived ratios."""
        with self._lock:
            c: dict[str, float] = dict(self.counters)
        lb = c.get("lookup_blocks", 0)
        c["block_hit_ratio"] = c.get("hit_blocks", 0) / lb if lb else 0.0
        c["useful_block_ratio"] = c.get("useful_blocks", 0) / lb if lb else 0.0
        return c
