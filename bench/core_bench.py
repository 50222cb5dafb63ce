#!/usr/bin/env python3
"""Issue 13's goals, measured side by side: the redesigned core against a baseline checkout.

Every measurement runs in a fresh subprocess with ``PYTHONPATH`` set to the code
under test (this checkout, and ``--base``: a checkout of the old core, e.g.
``git worktree add /tmp/base 6a1de75``, the parent of the redesign commit
0885dca), in ABBA order over ``--runs`` repetitions (run ``r`` goes new,
base when ``r`` is even, base, new when odd; LMCache runs between them). The
summary gives medians with min-max over runs, and for every ratio the median
of the *per-run* ratios (both sides measured back to back in that run).

Parts (``--parts``):

* ``stall`` -- thread A stores 256 KiB blocks that demote from a 64 MiB host
  tier to an NVMe file until at least ``--stall-bytes`` (1 GiB) have been
  written to NVMe, while thread B looks up a pinned, resident 8-block prefix
  in a loop; B's lookup latency idle (A not running) vs while A demotes:
  p50/p99/p99.9/max, lookups over 5 ms and their total time.
* ``nvme`` -- a store straight to NVMe (no memory tiers) through ``KVStore``
  vs the same blocks through ``SegmentStorage.put`` in the same batches (16
  blocks of 256 KiB, 4 of 4 MiB a call), both on the posix O_DIRECT engine,
  the two in alternating order; and LMCache 0.5.6's LocalDiskBackend storing
  the same bytes in 4 MiB chunks (``--lmcache-python``;
  ``bench/lmcache_helper.py``; it neither fsyncs nor checksums, tierstore
  does both).
* ``frag`` -- ``--frag-blocks`` 2 MiB blocks (Llama-3.1-8B: 32 layers x K/V x
  32 KiB) into/from the host tier in three forms: ``store_fragments``/
  ``load_fragments`` through ``KVPagePool`` plans (``plans_*``) and given as
  64 per-layer views per block, the plain list form (``lists_*``); and
  ``store``/``load`` of whole blocks (one ``(n, *block_shape)`` tensor in, a
  list of block tensors out: ``blocks_*``); each against ``copy_`` of the same
  bytes between two contiguous buffers (``memcpy``); one warm-up pass, then the
  median of 5 passes; every load is checked against what was stored. Beside them
  the floors (``floor_blocks``, ``floor_views_store``, ``floor_views_load``:
  the same bytes in plain torch with tierstore's thread structure and pieces,
  :func:`_frag_floor`); ``bench/copy_gap.py`` splits a call into its floor and
  its own work.
* ``meta`` -- tiny blocks (64 B), one thread, chains of ``--chains`` blocks:
  store (``store_keys`` of a tensor of blocks; and ``store`` by tokens into a fresh store),
  lookup by keys, lookup by tokens, and the chained hashing alone; blocks/s by wall time and by the
  thread's CPU time (``time.thread_time``: what the machine's other load does
  not inflate as much). Beside the rates, the floors that bound them from below, in the same process
  and run (``floor_*``, µs wall and CPU): the SHA-256 chain alone and the key table's probe alone
  (``KeyTable.get_many`` of the same keys) per block, and per call a ``lookup_keys`` of 1 key, a
  lookup and a store of a 1-block prompt (``bench/engine_cost.py`` prints them under its table).
* ``percall`` -- per-block cost of ``store``, ``lookup`` and ``load`` of 64-block prompts by
  tokens through the host tier at ``--percall-kib`` block sizes (16 KiB, 128 KiB, 2 MiB),
  ``--percall-prompts`` prompts a pass, best and median of ``--percall-passes``: microseconds
  of thread CPU and of wall time per block (issue 25 item 2). Not in the default ``--parts``.
* ``scrape`` -- thread B looks up a pinned, resident 8-block prefix in a loop while thread A
  calls ``stats()`` back to back (a metrics scrape) on a store indexing ``--scrape-blocks``
  (1M) blocks on an NVMe tier that keeps no data; B's latency idle vs during the scrapes,
  and A's CPU per ``stats()``. Not in the default ``--parts``.
* ``reclaim`` -- the same lookups while thread A stores 256-block batches of 64 B blocks into
  a full NVMe tier (no data kept) of 8 regions of ~15.6k blocks: ``--reclaim-regions`` (6)
  region evictions, each asking the index about and then dropping a whole region. Not in the
  default ``--parts``.
* ``mem`` -- bytes of metadata per indexed block at ``--mem-blocks`` blocks on
  an NVMe tier that keeps no data (:class:`tierstore.io.null.NullEngine`):
  the index's and the region manager's arrays, and the process's RSS growth.
  The baseline is measured at ``--base-mem-blocks`` (200k: it fills at ~300 blocks/s).

``--busy N`` measures every part but ``mem`` twice in each run: quiet, then
with N processes spinning on the CPUs (``while True: pass``; started before
and killed after both checkouts' workers), as on an engine's host. Keys are
then prefixed ``quiet.``/``busy.``; each worker's 1-minute load average at its
end is kept (``loadavg_1m``).

Example::

    python bench/core_bench.py --base /tmp/base --runs 3 --dir /work --json bench/results/core.json
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# =============================================================================== workers
def _layout(head_dim: int, tokens: int = 16, layers: int = 2, heads: int = 1):
    import torch

    from tierstore.layout import KVLayout

    return KVLayout(
        num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=torch.float16, tokens_per_block=tokens
    )


def _new_core() -> bool:
    try:
        import tierstore.index  # noqa: F401

        return True
    except ImportError:
        return False


def _nvme_store(lay, path: str, nbytes: int, **kw):
    """A KVStore with an NVMe file tier on the posix engine (both cores)."""
    from tierstore import KVStore

    if _new_core():
        kw["nvme_engine"] = "posix"
    return KVStore(lay, nvme_path=path, nvme_bytes=nbytes, **kw)


def _segment_bytes(s) -> int:
    """The segment size of a KVStore's NVMe tier (the old core keeps the tier on its manager)."""
    nv = s.nvme if hasattr(s, "nvme") else s.manager.nvme
    return nv.segment_size_bytes


