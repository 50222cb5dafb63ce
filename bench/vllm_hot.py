#!/usr/bin/env python3
"""vLLM connector hot path: the worker's cost per store and per load call, from the host tier.

What ``TierstoreConnector``'s worker does for one store job and one load job, without an engine
(the set-up of ``tests/integrations/vllm/test_protocol.py``): a fake CPU KV cache in vLLM's
per-layer layout (``detect_engine_layout``), an embedded ``KVStore`` whose host tier holds three
calls' blocks, and the worker's own ``_save`` (gather from the pool into the store) and ``_load``
(scatter from the store into other pool blocks) of ``--blocks`` blocks per call, fresh keys each
call, every loaded block compared with its source. Block classes (``CLASSES``): ``16KiB`` (2 layers,
2 KV heads, head dim 32, 16 tokens, fp32) and ``2MiB`` (32 layers, 8 KV heads, head dim 128,
16 tokens, bf16: Llama-3.1-8B's block of 16 tokens). Torch's threading is left as it is.

A run is one child process per tree (``PYTHONPATH`` = that tree): ``--calls`` store+load pairs
after one warm-up pair, the run's median per call. ``--base TREE`` runs another checkout side by
side, ABBA; the table gives per-tree medians over runs with min-max and the per-run ratio
base / this tree.

Run (the ``vllm`` nox environment)::

    PYTHONPATH=$PWD .nox/vllm/bin/python bench/vllm_hot.py --classes 16KiB,2MiB --runs 5 \\
        --base /tmp/base --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
#: class -> (layers, kv heads, head dim, tokens per block, dtype name)
CLASSES = {"16KiB": (2, 2, 32, 16, "float32"), "2MiB": (32, 8, 128, 16, "bfloat16")}


def child(cls: str, blocks: int, calls: int) -> dict:
    """One run of one class in this process (the tierstore on ``sys.path``)."""
    import types

    import torch

    from tierstore import KVStore
    from tierstore.integrations import vllm as tv

    layers, heads, dim, tokens, dtype = CLASSES[cls]
    nb = 2 * blocks  # sources, then load destinations
    whole = torch.randn(layers, nb, heads, tokens, 2 * dim).to(getattr(torch, dtype))
    eng = tv.detect_engine_layout(
        {f"layers.{i}.attn": whole[i] for i in range(layers)}, nb, tokens, heads, dim
    )
    bb = eng.layout.bytes_per_block
    store = KVStore(eng.layout, host_bytes=3 * blocks * bb)
    eid = f"bench-{os.getpid()}"
    settings = tv.ConnectorSettings()
    ns = tv.Namespace(model="bench@1")
    tv._REGISTRY[eid] = tv._EngineStore(store, eng, ns, settings)
    conn = types.SimpleNamespace(
        _kv_transfer_config=types.SimpleNamespace(engine_id=eid), _connector_metadata=None
    )
    worker = tv._WorkerSide(conn, None, None, None, settings)
    worker._shared = tv._REGISTRY[eid]
    src, dst = list(range(blocks)), list(range(blocks, nb))
    save_s, load_s = [], []
    try:
        for c in range(calls + 1):
            keys = [os.urandom(32) for _ in range(blocks)]
            t0 = time.perf_counter()
            st = worker._save(tv.StoreJob(f"r{c}", ns, keys, src, 0, None), None)
            t1 = time.perf_counter()
            got = worker._load([tv.LoadJob(f"r{c}", keys, dst)])
            t2 = time.perf_counter()
            assert all(s is tv.Status.OK for s in st) and all(s is tv.Status.OK for s in got), (st, got)
            assert torch.equal(whole[:, blocks:], whole[:, :blocks])
            whole[:, blocks:] = 0
            if c:  # the first pair warms up
                save_s.append(t1 - t0)
                load_s.append(t2 - t1)
    finally:
        worker._saver.shutdown(wait=True)
        worker._loader.shutdown(wait=True)
        del tv._REGISTRY[eid]
        store.close()
    return {
        "save_us": statistics.median(save_s) * 1e6,
        "load_us": statistics.median(load_s) * 1e6,
        "block_bytes": bb,
    }


def _spawn(tree: str, cls: str, blocks: int, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    args = [sys.executable, str(HERE), "--child", cls, "--blocks", str(blocks), "--calls", str(calls)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tree)
    if r.returncode:
        raise SystemExit(f"{tree} {cls}: child failed\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(v: list) -> str:
    return f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="16KiB,2MiB")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per store and per load call")
    ap.add_argument("--calls", type=int, default=10, help="timed store+load pairs per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--base", help="another checkout, run side by side (ABBA)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.blocks, a.calls)))
        return
    trees = {"new": str(HERE.parent.parent)}
    if a.base:
        trees["base"] = str(pathlib.Path(a.base).resolve())
    results: dict = {}
    for cls in a.classes.split(","):
        runs: dict = {t: [] for t in trees}
        for r in range(a.runs):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:  # ABBA
                res = _spawn(trees[name], cls, a.blocks, a.calls)
                res["loadavg_1m"] = os.getloadavg()[0]
                runs[name].append(res)
        results[cls] = runs
        for name, rs in runs.items():
            load = statistics.median(x["loadavg_1m"] for x in rs)
            save, load_us = _fmt([x["save_us"] for x in rs]), _fmt([x["load_us"] for x in rs])
            print(
                f"{cls:6} {name:5} store us/call {save}  load us/call {load_us}  load avg {load:.1f}",
                flush=True,
            )
        if "base" in runs:
            for k in ("save_us", "load_us"):
                q = [b[k] / n[k] for n, b in zip(runs["new"], runs["base"])]
                print(f"{cls:6} base/new {k[:-3]:5} {statistics.median(q):.2f} [{min(q):.2f}-{max(q):.2f}]")
    if a.json:
        meta = {"argv": sys.argv, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        pathlib.Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
