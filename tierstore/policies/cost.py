"""Load-versus-recompute cost model.

A hit is *useful* only when loading its KV is faster than recomputing it
(prefill). For a prefix of ``k`` full blocks the saving is::

    saved_s(k) = prefill_s(k * tokens_per_block) - sum_{i<k} load_s(tier_i, bytes_per_block)

and the engine should load the ``k`` that maximises ``saved_s(k)`` (0 if none
is positive). ``load_s(tier, n) = latency_s[tier] + n / bandwidth_bytes_per_s[tier]``
(the classic latency-bandwidth "alpha-beta" model, Hockney 1994).
``prefill_s(n) = n / prefill_tokens_per_s`` is linear by default; engines with a
measured quadratic attention term pass ``prefill_quadratic_s_per_token2``
(prefill FLOPs grow as ``O(n * d^2 + n^2 * d)``, Kaplan et al. 2020 §2.1).

Defaults are conservative placeholders (documented, not measured): the policies
layer and the benchmark calibrate them from measured bandwidth
(:meth:`CostModel.observe_load`) and a measured prefill rate.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CostModel:
    """Per-tier load-time model plus a prefill-time model.

    Parameters
    ----------
    prefill_tokens_per_s : float
        Prefill throughput of the engine, tokens per second.
    bandwidth_bytes_per_s : dict[str, float]
        Load bandwidth per tier name (``"hbm"``, ``"host"``, ``"nvme"``, ``"remote"``:
        the shared tier over the network; 1 GB/s and 1 ms are loopback-TCP
        placeholders until :meth:`observe_load` measures it).
    latency_s : dict[str, float]
        Fixed cost per load call per tier.
    prefill_quadratic_s_per_token2 : float
        Optional quadratic prefill term (attention), seconds per token squared.
    ewma_alpha : float
        Weight of a new bandwidth observation in :meth:`observe_load`.
    """

    prefill_tokens_per_s: float = 10_000.0
    bandwidth_bytes_per_s: dict = dataclasses.field(
        default_factory=lambda: {"hbm": 1.0e12, "host": 2.0e10, "nvme": 2.0e9, "remote": 1.0e9})
    latency_s: dict = dataclasses.field(
        default_factory=lambda: {"hbm": 5e-6, "host": 2e-5, "nvme": 2e-4, "remote": 1e-3})
    prefill_quadratic_s_per_token2: float = 0.0
    ewma_alpha: float = 0.2

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` tokens."""
        n = float(num_tokens)
        return n / self.prefill_tokens_per_s + self.prefill_quadratic_s_per_token2 * n * n

    def load_s(self, tier: str, nbytes: int) -> float:
        """Seconds to load ``nbytes`` from ``tier``."""
        return self.latency_s[tier] + nbytes / self.bandwidth_bytes_per_s[tier]

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """Fold a measured transfer into the tier's bandwidth (EWMA)."""
        if seconds <= 0 or nbytes <= 0:
            return
        bw = nbytes / seconds
        old = self.bandwidth_bytes_per_s[tier]
        self.bandwidth_bytes_per_s[tier] = (1 - self.ewma_alpha) * old + self.ewma_alpha * bw

    def useful_prefix(self, load_s: list[float], tokens_per_block: int) -> int:
        """:meth:`useful_blocks` from per-block load times already computed.

        Long chains are evaluated with numpy: the same sums in the same order
        (``cumsum`` adds left to right), the same first maximum.
        """
        best_k, best_saved, load = 0, 0.0, 0.0
        rate = self.prefill_tokens_per_s
        q = self.prefill_quadratic_s_per_token2
        if len(load_s) >= 128:  # below, the loop is cheaper than numpy's per-call cost
            n = np.arange(1, len(load_s) + 1, dtype=np.float64) * tokens_per_block
            saved = n / rate + q * n * n - np.cumsum(np.asarray(load_s, dtype=np.float64))
            k = int(np.argmax(saved))
            return k + 1 if saved[k] > 0.0 else 0
        for i, x in enumerate(load_s):
            load += x
            n = (i + 1) * tokens_per_block
            saved = n / rate + q * n * n - load
            if saved > best_saved:
                best_k, best_saved = i + 1, saved
        return best_k

    def useful_blocks(self, tiers: list[str], block_bytes: int, tokens_per_block: int) -> int:
        """Length ``k`` of the leading run that maximises ``saved_s(k)`` (0 if none saves time)."""
        best_k, best_saved, load = 0, 0.0, 0.0
        for i, t in enumerate(tiers):
            load += self.load_s(t, block_bytes)
            saved = self.prefill_s((i + 1) * tokens_per_block) - load
            if saved > best_saved:
                best_k, best_saved = i + 1, saved
        return best_k


def measure_prefill_tokens_per_s(hidden: int = 1024, layers: int = 2, tokens: int = 512,
                                 repeats: int = 3, device: str = "cpu",
                                 dtype: "torch.dtype | None" = None) -> float:
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
    w_attn = torch.randn(hidden, 4 * hidden, generator=g).to(device=device, dtype=dt) / hidden ** 0.5
    w_up = torch.randn(hidden, 4 * hidden, generator=g).to(device=device, dtype=dt) / hidden ** 0.5
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
