"""``--plot=DIR``: PNG charts of a job's results (matplotlib, headless).

Per job, whichever its result has data for:

* ``<job>-lat-cdf.png``: CDF of KV load latency (``kv["load_lat_ns"]``), or of
  the read/write completion latency for plain I/O jobs; log-scaled time axis
  with p50/p99/p99.9 marked.
* ``<job>-waf.png``: write amplification over time (``timeseries["waf"]``).
* ``<job>-tier-bytes.png``: bytes resident per tier over time
  (``timeseries["hbm_bytes"|"host_bytes"|"nvme_bytes"]``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np

from ..extras import require
from .result import JobResult

__all__ = ["plot_job", "plot_results"]

_TIERS = (("hbm_bytes", "HBM"), ("host_bytes", "host DRAM"), ("nvme_bytes", "NVMe"))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "job"


def _figure():
    matplotlib = require("matplotlib", "tierstore bench --plot")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    return plt, fig, ax


def _cdf(path: str, title: str, series: Sequence[tuple[str, np.ndarray]]) -> str:
    plt, fig, ax = _figure()
    for label, lat_ns in series:
        v = np.sort(np.asarray(lat_ns, dtype=np.float64)) / 1e3
        y = np.arange(1, v.size + 1) / v.size
        (line,) = ax.step(v, y, where="post")
        marks = []
        for p, style in ((50.0, ":"), (99.0, "--"), (99.9, "-.")):
            x = float(np.percentile(v, p))
            ax.axvline(x, linestyle=style, linewidth=0.8, color=line.get_color(), alpha=0.7)
            marks.append(f"p{p:g}={x:,.1f}")
        line.set_label(f"{label} (N={v.size}): " + ", ".join(marks) + " usec")
    ax.set_xscale("log")
    ax.set_xlabel("latency (usec, log scale)")
    ax.set_ylabel("fraction of operations")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_job(result: JobResult, directory: str) -> list[str]:
    """Write the PNGs of one job.

    Parameters
    ----------
    result : JobResult
        The job's results.
    directory : str
        Output directory (created if missing).

    Returns
    -------
    list of str
        Paths written (charts without data are skipped).
    """
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, _safe(result.jobname))
    written = []
    load = result.kv.get("load_lat_ns")
    if load is not None and len(load):
        written.append(
            _cdf(
                f"{stem}-lat-cdf.png", f"{result.jobname}: KV load latency CDF", [("load", np.asarray(load))]
            )
        )
    else:
        series = [
            (name, d.clat_ns)
            for name, d in (("read", result.read), ("write", result.write))
            if d.clat_ns.size
        ]
        if series:
            written.append(_cdf(f"{stem}-lat-cdf.png", f"{result.jobname}: completion latency CDF", series))
    ts = result.timeseries
    t_s = np.asarray(ts.get("t_s", []), dtype=np.float64)
    if t_s.size and len(ts.get("waf", [])) == t_s.size:
        written.append(
            _time_plot(
                f"{stem}-waf.png",
                f"{result.jobname}: WAF over time (cumulative since start)",
                "write amplification (media bytes / host bytes)",
                t_s,
                [("WAF", np.asarray(ts["waf"], dtype=np.float64), {"marker": "."})],
                hline=1.0,
            )
        )
    tiers = [(key, label) for key, label in _TIERS if len(ts.get(key, [])) == t_s.size and t_s.size]
    if tiers:
        written.append(
            _time_plot(
                f"{stem}-tier-bytes.png",
                f"{result.jobname}: bytes per tier over time",
                "bytes resident (MiB)",
                t_s,
                [(label, np.asarray(ts[key], dtype=np.float64) / (1 << 20), {}) for key, label in tiers],
            )
        )
    return written


def _time_plot(
    path: str, title: str, ylabel: str, t_s: np.ndarray, series, hline: float | None = None
) -> str:
    """A chart over time ``t_s`` (seconds) of ``series`` (``[(label, values, plot keywords)]``, from 0
    up, with a dotted grey line at ``hline``), saved as PNG to ``path``; returns ``path``."""
    plt, fig, ax = _figure()
    for label, values, kw in series:
        ax.plot(t_s, values, label=label, **kw)
    if hline is not None:
        ax.axhline(hline, linestyle=":", color="grey", linewidth=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_results(results: Sequence[JobResult], directory: str) -> list[str]:
    """Write the PNGs of every job; returns the paths written."""
    paths: list[str] = []
    for r in results:
        paths.extend(plot_job(r, directory))
    return paths
