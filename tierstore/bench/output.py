"""Reports of ``tierstore bench``: fio's ``normal``, ``json`` and ``json+`` formats.

The JSON keeps fio's keys with fio's units exactly (``bw`` KiB/s, ``bw_bytes``
B/s, ``runtime`` ms, ``*_ns`` ns; layout as fio 3.33's ``stat.c``) so tools
written for fio (fio-plot, fio2gnuplot, spreadsheets) read it unchanged. Our
own ``kv`` and ``device`` sections are added to each job; their keys carry
units in their names.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .fiostat import FIO_PERCENTILES, lat_buckets, lat_summary, num2str
from .jobfile import JobSpec, format_value
from .result import DirectionResult, JobResult

__all__ = [
    "FIO_VERSION",
    "OUTPUT_FORMATS",
    "TERSE_VERSION",
    "DEVICE_TERMS",
    "parse_output_formats",
    "job_to_json",
    "render_json",
    "render_normal",
    "render_terse",
    "to_jsonable",
]


def _package_version() -> str:
    """The installed distribution's version (package metadata), else the source tree's ``__version__``."""
    try:
        return importlib.metadata.version("tierstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from .. import __version__

        return __version__


#: Reported as ``"fio version"`` (and terse field 2); tools only check that the key exists.
FIO_VERSION = f"tierstore-{_package_version()}"
OUTPUT_FORMATS = ("normal", "json", "json+", "terse")
#: The terse format version written (fio's default ``--terse-version=3``).
TERSE_VERSION = 3

_DIRECTIONS = ("read", "write", "trim")


def parse_output_formats(text: str) -> list[str]:
    """Parse ``--output-format`` (comma-combined, e.g. ``normal,json``).

    Raises
    ------
    ValueError
        For an unknown format; the message names it and the accepted ones.
    """
    formats = [f.strip() for f in text.split(",") if f.strip()]
    for f in formats:
        if f not in OUTPUT_FORMATS:
            raise ValueError(
                f"output-format={f!r}: accepted values are {list(OUTPUT_FORMATS)}, comma-combined"
            )
    if not formats:
        raise ValueError(
            f"output-format={text!r}: accepted values are {list(OUTPUT_FORMATS)}, comma-combined"
        )
    if "json" in formats and "json+" in formats:
        formats.remove("json")  # json+ is a superset, as in fio
    return formats


def to_jsonable(value: Any) -> Any:
    """Convert numpy scalars/arrays, tuples and non-str keys into JSON types."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _sample_stats(samples: Sequence[float]) -> tuple[float, float, float, float, int]:
    """min, max, mean, sample stddev, N of a list of samples (fio's ``calc_lat``)."""
    n = len(samples)
    if n == 0:
        return 0.0, 0.0, 0.0, 0.0, 0
    a = np.asarray(samples, dtype=np.float64)
    return float(a.min()), float(a.max()), float(a.mean()), float(a.std(ddof=1)) if n > 1 else 0.0, n


def _lat_ns(d: DirectionResult) -> np.ndarray:
    """fio's ``lat`` = ``slat + clat`` per op (``clat`` alone when there is no slat)."""
    if d.slat_ns.size == d.clat_ns.size and d.slat_ns.size:
        return d.slat_ns + d.clat_ns
    return d.clat_ns


