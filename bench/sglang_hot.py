"""SGLang HiCache L3 hot path: per-page cost of ``batch_set_v1``/``batch_get_v1`` from the host tier.

What ``bench/sglang_bench.py``'s DRAM pair times, without HiCacheFile and NVMe: one
``HiCacheTierStore`` whose host tier holds every page (``promotion: none``), on SGLang 0.5.23's
real ``MHATokenToKVPoolHost`` (``page_first``, bf16, the page classes of ``sglang_bench.CLASSES``),
pages set and then loaded in SGLang's batches of ``STORAGE_BATCH_SIZE`` (128) into other host pages;
every loaded page is compared with its source. Torch's threading is left as it is.

Modes:

* default: ``--runs`` passes per class in this process; prints microseconds per page, wall and
  the calling thread's CPU time of the get (``time.thread_time``, a figure the host's load moves
  far less); ``--gets N`` loads the pages N times a pass and takes the median.
* ``--profile``: one more pass under ``cProfile``; prints the top functions by own time for the
  set and the get (the per-page breakdown) and the Python-level calls a ``batch_*_v1`` call makes.
* ``--base TREE``: side by side with another checkout (e.g. ``git worktree add /tmp/base main``):
  each run is one child process per tree (``PYTHONPATH`` = that tree, this script), in the order
  A B / B A alternating (ABBA); the table gives per-tree medians with min-max and the per-run
  ratios base / this tree.

Run (the ``sglang`` nox environment; ``tests/integrations/sglang/stubs`` stands in for
torchvision)::

    PYTHONPATH=$PWD:tests/integrations/sglang/stubs .nox/sglang/bin/python bench/sglang_hot.py \\
        --classes 16KiB,128KiB --total 64m --runs 5 --base /tmp/base --json OUT.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
STUBS = HERE.parent / "tests" / "integrations" / "sglang" / "stubs"


def _pass(cls: str, total: int, profile: bool, gets: int = 1) -> dict:
    """One pass of one class in this process: a fresh store, set every page, get every page
    ``gets`` times (the figures: medians over the gets; the first get pays warm-ups).

    Besides wall time per page, the calling thread's CPU time per page (``time.thread_time``: the
    part of the cost that does not depend on how busy the host is, copy threads excluded) and with
    ``profile`` the Python-level calls a ``batch_set_v1``/``batch_get_v1`` call makes (``cProfile``
    over the set and the last get)."""
    import sglang_bench as sb
    import torch
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo

    from tierstore.integrations.sglang import HiCacheTierStore

    layers, heads, head_dim, page = sb.CLASSES[cls]
    page_bytes = 2 * layers * heads * head_dim * 2 * page
    n = max(1, total // page_bytes)
    pool = sb.make_pool(cls, n)
    extra = {"tiers": {"host": {"capacity_bytes": (n + 64) * page_bytes}}, "policies": {"promotion": "none"}}
    b = HiCacheTierStore(sb.storage_config(extra), {})
    b.register_mem_pool_host(pool)
    keys = sb.page_keys(n, f"{cls}/{time.monotonic_ns()}")
    P, B = pool.page_size, STORAGE_BATCH_SIZE
    batches = [(keys[i : i + B], i, HiCacheStorageExtraInfo(prefix_keys=keys[:i])) for i in range(0, n, B)]
    pool.kv_buffer[:, n * P :].zero_()

    def set_all() -> None:
        for kb, i, info in batches:
            if not all(b.batch_set_v1(kb, torch.arange(i * P, (i + len(kb)) * P), info)):
                raise RuntimeError(f"set of batch {i // B} failed")

    def get_all() -> None:
        for kb, i, info in batches:
            got = b.batch_get_v1(kb, torch.arange((n + i) * P, (n + i + len(kb)) * P), info)
            if not all(got):
                raise RuntimeError(f"get of batch {i // B} loaded {sum(got)}/{len(kb)}")

    out: dict = {"pages": n, "page_bytes": page_bytes, "calls": len(batches)}
    phases = [("set", set_all)] + [("get", get_all)] * gets
    for k, (name, fn) in enumerate(phases):
        prof = cProfile.Profile() if profile and (k == 0 or k == len(phases) - 1) else None
        if prof is not None:
            prof.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if prof is not None:
            prof.disable()
            st = pstats.Stats(prof, stream=io.StringIO())
            out[f"{name}_py_calls_per_call"] = st.total_calls / len(batches)  # type: ignore[attr-defined]
            st.sort_stats("tottime").print_stats(22)
            out[f"{name}_profile"] = st.stream.getvalue()  # type: ignore[attr-defined]
        out.setdefault(f"{name}_us_per_page_all", []).append(dt / n * 1e6)
        out.setdefault(f"{name}_cpu_us_per_page_all", []).append(cpu / n * 1e6)
    for name in ("set", "get"):  # a profiled pass is slower: it is left out where there are others
        for k in ("us_per_page", "cpu_us_per_page"):
            vals = out[f"{name}_{k}_all"]
            if profile and name == "get" and len(vals) > 1:
                vals = vals[:-1]
            out[f"{name}_{k}"] = statistics.median(vals)
    src = pool.kv_buffer[:, : n * P].view(torch.uint8)
    dst = pool.kv_buffer[:, n * P : 2 * n * P].view(torch.uint8)
    if not torch.equal(src, dst):
        raise RuntimeError("loaded pages differ from their sources")
    b.close()
    return out


def _summary(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _child(tree: pathlib.Path, classes: str, total: int, gets: int) -> dict:
    """One pass of each class in a child process whose ``tierstore`` is ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{STUBS}")
    r = subprocess.run(
        [sys.executable, __file__, "--child", classes, "--total", str(total), "--gets", str(gets)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode:
        raise RuntimeError(f"child for {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", default="16KiB,128KiB")
    ap.add_argument("--total", default="64m", help="bytes of pages per pass (each class)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gets", type=int, default=1, help="get passes a run (their median)")
    ap.add_argument("--profile", action="store_true", help="also profile one pass (cProfile)")
    ap.add_argument("--base", default=None, help="another checkout to run side by side (ABBA)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from tierstore.units import parse_size

    total = parse_size(args.total, "total")
    if args.child:
        print(json.dumps({c: _pass(c, total, False, args.gets) for c in args.child.split(",")}))
        return 0
    here = HERE.parent
    res: dict = {
        "config": {**vars(args), "total_bytes": total, "loadavg_start": os.getloadavg(), "tree": str(here)},
        "classes": {},
    }
    classes = args.classes.split(",")
    by_class: dict[str, list[dict]] = {c: [] for c in classes}
    for r in range(args.runs):  # each child runs every class: SGLang's import is paid once a run
        if args.base:
            order = [("base", pathlib.Path(args.base)), ("this", here)]
            if r % 2:
                order.reverse()
            got = {name: _child(tree, args.classes, total, args.gets) for name, tree in order}
        else:
            got = {"this": {c: _pass(c, total, False, args.gets) for c in classes}}
        load = os.getloadavg()[0]
        for cls in classes:
            one = {name: g[cls] for name, g in got.items()}
            one["loadavg"] = load
            by_class[cls].append(one)
            print(
                f"[{cls} run {r + 1}/{args.runs}] "
                + "  ".join(
                    f"{k}: set {v['set_us_per_page']:.1f} get {v['get_us_per_page']:.1f} us/page"
                    f" (get CPU {v['get_cpu_us_per_page']:.1f})"
                    for k, v in one.items()
                    if isinstance(v, dict)
                )
                + f"  (load {load:.2f})",
                flush=True,
            )
    for cls in classes:
        runs = by_class[cls]
        out: dict = {
            "pages": runs[0]["this"]["pages"],
            "page_bytes": runs[0]["this"]["page_bytes"],
            "runs": runs,
        }
        for who in ("this", "base") if args.base else ("this",):
            for k in ("set_us_per_page", "get_us_per_page", "get_cpu_us_per_page"):
                out[f"{who}_{k}"] = _summary([x[who][k] for x in runs])
        if args.base:
            for k in ("set_us_per_page", "get_us_per_page", "get_cpu_us_per_page"):
                out[f"speedup_{k}"] = _summary([x["base"][k] / x["this"][k] for x in runs])
        res["classes"][cls] = out
        print(f"\n{cls} ({out['pages']} pages of {out['page_bytes']} B), median (min-max) of {args.runs}:")
        for k, v in out.items():
            if isinstance(v, dict) and "median" in v:
                print(f"  {k:28s} {v['median']:8.2f} ({v['min']:.2f}-{v['max']:.2f})")
        if args.profile:
            p = _pass(cls, total, True, max(2, args.gets))
            for name in ("set", "get"):
                print(
                    f"\nprofile, {name} ({p[f'{name}_us_per_page_all'][-1]:.1f} us/page profiled, "
                    f"{p[f'{name}_py_calls_per_call']:.0f} Python-level calls a call of "
                    f"{p['pages'] // p['calls']} pages):\n{p[f'{name}_profile']}"
                )
            res["classes"][cls]["py_calls_per_call"] = {
                k: p[f"{k}_py_calls_per_call"] for k in ("set", "get")
            }
    res["config"]["loadavg_end"] = os.getloadavg()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