def worker_stall(a: dict) -> dict:
    import threading

    import numpy as np
    import torch

    from tierstore import Namespace

    lay = _layout(head_dim=4096, tokens=16, layers=1, heads=1)  # 2 x 1 x 1 x 4096 x 2 B x 16 = 256 KiB blocks
    bb = lay.bytes_per_block
    d = tempfile.mkdtemp(dir=a["dir"], prefix="core-stall-")
    s = _nvme_store(lay, d, a["stall_bytes"] * 2 + (256 << 20), host_bytes=64 << 20)
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
            if r.matched_blocks != 8:
                raise SystemExit(f"the pinned prefix was not found ({r.matched_blocks} blocks)")

    idle: list = []
    probe(a["idle_s"], idle)
    busy: list = []
    stop = threading.Event()
    written = [0]

    def nvme_written() -> int:
        st = s.stats()
        return int(st.get("nvme_write_bytes", st.get("nvme_bytes_written", 0)))

    def writer():
        i = 0
        blk = torch.ones(16, *lay.block_shape, dtype=lay.dtype)
        try:
            while written[0] < a["stall_bytes"]:
                toks = np.arange(16 * 16) + (i + 1) * 1_000_000
                s.store(ns, toks, blk)
                i += 1
                written[0] = nvme_written()
        finally:
            stop.set()

    t = threading.Thread(target=writer)
    t0 = time.perf_counter()
    t.start()
    probe(3600, busy, stop)
    t.join()
    dt = time.perf_counter() - t0
    idle_after: list = []
    probe(a["idle_s"], idle_after)
    s.close(**({"flush": False} if _new_core() else {}))
    shutil.rmtree(d, ignore_errors=True)

    def summ(x):
        v = np.asarray(x, dtype=np.int64)
        over = v[v > 5_000_000]
        return {
            "n": int(v.size),
            "p50_us": float(np.percentile(v, 50)) / 1e3,
            "p99_us": float(np.percentile(v, 99)) / 1e3,
            "p999_us": float(np.percentile(v, 99.9)) / 1e3,
            "max_ms": float(v.max()) / 1e6,
            "over_5ms": int(over.size),
            "stall_s": float(over.sum()) / 1e9,
        }

    return {
        "idle": summ(idle),
        "busy": summ(busy),
        "idle_after": summ(idle_after),
        "demoted_bytes": written[0],
        "busy_s": dt,
        "block_bytes": bb,
    }


def worker_nvme(a: dict) -> dict:
    import numpy as np
    import torch

    from tierstore import Namespace, Status
    from tierstore.io import SegmentStorage

    out = {}
    for bb_k, per_call in ((256, 16), (4096, 4)):
        head_dim = bb_k * 1024 // (2 * 2 * 16)  # 1 layer, 1 head, fp16, 16 tokens
        lay = _layout(head_dim=head_dim, tokens=16, layers=1, heads=1)
        bb = lay.bytes_per_block
        n = a["nvme_bytes"] // bb // per_call * per_call
        blocks = torch.randint(0, 255, (per_call, bb), dtype=torch.uint8)
        d = tempfile.mkdtemp(dir=a["dir"], prefix="core-nvme-")
        cap = a["nvme_bytes"] * 2 + (512 << 20)
        res = {}

        def kvstore():
            s = _nvme_store(lay, os.path.join(d, "kv"), cap)
            ns = Namespace(model="nvme")
            seg = _segment_bytes(s)
            src = blocks if _new_core() else list(blocks)  # the old core takes a list of raw blocks
            t0 = time.perf_counter()
            for i in range(0, n, per_call):
                toks = np.arange(per_call * 16) + i * 1000
                st = s.store(ns, toks, src)
                if any(x is not Status.OK for x in st):
                    raise SystemExit(f"KVStore store: {st}")
            res["kvstore_gbps"] = n * bb / (time.perf_counter() - t0) / 1e9
            s.close(**({"flush": False} if _new_core() else {}))
            return seg

        def segment(seg):
            g = SegmentStorage(os.path.join(d, "seg.bin"), cap, bb, segment_size_bytes=seg, engine="posix")
            keys = [os.urandom(32) for _ in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, per_call):
                st = g.put(keys[i : i + per_call], list(blocks))
                if any(x is not Status.OK for x in st):
                    raise SystemExit(f"SegmentStorage put: {st}")
            res["segment_gbps"] = n * bb / (time.perf_counter() - t0) / 1e9
            g.close()

        if a.get("run", 0) % 2 == 0:
            segment(kvstore())
        else:  # the segment store first: same segment size as the KVStore would choose
            probe = _nvme_store(lay, os.path.join(d, "probe"), cap)
            seg = _segment_bytes(probe)
            probe.close(**({"flush": False} if _new_core() else {}))
            segment(seg)
            kvstore()
        shutil.rmtree(d, ignore_errors=True)
        res["kvstore_over_segment"] = res["kvstore_gbps"] / res["segment_gbps"]
        out[f"{bb_k}k"] = res
    return out


