"""Write amplification: measurement windows and the analytic greedy-GC model.

Two things live here:

* :class:`WafWindow` -- WAF over a measurement window from the cumulative FDP
  statistics counters, ``WAF = ΔMBMW / ΔHBMW``.  The counters are those of the
  FDP Statistics log page (log identifier 22h "FDP Statistics"; NVMe Base
  Specification 2.1 Get Log Page; TP4146): *Host Bytes with Metadata
  Written* (HBMW), *Media Bytes with Metadata Written* (MBMW) and *Media Bytes
  Erased* (MBE).  They are cumulative, so a window is the difference of two
  samples.  Any object with a ``stats()`` method returning a mapping with
  ``hbmw_bytes``, ``mbmw_bytes`` and ``mbe_bytes`` works: a real device through
  :class:`tierstore.fdp.nvme_cli.NvmeCli` (:meth:`~tierstore.fdp.nvme_cli.FdpDeviceStats.stats`)
  or the FTL model (:meth:`tierstore.fdp.ftl.FTLModel.stats`).

Continued in ``docs/FDP.md`` (``tierstore/fdp/waf.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConfigError, InvariantError

__all__ = ["StatsSource", "WafSample", "WafWindow", "lambert_w0", "analytic_greedy_waf"]


class StatsSource(Protocol):
    """Anything that reports cumulative FDP statistics counters (bytes)."""

    def stats(self) -> Mapping[str, Any]:  # pragma: no cover - protocol
        """Return a mapping with at least ``hbmw_bytes``, ``mbmw_bytes``, ``mbe_bytes`` (int)."""
        ...


@dataclass(frozen=True)
class WafSample:
    """One reading of the cumulative FDP statistics counters.

    Attributes
    ----------
    hbmw_bytes, mbmw_bytes, mbe_bytes : int
        Host bytes written, media bytes written, media bytes erased (cumulative;
        FDP Statistics log page 22h, NVMe Base Spec 2.1 / TP4146).
    """

    hbmw_bytes: int
    mbmw_bytes: int
    mbe_bytes: int

    @classmethod
    def of(cls, source: StatsSource) -> WafSample:
        """Read ``source.stats()`` once."""
        s = source.stats()
        return cls(int(s["hbmw_bytes"]), int(s["mbmw_bytes"]), int(s["mbe_bytes"]))


class WafWindow:
    """WAF over a window: ``(MBMW_end - MBMW_start) / (HBMW_end - HBMW_start)``.

    Parameters
    ----------
    source : StatsSource
        A device (:class:`tierstore.fdp.nvme_cli.FdpDeviceStats`) or the FTL model.

    Examples
    --------
    >>> w = WafWindow(model); w.start(); ...write...; w.stop(); w.waf  # doctest: +SKIP
    """

    def __init__(self, source: StatsSource) -> None:
        self.source = source
        self.begin: WafSample | None = None
        self.end: WafSample | None = None

    def start(self) -> WafSample:
        """Take the starting sample (resets the window)."""
        self.begin = WafSample.of(self.source)
        self.end = None
        return self.begin

    def stop(self) -> WafSample:
        """Take the closing sample."""
        if self.begin is None:
            raise InvariantError("WafWindow.stop() before start()")
        self.end = WafSample.of(self.source)
        for name in ("hbmw_bytes", "mbmw_bytes", "mbe_bytes"):
            if getattr(self.end, name) < getattr(self.begin, name):
                raise InvariantError(
                    f"cumulative counter {name} went backwards "
                    f"({getattr(self.begin, name)} -> {getattr(self.end, name)})"
                )
        return self.end

    def _delta(self, name: str) -> int:
        if self.begin is None or self.end is None:
            raise InvariantError("WafWindow: call start() and stop() first")
        return getattr(self.end, name) - getattr(self.begin, name)

    @property
    def host_bytes(self) -> int:
        """ΔHBMW over the window, bytes."""
        return self._delta("hbmw_bytes")

    @property
    def media_bytes(self) -> int:
        """ΔMBMW over the window, bytes."""
        return self._delta("mbmw_bytes")

    @property
    def erased_bytes(self) -> int:
        """ΔMBE over the window, bytes."""
        return self._delta("mbe_bytes")

    @property
    def waf(self) -> float:
        """ΔMBMW / ΔHBMW; ``nan`` when no host bytes were written in the window."""
        h = self.host_bytes
        return self.media_bytes / h if h > 0 else float("nan")


def lambert_w0(x: float, tol: float = 1e-15, max_iter: int = 100) -> float:
    """Principal branch ``W0(x)`` of the Lambert W function, ``x >= -1/e``.

    Halley iteration on ``f(w) = w e^w - x`` (R. M. Corless, G. H. Gonnet,
    D. E. G. Hare, D. J. Jeffrey, D. E. Knuth, "On the Lambert W function",
    Adv. Comput. Math. 5 (1996) 329-359, eq. 5.9), started from the branch-point
    series ``w ≈ -1 + p - p²/3 + 11p³/72`` with ``p = sqrt(2(e x + 1))`` (ibid.,
    eq. 4.22) near ``-1/e`` and from ``log1p(x)`` elsewhere.

    Raises
    ------
    ConfigError
        For ``x < -1/e`` (no real value).
    """
    branch = -1.0 / math.e
    if x < branch - 1e-15:
        raise ConfigError(f"lambert_w0: x={x!r} < -1/e has no real W0")
    if x <= branch:
        return -1.0
    if x == 0.0:
        return 0.0
    if x < -0.25:
        p = math.sqrt(max(0.0, 2.0 * (math.e * x + 1.0)))
        w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3
    else:
        w = math.log1p(x) if x < 3 else math.log(x) - math.log(math.log(x))
    for _ in range(max_iter):
        ew = math.exp(w)
        f = w * ew - x
        if f == 0.0:
            return w
        wp1 = w + 1.0
        if wp1 == 0.0:
            return w
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= tol * (1.0 + abs(w)):
            return w
    return w


def analytic_greedy_waf(op_fraction: float) -> float:
    """Analytic WA of greedy GC under uniform random page writes.

    Parameters
    ----------
    op_fraction : float
        Over-provisioning ``OP = (T - U) / U`` (physical minus user capacity, over
        user capacity), > 0.

    Returns
    -------
    float
        ``1 / (1 - X)`` with ``X = -W0(-alpha e^-alpha) / alpha``, ``alpha = 1 + OP``
        (Desnoyers, SYSTOR 2012; Xiang & Kurkoski, arXiv:1110.4245; see module doc).
    """
    if not op_fraction > 0:
        raise ConfigError(f"op_fraction={op_fraction!r}: must be > 0")
    alpha = 1.0 + float(op_fraction)
    x = -lambert_w0(-alpha * math.exp(-alpha)) / alpha
    return 1.0 / (1.0 - x)
