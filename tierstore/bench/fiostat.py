"""fio's latency statistics, reproduced from fio's ``stat.c`` / ``io_u.c``.

* Percentiles come from fio's log-linear histogram (``FIO_IO_U_PLAT_BITS=6``:
  64 buckets per power of two, 29 groups), and a percentile is the
  representative value of the first bucket whose cumulative count reaches
  ``p/100 * N`` (``calc_clat_percentiles``). The ``json+`` ``bins`` are that
  histogram's non-empty buckets keyed by their value in ns.
* ``latency_ns``/``latency_us``/``latency_ms`` are fio's coarse buckets
  (``io_u_mark_lat_nsec`` etc.): each key is a bucket's upper bound, the
  value the percentage of all I/Os in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "FIO_PERCENTILES",
    "plat_val_to_idx",
    "plat_idx_to_val",
    "lat_summary",
    "lat_buckets",
    "num2str",
    "percentile_key",
]

PLAT_BITS = 6
PLAT_VAL = 1 << PLAT_BITS
PLAT_GROUP_NR = 29
PLAT_NR = PLAT_GROUP_NR * PLAT_VAL

#: fio's default ``percentile_list``.
FIO_PERCENTILES = (
    1.0,
    5.0,
    10.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    70.0,
    80.0,
    90.0,
    95.0,
    99.0,
    99.5,
    99.9,
    99.95,
    99.99,
)

#: Bucket upper bounds of ``latency_ns`` / ``latency_us`` (fio's ``FIO_IO_U_LAT_N_NR``/``_U_NR``).
_NS_US_BOUNDS = (2, 4, 10, 20, 50, 100, 250, 500, 750, 1000)
#: Bucket upper bounds of ``latency_ms``; the last bucket is ``>=2000``.
_MS_BOUNDS = (2, 4, 10, 20, 50, 100, 250, 500, 750, 1000, 2000)


def plat_val_to_idx(values_ns: np.ndarray) -> np.ndarray:
    """fio's ``plat_val_to_idx``: histogram bucket of each latency (vectorised).

    Parameters
    ----------
    values_ns : numpy.ndarray
        Non-negative latencies in ns.

    Returns
    -------
    numpy.ndarray
        Bucket indices in ``[0, PLAT_NR)``.
    """
    v = np.asarray(values_ns, dtype=np.int64)
    v = np.maximum(v, 0)
    msb = np.zeros(v.shape, dtype=np.int64)
    nz = v > 0
    msb[nz] = np.floor(np.log2(v[nz].astype(np.float64))).astype(np.int64)
    # float log2 can be off by one right at powers of two; fix with exact integer checks
    msb = np.where((np.left_shift(1, msb + 1, dtype=np.int64) <= v) & nz, msb + 1, msb)
    msb = np.where((np.left_shift(1, msb, dtype=np.int64) > v) & nz, msb - 1, msb)
    error_bits = np.maximum(msb - PLAT_BITS, 0)
    base = (error_bits + 1) << PLAT_BITS
    offset = (PLAT_VAL - 1) & (v >> error_bits)
    idx = np.minimum(base + offset, PLAT_NR - 1)
    return np.where(msb <= PLAT_BITS, v, idx)


def plat_idx_to_val(idx: np.ndarray | int) -> np.ndarray:
    """fio's ``plat_idx_to_val``: the value (ns) a bucket stands for.

    Parameters
    ----------
    idx : numpy.ndarray or int
        Bucket indices.

    Returns
    -------
    numpy.ndarray
        int64 ns: the index itself below 128, else the middle of the bucket.
    """
    i = np.asarray(idx, dtype=np.int64)
    error_bits = np.maximum((i >> PLAT_BITS) - 1, 0)
    base = np.left_shift(1, error_bits + PLAT_BITS, dtype=np.int64)
    k = i % PLAT_VAL
    val = base + ((k + 0.5) * np.left_shift(1, error_bits, dtype=np.int64)).astype(np.int64)
    return np.where(i < (PLAT_VAL << 1), i, val)


def percentile_key(p: float) -> str:
    """fio's JSON percentile key, e.g. ``99.9 -> "99.900000"``."""
    return f"{p:f}"