def _frag_floor(nb: int, bb: int, pool, src_flat, dst_flat, slots=None, out=None) -> dict | None:
    """The frag part's copies in plain torch with tierstore's thread structure: ``{name: callable}``.

    Each runs the bytes of one frag call on the process's shared :class:`Copier` (the caller and
    its copy threads, one OpenMP thread each, pieces claimed), cut as tierstore cuts them: whole
    blocks as one ``copy`` of ``(nb, bb)`` rows (``blocks``: a store's one run of consecutive
    rows and slots; a load's per-block pieces are the same 2 MiB rows), per-layer views as one
    strided ``(64, 32 KiB)`` copy a block into / out of a contiguous slot (``views_store``,
    ``views_load``: what ``store_fragments``/``load_fragments`` copy through plans or view
    lists). No index, no plans, no checks: what is left of a call's time over its floor is the
    call's own work. ``slots`` (``(nb, bb)`` uint8) and ``out`` (``pool``'s bytes as
    ``(64, nb, 32 KiB)`` uint8) receive the views' copies (new buffers when None). None when the
    tree under test has no copier (a ``--base`` of an old core).
    """
    import functools

    import torch

    try:
        from tierstore.io.copies import shared_copier
    except ImportError:
        return None
    cp = shared_copier()
    frags = pool.view(torch.uint8).view(pool.shape[0] * pool.shape[1], nb, -1)  # (64, nb, 32 KiB)
    slots = torch.zeros(nb, bb, dtype=torch.uint8) if slots is None else slots
    out = torch.zeros_like(frags) if out is None else out

    def put(b: int) -> None:
        slots[b].view(frags.shape[0], -1).copy_(frags[:, b])

    def get(b: int) -> None:
        out[:, b].copy_(slots[b].view(frags.shape[0], -1))

    return {
        "floor_blocks": lambda: cp.copy(dst_flat.view(nb, bb), src_flat.view(nb, bb)),
        "floor_views_store": lambda: cp.run([functools.partial(put, b) for b in range(nb)], nb * bb),
        "floor_views_load": lambda: cp.run([functools.partial(get, b) for b in range(nb)], nb * bb),
    }


def worker_frag(a: dict) -> dict:
    import numpy as np
    import torch

    from tierstore import KVStore, Namespace, Status
    from tierstore.io.pages import KVPagePool
    from tierstore.layout import KVLayout

    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens_per_block=16)
    nb = a["frag_blocks"]
    bb = lay.bytes_per_block
    pool = torch.randn(lay.num_layers, 2, nb, 16, 8, 128).to(torch.bfloat16)
    dst = torch.zeros_like(pool)
    pages, dpages = KVPagePool(pool), KVPagePool(dst)
    blocks = torch.randn(nb, *lay.block_shape).to(lay.dtype)  # whole blocks, one tensor
    dblocks = torch.zeros_like(blocks)
    s = KVStore(lay, host_bytes=(nb + 4) * bb, device="cpu")
    ns = Namespace(model="frag")
    toks = np.arange(nb * 16)
    keys = s.keys_for(ns, toks)
    forms = ("plans", "lists", "blocks")
    res: dict = {k: [] for f in forms for k in (f"{f}_store", f"{f}_load")}
    res["memcpy"] = []
    src_flat = torch.ones(nb * bb, dtype=torch.uint8)
    dst_flat = torch.zeros(nb * bb, dtype=torch.uint8)
    floor = _frag_floor(nb, bb, pool, src_flat, dst_flat) or {}
    res.update({k: [] for k in floor})

    def views(t, b):  # the plain list form: one block's 64 per-layer K/V views
        return [t[layer, kv, b] for layer in range(lay.num_layers) for kv in range(2)]

    def ok(st, what):
        if any(x is not Status.OK for x in st):
            raise SystemExit(f"{what}: {st}")

    for rep in range(6):  # rep 0 warms up (first touch of the host tier and the buffers)
        for form in forms:
            if form == "plans":
                src, dsts = pages.plans(range(nb)), dpages.plans(range(nb), destination=True)
            elif form == "lists":
                src, dsts = [views(pool, b) for b in range(nb)], [views(dst, b) for b in range(nb)]
            else:
                src, dsts = blocks, list(dblocks)
            t0 = time.perf_counter()
            st = s.store(ns, toks, src) if form == "blocks" else s.store_fragments(ns, toks, src)
            t1 = time.perf_counter()
            ok(st, f"{form} store")
            (dblocks if form == "blocks" else dst).zero_()
            t2 = time.perf_counter()
            st = s.load(keys, dsts)[0] if form == "blocks" else s.load_fragments(keys, dsts)
            t3 = time.perf_counter()
            ok(st, f"{form} load")
            if not (torch.equal(dblocks, blocks) if form == "blocks" else torch.equal(dst, pool)):
                raise SystemExit(f"{form}: loaded KV differs from the stored KV")
            if rep:
                res[f"{form}_store"].append(t1 - t0)
                res[f"{form}_load"].append(t3 - t2)
            s.remove(keys) if hasattr(s, "remove") else s.manager.remove(keys)
        for k, fn in [("memcpy", lambda: dst_flat.copy_(src_flat)), *floor.items()]:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if rep:
                res[k].append(t1 - t0)
    s.close()
    total = nb * bb
    out = {f"{k}_gbps": total / statistics.median(v) / 1e9 for k, v in res.items()}
    for k in res:
        if k != "memcpy":
            out[f"{k}_over_memcpy"] = out[f"{k}_gbps"] / out["memcpy_gbps"]
    return out


