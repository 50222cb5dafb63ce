#!/usr/bin/env python3
"""Why a lookup waits while another thread demotes (issue 25 item 4): a diagnostic, not a benchmark.

The scenario of ``core_bench.py --parts stall``: thread WRITER stores 16 x 256 KiB blocks a call
through a 64 MiB host tier that demotes to an NVMe file (posix engine) until ``--stall-mib`` MiB
have reached NVMe. The main thread is, per ``--mode``:

* ``split`` -- the lookup loop of the benchmark (a pinned, resident 8-block prefix). For each
  lookup over ``--slow-ms`` it reads the thread's voluntary and involuntary context switches
  (``getrusage(RUSAGE_THREAD)``): a voluntary switch is a sleep (waiting for the GIL or a lock),
  an involuntary one an OS preemption; and the CPU time WRITER burnt meanwhile.
* ``stretch`` -- a probe that sleeps 0.2 ms in a loop and wants the GIL back at each wake-up. A
  wake-up later than ``--gap-ms`` while one other thread of the process burnt CPU is a time that
  thread kept the GIL (or the OS preempted the probe); the thread's frames at the start and the
  end of the gap say where its stretch began and ended (``sys._current_frames``).

``--time-submits`` also times every ``ThreadPoolExecutor.submit`` (the posix engine's I/O pieces,
the copy threads' jobs): a submit wakes a pool thread while holding the GIL; an involuntary
context switch inside it is the OS preempting the GIL holder for the thread it woke.

``--switch-interval S`` sets ``sys.setswitchinterval`` *in this diagnostic process only* (CPython's
default is 5 ms); tierstore never changes the interpreter's settings.

Example::

    PYTHONPATH=$PWD python bench/stall_diag.py --mode split --runs 3
    PYTHONPATH=$PWD python bench/stall_diag.py --mode split --runs 3 --switch-interval 0.001
    PYTHONPATH=$PWD python bench/stall_diag.py --mode stretch --runs 3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from tierstore import KVStore, Namespace
from tierstore.layout import KVLayout


def _store(d: str, stall_bytes: int) -> tuple[KVStore, Namespace, np.ndarray]:
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4096, dtype=torch.float16, tokens_per_block=16)
    s = KVStore(
        lay, host_bytes=64 << 20, nvme_path=d, nvme_bytes=stall_bytes * 2 + (256 << 20), nvme_engine="posix"
    )
    ns = Namespace(model="stall")
    hot = np.arange(8 * 16)
    s.store(ns, hot, torch.zeros(8, *lay.block_shape, dtype=lay.dtype))
    s.pin(ns, hot, lease_s=3600)
    return s, ns, hot


def _writer(
    s: KVStore, ns: Namespace, stall_bytes: int, stop: threading.Event, ident: list
) -> threading.Thread:
    lay = s.layout

    def run() -> None:
        ident.append(threading.get_ident())
        blk = torch.ones(16, *lay.block_shape, dtype=lay.dtype)
        i = 0
        try:
            while int(s.stats().get("nvme_write_bytes", 0)) < stall_bytes:
                s.store(ns, np.arange(16 * 16) + (i + 1) * 1_000_000, blk)
                i += 1
        finally:
            stop.set()

    t = threading.Thread(target=run, name="WRITER")
    t.start()
    while not ident:
        time.sleep(0.001)
    return t


def _switches() -> tuple[int, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


def run_split(s: KVStore, ns: Namespace, hot: np.ndarray, stall_bytes: int, slow_ms: float) -> dict:
    """Lookups while WRITER demotes; the slow ones split by how the thread lost the CPU."""
    stop, ident = threading.Event(), []
    t = _writer(s, ns, stall_bytes, stop, ident)
    wclock = time.pthread_getcpuclockid(ident[0])
    lat, slow = [], []
    while not stop.is_set():
        v0, w0 = _switches(), time.clock_gettime(wclock)
        t0 = time.perf_counter_ns()
        s.lookup(ns, hot)
        dt = time.perf_counter_ns() - t0
        v1 = _switches()
        w1 = time.clock_gettime(wclock) if not stop.is_set() else w0
        lat.append(dt)
        if dt > slow_ms * 1e6:
            slow.append((dt / 1e6, v1[0] - v0[0], v1[1] - v0[1], (w1 - w0) * 1e3))
    t.join()
    v = np.asarray(lat) / 1e6
    out = {"lookups": int(v.size), "p999_ms": float(np.percentile(v, 99.9)), "max_ms": float(v.max())}
    for name, pick in (("slept", lambda r: r[1] > 0), ("preempted_only", lambda r: r[1] == 0 and r[2] > 0)):
        rows = [r for r in slow if pick(r)]
        out[name] = {
            "n": len(rows),
            "over_5ms": sum(r[0] > 5 for r in rows),
            "max_ms": max((r[0] for r in rows), default=0.0),
            "writer_cpu_ms_per_ms": sum(r[3] for r in rows) / max(1e-9, sum(r[0] for r in rows)),
        }
    return out


def _where(frame, depth: int = 3) -> str:
    out = []
    while frame is not None and len(out) < depth:
        out.append(f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(out)


def _cpu_by_thread(me: int) -> dict[int, tuple[str, float]]:
    out = {}
    for th in threading.enumerate():
        if th.ident is None or th.ident == me:
            continue
        try:
            out[th.ident] = (th.name, time.clock_gettime(time.pthread_getcpuclockid(th.ident)))
        except (OSError, ValueError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return out


def run_stretch(s: KVStore, ns: Namespace, stall_bytes: int, gap_ms: float) -> dict:
    """Late wake-ups of a sleeping probe: who kept the GIL, from where to where."""
    stop, ident = threading.Event(), []
    me = threading.get_ident()
    t = _writer(s, ns, stall_bytes, stop, ident)
    gaps = []
    prev_t, prev_c = time.perf_counter(), _cpu_by_thread(me)
    prev_f = {k: _where(f) for k, f in sys._current_frames().items() if k != me}
    while not stop.is_set():
        time.sleep(0.0002)
        now = time.perf_counter()
        frames, cpu = sys._current_frames(), _cpu_by_thread(me)
        if now - prev_t > gap_ms / 1e3:
            burnt = {k: cpu[k][1] - prev_c[k][1] for k in cpu if k in prev_c}
            k = max(burnt, key=lambda x: burnt[x], default=None)
            if k is not None and burnt[k] > 0.2e-3:
                gaps.append(
                    (
                        (now - prev_t) * 1e3,
                        cpu[k][0],
                        burnt[k] * 1e3,
                        prev_f.get(k, "?"),
                        _where(frames.get(k)),
                    )
                )
            else:
                gaps.append(((now - prev_t) * 1e3, None, 0.0, "", ""))
        prev_t, prev_c = time.perf_counter(), cpu
        prev_f = {k: _where(f) for k, f in frames.items() if k != me}
    t.join()
    held = [g for g in gaps if g[1] is not None]
    spans = collections.Counter()
    for g in held:
        spans[f"{g[3].split(' < ')[0]} -> {g[4].split(' < ')[0]}"] += g[2]
    return {
        "gaps": len(gaps),
        "gaps_no_cpu_burnt": len(gaps) - len(held),
        "held_gaps_by_thread": dict(collections.Counter(g[1] for g in held)),
        "held_max_cpu_ms": max((g[2] for g in held), default=0.0),
        "held_over_2ms": sum(g[2] > 2 for g in held),
        "held_cpu_ms_by_span": {k: round(v, 2) for k, v in spans.most_common(6)},
        "longest": [
            {"gap_ms": g[0], "thread": g[1], "cpu_ms": g[2], "from": g[3], "to": g[4]}
            for g in sorted(held, key=lambda g: -g[2])[:4]
        ],
    }


def _time_submits() -> list:
    """Diagnostic only: wrap ``ThreadPoolExecutor.submit`` to time each call (wall ms, involuntary
    context switches inside it)."""
    import concurrent.futures.thread as cft

    rows: list = []
    orig = cft.ThreadPoolExecutor.submit

    def submit(self, fn, /, *args, **kwargs):
        n0, t0 = _switches()[1], time.perf_counter()
        try:
            return orig(self, fn, *args, **kwargs)
        finally:
            rows.append(((time.perf_counter() - t0) * 1e3, _switches()[1] - n0))

    cft.ThreadPoolExecutor.submit = submit  # type: ignore[method-assign]
    return rows


def _submit_summary(rows: list) -> dict:
    w = np.asarray([r[0] for r in rows] or [0.0])
    pre = [r[0] for r in rows if r[1] > 0]
    return {
        "submits": len(rows),
        "submit_p99_ms": float(np.percentile(w, 99)),
        "submit_max_ms": float(w.max()),
        "submits_preempted": len(pre),
        "preempted_ms_total": float(sum(pre)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("split", "stretch"), default="split")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stall-mib", type=int, default=256)
    ap.add_argument("--slow-ms", type=float, default=1.0, help="split: lookups slower than this are split")
    ap.add_argument("--gap-ms", type=float, default=1.2, help="stretch: probe wake-ups later than this")
    ap.add_argument("--switch-interval", type=float, help="diagnostic only: sys.setswitchinterval (s)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--time-submits", action="store_true", help="time each thread-pool submit")
    a = ap.parse_args()
    submits = _time_submits() if a.time_submits else None
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    nbytes = a.stall_mib << 20
    for run in range(a.runs):
        d = tempfile.mkdtemp(dir=a.dir, prefix="stall-diag-")
        s, ns, hot = _store(d, nbytes)
        t0 = time.perf_counter()
        try:
            r = (
                run_split(s, ns, hot, nbytes, a.slow_ms)
                if a.mode == "split"
                else run_stretch(s, ns, nbytes, a.gap_ms)
            )
        finally:
            s.close(flush=False)
            shutil.rmtree(d, ignore_errors=True)
        if submits is not None:
            r.update(_submit_summary(submits))
            submits.clear()
        r.update(
            demoting_s=time.perf_counter() - t0,
            run=run,
            switch_interval_ms=sys.getswitchinterval() * 1e3,
            loadavg_1m=os.getloadavg()[0],
        )
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
