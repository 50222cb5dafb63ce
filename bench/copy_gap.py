#!/usr/bin/env python3
"""Where a frag call's time goes beside a plain ``copy_`` (issue 25 item 1), in one process.

Each round runs, in alternating order, the 64-block (2 MiB Llama-3.1-8B blocks) copies of
``core_bench.py --parts frag`` and their parts: ``memcpy`` (torch ``copy_`` of the same bytes
between two contiguous buffers, torch's OpenMP threads), ``memcpy_1omp`` (the same on one OpenMP
thread), the floors (``core_bench._frag_floor``: the same bytes in plain torch with tierstore's
thread structure and pieces), ``floor_blocks_2pieces`` (the blocks' bytes cut in two pieces, one
per copying thread), each form's store/load through a ``KVStore`` (``real``) and through a store
whose copier runs the pieces on the caller with every block copy skipped (``meta``: the call's
own work, index, plans, checks and the pieces' Python; every status is checked OK). Prints per
case the median time (min..max) and the median over rounds of ``memcpy`` time / case time
measured in the same round (1.0: as fast as ``copy_``).

Example::

    PYTHONPATH=$PWD python bench/copy_gap.py --rounds 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import functools

    import numpy as np
    import torch
    from core_bench import _frag_floor

    from tierstore import KVStore, Namespace, Status
    from tierstore.io import copies
    from tierstore.io.pages import KVPagePool
    from tierstore.layout import KVLayout
    from tierstore.movers.memory import _copy_run as copy_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens_per_block=16)
    nb, bb = a.blocks, lay.bytes_per_block
    pool = torch.randn(lay.num_layers, 2, nb, 16, 8, 128).to(torch.bfloat16)
    dst = torch.zeros_like(pool)
    pages, dpages = KVPagePool(pool), KVPagePool(dst)
    blocks = torch.randn(nb, *lay.block_shape).to(lay.dtype)
    dblocks = torch.zeros_like(blocks)
    src_flat, dst_flat = torch.ones(nb * bb, dtype=torch.uint8), torch.zeros(nb * bb, dtype=torch.uint8)

    class Skip(copies.Copier):  # the meta store's: pieces on the caller, their copies skipped
        def run(self, pieces, nbytes=0, *, split=None):
            with skipped_copies():
                for p in pieces:  # a run of rows is a copy and nothing else: skipped
                    if getattr(p, "func", None) not in (copy_run, copies._copy_rows):
                        p()

        def copy(self, dst, src):
            pass

    real = KVStore(lay, host_bytes=(nb + 4) * bb, device="cpu")
    saved, copies._SHARED = copies._SHARED, Skip()  # the meta store's movers take the shared copier
    meta = KVStore(lay, host_bytes=(nb + 4) * bb, device="cpu")
    copies._SHARED = saved
    ns = Namespace(model="frag")
    toks = np.arange(nb * 16)
    keys = real.keys_for(ns, toks)
    cp = copies.shared_copier()
    half = nb * bb // 2

    def views(t, b):
        return [t[layer, kv, b] for layer in range(lay.num_layers) for kv in range(2)]

    def m1() -> None:
        with copies.one_omp_thread():
            dst_flat.copy_(src_flat)

    def two() -> None:
        halves = [functools.partial(copies._copy_rows, dst_flat, src_flat, x, half) for x in (0, half)]
        cp.run(halves, split=True)

    cases = {"memcpy": lambda: dst_flat.copy_(src_flat), "memcpy_1omp": m1, "floor_blocks_2pieces": two}
    cases.update(_frag_floor(nb, bb, pool, src_flat, dst_flat) or {})

    def form_case(s, form: str, op: str):
        def fn() -> float:
            if form == "plans":
                src, dsts = pages.plans(range(nb)), dpages.plans(range(nb), destination=True)
            elif form == "lists":
                src, dsts = [views(pool, b) for b in range(nb)], [views(dst, b) for b in range(nb)]
            else:
                src, dsts = blocks, list(dblocks)
            if op == "store":
                s.remove(keys)
                t0 = time.perf_counter()
                st = s.store(ns, toks, src) if form == "blocks" else s.store_fragments(ns, toks, src)
            else:
                t0 = time.perf_counter()
                st = s.load(keys, dsts)[0] if form == "blocks" else s.load_fragments(keys, dsts)
            dt = time.perf_counter() - t0
            if any(x is not Status.OK for x in st):
                raise SystemExit(f"{form} {op}: {st}")
            return dt

        return fn

    timed = {}
    for form in ("blocks", "plans", "lists"):
        for op in ("store", "load"):  # a load reads what the store before it stored
            timed[f"{form}_{op}_real"] = form_case(real, form, op)
            timed[f"{form}_{op}_meta"] = form_case(meta, form, op)
    timed["blocks_store_real"](), timed["blocks_store_meta"]()  # a round in reverse loads first
    report(rounds(cases, timed, a.rounds), a.rounds, a.json)


@contextlib.contextmanager
def skipped_copies() -> Iterator[None]:
    """Meanwhile a block plan's ``gather``/``scatter`` checks and returns its bytes, copying nothing."""
    from tierstore.errors import LayoutError
    from tierstore.io.pages import FragmentPlan

    saved = FragmentPlan.gather, FragmentPlan.scatter

    def gather(self, staging, offset: int) -> int:
        return self.nbytes

    def scatter(self, staging, offset: int) -> int:
        if not self.destination:
            raise LayoutError("not a destination")
        return self.nbytes

    FragmentPlan.gather, FragmentPlan.scatter = gather, scatter  # type: ignore[method-assign]
    try:
        yield
    finally:
        FragmentPlan.gather, FragmentPlan.scatter = saved  # type: ignore[method-assign]


def rounds(cases: dict, timed: dict, n: int) -> dict:
    """``{case: [seconds per round]}``: every case once a round, in alternating order."""
    names = list(cases) + list(timed)
    res: dict = {k: [] for k in names}
    for r in range(n + 1):  # round 0 warms up
        for k in names if r % 2 else names[::-1]:
            if k in timed:
                dt = timed[k]()
            else:
                t0 = time.perf_counter()
                cases[k]()
                dt = time.perf_counter() - t0
            if r:
                res[k].append(dt)
    return res


def report(res: dict, n: int, path: str | None) -> None:
    """Print (and write to ``path`` as JSON) each case's median, min..max and memcpy ratio."""
    out: dict = {"loadavg": os.getloadavg(), "rounds": n, "cases": {}}
    for k, v in res.items():
        ratio = [m / x for m, x in zip(res["memcpy"], v)]
        out["cases"][k] = {
            "ms": statistics.median(v) * 1e3,
            "ms_min": min(v) * 1e3,
            "ms_max": max(v) * 1e3,
            "memcpy_over": statistics.median(ratio),
            "all_ms": [x * 1e3 for x in v],
        }
        c = out["cases"][k]
        print(
            f"{k:24s} {c['ms']:8.2f} ms ({c['ms_min']:.2f}..{c['ms_max']:.2f})"
            f"  memcpy/this {c['memcpy_over']:.2f}  min/min {min(res['memcpy']) / min(v):.2f}"
        )
    print("load", out["loadavg"])
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