def worker_meta(a: dict) -> dict:
    import numpy as np
    import torch

    from tierstore import KVStore, Namespace
    from tierstore.identity import block_hashes

    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)  # 64-byte blocks
    bb = lay.bytes_per_block
    out: dict = {}
    for chain in a["chains"]:
        n = a["meta_ops"] // chain * chain
        s = KVStore(lay, host_bytes=(n + chain) * bb, device="cpu")
        ns = Namespace(model="meta")
        d = s.digest(ns)
        prompts = [np.arange(chain * 16, dtype=np.int64) + i * 10_000_000 for i in range(n // chain)]
        blk = torch.zeros(chain, bb, dtype=torch.uint8)
        new_api = hasattr(s, "store_keys")

        def timed(fn):
            w0, c0 = time.perf_counter(), time.thread_time()
            r = fn()
            return time.perf_counter() - w0, time.thread_time() - c0, r

        hash_w, hash_c, keys = timed(lambda: [block_hashes(d, p, 16) for p in prompts])
        if new_api:
            store = lambda: [s.store_keys(ns, k, blk) for k in keys]  # noqa: E731
        else:
            rows = list(blk)
            store = lambda: [s.manager.store(d, k, rows, None, None, 0) for k in keys]  # noqa: E731
        st_w, st_c, _ = timed(store)
        lk_w, lk_c, r = timed(lambda: [s.lookup_keys(k) for k in keys][-1])
        if r.matched_blocks != chain:
            raise SystemExit(f"lookup_keys matched {r.matched_blocks} of {chain}")
        lt_w, lt_c, r = timed(lambda: [s.lookup(ns, p) for p in prompts][-1])
        if r.matched_blocks != chain:
            raise SystemExit(f"lookup matched {r.matched_blocks} of {chain}")
        floors = _meta_floors(s, ns, keys, prompts, timed)
        s.close()
        s = KVStore(lay, host_bytes=(n + chain) * bb, device="cpu")  # store by tokens: a fresh store
        stt_w, stt_c, _ = timed(lambda: [s.store(ns, p, blk) for p in prompts])
        s.close()
        s = KVStore(lay, host_bytes=(len(prompts) + chain) * bb, device="cpu")  # 1-block stores: room for all
        st1_w, st1_c, _ = timed(lambda: [s.store(ns, p[:16], blk[:1]) for p in prompts])
        s.close()
        floors["floor_store_tokens_1_us"] = st1_w / len(prompts) * 1e6
        floors["floor_store_tokens_1_cpu_us"] = st1_c / len(prompts) * 1e6
        out[f"chain{chain}"] = {
            "blocks": n,
            "store_blocks_per_s": n / st_w,
            "store_blocks_per_cpu_s": n / st_c,
            "store_tokens_blocks_per_s": n / stt_w,
            "store_tokens_blocks_per_cpu_s": n / stt_c,
            "lookup_keys_blocks_per_s": n / lk_w,
            "lookup_keys_blocks_per_cpu_s": n / lk_c,
            "lookup_tokens_blocks_per_s": n / lt_w,
            "lookup_tokens_blocks_per_cpu_s": n / lt_c,
            "hash_blocks_per_s": n / hash_w,
            "hash_blocks_per_cpu_s": n / hash_c,
            "lookup_tokens_over_hash_cpu": lt_c / hash_c,
            "floor_hash_us_per_block": hash_w / n * 1e6,
            "floor_hash_cpu_us_per_block": hash_c / n * 1e6,
            **floors,
        }
    return out


def _meta_floors(s, ns, keys: list, prompts: list, timed) -> dict:
    """What bounds the meta rates from below, timed on the store the lookups just ran on (µs, wall and
    thread CPU): the key table's probe alone (``KeyTable.get_many`` of every chain's keys, per block;
    left out where the checkout has no such table) and the fixed cost of a call, a ``lookup_keys``
    of one key and a ``lookup`` of a one-block prompt (the first block of every chain), per call."""
    out: dict = {}
    rows = getattr(getattr(s, "_index", None), "rows", None)
    table = getattr(rows, "table", None)
    if table is not None and hasattr(table, "get_many"):
        w, c, found = timed(lambda: [table.get_many(k) for k in keys])
        if any(int((f < 0).sum()) for f in found):
            raise SystemExit("KeyTable.get_many missed a stored key")
        blocks = sum(len(k) for k in keys)
        out["floor_probe_us_per_block"], out["floor_probe_cpu_us_per_block"] = (
            w / blocks * 1e6,
            c / blocks * 1e6,
        )
    w, c, r = timed(lambda: [s.lookup_keys(k[:1]) for k in keys][-1])
    if r.matched_blocks != 1:
        raise SystemExit(f"lookup_keys of 1 key matched {r.matched_blocks}")
    out["floor_lookup_keys_1_us"], out["floor_lookup_keys_1_cpu_us"] = (
        w / len(keys) * 1e6,
        c / len(keys) * 1e6,
    )
    w, c, r = timed(lambda: [s.lookup(ns, p[:16]) for p in prompts][-1])
    if r.matched_blocks != 1:
        raise SystemExit(f"lookup of a 1-block prompt matched {r.matched_blocks}")
    out["floor_lookup_tokens_1_us"], out["floor_lookup_tokens_1_cpu_us"] = (
        w / len(prompts) * 1e6,
        c / len(prompts) * 1e6,
    )
    return out


def worker_percall(a: dict) -> dict:
    """Per-block cost of 64-block prompts by tokens into and out of the host tier, per block size:
    ``store``, ``lookup`` and ``load`` (into a new buffer) in microseconds of the thread's CPU
    (``time.thread_time``) and of wall time per block, best and median of ``percall_passes``."""
    import numpy as np
    import torch

    from tierstore import KVStore, Namespace, leading_ok

    chain, prompts = 64, a["percall_prompts"]
    out: dict = {}
    for kib in a["percall_kib"]:
        lay = _layout(head_dim=kib * 8, tokens=16, layers=1, heads=2)  # K/V x 2 heads x 16 tokens x fp16
        bb = lay.bytes_per_block
        assert bb == kib * 1024, (bb, kib)
        s = KVStore(lay, host_bytes=(prompts + 1) * chain * bb, device="cpu")
        ns = Namespace(model="percall")
        blk = torch.ones(chain, *lay.block_shape, dtype=lay.dtype)
        rows: dict = {"store": [], "lookup": [], "load": []}
        for p in range(a["percall_passes"]):
            toks = [
                np.arange(chain * 16, dtype=np.int64) + (p * prompts + i) * 10_000_000 for i in range(prompts)
            ]
            for what, fn in (
                ("store", lambda t: s.store(ns, t, blk)),
                ("lookup", lambda t: s.lookup(ns, t)),
                ("load", lambda t: s.load(s.lookup(ns, t))),
            ):
                w0, c0 = time.perf_counter(), time.thread_time()
                res = [fn(t) for t in toks]
                rows[what].append(((time.perf_counter() - w0), (time.thread_time() - c0)))
                if what == "load" and any(leading_ok(st) != chain for st, _ in res):
                    raise SystemExit("a load of a stored prompt missed")
            s.remove([k for t in toks for k in s.keys_for(ns, t)])  # room for the next pass
        s.close()
        nb = chain * prompts
        for what, v in rows.items():
            walls = sorted(w / nb * 1e6 for w, _ in v)
            cpus = sorted(c / nb * 1e6 for _, c in v)
            out[f"{kib}k"] = out.get(f"{kib}k", {})
            out[f"{kib}k"].update(
                {
                    f"{what}_us_per_block_cpu": cpus[0],
                    f"{what}_us_per_block_cpu_median": cpus[len(cpus) // 2],
                    f"{what}_us_per_block_wall": walls[0],
                    f"{what}_us_per_block_wall_median": walls[len(walls) // 2],
                }
            )
    return out


def worker_mem(a: dict) -> dict:
    """Metadata bytes per indexed block at ``mem_blocks`` blocks on NVMe (no data kept)."""
    import resource

    import numpy as np
    import torch

    from tierstore import KVStore, Namespace

    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)
    bb = lay.bytes_per_block
    nblocks = a["mem_blocks"]
    per = 4000  # blocks per extent and per store call
    ext = 4096 + per * 4096
    seg = ext * 4
    cap = (nblocks // per + 64) * ext // seg * seg + 8 * seg
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        from tierstore.io.null import NullEngine
        from tierstore.io.segments import SegmentStorage

        nv = SegmentStorage(
            None,
            cap,
            bb,
            segment_size_bytes=seg,
            engine=NullEngine(cap),
            extent_size_bytes=ext,
            owns_engine=True,
        )
        s = KVStore(lay, nvme=nv)
        blk = torch.zeros(per, bb, dtype=torch.uint8)
        put = lambda keys: s.store_keys(ns, keys, blk)  # noqa: E731
    except ImportError:  # the old core: no NullEngine; a memory engine would hold the data, so a
        # sparse file stands in (its pages are the kernel's, not this process's RSS)
        from tierstore.io import SegmentStorage

        d = tempfile.mkdtemp(dir=a["dir"], prefix="core-mem-")
        nv = SegmentStorage(
            os.path.join(d, "mem.bin"), cap, bb, segment_size_bytes=seg, engine="posix", extent_size_bytes=ext
        )
        s = KVStore(lay, nvme=nv)
        rows = list(torch.zeros(per, bb, dtype=torch.uint8))
        put = lambda keys: s.manager.store(s.digest(ns), keys, rows, None, None, 0)  # noqa: E731
    ns = Namespace(model="mem")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _i in range(0, nblocks, per):
        raw = rng.bytes(32 * per)
        put([raw[j : j + 32] for j in range(0, 32 * per, 32)])
    dt = time.perf_counter() - t0
    stats = s.stats()
    got = stats["blocks"] if "blocks" in stats else len(s.manager.index)  # the old core's entry dict
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "mem_blocks": got,
        "rss_bytes_per_block": (rss1 - rss0) * 1024 / got,
        "fill_s": dt,
        "fill_blocks_per_s": got / dt,
    }
    if "index_bytes" in stats and hasattr(nv, "index_nbytes"):
        out["index_bytes_per_block"] = stats["index_bytes"] / got
        out["nvme_index_bytes_per_block"] = nv.index_nbytes() / got
        out["struct_bytes_per_block"] = (stats["index_bytes"] + nv.index_nbytes()) / got
    return out


def worker_scrape(a: dict) -> dict:
    """Lookups of a pinned, resident prefix while another thread polls ``stats()`` (a metrics
    scrape, back to back) on a store indexing ``scrape_blocks`` NVMe blocks (a NullEngine tier):
    the lookup thread's latency idle vs during the scrapes, and the scraping thread's CPU per
    ``stats()`` call."""
    import threading

    import numpy as np
    import torch

    from tierstore import KVStore, Namespace
    from tierstore.io.null import NullEngine
    from tierstore.io.segments import SegmentStorage

    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)
    bb = lay.bytes_per_block
    nblocks, per = a["scrape_blocks"], 4000
    ext = 4096 + per * 4096
    seg = ext * 4
    cap = (nblocks // per + 64) * ext // seg * seg + 8 * seg
    nv = SegmentStorage(
        None, cap, bb, segment_size_bytes=seg, engine=NullEngine(cap), extent_size_bytes=ext, owns_engine=True
    )
    s = KVStore(lay, nvme=nv, host_bytes=64 * bb, device="cpu")
    ns = Namespace(model="scrape")
    rng = np.random.default_rng(0)
    blk = torch.zeros(per, bb, dtype=torch.uint8)
    for _ in range(0, nblocks, per):
        raw = rng.bytes(32 * per)
        s.store_keys(ns, [raw[j : j + 32] for j in range(0, 32 * per, 32)], blk)
    hot = np.arange(8 * 16)
    s.store(ns, hot, torch.zeros(8, bb, dtype=torch.uint8))
    s.pin(ns, hot, lease_s=3600)

    def probe(seconds: float, lat: list, stop=None) -> None:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and not (stop is not None and stop.is_set()):
            t0 = time.perf_counter_ns()
            r = s.lookup(ns, hot)
            lat.append(time.perf_counter_ns() - t0)
            if r.matched_blocks != 8:
                raise SystemExit(f"the pinned prefix was not found ({r.matched_blocks} blocks)")

    idle: list = []
    probe(a["idle_s"], idle)
    busy: list = []
    stop = threading.Event()
    cpu: list = []

    def scraper() -> None:
        t_end = time.perf_counter() + a["idle_s"]
        while time.perf_counter() < t_end:
            c0 = time.thread_time()
            s.stats()
            cpu.append(time.thread_time() - c0)
        stop.set()

    t = threading.Thread(target=scraper)
    t.start()
    probe(3600, busy, stop)
    t.join()
    blocks = s.stats()["blocks"]
    s.close()

    def summ(x):
        v = np.asarray(x, dtype=np.int64)
        return {
            "n": int(v.size),
            "p50_us": float(np.percentile(v, 50)) / 1e3,
            "p99_us": float(np.percentile(v, 99)) / 1e3,
            "p999_us": float(np.percentile(v, 99.9)) / 1e3,
            "max_ms": float(v.max()) / 1e6,
            "over_5ms": int((v > 5_000_000).sum()),
        }

    return {
        "idle": summ(idle),
        "busy": summ(busy),
        "blocks": blocks,
        "scrapes": len(cpu),
        "stats_cpu_ms_median": 1e3 * statistics.median(cpu),
        "stats_cpu_ms_max": 1e3 * max(cpu),
        "p999_busy_over_idle": summ(busy)["p999_us"] / summ(idle)["p999_us"],
    }


def worker_reclaim(a: dict) -> dict:
    """Lookups of a pinned, resident prefix while another thread stores 256-block batches of
    64 B blocks into a full NVMe tier (a NullEngine tier of 8 segments of ~15.6k blocks), so
    that every few batches a region is evicted: the lookup thread's latency idle vs during
    ``reclaim_regions`` region evictions."""
    import threading

    import numpy as np
    import torch

    from tierstore import KVStore, Namespace
    from tierstore.io.null import NullEngine
    from tierstore.io.segments import SegmentStorage

    lay = _layout(head_dim=1, tokens=16, layers=1, heads=1)
    bb = lay.bytes_per_block
    per, batch = 4000, 256
    ext = 4096 + per * 4096
    seg = ext * 4
    cap = 8 * seg
    nv = SegmentStorage(
        None, cap, bb, segment_size_bytes=seg, engine=NullEngine(cap), extent_size_bytes=ext, owns_engine=True
    )
    s = KVStore(lay, nvme=nv, host_bytes=64 * bb, device="cpu")
    ns = Namespace(model="reclaim")
    rng = np.random.default_rng(0)
    blk = torch.zeros(batch, bb, dtype=torch.uint8)

    def put() -> None:
        raw = rng.bytes(32 * batch)
        s.store_keys(ns, [raw[j : j + 32] for j in range(0, 32 * batch, 32)], blk)

    while nv.stats().get("regions_evicted", 0) == 0:  # full: every later store evicts in turn
        put()
    hot = np.arange(8 * 16)
    s.store(ns, hot, torch.zeros(8, bb, dtype=torch.uint8))
    s.pin(ns, hot, lease_s=3600)

    def probe(seconds: float, lat: list, stop=None) -> None:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and not (stop is not None and stop.is_set()):
            t0 = time.perf_counter_ns()
            r = s.lookup(ns, hot)
            lat.append(time.perf_counter_ns() - t0)
            if r.matched_blocks != 8:
                raise SystemExit(f"the pinned prefix was not found ({r.matched_blocks} blocks)")

    idle: list = []
    probe(a["idle_s"], idle)
    busy: list = []
    stop = threading.Event()
    ev0 = nv.stats()["regions_evicted"]

    def writer() -> None:
        try:
            while nv.stats()["regions_evicted"] - ev0 < a["reclaim_regions"]:
                put()
        finally:
            stop.set()

    t = threading.Thread(target=writer)
    t0 = time.perf_counter()
    t.start()
    probe(3600, busy, stop)
    t.join()
    dt = time.perf_counter() - t0
    regions = nv.stats()["regions_evicted"] - ev0
    s.close()

    def summ(x):
        v = np.asarray(x, dtype=np.int64)
        return {
            "n": int(v.size),
            "p50_us": float(np.percentile(v, 50)) / 1e3,
            "p99_us": float(np.percentile(v, 99)) / 1e3,
            "p999_us": float(np.percentile(v, 99.9)) / 1e3,
            "max_ms": float(v.max()) / 1e6,
            "over_5ms": int((v > 5_000_000).sum()),
            "over_20ms": int((v > 20_000_000).sum()),
        }

    return {
        "idle": summ(idle),
        "busy": summ(busy),
        "regions_evicted": regions,
        "busy_s": dt,
        "p999_busy_over_idle": summ(busy)["p999_us"] / summ(idle)["p999_us"],
    }


WORKERS = {
    "stall": worker_stall,
    "nvme": worker_nvme,
    "frag": worker_frag,
    "meta": worker_meta,
    "percall": worker_percall,
    "mem": worker_mem,
    "scrape": worker_scrape,
    "reclaim": worker_reclaim,
}


# =============================================================================== driver
def run_worker(
    root: str,
    part: str,
    args: dict,
    timeout_s: float,
    python: str = sys.executable,
    script: str = __file__,
    extra_path: tuple[str, ...] = (),
) -> dict:
    """``script --worker part ARGS`` in a fresh ``python`` whose ``PYTHONPATH`` is ``root`` (then
    ``extra_path``), cwd ``root``; returns the JSON of its last stdout line, or ``{"error": stderr tail}``
    (a non-zero exit or ``timeout_s`` passed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((root, *extra_path)))
    try:
        r = subprocess.run(
            [python, os.path.abspath(script), "--worker", part, json.dumps(args)],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    if r.returncode != 0:
        return {"error": r.stderr[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def lmcache(py: str, d: str, total: int) -> dict:
    helper = os.path.join(HERE, "lmcache_helper.py")
    r = subprocess.run(
        [py, helper, "--dir", d, "--total-bytes", str(total), "--chunk-bytes", str(4 << 20), "--runs", "1"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"store_gbps": res["total_bytes"] / res["write_s"][0] / 1e9}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def _stat(vals: list) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("PART", "ARGS"))
    ap.add_argument("--base", help="a checkout of the old core to compare against")
    ap.add_argument("--parts", default="stall,nvme,frag,meta,mem")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--stall-bytes", type=int, default=1 << 30)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--nvme-bytes", type=int, default=512 << 20)
    ap.add_argument("--frag-blocks", type=int, default=64)
    ap.add_argument("--chains", default="64,256")
    ap.add_argument("--meta-ops", type=int, default=200_000)
    ap.add_argument("--percall-kib", default="16,128,2048", help="block sizes (KiB) of the percall part")
    ap.add_argument("--percall-prompts", type=int, default=4, help="64-block prompts a percall pass stores")
    ap.add_argument("--percall-passes", type=int, default=5)
    ap.add_argument("--mem-blocks", type=int, default=10_000_000)
    ap.add_argument(
        "--scrape-blocks", type=int, default=1_000_000, help="blocks indexed on NVMe in the scrape part"
    )
    ap.add_argument("--reclaim-regions", type=int, default=6, help="region evictions in the reclaim part")
    ap.add_argument("--mem-runs", type=int, default=1, help="runs of the mem part (deterministic sizes)")
    ap.add_argument("--base-mem-blocks", type=int, default=200_000)
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per worker")
    ap.add_argument(
        "--lmcache-python", default=os.environ.get("LMCACHE_PYTHON", "/tmp/lmcache-venv/bin/python")
    )
    ap.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="also measure every part but mem with N competing processes spinning on the CPUs",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        part, args = a.worker
        print(json.dumps(WORKERS[part](json.loads(args))))
        return
    wargs = {
        "dir": a.dir,
        "stall_bytes": a.stall_bytes,
        "idle_s": a.idle_s,
        "nvme_bytes": a.nvme_bytes,
        "frag_blocks": a.frag_blocks,
        "chains": [int(c) for c in a.chains.split(",")],
        "meta_ops": a.meta_ops,
        "percall_kib": [int(k) for k in a.percall_kib.split(",")],
        "percall_prompts": a.percall_prompts,
        "percall_passes": a.percall_passes,
        "mem_blocks": a.mem_blocks,
        "scrape_blocks": a.scrape_blocks,
        "reclaim_regions": a.reclaim_regions,
    }
    codes = [("new", ROOT)] + ([("base", os.path.abspath(a.base))] if a.base else [])
    use_lmc = os.path.exists(a.lmcache_python)
    results: dict = {}
    started = time.time()
    for part in a.parts.split(","):
        rows: dict = {name: [] for name, _ in codes}
        if part == "nvme" and use_lmc:
            rows["lmcache"] = []
        runs = a.mem_runs if part == "mem" else a.runs
        modes = ["quiet", "busy"] if a.busy and part != "mem" else ["quiet"]
        for run in range(runs):
            order = codes if run % 2 == 0 else codes[::-1]  # ABBA
            got: dict = {name: {} for name, _ in codes}
            for mode in modes:
                from tierstore.bench.busy import competitors  # here: a --base tree may lack it

                with competitors(a.busy if mode == "busy" else 0):
                    for k, (name, root) in enumerate(order):
                        wa = dict(wargs, run=run)
                        if part == "mem" and name == "base":
                            # the old core fills an NVMe-only store at ~300 blocks/s here: 200k blocks
                            # (the issue measured ~0.9 KB a block at 1M)
                            wa["mem_blocks"] = min(a.mem_blocks, a.base_mem_blocks)
                        r = run_worker(root, part, wa, a.timeout_s)
                        r["loadavg_1m"] = os.getloadavg()[0]
                        got[name][mode] = r
                        print(
                            f"[{time.time() - started:7.0f} s] {part} run {run} {mode} {name}: "
                            f"{json.dumps(r)[:400]}",
                            file=sys.stderr,
                            flush=True,
                        )
                        if part == "nvme" and use_lmc and k == 0 and mode == "quiet":  # LMCache between them
                            rows["lmcache"].append(lmcache(a.lmcache_python, a.dir, a.nvme_bytes))
                            print(
                                f"[{time.time() - started:7.0f} s] nvme run {run} lmcache: "
                                f"{rows['lmcache'][-1]}",
                                file=sys.stderr,
                                flush=True,
                            )
            for name, by_mode in got.items():  # one mode: the row as before; both: {"quiet": .., "busy": ..}
                errs = [r["error"] for r in by_mode.values() if "error" in r]
                row = by_mode if len(modes) > 1 else by_mode["quiet"]
                rows[name].append({"error": errs[0]} if errs else row)
        results[part] = rows
    summary: dict = {}
    for part, rows in results.items():
        for name, runs in rows.items():
            flat = [_flat(r) for r in runs if "error" not in r]
            for key in sorted({k for f in flat for k in f}):
                vals = [f[key] for f in flat if key in f]
                summary[f"{part}.{name}.{key}"] = _stat(vals)
    # ratios of paired runs (both sides measured back to back in the same run)
    paired = {}

    def pair(label, a_rows, a_key, b_rows, b_key):
        vals = []
        for x, y in zip(a_rows, b_rows):
            fx, fy = _flat(x), _flat(y)
            if a_key in fx and b_key in fy and fy[b_key]:
                vals.append(fx[a_key] / fy[b_key])
        if vals:
            paired[label] = _stat(vals)

    res = results
    if "nvme" in res and "lmcache" in res["nvme"]:
        pair(
            "nvme.new_kvstore_4m_over_lmcache",
            res["nvme"]["new"],
            ("quiet." if a.busy else "") + "4096k.kvstore_gbps",
            res["nvme"]["lmcache"],
            "store_gbps",
        )
    if a.base:
        for part, keys in (
            ("meta", [k for k in summary if k.startswith("meta.new.") and "per_" in k]),
            ("percall", [k for k in summary if k.startswith("percall.new.") and "per_block" in k]),
            ("nvme", [k for k in summary if k.startswith("nvme.new.") and k.endswith("_gbps")]),
            ("frag", [k for k in summary if k.startswith("frag.new.") and k.endswith("_gbps")]),
        ):
            if part not in res:
                continue
            for k in keys:
                sub = k.split(".", 2)[2]
                if sub.startswith("loadavg"):
                    continue
                pair(f"{part}.new_over_base.{sub}", res[part]["new"], sub, res[part]["base"], sub)
    for k, v in {**summary, **{f"ratio.{k}": v for k, v in paired.items()}}.items():
        print(f"{k:70s} {v['median']:14.4g}  [{v['min']:.4g}, {v['max']:.4g}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "args": vars(a),
                    "raw": results,
                    "summary": summary,
                    "paired_ratios": paired,
                    "loadavg_at_end": os.getloadavg(),
                    "elapsed_s": time.time() - started,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
