#!/usr/bin/env python3
"""The replay's deterministic counts, to show that a change moved code and changed no decision.

Replays the packaged excerpt through the ``tierstore bench --rw=kvtrace`` job (``excerpt``) and through
:func:`tierstore.replay.run_replay` in each configuration of :data:`CONFIGS`; with ``--full TRACE`` also
that trace through the bench job (``full``; minutes). Per configuration it keeps every count the replay
reports (hits and loaded bytes per tier, saved prefill tokens, bytes written per tier and by GC,
evictions, demotions, segment and engine counters, the FTL model's figures, a SHA-256 of the time
series), prints a summary line and the SHA-256 of the canonical JSON of the counts. Left out: timings
(``*_ns``, ``*latency*``, ``load_lat*``, CPU, wall) and the device description (a temporary path).

Determinism: the clock is trace time and the replay drains the store after each request, so two runs
give identical counts (checked twice at 57790a5). The one machine-dependent input, the cost model's
measured load times, needs no pin: an estimate never exceeds the declared figures
(``CostModel.max_slowdown = 1``; at most 0.22 ms for a 32 KiB NVMe block) and recomputing a 512-token
block costs 51 ms at the declared prefill rate, so every matched block is useful whatever is measured
(``useful_blocks == hit_blocks`` in every configuration). A change there shows as a ``useful_blocks``
difference.

Usage (from a checkout; ``PYTHONPATH`` naming it when another tierstore is installed)::

    python bench/replay_counts.py [--out FILE.json] [--full TRACE.jsonl] [--only NAME,...]
    python bench/replay_counts.py --compare bench/results/replay_counts_B.json

``--compare FILE`` compares each configuration run here with the one of that name in FILE, prints
every differing key (``config.counts.section.key: before -> after``) and exits 1 on any difference
(also for a configuration FILE lacks); FILE's configurations not run here are named, not compared.
:func:`run_config`, :func:`compare` and :func:`digest` are importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierstore.bench.jobfile import parse_jobs
from tierstore.bench.kvjobs import run_kvtrace
from tierstore.replay import ReplayConfig, run_replay

#: :class:`~tierstore.replay.ReplayConfig` fields of each matrix configuration (the excerpt).
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "copy_forward": {
        "policies": {"promotion": "none", "reinsert": "clock"},
        "nvme_options": {"region_policy": "fifo"},
    },
    "fdp_sim": {
        "policies": {"classifier": "reuse"},
        "nvme_options": {"device": "sim", "fdp": {"enabled": True}, "model": {"utilization": 0.9}},
    },
    "write_through": {
        "eviction": "s3fifo",
        "policies": {"write_policy": "write_through", "admission": "reused"},
    },
    "min_live_cost": {
        "eviction": "cost",
        "policies": {"promotion": "one"},
        "nvme_options": {"region_policy": "min_live"},
    },
    "accounting": {"keep_data": False, "nvme_options": {"device": "sim"}},
}
#: Names of the bench-job configurations (``tierstore bench --rw=kvtrace [--trace=...]``).
JOBS = ("excerpt", "full")

_TIMING = re.compile(r"(_ns|_ms)$|latency|^load_lat|^store_lat|cpu|wall|runtime")
#: Memory footprints of the index structures: recorded, not compared (they follow the structures'
#: layout, e.g. the key table's rehash state, not the store's decisions).
_FOOTPRINT = re.compile(r"index_bytes$")


def _counts(obj: Any) -> Any:
    """``obj`` without timings and temporary paths; numpy scalars as Python numbers."""
    if isinstance(obj, dict):
        return {
            str(k): _counts(v)
            for k, v in obj.items()
            if not _TIMING.search(str(k)) and str(k) not in ("device", "waf_timeseries")
        }
    if isinstance(obj, (list, tuple)):
        return [_counts(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj


def canonical(obj: Any) -> str:
    """The canonical JSON of ``obj``: sorted keys, no spaces, floats as ``repr`` (exact)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def digest(obj: Any) -> str:
    """SHA-256 (hex) of :func:`canonical` ``(obj)``."""
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


def _summary(kv: dict, nvme: dict, device: dict) -> dict:
    nvme = nvme or {k[5:]: v for k, v in device.items() if k.startswith("nvme_")}
    return {
        "hits": [kv.get(f"hit_blocks_{t}", 0) for t in ("hbm", "host", "nvme")],
        "useful": kv.get("useful_blocks"),
        "saved_prefill_tokens": kv.get("saved_prefill_tokens"),
        "nvme_write_bytes": kv.get("nvme_write_bytes"),
        "engine_write_bytes": device.get("engine_write_bytes"),
        "gc_bytes": nvme.get("gc_bytes_written"),
        "kept_blocks": nvme.get("region_kept_blocks"),
        "waf": device.get("waf"),
    }