def _direction_json(d: DirectionResult, plus: bool, group_bw_bytes_s: float) -> dict[str, Any]:
    runtime_ms = int(round(d.runtime_s * 1000)) if d.ops else 0
    bw_bytes = int(d.io_bytes * 1000 / runtime_ms) if runtime_ms else 0
    bw_kib = [s / 1024.0 for s in d.bw_samples_bytes_s]
    bmin, bmax, bmean, bdev, bn = _sample_stats(bw_kib)
    imin, imax, imean, idev, inn = _sample_stats(d.iops_samples)
    return {
        "io_bytes": int(d.io_bytes),
        "io_kbytes": int(d.io_bytes // 1024),
        "bw_bytes": bw_bytes,
        "bw": bw_bytes // 1024,
        "iops": d.ops * 1000.0 / runtime_ms if runtime_ms else 0.0,
        "runtime": runtime_ms,
        "total_ios": int(d.ops),
        "short_ios": int(d.short_ios),
        "drop_ios": int(d.drop_ios),
        "slat_ns": lat_summary(d.slat_ns, percentiles=None),
        "clat_ns": lat_summary(d.clat_ns, percentiles=FIO_PERCENTILES, bins=plus),
        "lat_ns": lat_summary(_lat_ns(d), percentiles=None),
        "bw_min": int(bmin),
        "bw_max": int(bmax),
        "bw_agg": 100.0 * bmean * 1024.0 / group_bw_bytes_s if group_bw_bytes_s and bn else 0.0,
        "bw_mean": bmean,
        "bw_dev": bdev,
        "bw_samples": bn,
        "iops_min": int(imin),
        "iops_max": int(imax),
        "iops_mean": imean,
        "iops_stddev": idev,
        "iops_samples": inn,
    }


def _depth_dist(result: JobResult) -> dict[str, float]:
    if result.iodepth_level is not None:
        return dict(result.iodepth_level)
    keys = ["1", "2", "4", "8", "16", "32", ">=64"]
    depth = int(result.options.get("iodepth", 1))
    level = ">=64" if depth >= 64 else str(1 << (depth.bit_length() - 1))
    return {k: (100.0 if k == level else 0.0) for k in keys}


def _kv_json(kv: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in kv.items():
        if key.endswith("_lat_ns") and isinstance(value, (np.ndarray, list, tuple)):
            out[key] = lat_summary(np.asarray(value, dtype=np.int64), percentiles=FIO_PERCENTILES)
        else:
            out[key] = to_jsonable(value)
    return out


def job_options_json(spec: JobSpec | None, result: JobResult) -> dict[str, str]:
    """fio's ``job options``: the keys the job set, as strings, plus rw/bs/iodepth/numjobs.

    fio-plot selects files by ``rw``, ``iodepth``, ``numjobs`` and reads ``bs``,
    so these four are always present.
    """
    opts = result.options
    out = {"name": spec.name if spec is not None else result.jobname}
    for key in ("rw", "bs", "iodepth", "numjobs"):
        out[key] = format_value(key, opts.get(key, ""))
    if spec is not None:
        for key, raw in spec.explicit.items():
            if key != "name":
                out[key] = raw
    return out


def job_to_json(result: JobResult, spec: JobSpec | None = None, plus: bool = False) -> dict[str, Any]:
    """One entry of fio's ``jobs[]`` for a :class:`JobResult`, plus ``kv`` and ``device``.

    Parameters
    ----------
    result : JobResult
        What the runner measured.
    spec : JobSpec, optional
        The parsed job (its explicit keys become ``job options``).
    plus : bool
        json+: add ``clat_ns.bins``.

    Returns
    -------
    dict
    """
    dirs = {"read": result.read, "write": result.write, "trim": DirectionResult()}
    job: dict[str, Any] = {
        "jobname": result.jobname,
        "groupid": result.groupid,
        "error": result.error,
        "eta": 0,
        "elapsed": int(math.ceil(result.runtime_s)),
        "job options": job_options_json(spec, result),
    }
    for name, d in dirs.items():
        # fio's bw_agg: mean sampled bandwidth as a share of the group's aggregate
        # bandwidth in that direction (one job per group here: its own average)
        runtime_ms = int(round(d.runtime_s * 1000))
        dir_bw = d.io_bytes * 1000 / runtime_ms if runtime_ms and d.ops else 0.0
        job[name] = _direction_json(d, plus, dir_bw)
    job["sync"] = {"total_ios": 0, "lat_ns": lat_summary([], percentiles=None)}
    job["job_runtime"] = int(round(result.runtime_s * 1000))
    job["usr_cpu"] = float(result.usr_cpu)
    job["sys_cpu"] = float(result.sys_cpu)
    job["ctx"] = int(result.ctx)
    job["majf"] = int(result.majf)
    job["minf"] = int(result.minf)
    job["iodepth_level"] = _depth_dist(result)
    submit = {"0": 0.0, "4": 100.0, "8": 0.0, "16": 0.0, "32": 0.0, "64": 0.0, ">=64": 0.0}
    total_ios = result.read.ops + result.write.ops
    if not total_ios:
        submit["4"] = 0.0
    job["iodepth_submit"] = submit
    job["iodepth_complete"] = dict(submit)
    all_lat = np.concatenate([_lat_ns(result.read), _lat_ns(result.write)])
    job.update(lat_buckets(all_lat))  # shares of the latencies measured (KV jobs: calls, not blocks)
    job["latency_depth"] = int(result.options.get("iodepth", 1))
    job["latency_target"] = 0
    job["latency_percentile"] = 100.0
    job["latency_window"] = 0
    job["kv"] = _kv_json(result.kv)
    job["device"] = to_jsonable(result.device)
    return job


def render_json(
    results: Sequence[JobResult],
    specs: Sequence[JobSpec | None],
    plus: bool = False,
    now_s: float | None = None,
) -> str:
    """The whole JSON document, laid out as fio prints it.

    Parameters
    ----------
    results : sequence of JobResult
        One per job, in job order.
    specs : sequence of JobSpec or None
        The parsed jobs, aligned with ``results``.
    plus : bool
        json+ (adds ``clat_ns.bins``).
    now_s : float, optional
        Timestamp to report (default: now).

    Returns
    -------
    str
    """
    now_s = time.time() if now_s is None else now_s
    global_opts: dict[str, str] = {}
    for spec in specs:
        if spec is not None:
            global_opts.update({k: v for k, v in spec.global_explicit.items() if k not in spec.explicit})
    doc = {
        "fio version": FIO_VERSION,
        "timestamp": int(now_s),
        "timestamp_ms": int(now_s * 1000),
        "time": time.asctime(time.localtime(now_s)),  # ctime(3), as fio: "Thu Dec  3 05:31:35 2026"
        "global options": global_opts,
        "jobs": [job_to_json(r, s, plus) for r, s in zip(results, specs)],
    }
    return json.dumps(to_jsonable(doc), indent=2, separators=(",", " : ")) + "\n"


# ---------------------------------------------------------------- normal ----


def _scale_lat(values: dict[str, Any]) -> tuple[str, float]:
    """fio's ``display_lat`` unit choice: msec, usec or nsec."""
    mn, mx, mean, dev = values["min"], values["max"], values["mean"], values["stddev"]
    if mn > 2_000_000 and mx > 2_000_000 and mean > 2_000_000 and dev > 2_000_000:
        return "msec", 1e6
    if mn > 1000 and mx > 1000 and mean > 1000 and dev > 1000:
        return "usec", 1e3
    return "nsec", 1.0


def _lat_line(label: str, summary: dict[str, Any]) -> str:
    unit, div = _scale_lat(summary)
    return (
        f"    {label} ({unit}): min={num2str(int(summary['min'] // div), unit='', sig_figs=6)}, "
        f"max={num2str(int(summary['max'] // div), unit='', sig_figs=6)}, "
        f"avg={summary['mean'] / div:5.02f}, stdev={summary['stddev'] / div:5.02f}\n"
    )


def _percentile_block(label: str, percentiles: dict[str, int]) -> str:
    vals = list(percentiles.values())
    minv, maxv = min(vals), max(vals)
    if minv > 2_000_000 and maxv > 99_999_999:
        unit, scale = "msec", 2
    elif minv > 2000 and maxv > 99_999:
        unit, scale = "usec", 1
    else:
        unit, scale = "nsec", 0
    out = [f"    {label} percentiles ({unit}):\n     |"]
    items = list(percentiles.items())
    for j, (key, v) in enumerate(items):
        for _ in range(scale):
            v = (v + 999) // 1000
        if j and j % 4 == 0:
            out.append("     |")
        last = j == len(items) - 1
        out.append(f" {float(key):5.2f}th=[{v:5d}]" + ("\n" if last else ","))
        if not last and j % 4 == 3:
            out.append("\n")
    return "".join(out)


def _buckets_lines(buckets: dict[str, dict[str, float]]) -> str:
    lines = []
    for key, unit in (("latency_ns", "nsec"), ("latency_us", "usec"), ("latency_ms", "msec")):
        shown = [(k, v) for k, v in buckets[key].items() if v > 0.0]
        for i in range(0, len(shown), 5):
            chunk = ", ".join(f"{k}={v:3.2f}%" for k, v in shown[i : i + 5])
            lines.append(f"  lat ({unit})   : {chunk}\n")
    return "".join(lines)


def _direction_normal(name: str, dj: dict[str, Any]) -> str:
    runtime_ms = dj["runtime"]
    bw_b = dj["bw_bytes"]
    out = [
        f"  {name}: IOPS={num2str(dj['iops'])}, BW={num2str(bw_b, 1024, 'B/s')} "
        f"({num2str(bw_b, 1000, 'B/s')})({num2str(dj['io_bytes'], 1024, 'B')}/{runtime_ms}msec)\n"
    ]
    if dj["clat_ns"]["N"]:
        if dj["slat_ns"]["N"]:
            out.append(_lat_line("slat", dj["slat_ns"]))
        out.append(_lat_line("clat", dj["clat_ns"]))
        out.append(_lat_line(" lat", dj["lat_ns"]))
        out.append(_percentile_block("clat", dj["clat_ns"]["percentile"]))
    if dj["bw_samples"]:
        unit, div = ("MiB", 1024.0) if dj["bw_mean"] > 1024 * 1024 else ("KiB", 1.0)
        out.append(
            f"   bw ({unit:>5s}/s): min={int(dj['bw_min'] / div):5d}, max={int(dj['bw_max'] / div):5d}, "
            f"per={dj['bw_agg']:3.2f}%, avg={dj['bw_mean'] / div:5.02f}, stdev={dj['bw_dev'] / div:5.02f}, "
            f"samples={dj['bw_samples']}\n"
        )
        out.append(
            f"   iops        : min={dj['iops_min']:5d}, max={dj['iops_max']:5d}, "
            f"avg={dj['iops_mean']:5.02f}, "
            f"stdev={dj['iops_stddev']:5.02f}, samples={dj['iops_samples']}\n"
        )
    return "".join(out)


def _fmt_kv_value(key: str, value: Any) -> str:
    if value is None:  # not measured (e.g. WAF before any write): JSON keeps null
        return "-"
    if isinstance(value, float) and (key == "waf" or key.endswith("_waf")):
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if key.endswith("_bytes") and isinstance(value, (int, np.integer)):
        return num2str(int(value), 1024, "B")
    return str(value)


def _is_series(value: Any) -> bool:
    """A time series (lists of samples): the JSON and the plots carry it, the text report does not."""
    return isinstance(value, (list, tuple)) or (
        isinstance(value, dict) and bool(value) and all(isinstance(v, (list, tuple)) for v in value.values())
    )


def _is_sentence(value: Any) -> bool:
    return isinstance(value, str) and " " in value


def _kv_normal(kv: dict[str, Any]) -> str:
    if not kv:
        return ""
    scalars = [
        (k, v) for k, v in kv.items() if not isinstance(v, dict) and not _is_series(v) and not _is_sentence(v)
    ]
    out = []
    for i in range(0, len(scalars), 4):
        label = "  kv           : " if i == 0 else "                 "
        out.append(label + ", ".join(f"{k}={_fmt_kv_value(k, v)}" for k, v in scalars[i : i + 4]) + "\n")
    for key, value in kv.items():
        if _is_sentence(value) and key not in ("verdict", "io_unit"):  # those two lead the report instead
            out.append(f"    {key}: {value}\n")
    for key, value in kv.items():
        if isinstance(value, dict) and "N" in value and "mean" in value:
            name = key[: -len("_lat_ns")].replace("_", " ") + " lat" if key.endswith("_lat_ns") else key
            if value["N"]:
                out.append(_lat_line(name, value))
                if "percentile" in value:
                    out.append(_percentile_block(name, value["percentile"]))
        elif isinstance(value, dict):
            out.append(f"    {key:13s}: " + _dict_text(key, value) + "\n")
    return "".join(out)


def _dict_text(key: str, value: dict) -> str:
    """``k=v, ...``; ``none`` for an empty mapping (e.g. no GC bytes on any RUH)."""
    return ", ".join(f"{k}={_fmt_kv_value(key, v)}" for k, v in value.items()) or "none"


#: What the write-amplification figures of a ``device`` section mean, printed under it for those present.
DEVICE_TERMS = {
    "waf": "WAF = media bytes written / host bytes written, in the FTL model of the SSD "
    "(its garbage-collection copies; 1.000 = none)",
    "e2e_wa": "e2e_wa = media bytes written / bytes the store wrote to its NVMe tier "
    "(WAF plus segment headers, padding and tierstore's own copy-forward)",
    "host_write_amplification": "host_write_amplification = (bytes the NVMe tier wrote for stores "
    "+ bytes it copied forward when it reclaimed regions) / bytes it wrote "
    "for stores (tierstore's share, before the SSD's)",
}


def _device_terms(device: dict[str, Any]) -> str:
    present = [text for key, text in DEVICE_TERMS.items() if key in device or f"nvme_{key}" in device]
    return "".join(f"    ({text})\n" for text in present)


def _device_normal(device: dict[str, Any]) -> str:
    if not device:
        return ""
    names = {"hbmw_bytes": "HBMW", "mbmw_bytes": "MBMW", "mbe_bytes": "MBE", "waf": "WAF"}
    head = [str(device["device"])] if "device" in device else []
    for key, label in names.items():
        if key in device:
            head.append(f"{label}={_fmt_kv_value(key, device[key])}")
    rest = [(k, v) for k, v in device.items() if k not in names and k != "device" and not _is_series(v)]
    out = ["  device       : " + ", ".join(head) + "\n"] if head else []
    for key, value in rest:
        if isinstance(value, dict):
            out.append(f"    {key:14s}: " + _dict_text(key, value) + "\n")
        else:
            out.append(f"    {key:14s}: {_fmt_kv_value(key, value)}\n")
    out.append(_device_terms(device))
    return "".join(out)


def _job_normal(r: JobResult, j: dict[str, Any], stamp: str) -> str:
    """One job's block of :func:`render_normal` (``j``: its JSON, :func:`job_to_json`)."""
    out: list[str] = []
    out.append(
        f"{r.jobname}: (groupid={r.groupid}, jobs={r.options.get('numjobs', 1)}): err={r.error:2d}: "
        f"pid={os.getpid()}: {stamp}\n"
    )
    if r.options.get("description"):
        out.append(f"  Description  : [{r.options['description']}]\n")
    for name in ("read", "write"):
        if j[name]["total_ios"]:
            text = _direction_normal(name, j[name])
            if r.kv:  # KV jobs: say what an I/O is
                first, _, rest = text.partition("\n")
                calls = j[name]["clat_ns"]["N"]
                text = (
                    f"{first}\n    (IOPS are KV blocks/s, {num2str(int(r.options.get('bs', 0)), 1024, 'B')} "
                    f"each; the latencies are per {'load' if name == 'read' else 'store'} call: {calls} "
                    "calls, "
                    f"{j[name]['total_ios'] / max(calls, 1):.1f} blocks each on average)\n{rest}"
                )
            out.append(text)
    out.append(_buckets_lines({k: j[k] for k in ("latency_ns", "latency_us", "latency_ms")}))
    out.append(
        f"  cpu          : usr={j['usr_cpu']:3.2f}%, sys={j['sys_cpu']:3.2f}%, ctx={j['ctx']}, "
        f"majf={j['majf']}, minf={j['minf']}\n"
    )
    out.append(
        "  IO depths    : " + ", ".join(f"{k}={v:3.1f}%" for k, v in j["iodepth_level"].items()) + "\n"
    )
    out.append(
        f"     issued rwts: total={j['read']['total_ios']},{j['write']['total_ios']},0,0 "
        f"short={j['read']['short_ios']},{j['write']['short_ios']},0,0 "
        f"dropped={j['read']['drop_ios']},{j['write']['drop_ios']},0,0\n"
    )
    out.append(f"     latency   : target=0, window=0, percentile=100.00%, depth={j['latency_depth']}\n")
    out.append(_kv_normal(j["kv"]))
    out.append(_device_normal(j["device"]))
    out.append("\n")
    return "".join(out)


def _run_status_normal(results: Sequence[JobResult], jobs_json: list[dict[str, Any]]) -> str:
    """The ``Run status group`` lines of :func:`render_normal`: per group and direction, the
    aggregate bandwidth, the range of the jobs' bandwidths, the bytes moved and the run times."""
    out: list[str] = []
    groups = sorted({r.groupid for r in results})
    for g in groups:
        out.append(f"Run status group {g} (all jobs):\n")
        members = [j for r, j in zip(results, jobs_json) if r.groupid == g]
        for name, label in (("read", "READ"), ("write", "WRITE")):
            dirs = [m[name] for m in members if m[name]["total_ios"]]
            if not dirs:
                continue
            io = sum(d["io_bytes"] for d in dirs)
            run_max = max(d["runtime"] for d in dirs)
            run_min = min(d["runtime"] for d in dirs)
            agg = io * 1000 / run_max if run_max else 0
            bws = [d["bw_bytes"] for d in dirs]
            out.append(
                f"{label:>7s}: bw={num2str(agg, 1024, 'B/s')} ({num2str(agg, 1000, 'B/s')}), "
                f"{num2str(min(bws), 1024, 'B/s')}-{num2str(max(bws), 1024, 'B/s')} "
                f"({num2str(min(bws), 1000, 'B/s')}-{num2str(max(bws), 1000, 'B/s')}), "
                f"io={num2str(io, 1024, 'B')} ({num2str(io, 1000, 'B')}), run={run_min}-{run_max}msec\n"
            )
    return "".join(out)


def render_normal(results: Sequence[JobResult], specs: Sequence[JobSpec | None], plus: bool = False) -> str:
    """fio's human-readable report.

    Parameters
    ----------
    results : sequence of JobResult
        One per job.
    specs : sequence of JobSpec or None
        The parsed jobs, aligned with ``results``.
    plus : bool
        Unused (accepted for symmetry with :func:`render_json`).

    Returns
    -------
    str
    """
    out: list[str] = []
    for r in results:  # a KV replay leads with its verdict (one line)
        if r.kv.get("verdict"):
            out.append(f"{r.jobname}: {r.kv['verdict']}\n")
    for r in results:
        o = r.options
        bs = int(o.get("bs", 0))
        out.append(
            f"{r.jobname}: (g={r.groupid}): rw={o.get('rw')}, bs=(R) {bs}B-{bs}B, (W) {bs}B-{bs}B, "
            f"(T) {bs}B-{bs}B, ioengine={o.get('ioengine')}, iodepth={o.get('iodepth')}\n"
        )
        if r.kv.get("io_unit"):  # a KV job: what the bs above is, and what the job's bs= did
            out.append(f"  ({r.kv['io_unit']})\n")
    out.append(f"{FIO_VERSION}\n")
    nproc = sum(int(r.options.get("numjobs", 1)) for r in results)
    out.append(f"Starting {nproc} process{'es' if nproc != 1 else ''}\n\n")
    jobs_json = [job_to_json(r, s) for r, s in zip(results, specs)]
    stamp = datetime.datetime.now().ctime()  # ctime(3), as fio
    for r, j in zip(results, jobs_json):
        out.append(_job_normal(r, j, stamp))
    out.append(_run_status_normal(results, jobs_json))
    return "".join(out)


# ---------------------------------------------------------------- terse ----


def _terse_latency_us(lat: dict[str, Any]) -> list[str]:
    """A latency's 4 terse fields from its ``*_ns`` section: min, max (integer usec), mean, stdev (usec)."""
    if not lat["N"]:
        return ["0", "0", f"{0:f}", f"{0:f}"]
    return [
        str(int(lat["min"]) // 1000),
        str(int(lat["max"]) // 1000),
        f"{lat['mean'] / 1000:f}",
        f"{lat['stddev'] / 1000:f}",
    ]


def _terse_direction(d: dict[str, Any]) -> list[str]:
    """One direction's 41 fields of terse v3 (fio's ``show_ddir_status_terse``): KiB, KiB/s, IOPS, ms;
    slat, clat min/max/mean/stdev in usec; 20 clat percentiles ``P%=usec``; lat; bandwidth in KiB/s."""
    out = [str(d["io_bytes"] >> 10), str(d["bw"]), str(int(d["iops"])), str(d["runtime"])]
    out += _terse_latency_us(d["slat_ns"]) + _terse_latency_us(d["clat_ns"])
    pct = d["clat_ns"].get("percentile") or {f"{p:f}": 0 for p in FIO_PERCENTILES}
    fields = [f"{float(p):f}%={int(v) // 1000}" for p, v in pct.items()]
    out += (fields + ["0%=0"] * 20)[:20]
    out += _terse_latency_us(d["lat_ns"])
    out += [str(d["bw_min"]), str(d["bw_max"]), f"{d['bw_agg']:f}%", f"{d['bw_mean']:f}", f"{d['bw_dev']:f}"]
    return out


def render_terse(results: Sequence[JobResult], specs: Sequence[JobSpec | None]) -> str:
    """fio's terse (``--minimal``) format, version 3: one semicolon-separated line per job.

    Fields, in fio 3.33's order (``man fio``, TERSE OUTPUT): terse version (3), fio version, job
    name, group id, error; read, then write, 41 fields each (:func:`_terse_direction`); CPU user
    and system percent, context switches, major and minor faults; IO depths <=1 .. >=64 (7); latency
    shares at <=2 .. 1000 usec (10, nanosecond latencies counted in the first) and <=2 .. >=2000
    msec (12): 121 fields. fio then adds 9 disk-utilization fields per disk it sampled; tierstore
    samples no disk, as fio with a disk-less engine (``ioengine=null``: 121 fields). The job's
    ``description``, when set, is the last field. ``kv`` and ``device`` sections have no terse
    form (use json).

    ``results`` and ``specs`` as in :func:`render_normal`. Returns one line per job, newline-terminated.
    """
    lines = []
    for r, spec in zip(results, specs):
        j = job_to_json(r, spec)
        fields = [str(TERSE_VERSION), FIO_VERSION, r.jobname, str(r.groupid), str(r.error)]
        fields += _terse_direction(j["read"]) + _terse_direction(j["write"])
        fields += [f"{j['usr_cpu']:f}%", f"{j['sys_cpu']:f}%", str(j["ctx"]), str(j["majf"]), str(j["minf"])]
        fields += [f"{v:3.1f}%" for v in j["iodepth_level"].values()]
        lat_us = list(j["latency_us"].values())
        lat_us[0] += sum(j["latency_ns"].values())
        fields += [f"{v:3.2f}%" for v in lat_us]
        fields += [f"{v:3.2f}%" for v in j["latency_ms"].values()]
        if r.options.get("description"):
            fields.append(str(r.options["description"]))
        lines.append(";".join(fields) + "\n")
    return "".join(lines)


def render(results: Sequence[JobResult], specs: Sequence[JobSpec | None], formats: Iterable[str]) -> str:
    """All requested formats, concatenated in the order given (fio's behaviour)."""
    parts = []
    for fmt in formats:
        if fmt == "normal":
            parts.append(render_normal(results, specs))
        elif fmt == "terse":
            parts.append(render_terse(results, specs))
        else:
            parts.append(render_json(results, specs, plus=fmt == "json+"))
    return "".join(parts)
