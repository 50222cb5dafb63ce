#!/usr/bin/env python
"""``tierstore bench`` against fio on the same plain job: IOPS ratio, ABBA pairs, quiet and loaded.

For every (workload, ioengine) the same command line is given to fio and to ``tierstore bench``::

    --name=job --rw=RW --bs=4k --iodepth=16 --ioengine=ENGINE --direct=1 --size=SIZE
    --runtime=T --time_based --filename=FILE --output-format=json --output=OUT

(``--rwmixread=70`` added for ``randrw``), on one preallocated O_DIRECT file on the disk under
``--dir`` (laid out once, before any timing; removed at the end). Both read their own JSON; the
IOPS of a run is ``read.iops + write.iops``; each tool's CPU per I/O (user + system, us) comes from
its own ``usr_cpu``/``sys_cpu`` over its I/Os. Which io_uring turn tierstore runs (C where
``tierstore.io._ringloop`` is built, else Python) is printed first and kept in the JSON's ``config``.

Method: ``--pairs`` pairs per case, run back to back in ABBA order (pair 0: fio then tierstore,
pair 1: tierstore then fio, ...), so neither side always follows the other. The ratio is
tierstore IOPS / fio IOPS per pair; the table gives the median of the per-pair ratios with min and
max, the median IOPS of each side, and the 1-minute load average before each pair (median, and
min-max). ``--conditions quiet,busy`` repeats everything with ``--busy N`` (default 1) competitor
processes: Python spin loops (``while True: pass``) started before each pair and stopped after it, so
both sides of a pair share the CPU with them.

Usage::

    . .venv/bin/activate && export PYTHONPATH=$PWD
    python bench/fio_iops.py --dir /work/tmp-bench --json bench/results/fio_iops.json

Nothing here sets a thread count or an environment variable; both tools run as a user runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("randread", "read", "randwrite", "write", "randrw")
ENGINES = ("io_uring", "psync")


def job_args(rw: str, engine: str, size: str, runtime_s: float, path: str, out: str) -> list[str]:
    """The job, as both tools read it."""
    args = [
        "--name=job",
        f"--rw={rw}",
        "--bs=4k",
        "--iodepth=16",
        f"--ioengine={engine}",
        "--direct=1",
        f"--size={size}",
        f"--runtime={runtime_s:g}",
        "--time_based",
        f"--filename={path}",
        "--output-format=json",
        f"--output={out}",
    ]
    if rw == "randrw":
        args.append("--rwmixread=70")
    return args


def _job(out: str) -> dict:
    text = open(out, encoding="utf-8").read()
    job = json.loads(text[text.index("{") :])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"{out}: the job failed with error={job['error']}")
    return job


def _iops(out: str) -> float:
    job = _job(out)
    return float(job["read"]["iops"]) + float(job["write"]["iops"])


def _cpu_us_per_io(out: str, runtime_s: float) -> tuple[float, float]:
    """User and system CPU per I/O (us), from the tool's own ``usr_cpu``/``sys_cpu`` (percent of its
    runtime)."""
    job = _job(out)
    ios = max(1, int(job["read"]["total_ios"]) + int(job["write"]["total_ios"]))
    return (
        float(job["usr_cpu"]) / 100 * runtime_s / ios * 1e6,
        float(job["sys_cpu"]) / 100 * runtime_s / ios * 1e6,
    )


def run_one(
    tool: str, rw: str, engine: str, size: str, runtime_s: float, path: str, tmp: str
) -> tuple[float, tuple[float, float]]:
    """One run of ``tool`` (``fio`` or ``tierstore``); returns its IOPS and its (user, system) CPU us per
    I/O."""
    out = os.path.join(tmp, f"{tool}.json")
    # the file is the run's own (fio laid it out): tierstore writes over a file it did not create
    # only with --format=1
    cmd = (
        ["fio"]
        if tool == "fio"
        else [sys.executable, "-m", "tierstore.cli", "bench", "--eta=never", "--format=1"]
    )
    cmd += job_args(rw, engine, size, runtime_s, path, out)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return _iops(out), _cpu_us_per_io(out, runtime_s)


def lay_out(path: str, size_bytes: int) -> None:
    """Write the test file once with incompressible bytes and sync it (no tool lays it out in a timed run)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(size_bytes >> 20):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir", default=tempfile.gettempdir(), help="parent of the test file (a disk, not tmpfs)"
    )
    ap.add_argument("--size", default="256m", help="file size (fio/tierstore size=)")
    ap.add_argument("--runtime", type=float, default=5.0, help="seconds per run")
    ap.add_argument("--pairs", type=int, default=5, help="ABBA pairs per case")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument(
        "--conditions", default="quiet,busy", help="quiet, busy (--busy spin-loop competitors), or both"
    )
    ap.add_argument("--busy", type=int, default=1, help="spin-loop processes that run through each busy pair")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed", file=sys.stderr)
        return 1
    from tierstore.io.ring import native_turn
    from tierstore.units import parse_size

    size_bytes = parse_size(args.size, "size")
    native, why = native_turn()
    turn = "C (tierstore.io._ringloop)" if native else f"Python ({why})"
    print(f"tierstore's io_uring turn: {turn}", flush=True)
    work = tempfile.mkdtemp(prefix="fio-iops-", dir=args.dir)
    path = os.path.join(work, "job.dat")
    results = {
        "config": {
            "size": args.size,
            "runtime_s": args.runtime,
            "pairs": args.pairs,
            "dir": args.dir,
            "busy_processes": args.busy,
            "fio": subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip(),
            "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "tierstore_io_uring_turn": turn,
            "command_example": {
                t: " ".join(
                    (["fio"] if t == "fio" else ["tierstore", "bench", "--eta=never", "--format=1"])
                    + job_args("randread", "io_uring", args.size, args.runtime, path, "OUT.json")
                )
                for t in ("fio", "tierstore")
            },
        },
        "cases": [],
    }
    try:
        lay_out(path, size_bytes)
        for condition in args.conditions.split(","):
            for engine in args.engines.split(","):
                for rw in args.workloads.split(","):
                    case = {"condition": condition, "engine": engine, "rw": rw, "pairs": []}
                    for i in range(args.pairs):
                        order = ("fio", "tierstore") if i % 2 == 0 else ("tierstore", "fio")
                        load = os.getloadavg()[0]
                        got, cpu = {}, {}
                        from tierstore.bench.busy import competitors  # here: a --base tree may lack it

                        with competitors(args.busy if condition == "busy" else 0):
                            for tool in order:
                                got[tool], cpu[tool] = run_one(
                                    tool, rw, engine, args.size, args.runtime, path, work
                                )
                        pair = {
                            "order": list(order),
                            "loadavg_1m": load,
                            "fio_iops": got["fio"],
                            "tierstore_iops": got["tierstore"],
                            "ratio": got["tierstore"] / got["fio"],
                            "fio_cpu_us_per_io": cpu["fio"],
                            "tierstore_cpu_us_per_io": cpu["tierstore"],
                        }
                        case["pairs"].append(pair)
                        print(
                            f"{condition:5s} {engine:8s} {rw:9s} pair {i}: fio {got['fio']:9.0f}  tierstore "
                            f"{got['tierstore']:9.0f}  ratio {pair['ratio']:.2f}  load {load:.2f}",
                            flush=True,
                        )
                    case["ratio"] = summarize([p["ratio"] for p in case["pairs"]])
                    case["fio_iops"] = summarize([p["fio_iops"] for p in case["pairs"]])
                    case["tierstore_iops"] = summarize([p["tierstore_iops"] for p in case["pairs"]])
                    case["loadavg_1m"] = summarize([p["loadavg_1m"] for p in case["pairs"]])
                    for tool in ("fio", "tierstore"):  # user + system CPU per I/O, us
                        case[f"{tool}_cpu_us_per_io"] = summarize(
                            [sum(p[f"{tool}_cpu_us_per_io"]) for p in case["pairs"]]
                        )
                    results["cases"].append(case)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["config"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(
        "\n| condition | ioengine | rw | tierstore / fio IOPS (median, min-max) | fio IOPS | tierstore IOPS "
        "| CPU us per I/O, fio / tierstore | load avg 1 min |"
    )
    print("|---|---|---|---|---:|---:|---|---|")
    for c in results["cases"]:
        r, la = c["ratio"], c["loadavg_1m"]
        print(
            f"| {c['condition']} | {c['engine']} | {c['rw']} | {r['median']:.2f} "
            f"({r['min']:.2f}-{r['max']:.2f}) "
            f"| {c['fio_iops']['median']:.0f} | {c['tierstore_iops']['median']:.0f} "
            f"| {c['fio_cpu_us_per_io']['median']:.1f} / {c['tierstore_cpu_us_per_io']['median']:.1f} "
            f"| {la['median']:.1f} ({la['min']:.1f}-{la['max']:.1f}) |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
