#!/usr/bin/env python3
"""CPU time and Python-level calls per lookup, this tree against a base tree in one process
(issue 25: lookup by keys / by tokens, per-call fixed cost).

Rates on a shared 2-vCPU VM swing by 2x with other processes' load; this measures what the
load changes least: the calling thread's CPU time (``time.thread_time``) per call over
``--calls`` lookups, the two trees interleaved in ABBA order within one process (the base
tree imported as a second package, ``tierstore_base``), and ``cProfile``'s count of calls
per lookup. Each tree gets a store of ``--blocks`` indexed 64-byte blocks in chains of
``--chain`` (embedded defaults, host tier only, as ``core_bench.py --parts meta``); the
lookups are of stored chains (every block a host hit), by keys (``lookup_keys``) and by
tokens (``lookup``). Prints one JSON object: per tree and kind the median, min and max of
``--rounds`` rounds of CPU microseconds per call, blocks per CPU-second, calls per call,
and the paired new/base ratios of CPU time.

Example::

    git -C /work/main archive <base commit> | tar -x -C /tmp/base
    PYTHONPATH=$PWD python bench/lookup_cpu.py --base /tmp/base --chain 64 --rounds 7
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import json
import os
import pstats
import statistics
import sys
import time


def _import_tree(root: str, name: str):
    """The package ``tierstore`` of checkout ``root`` imported as ``name`` (its imports are
    relative, so both trees live side by side in one process)."""
    pkg = os.path.join(root, "tierstore")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _setup(ts, blocks: int, chain: int):
    """A store of ``blocks`` stored 64-byte blocks of tree ``ts``; the lookup calls to time."""
    import numpy as np
    import torch

    lay = importlib.import_module(ts.__name__ + ".layout").KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, tokens_per_block=16
    )
    n = max(1, blocks // chain)
    s = ts.KVStore(lay, host_bytes=(n + 2) * chain * lay.bytes_per_block, device="cpu")
    ns = ts.Namespace(model="lookup-cpu")
    blk = torch.zeros(chain, *lay.block_shape, dtype=lay.dtype)
    prompts = [np.arange(chain * 16, dtype=np.int64) + i * 10_000_000 for i in range(n)]
    keys = [s.keys_for(ns, p) for p in prompts]
    for k in keys:
        s.store_keys(ns, k, blk)
    for k in keys[:64]:  # warm-up
        s.lookup_keys(k)
    return s, ns, prompts, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a checkout of the tree to compare against")
    ap.add_argument("--chain", type=int, default=64, help="blocks a lookup")
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks indexed in each store")
    ap.add_argument("--calls", type=int, default=1000, help="lookups a round")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    import tierstore as new

    base = _import_tree(os.path.abspath(a.base), "tierstore_base")
    trees = {"new": new, "base": base}
    state = {name: _setup(ts, a.blocks, a.chain) for name, ts in trees.items()}

    def calls(name: str, kind: str):
        s, ns, prompts, keys = state[name]
        m = min(a.calls, len(keys))
        if kind == "keys":
            return [lambda k=keys[i]: s.lookup_keys(k) for i in range(m)]
        return [lambda p=prompts[i]: s.lookup(ns, p) for i in range(m)]

    fns = {(name, kind): calls(name, kind) for name in trees for kind in ("keys", "tokens")}
    us: dict = {k: [] for k in fns}
    load = [os.getloadavg()[0]]
    for r in range(a.rounds):
        order = ["new", "base"] if r % 2 == 0 else ["base", "new"]  # ABBA
        for kind in ("keys", "tokens"):
            for name in order:
                f = fns[(name, kind)]
                c0 = time.thread_time()
                for fn in f:
                    fn()
                us[(name, kind)].append((time.thread_time() - c0) / len(f) * 1e6)
    load.append(os.getloadavg()[0])
    out: dict = {
        "chain": a.chain,
        "blocks": a.blocks,
        "calls": a.calls,
        "rounds": a.rounds,
        "loadavg_1m": load,
    }
    for (name, kind), v in us.items():
        f = fns[(name, kind)]
        pr = cProfile.Profile()
        pr.enable()
        for fn in f[:200]:
            fn()
        pr.disable()
        med = statistics.median(v)
        out[f"{name}.{kind}"] = {
            "cpu_us_per_call": {"median": med, "min": min(v), "max": max(v)},
            "blocks_per_cpu_s": a.chain / med * 1e6,
            "calls_per_call": pstats.Stats(pr).total_calls / min(200, len(f)),
        }
    for kind in ("keys", "tokens"):
        ratios = [x / y for x, y in zip(us[("new", kind)], us[("base", kind)])]
        out[f"new_over_base.{kind}.cpu_us"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    for st in state.values():
        st[0].close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
