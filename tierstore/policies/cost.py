"""Load-versus-recompute cost model.

A hit is *useful* only when loading its KV is faster than recomputing it
(prefill). For a prefix of ``k`` full blocks the saving is::

    saved_s(k) = prefill_s(k * tokens_per_block) - sum_{i<k} load_s_i

and the engine should load the ``k`` that maximises ``saved_s(k)`` (0 if none
is positive). ``prefill_s(n) = n / prefill_tokens_per_s`` is linear by default;
engines with a measured quadratic attention term pass
``prefill_quadratic_s_per_token2`` (prefill FLOPs grow as
``O(n * d^2 + n^2 * d)``, Kaplan et al. 2020 §2.1).

Continued in ``docs/POLICIES.md`` (``tierstore/policies/cost.py``): load time: declared, then
measured, always bounded.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import operator
import threading
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Tiers the model knows (``Tier.label`` of the index, plus ``"remote"``).
TIERS = ("hbm", "host", "nvme", "remote")


@dataclasses.dataclass
class CostModel:
    """Per-tier load-time model plus a prefill-time model.

    Parameters
    ----------
    prefill_tokens_per_s : float
        Prefill throughput of the engine, tokens per second.
    bandwidth_bytes_per_s : dict[str, float]
        Declared load bandwidth per tier name (``"hbm"``, ``"host"``, ``"nvme"``,
        ``"remote"``: the shared tier over the network), bytes per second. See
        the module docstring for the defaults' sources.
    latency_s : dict[str, float]
        Declared fixed cost of one load call per tier, seconds (charged once
        per tier per load).
    prefill_quadratic_s_per_token2 : float
        Optional quadratic prefill term (attention), seconds per token squared.
    measured_window : int
        Loads per (tier, block size) whose median seconds per block is the
        measured estimate; 0 turns measuring off (the declared figures only).
    min_measured : int
        Loads of a (tier, block size) before the measured estimate is used.
    max_slowdown, max_speedup : float
        Bounds of a measured estimate relative to the declared model of the
        same load (module docstring): at most ``max_slowdown`` times slower
        (default 1: never slower than declared) and ``max_speedup`` times
        faster (default 32: a 200 Gb/s RDMA link is about 20 times the
        remote tier's declared 10 GbE).

    Raises
    ------
    ConfigError
        For a non-positive rate, a negative latency or window, or a bound
        below 1.
    """

    prefill_tokens_per_s: float = 10_000.0
    bandwidth_bytes_per_s: dict = dataclasses.field(
        default_factory=lambda: {"hbm": 1.0e12, "host": 2.0e10, "nvme": 2.0e9, "remote": 1.0e9}
    )
    latency_s: dict = dataclasses.field(
        default_factory=lambda: {"hbm": 5e-6, "host": 2e-5, "nvme": 2e-4, "remote": 1e-3}
    )
    prefill_quadratic_s_per_token2: float = 0.0
    measured_window: int = 32
    min_measured: int = 3
    max_slowdown: float = 1.0
    max_speedup: float = 32.0
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )
    #: (tier, block_bytes) -> recent seconds per block
    _samples: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    #: (tier, block_bytes) -> median seconds per block (set once min_measured loads are in)
    _measured: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _warned: set = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ConfigError(f"CostModel: prefill_tokens_per_s={self.prefill_tokens_per_s}: must be > 0")
        for t, v in self.bandwidth_bytes_per_s.items():
            if not v > 0:
                raise ConfigError(f"CostModel: bandwidth_bytes_per_s[{t!r}]={v}: must be > 0")
        for t, v in self.latency_s.items():
            if not v >= 0:
                raise ConfigError(f"CostModel: latency_s[{t!r}]={v}: must be >= 0")
        if self.measured_window < 0 or self.min_measured < 1:
            raise ConfigError(
                f"CostModel: measured_window={self.measured_window} must be >= 0 and "
                f"min_measured={self.min_measured} >= 1"
            )
        if not (self.max_slowdown >= 1 and self.max_speedup >= 1):
            raise ConfigError(
                f"CostModel: max_slowdown={self.max_slowdown} and max_speedup={self.max_speedup} "
                "must be >= 1 (1: no deviation from the declared figures that way)"
            )

    # ----------------------------------------------------------- prefill
    def prefill_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` tokens."""
        n = float(num_tokens)
        return n / self.prefill_tokens_per_s + self.prefill_quadratic_s_per_token2 * n * n

    # ----------------------------------------------------------- loads
    def declared_s(self, tier: str, block_bytes: int, num_blocks: int = 1) -> float:
        """Seconds to load ``num_blocks`` blocks in one call by the declared figures."""
        return self.latency_s[tier] + num_blocks * block_bytes / self.bandwidth_bytes_per_s[tier]

    def measured_s(self, tier: str, block_bytes: int) -> float | None:
        """Median measured seconds per block (unbounded), or ``None`` before
        ``min_measured`` loads of this tier and block size."""
        return self._measured.get((tier, int(block_bytes)))

    def load_s(self, tier: str, nbytes: int) -> float:
        """Estimated seconds to load one block of ``nbytes`` from ``tier`` in a call of its own."""
        return self.tier_load_s(tier, nbytes, 1)[0]

    def tier_load_s(self, tier: str, block_bytes: int, count: int) -> list[float]:
        """Estimated seconds of each of ``count`` blocks a load takes from ``tier``.

        Element ``j`` is ``estimate_s(j + 1) - estimate_s(j)`` (module
        docstring): without measurements the first block carries the call's
        latency; with them each block costs the measured median, within the
        bounds. The sum is the estimate for the whole run.
        """
        if count <= 0:
            return []
        lat = self.latency_s[tier]
        x = block_bytes / self.bandwidth_bytes_per_s[tier]
        m = self._measured.get((tier, int(block_bytes)))
        if m is None:
            return [lat + x] + [x] * (count - 1)
        hi_f, lo_f = self.max_slowdown, 1.0 / self.max_speedup
        if lo_f * (lat + x) <= m <= hi_f * x:  # within bounds at every j (both bounds grow with j)
            return [m] * count
        return _bounded_increments(m, lat, x, lo_f, hi_f, count)

    def chain_load_s(self, tiers: list[str], block_bytes: int) -> list[float]:
        """Estimated seconds of each block of a matched chain (tier names, in
        chain order): the blocks of each tier are one load call."""
        out = [0.0] * len(tiers)
        pos: dict[str, list[int]] = {}
        for i, t in enumerate(tiers):
            pos.setdefault(t, []).append(i)
        for t, idx in pos.items():
            for i, v in zip(idx, self.tier_load_s(t, block_bytes, len(idx))):
                out[i] = v
        return out

    def observe_load(self, tier: str, nbytes: int, seconds: float, num_blocks: int = 1) -> None:
        """Record a measured load of ``num_blocks`` blocks (``nbytes`` in all) from ``tier``.

        Thread-safe. Non-positive sizes or times are ignored. Keeps the last
        ``measured_window`` loads per (tier, block size); their median seconds
        per block is the measured estimate once ``min_measured`` are in.
        """
        if (
            seconds <= 0
            or nbytes <= 0
            or num_blocks <= 0
            or self.measured_window <= 0
            or not math.isfinite(seconds)
        ):
            return
        bb = int(nbytes) // int(num_blocks)
        key = (tier, bb)
        with self._lock:
            q = self._samples.get(key)
            if q is None or q.maxlen != self.measured_window:
                q = self._samples[key] = collections.deque(q or (), maxlen=self.measured_window)
            q.append(seconds / num_blocks)
            if len(q) < self.min_measured:
                return
            m = float(np.median(np.fromiter(q, dtype=np.float64, count=len(q))))
            self._measured[key] = m
            warn = key not in self._warned and tier in self.latency_s and m > 2.0 * self.declared_s(tier, bb)
            if warn:
                self._warned.add(key)
        if warn:
            decl, priced = self.declared_s(tier, bb), self.load_s(tier, bb)
            log.warning(
                "%s loads measured %.2f ms per %s block, %.1fx the declared %.2f ms (%.2g B/s + %.2g s a "
                "call); %s: declare the tier's bandwidth if this is the device, not a busy machine",
                tier,
                m * 1e3,
                _size(bb),
                m / decl,
                decl * 1e3,
                self.bandwidth_bytes_per_s[tier],
                self.latency_s[tier],
                self._priced_text(priced, decl),
            )

    def _priced_text(self, priced_s: float, declared_s: float) -> str:
        """What the slow-measurement warning says loads are priced at, and why (``max_slowdown``)."""
        if self.max_slowdown == 1:
            return (
                f"loads are still priced at the declared {declared_s * 1e3:.2f} ms (max_slowdown=1 caps the "
                "estimate at the declared figure)"
            )
        if not math.isfinite(self.max_slowdown):
            return f"loads are priced at the measured {priced_s * 1e3:.2f} ms (max_slowdown=inf: no cap)"
        return (
            f"loads are priced at {priced_s * 1e3:.2f} ms (max_slowdown={self.max_slowdown:g} caps the "
            "estimate "
            f"at {self.max_slowdown:g}x the declared figure)"
        )

    def reset_measurements(self) -> None:
        """Forget every measurement (the declared figures apply again)."""
        with self._lock:
            self._samples.clear()
            self._measured.clear()

    def estimates(self, block_bytes: int) -> dict:
        """Per tier: the declared and (if any) measured milliseconds per block and the estimate
        used for an 8-block load, for stats and logs."""
        out = {}
        for t in self.bandwidth_bytes_per_s:
            if t not in self.latency_s:
                continue
            m = self.measured_s(t, block_bytes)
            with self._lock:
                n = len(self._samples.get((t, int(block_bytes)), ()))
            out[t] = {
                "declared_ms_per_block": self.declared_s(t, block_bytes) * 1e3,
                "measured_ms_per_block": None if m is None else m * 1e3,
                "measured_loads": n,
                "estimate_ms_per_block_of_8": sum(self.tier_load_s(t, block_bytes, 8)) / 8 * 1e3,
            }
        return out

    # ----------------------------------------------------------- decisions
    def useful_prefix(self, load_s: list[float], tokens_per_block: int) -> int:
        """:meth:`useful_blocks` from per-block load times already computed.

        Long chains are evaluated with numpy: the same sums in the same order
        (``cumsum`` adds left to right), the same first maximum.
        """
        best_k, best_saved, load = 0, 0.0, 0.0
        rate = self.prefill_tokens_per_s
        q = self.prefill_quadratic_s_per_token2
        k = self._monotone_prefix(load_s, tokens_per_block)
        if k is not None:
            return k
        if len(load_s) >= 128:  # below, the loop is cheaper than numpy's per-call cost
            tokens = np.arange(1, len(load_s) + 1, dtype=np.float64) * tokens_per_block
            saved_s = tokens / rate + q * tokens * tokens - np.cumsum(np.asarray(load_s, dtype=np.float64))
            k = int(np.argmax(saved_s))
            return k + 1 if saved_s[k] > 0.0 else 0
        for i, x in enumerate(load_s):
            load += x
            n = (i + 1) * tokens_per_block
            saved = n / rate + q * n * n - load
            if saved > best_saved:
                best_k, best_saved = i + 1, saved
        return best_k

    #: Relative margin by which a linear ``saved_s`` must rise or fall per block for
    #: :meth:`_monotone_prefix` to answer: far above the rounding of the loop's sums (a few
    #: ulp, 2**-52 ~ 2.2e-16, of the largest term per step).
    MONOTONE_MARGIN = 1e-12

    def _monotone_prefix(self, load_s: list[float], tokens_per_block: int) -> int | None:
        """:meth:`useful_prefix` in O(1) Python steps when it is decided by an end of the chain.

        With a linear prefill (``prefill_quadratic_s_per_token2 == 0``) and every block after the
        first costing the same ``x`` (one load call from one tier: :meth:`tier_load_s`),
        ``saved_s(k)`` changes by ``tokens_per_block / rate - x`` per block: when that step is
        clearly above (below) the rounding of the sums, the sequence the loop computes rises
        (falls) strictly, so its first maximum is the last (first) block, kept when positive.
        Both ends are computed with the loop's own operations in its order, so the answer is the
        loop's. ``None`` when this does not apply (the caller runs the loop).
        """
        m = len(load_s)
        if m < 2 or self.prefill_quadratic_s_per_token2 != 0.0:
            return None
        x = load_s[-1]
        if load_s.count(x) + (load_s[0] != x) != m:  # the tail is not uniform
            return None
        rate = self.prefill_tokens_per_s
        step = tokens_per_block / rate - x
        scale = m * tokens_per_block / rate + abs(load_s[0]) + m * abs(x)
        if not (math.isfinite(step) and math.isfinite(scale)) or abs(step) <= self.MONOTONE_MARGIN * scale:
            return None
        q = self.prefill_quadratic_s_per_token2
        if step > 0:  # rising: the last block's saving decides
            n = m * tokens_per_block
            saved = n / rate + q * n * n - functools.reduce(operator.add, load_s, 0.0)
            return m if saved > 0.0 else 0
        n = tokens_per_block  # falling: the first block's saving decides
        return 1 if n / rate + q * n * n - (0.0 + load_s[0]) > 0.0 else 0

    def useful_blocks(self, tiers: list[str], block_bytes: int, tokens_per_block: int) -> int:
        """Length ``k`` of the leading run that maximises ``saved_s(k)`` (0 if none saves time)."""
        return self.useful_prefix(self.chain_load_s(tiers, block_bytes), tokens_per_block)

    def not_useful_reason(
        self, tiers: list[str], load_s: list[float], useful: int, block_bytes: int, tokens_per_block: int
    ) -> str | None:
        """Why blocks ``useful:`` of a matched chain are not worth loading, or ``None``
        when every matched block is useful.

        Example: ``"load slower than recompute: est 3.10 ms vs recompute 1.60 ms per
        block (remote: declared 1 GB/s + 1 ms a call)"``: the mean estimated load
        time of the blocks left out against their mean recompute time.
        """
        m = len(load_s)
        if useful >= m:
            return None
        T = tokens_per_block
        est_s = sum(load_s[useful:]) / (m - useful)
        re_s = (self.prefill_s(m * T) - self.prefill_s(useful * T)) / (m - useful)
        names = list(dict.fromkeys(tiers[useful:]))
        how = []
        for t in names:
            mm = self.measured_s(t, block_bytes)
            decl = (
                f"declared {self.bandwidth_bytes_per_s[t]:.3g} B/s + {self.latency_s[t] * 1e3:.3g} ms a call"
            )
            if mm is None:
                how.append(f"{t}: {decl}")
            else:
                how.append(
                    f"{t}: measured {mm * 1e3:.3g} ms per block, bounded by {decl} x{self.max_slowdown:g}"
                )
        verdict = "slower than" if est_s > re_s else "no faster than"
        head = (
            f"load {verdict} recompute: est {est_s * 1e3:.3g} ms vs recompute {re_s * 1e3:.3g} ms per block"
        )
        return f"{head} ({'; '.join(how)})"


def _bounded_increments(m: float, lat: float, x: float, lo_f: float, hi_f: float, count: int) -> list[float]:
    """Increments of ``cum(j) = clamp(j*m, lo_f*(lat + j*x), hi_f*(lat + j*x))``, ``j = 1..count``.

    The three lines cross at most twice, so ``j`` runs through at most three
    regimes in the order lo, measured, hi (``j*m`` rises faster than the low
    bound and slower than the high one past their crossings); each regime adds
    a constant per block, so only its first block is computed. Lookups call
    this per tier: a few microseconds for any chain length.
    """

    def cum(j: int) -> float:
        if j <= 0:
            return 0.0
        d = lat + j * x
        return min(max(j * m, lo_f * d), hi_f * d)

    # lo regime: j*m < lo_f*(lat + j*x)  <=>  j < lo_f*lat / (m - lo_f*x)
    j1 = lo_f * lat / (m - lo_f * x) if m > lo_f * x else math.inf
    # hi regime: j*m > hi_f*(lat + j*x)  <=>  j > hi_f*lat / (m - hi_f*x)
    j2 = hi_f * lat / (m - hi_f * x) if m > hi_f * x and math.isfinite(hi_f) else math.inf
    a = count if math.isinf(j1) else max(0, min(count, math.ceil(j1) - 1))  # last j of the lo regime
    b = count if math.isinf(j2) else max(a, min(count, math.floor(j2)))  # last j of the measured one
    out = [0.0] * count
    for start, end, inc in ((1, a, lo_f * x), (a + 1, b, m), (b + 1, count, hi_f * x)):
        if start > end:
            continue
        out[start - 1] = cum(start) - cum(start - 1)
        out[start:end] = [inc] * (end - start)
    return out


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def measure_prefill_tokens_per_s(
    hidden: int = 1024,
    layers: int = 2,
    tokens: int = 512,
    repeats: int = 3,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> float:
    """Measure a prefill rate with a matmul proxy of a transformer's dense layers.

    Per layer, a prefill of ``n`` tokens runs the QKV and output projections
    (``4 d^2`` weights) and a 4x MLP (``8 d^2`` weights): ``2 * 12 * n * d^2``
    FLOPs, the dominant term of ``O(n d^2 + n^2 d)`` (Kaplan et al. 2020, §2.1,
    Table 1: ``C_forward ~ 2 N``). The proxy times exactly these matmuls (best
    of ``repeats``) and returns tokens per second for ``layers`` layers; scale
    by ``layers / model_layers`` and ``(hidden / model_hidden)^2`` to estimate
    a bigger model, or pass an engine's measured rate to :class:`CostModel`
    instead.

    Returns
    -------
    float
        Tokens per second.
    """
    import time

    import torch

    dt = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dt)
    w_attn = torch.randn(hidden, 4 * hidden, generator=g).to(device=device, dtype=dt) / hidden**0.5
    w_up = torch.randn(hidden, 4 * hidden, generator=g).to(device=device, dtype=dt) / hidden**0.5
    w_down = torch.randn(4 * hidden, hidden, generator=g).to(device=device, dtype=dt) / (4 * hidden) ** 0.5
    best_s = float("inf")
    for _ in range(max(1, repeats)):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = x
        for _ in range(layers):
            h = h + (h @ w_attn)[:, :hidden]
            h = h + torch.relu(h @ w_up) @ w_down
        if device != "cpu":
            torch.cuda.synchronize()
        best_s = min(best_s, time.perf_counter() - t0)
    return tokens / max(best_s, 1e-9)