def run_config(name: str, full_trace: str | None = None, limit: int | None = None) -> dict:
    """Replay configuration ``name`` and return its counts.

    Parameters
    ----------
    name : str
        A key of :data:`CONFIGS`, or ``"excerpt"``/``"full"`` (the bench job; ``"full"`` needs
        ``full_trace``).
    full_trace : str, optional
        Mooncake JSONL trace of the ``"full"`` job.
    limit : int, optional
        Replay only the first ``limit`` requests (a quick check; it is part of the configuration).

    Returns
    -------
    dict
        ``{"config", "counts": {"kv", "nvme", "device", "index", "timeseries_sha256"}, "summary",
        "sha256"}``: ``sha256`` is :func:`digest` of ``counts``. The bench jobs report the segment
        store's counters inside ``device`` (``nvme_*``) and no ``index`` section.

    Raises
    ------
    KeyError
        For an unknown name; ``ValueError`` for ``"full"`` without a trace.
    """
    if name in JOBS:
        if name == "full" and not full_trace:
            raise ValueError("the full job needs a trace (--full TRACE)")
        flags = ["--rw=kvtrace"] + ([f"--trace={full_trace}"] if name == "full" else [])
        flags += [f"--number_ios={limit}"] if limit else []
        res = run_kvtrace(parse_jobs(flags)[0].options)
        kv, nvme, index, device, series = res.kv, {}, {}, res.device, res.timeseries
        config: dict[str, Any] = {"bench_flags": flags}
    else:
        config = dict(CONFIGS[name], **({"limit": limit} if limit else {}))
        rep = run_replay(ReplayConfig(**config))
        final = dict(rep.final_stats)
        nvme = final.pop("nvme_backend", {}) or {}
        kv, index, device, series = rep.kv, final, rep.device, rep.timeseries
    counts = {
        "kv": _counts(kv),
        "nvme": _counts(nvme),
        "device": _counts(device),
        "index": _counts(index),
        "timeseries_sha256": digest(_counts(series)),
    }
    return {
        "config": config,
        "counts": counts,
        "summary": _summary(counts["kv"], counts["nvme"], counts["device"]),
        "sha256": digest(counts),
    }


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def compare(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """Differences between two outputs of this tool (the ``configs`` sections).

    Returns
    -------
    (list of str, list of str)
        One line per differing key but the memory footprints (``_FOOTPRINT``),
        ``"config.counts.section.key: before -> after"`` (a configuration
        ``before`` lacks is one line), and the configurations of ``before`` not in ``after``.
    """
    diffs, skipped = [], sorted(set(before) - set(after))
    for name in sorted(after):
        if name not in before:
            diffs.append(f"{name}: not in the baseline")
            continue
        a = _flat({"config": before[name]["config"], "counts": before[name]["counts"]}, name)
        b = _flat({"config": after[name]["config"], "counts": after[name]["counts"]}, name)
        for key in sorted(set(a) | set(b)):
            if _FOOTPRINT.search(key):
                continue
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                diffs.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return diffs, skipped


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (module docstring). Returns the exit status: 1 when ``--compare`` finds a difference."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the counts as JSON here")
    ap.add_argument("--full", metavar="TRACE", help="also replay this trace through the bench job (minutes)")
    ap.add_argument("--limit", type=int, help="replay only the first N requests of each trace (quick check)")
    ap.add_argument("--only", help="comma-separated configurations to run (default: all; 'full' with --full)")
    ap.add_argument(
        "--compare", metavar="FILE", help="compare with this earlier output; exit 1 on a difference"
    )
    args = ap.parse_args(argv)
    names = ["excerpt", *CONFIGS] + (["full"] if args.full else [])
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            ap.error(f"--only: unknown {unknown}; accepted values are {names}")
        names = wanted
    configs = {}
    for name in names:
        t0 = time.perf_counter()
        configs[name] = run_config(name, args.full, args.limit)
        s = configs[name]["summary"]
        print(
            f"{name:14s} hits hbm/host/nvme {s['hits']} useful {s['useful']} "
            f"saved {s['saved_prefill_tokens']} "
            f"nvme_write {s['nvme_write_bytes']} engine_write {s['engine_write_bytes']} gc {s['gc_bytes']} "
            f"kept {s['kept_blocks']} waf {s['waf']} sha256 {configs[name]['sha256'][:16]} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    out = {
        "meta": {"tool": "bench/replay_counts.py", "commit": _commit(), "full_trace": args.full},
        "configs": configs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    if not args.compare:
        return 0
    diffs, skipped = compare(json.loads(Path(args.compare).read_text())["configs"], configs)
    if skipped:
        print(f"not run here, not compared: {', '.join(skipped)}")
    print("\n".join(diffs) if diffs else f"IDENTICAL to {args.compare} ({len(configs)} configurations)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