def lat_summary(
    lat_ns: np.ndarray | Sequence[int],
    percentiles: Sequence[float] | None = FIO_PERCENTILES,
    bins: bool = False,
) -> dict[str, Any]:
    """fio's ``clat_ns``/``lat_ns`` object for a set of latencies.

    Parameters
    ----------
    lat_ns : array-like
        Latencies in ns.
    percentiles : sequence of float, optional
        Percentiles to report (``None``: none, as fio's ``lat_ns``). Omitted
        when there are no samples, as fio does.
    bins : bool
        Add ``bins`` (json+): ``{bucket value in ns: count}`` of non-empty buckets.

    Returns
    -------
    dict
        ``min``, ``max`` (int ns), ``mean``, ``stddev`` (float ns, sample stddev
        as fio), ``N`` and optionally ``percentile`` and ``bins``.
    """
    v = np.asarray(lat_ns, dtype=np.int64)
    n = int(v.size)
    if n == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}
    out: dict[str, Any] = {
        "min": int(v.min()),
        "max": int(v.max()),
        "mean": float(v.mean()),
        "stddev": float(v.std(ddof=1)) if n > 1 else 0.0,
        "N": n,
    }
    if percentiles is None and not bins:
        return out
    counts = np.bincount(plat_val_to_idx(v), minlength=PLAT_NR)
    if percentiles is not None:
        cum = np.cumsum(counts)
        thresholds = np.asarray(percentiles, dtype=np.float64) / 100.0 * n
        first = np.searchsorted(cum, thresholds, side="left")
        first = np.minimum(first, PLAT_NR - 1)
        vals = plat_idx_to_val(first)
        out["percentile"] = {percentile_key(p): int(x) for p, x in zip(percentiles, vals)}
    if bins:
        nz = np.nonzero(counts)[0]
        out["bins"] = {str(int(val)): int(c) for val, c in zip(plat_idx_to_val(nz), counts[nz])}
    return out


def lat_buckets(
    lat_ns: np.ndarray | Sequence[int], total_ios: int | None = None
) -> dict[str, dict[str, float]]:
    """fio's ``latency_ns``, ``latency_us`` and ``latency_ms`` bucket percentages.

    Parameters
    ----------
    lat_ns : array-like
        Latencies in ns (all directions of the job together, as fio).
    total_ios : int, optional
        Denominator; default the number of latencies.

    Returns
    -------
    dict
        ``{"latency_ns": {...}, "latency_us": {...}, "latency_ms": {...}}``
        with fio's exact keys.
    """
    v = np.asarray(lat_ns, dtype=np.int64)
    total = total_ios if total_ios is not None else int(v.size)
    ns_b = np.asarray((0,) + _NS_US_BOUNDS)
    ms_b = np.asarray((0,) + _MS_BOUNDS)

    def pct(counts: np.ndarray) -> list[float]:  # fio's stat_calc_lat: a bucket with any I/O shows >= 0.01 %
        return [max(100.0 * float(c) / total, 0.01) if total and c else 0.0 for c in counts]

    ns_vals = v[v < 1000]
    us_vals = v[(v >= 1000) & (v < 1_000_000)] // 1000
    ms_vals = v[v >= 1_000_000] // 1_000_000
    ns_counts = np.histogram(ns_vals, bins=ns_b)[0] if ns_vals.size else np.zeros(len(_NS_US_BOUNDS))
    us_counts = np.histogram(us_vals, bins=ns_b)[0] if us_vals.size else np.zeros(len(_NS_US_BOUNDS))
    ms_counts = np.zeros(len(_MS_BOUNDS) + 1)
    if ms_vals.size:
        ms_counts[:-1] = np.histogram(ms_vals[ms_vals < 2000], bins=ms_b)[0]
        ms_counts[-1] = int((ms_vals >= 2000).sum())
    return {
        "latency_ns": dict(zip([str(b) for b in _NS_US_BOUNDS], pct(ns_counts))),
        "latency_us": dict(zip([str(b) for b in _NS_US_BOUNDS], pct(us_counts))),
        "latency_ms": dict(zip([str(b) for b in _MS_BOUNDS] + [">=2000"], pct(ms_counts))),
    }


def num2str(value: float, base: int = 1000, unit: str = "", sig_figs: int = 4) -> str:
    """fio's ``num2str``: ``23722 -> "23.7k"``, ``97234000 B -> "97.2MB"``.

    Parameters
    ----------
    value : float
        The number.
    base : int
        1000 (SI prefixes: k, M, G) or 1024 (Ki, Mi, Gi).
    unit : str
        Appended after the prefix (``"B"``, ``"B/s"``).
    sig_figs : int
        Digits kept (fio's default 4).

    Returns
    -------
    str
    """
    prefixes = ["", "k", "M", "G", "T", "P"] if base == 1000 else ["", "Ki", "Mi", "Gi", "Ti", "Pi"]
    if base == 1000:
        prefixes[0] = ""
    i = 0
    v = float(value)
    while abs(v) >= 10**sig_figs and i < len(prefixes) - 1:
        v /= base
        i += 1
    if i == 0:
        text = (
            f"{v:.0f}"
            if v == int(v) or abs(v) >= 10 ** (sig_figs - 1)
            else f"{v:.{sig_figs - 1 - len(str(int(abs(v))))}f}"
        )
    else:
        int_digits = len(str(int(abs(v))))
        decimals = max(sig_figs - int_digits - 1, 0)
        text = f"{v:.{decimals}f}"
    return f"{text}{prefixes[i]}{unit}"
