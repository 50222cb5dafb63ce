#!/usr/bin/env python3
"""Issue 13's goals, measured side by side: the redesigned core against a baseline checkout.

Every measurement runs in a fresh subprocess with ``PYTHONPATH`` set to the code
under test (this checkout, and optionally ``--base`` — a checkout of the old
core, e.g. ``git worktree add /tmp/base ec6b0c6``), in ABBA order over
``--runs`` repetitions; the tables give medians with min-max.

Parts (``--parts``):

* ``stall``  -- thread A stores 256 KiB blocks that demote to an NVMe file (at
  least ``--stall-bytes``, 1 GiB default) while thread B looks up a pinned,
  resident prefix in a loop; B's lookup latency idle vs during A's demotions
  (p50/p99/p99.9/max, lookups over 5 ms and their total time).
* ``nvme``   -- a store straight to NVMe (no memory tiers) through ``KVStore``
  vs the same blocks through ``SegmentStorage.put`` in the same batches, at 256
  KiB and 4 MiB blocks; and vs LMCache's LocalDiskBackend at 4 MiB when its
  venv exists (``--lmcache-python``; bench/io_lmcache_helper.py).
* ``frag``   -- ``store_fragments``/``load_fragments`` through ``KVPagePool``
  plans (2 MiB blocks of 32 layers x K/V x 32 KiB) into/from the host tier vs a
  memcpy of the same bytes (``torch`` ``copy_`` of contiguous buffers).
* ``meta``   -- tiny blocks (64 B), one thread: store, lookup by keys, lookup by
  tokens (and the chained hashing alone), in chains of ``--chain`` blocks; and
  the bytes of metadata per indexed block at ``--meta-blocks`` blocks on an NVMe
  tier that keeps no data (:class:`tierstore.io.null.NullEngine`).

Example::

    python bench/core_bench.py --base /tmp/base --runs 3 --dir /work --json bench/results/core.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# =============================================================================== workers
def _layout(head_dim: int, tokens: int = 16, layers: int = 2, heads: int = 1):
    import torch
    from tierstore.layout import KVLayout
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=torch.float16,
                    tokens_per_block=tokens)


def _store_keys(s, ns, keys, blocks, first=0):
    if hasattr(s, "store_keys"):
        return s.store_keys(ns, keys, blocks, first_position=first)
    return s.manager.store(s.digest(ns), keys, blocks, None, None, first)  # the old core


def _lookup_keys(s, keys):
    if hasattr(s, "lookup_keys"):
        return s.lookup_keys(keys)
    return s.manager.lookup(keys)


def worker_stall(a: dict) -> dict:
    import threading

    import numpy as np
    import torch
    from tierstore import KVStore, Namespace
    lay = _layout(head_dim=4096, tokens=16, layers=1, heads=1)  # 2 x 1 x 1 x 4096 x 2 B x 16 = 256 KiB blocks
    bb = lay.bytes_per_block
    d = tempfile.mkdtemp(dir=a["dir"], prefix="core-stall-")
    s = KVStore(lay, host_bytes=64 << 20, nvme_path=d, nvme_bytes=a["stall_bytes"] * 2 + (256 << 20))
    ns = Namespace(model="stall")
    hot = np.arange(8 * 16)
    s.store(ns, hot, torch.zeros(8, *lay.block_shape, dtype=lay.dtype))
    s.pin(ns, hot, lease_s=3600)

    def probe(seconds: float, lat: list, stop: threading.Event | None = None):
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and not (stop is not None and stop.is_set()):
            t0 = time.perf_counter_ns()
            r = s.lookup(ns, hot)
            lat.append(time.perf_counter_ns() - t0)
            assert r.matched_blocks == 8
    idle: list = []
    probe(a["idle_s"], idle)
    busy: list = []
    stop = threading.Event()
    written = [0]

    def writer():
        i = 0
        blk = torch.ones(16, *lay.block_shape, dtype=lay.dtype)
        while written[0] < a["stall_bytes"]:
            toks = np.arange(16 * 16) + (i + 1) * 1_000_000
            s.store(ns, toks, blk)
            i += 1
            written[0] = int(s.stats().get("nvme_write_bytes", 0))
        stop.set()
    t = threading.Thread(target=writer)
    t0 = time.perf_counter()
    t.start()
    probe(3600, busy, stop)
    t.join()
    dt = time.perf_counter() - t0
    s.close()

    def summ(x):
        v = np.asarray(x, dtype=np.int64)
        over = v[v > 5_000_000]
        return {"n": int(v.size), "p50_us": float(np.percentile(v, 50)) / 1e3, "p99_us": float(np.percentile(v, 99)) / 1e3,
                "p999_us": float(np.percentile(v, 99.9)) / 1e3, "max_ms": float(v.max()) / 1e6,
                "over_5ms": int(over.size), "stall_s": float(over.sum()) / 1e9}
    return {"idle": summ(idle), "busy": summ(busy), "demoted_bytes": written[0], "busy_s": dt,
            "block_bytes": bb}


def worker_nvme(a: dict) -> dict:
    import torch
    from tierstore import KVStore, Namespace
    from tierstore.io import SegmentStorage
    out = {}
    for bb_k, per_call in ((256, 16), (4096, 4)):
        head_dim = bb_k * 1024 // (2 * 2 * 16)  # 1 layer, 1 head, fp16, 16 tokens
        lay = _layout(head_dim=head_dim, tokens=16, layers=1, heads=1)
        bb = lay.bytes_per_block
        n = a["nvme_bytes"] // bb
        blocks = torch.randint(0, 255, (per_call, bb), dtype=torch.uint8)
        d = tempfile.mkdtemp(dir=a["dir"], prefix="core-nvme-")
        cap = a["nvme_bytes"] * 2 + (512 << 20)
        # KVStore, NVMe only
        s = KVStore(lay, nvme_path=os.path.join(d, "kv"), nvme_bytes=cap)
        ns = Namespace(model="nvme")
        import numpy as np
        t0 = time.perf_counter()
        for i in range(0, n, per_call):
            toks = np.arange(per_call * 16) + i * 1000
            st = s.store(ns, toks, list(blocks))
            assert all(x.value == "ok" for x in st), st
        kv_s = time.perf_counter() - t0
        s.close(**({"flush": False} if "flush" in s.close.__code__.co_varnames else {}))
        # SegmentStorage, same batches
        seg_path = os.path.join(d, "seg.bin")
        seg_size = s.nvme.segment_size_bytes if hasattr(s, "nvme") and s.nvme is not None else 256 << 20
        g = SegmentStorage(seg_path, cap, bb, segment_size_bytes=seg_size, engine="posix")
        t0 = time.perf_counter()
        for i in range(0, n, per_call):
            keys = [os.urandom(32) for _ in range(per_call)]
            st = g.put(keys, list(blocks))
        seg_s = time.perf_counter() - t0
        g.close()
        import shutil
        shutil.rmtree(d, ignore_errors=True)
        out[f"{bb_k}k"] = {"kvstore_gbps": n * bb / kv_s / 1e9, "segment_gbps": n * bb / seg_s / 1e9}
    return out


def worker_frag(a: dict) -> dict:
    import torch
    from tierstore import KVStore, Namespace, Status
    from tierstore.io.pages import KVPagePool
    from tierstore.layout import KVLayout
    import numpy as np
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens_per_block=16)
    nb = a["frag_blocks"]
    bb = lay.bytes_per_block
    pool = torch.randn(lay.num_layers, 2, nb, 16, 8, 128).to(torch.bfloat16)
    dst = torch.zeros_like(pool)
    pages, dpages = KVPagePool(pool), KVPagePool(dst)
    s = KVStore(lay, host_bytes=(nb + 4) * bb, device="cpu")
    ns = Namespace(model="frag")
    toks = np.arange(nb * 16)
    plans = pages.plans(range(nb))
    dplans = dpages.plans(range(nb), destination=True)
    keys = s.keys_for(ns, toks)
    res = {"store": [], "load": [], "memcpy": []}
    src_flat = torch.empty(nb * bb, dtype=torch.uint8)
    dst_flat = torch.empty(nb * bb, dtype=torch.uint8)
    for rep in range(3):
        t0 = time.perf_counter()
        st = s.store_fragments(ns, toks, plans)
        res["store"].append(time.perf_counter() - t0)
        assert all(x is Status.OK for x in st)
        t0 = time.perf_counter()
        st = s.load_fragments(keys, dplans)
        res["load"].append(time.perf_counter() - t0)
        assert all(x is Status.OK for x in st)
        t0 = time.perf_counter()
        dst_flat.copy_(src_flat)
        res["memcpy"].append(time.perf_counter() - t0)
        if rep == 0:
            assert torch.equal(dst, pool)
        s.remove(keys) if hasattr(s, "remove") else s.manager.remove(keys)
    s.close()
    total = nb * bb
    return {k: total / statistics.median(v) / 1e9 for k, v in res.items()}


def worker_meta(a: dict) -> dict:
    import numpy as np
    import torch
    from tierstore import KVStore, Namespace
    from tierstore.identity import block_hashes
    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)   # 64-byte blocks
    bb = lay.bytes_per_block
    chain = a["chain"]
    n = a["meta_ops"] // chain * chain
    s = KVStore(lay, host_bytes=(n + chain) * bb, device="cpu")
    ns = Namespace(model="meta")
    d = s.digest(ns)
    prompts = [np.arange(chain * 16, dtype=np.int64) + i * 10_000_000 for i in range(n // chain)]
    t0 = time.perf_counter()
    keys = [block_hashes(d, p, 16) for p in prompts]
    hash_s = time.perf_counter() - t0
    blk = torch.zeros(chain, bb, dtype=torch.uint8)
    t0 = time.perf_counter()
    for k in keys:
        _store_keys(s, ns, k, list(blk) if not hasattr(s, "store_keys") else blk)
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        r = _lookup_keys(s, k)
    lk_s = time.perf_counter() - t0
    assert r.matched_blocks == chain
    t0 = time.perf_counter()
    for p in prompts:
        r = s.lookup(ns, p)
    lt_s = time.perf_counter() - t0
    assert r.matched_blocks == chain
    s.close()
    out = {"chain": chain, "blocks": n, "store_blocks_per_s": n / store_s, "lookup_keys_blocks_per_s": n / lk_s,
           "lookup_tokens_blocks_per_s": n / lt_s, "hash_blocks_per_s": n / hash_s,
           "lookup_tokens_over_hash": lt_s / hash_s}
    out.update(_meta_memory(a))
    return out


def _meta_memory(a: dict) -> dict:
    """Metadata bytes per indexed block at ``meta_blocks`` blocks on NVMe (no data kept)."""
    import resource

    import numpy as np
    import torch
    from tierstore import KVStore, Namespace
    try:
        from tierstore.io.null import NullEngine
        from tierstore.io.segments import SegmentStorage
    except ImportError:
        return {}
    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)
    bb = lay.bytes_per_block
    nblocks = a["meta_blocks"]
    per = 4000  # blocks per extent
    ext = 4096 + per * 4096
    seg = ext * 4
    cap = (nblocks // per + 64) * ext // seg * seg + 8 * seg
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nv = SegmentStorage(None, cap, bb, segment_size_bytes=seg, engine=NullEngine(cap), extent_size_bytes=ext,
                        owns_engine=True)
    s = KVStore(lay, nvme=nv)
    ns = Namespace(model="mem")
    blk = torch.zeros(per, bb, dtype=torch.uint8)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(0, nblocks, per):
        raw = rng.bytes(32 * per)
        keys = [raw[j:j + 32] for j in range(0, 32 * per, 32)]
        s.store_keys(ns, keys, blk)
    dt = time.perf_counter() - t0
    got = s.stats()["blocks"]
    struct = s.stats()["index_bytes"] + nv.index_nbytes()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s.close(flush=False)
    return {"mem_blocks": got, "index_bytes_per_block": struct / got,
            "rss_kib_delta_per_block": (rss1 - rss0) * 1024 / got, "mem_fill_s": dt}


WORKERS = {"stall": worker_stall, "nvme": worker_nvme, "frag": worker_frag, "meta": worker_meta}


# =============================================================================== driver
def run_worker(root: str, part: str, args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", part, json.dumps(args)],
                       capture_output=True, text=True, env=env, cwd=root)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def lmcache(py: str, d: str, total: int) -> dict:
    helper = os.path.join(HERE, "io_lmcache_helper.py")
    r = subprocess.run([py, helper, "--dir", d, "--total-bytes", str(total), "--chunk-bytes", str(4 << 20),
                        "--runs", "1"], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"write_gbps": res["total_bytes"] / res["write_s"][0] / 1e9}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("PART", "ARGS"))
    ap.add_argument("--base", help="a checkout of the old core to compare against")
    ap.add_argument("--parts", default="stall,nvme,frag,meta")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--stall-bytes", type=int, default=1 << 30)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--nvme-bytes", type=int, default=512 << 20)
    ap.add_argument("--frag-blocks", type=int, default=64)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--meta-ops", type=int, default=200_000)
    ap.add_argument("--meta-blocks", type=int, default=1_000_000)
    ap.add_argument("--lmcache-python", default=os.environ.get("LMCACHE_PYTHON", "/work/lmcache-venv/bin/python"))
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        part, args = a.worker
        print(json.dumps(WORKERS[part](json.loads(args))))
        return
    wargs = {"dir": a.dir, "stall_bytes": a.stall_bytes, "idle_s": a.idle_s, "nvme_bytes": a.nvme_bytes,
             "frag_blocks": a.frag_blocks, "chain": a.chain, "meta_ops": a.meta_ops, "meta_blocks": a.meta_blocks}
    codes = [("new", ROOT)] + ([("base", os.path.abspath(a.base))] if a.base else [])
    results: dict = {}
    for part in a.parts.split(","):
        rows: dict = {name: [] for name, _ in codes}
        for run in range(a.runs):
            order = codes if run % 2 == 0 else codes[::-1]  # ABBA
            for name, root in order:
                wa = dict(wargs)
                if part == "meta" and name == "base":
                    wa["meta_blocks"] = min(a.meta_blocks, 1_000_000)  # ~0.9 KB a block on the old core
                rows[name].append(run_worker(root, part, wa))
                print(f"{part} run {run} {name}: {json.dumps(rows[name][-1])[:300]}", file=sys.stderr)
        if part == "nvme" and os.path.exists(a.lmcache_python):
            rows["lmcache_4m"] = [lmcache(a.lmcache_python, a.dir, a.nvme_bytes) for _ in range(a.runs)]
        results[part] = rows
    summary: dict = {}
    for part, rows in results.items():
        for name, runs in rows.items():
            flat = [_flat(r) for r in runs if "error" not in r]
            for key in sorted({k for f in flat for k in f}):
                vals = [f[key] for f in flat if key in f]
                summary[f"{part}.{name}.{key}"] = {"median": statistics.median(vals), "min": min(vals),
                                                   "max": max(vals), "runs": vals}
    for k, v in summary.items():
        print(f"{k:60s} {v['median']:14.4g}  [{v['min']:.4g}, {v['max']:.4g}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "raw": results, "summary": summary,
                       "loadavg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
