"""SGLang HiCache L3: tierstore's backend vs SGLang's built-in HiCacheFile, same file system, same run.

Both backends run under SGLang 0.5.23's own controller code paths, on one
``MHATokenToKVPoolHost`` (layout ``page_first``, bf16) that holds the source
pages and the load destinations:

* tierstore (``HiCacheTierStore``, ``interface_v1=1``):
  ``HiCacheController._page_set_zero_copy`` -> ``batch_set_v1`` and
  ``HiCacheController._page_get_zero_copy`` -> ``batch_get_v1``.
* HiCacheFile (the ``file`` backend, which SGLang runs on its copying path):
  ``HiCacheController._generic_page_set`` -> ``get_data_page`` + ``batch_set``
  and ``HiCacheController._generic_page_get`` -> ``batch_get`` into dummy
  pages + ``set_from_flat_data_page``.

Pages go in batches of SGLang's ``STORAGE_BATCH_SIZE`` (128). Page classes
(Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16; its config.json):

=======  ==============================  ===========
class    what it is                       page bytes
=======  ==============================  ===========
16KiB    TP=8 rank (1 KV head), page 1   16 KiB
128KiB   TP=1, page 1                    128 KiB
2MiB     TP=1, page 16                   2 MiB
=======  ==============================  ===========

What each side does with memory and the file system (stated, not hidden):

* HiCacheFile writes one file per page through the page cache
  (``numpy.tofile`` to a temp file, ``os.replace``) and never fsyncs: a set
  returns when the bytes are in the page cache. It reads with buffered
  ``readinto``. "+syncfs" adds the ``syncfs(2)`` that makes its files durable
  (the write-back the kernel otherwise does later, outside the timing).
* tierstore writes with O_DIRECT into 16 MiB extents of a log-structured
  segment file and fdatasyncs before a put returns; its host tier takes pages
  first and demotes them to NVMe in batches. It reads NVMe with O_DIRECT and
  checks each page's CRC32C. ``promotion: none``: a page SGLang loads goes to
  SGLang's L2, not also into tierstore's host tier.

So each run measures two pairs, each side with the same kind of memory:

* **DRAM** -- ``ts_mem`` (tierstore whose host tier holds all the data)
  against HiCacheFile with its files in the page cache: set, and get right
  after it.
* **disk** -- ``ts_nvme`` (host tier ``--host-fraction`` of the data, 1/8 by
  default, so 7/8 of the pages are written to and read from NVMe; the share
  read from NVMe is printed as ``nvme_share``) against HiCacheFile made durable
  (set + ``syncfs``) and read cold (after ``sync`` and
  ``posix_fadvise(DONTNEED)`` on every page file).

Method: each run does one pass per side (fresh directory; set all pages, get
all pages; every loaded page is compared with its source); odd runs reverse
the order (``ts_mem, file, ts_nvme`` / ``ts_nvme, file, ts_mem``), and every
timed phase starts after ``sync`` and ``--settle`` idle seconds (a get's destinations are
zeroed before them, not inside them: since session 40, also the warm HiCacheFile get). Tables give
the median of the runs with min and max; ratios are computed per run. Beside each get's wall
time, the calling thread's CPU time of the same get (``time.thread_time``, ``*_cpu_us_per_page``):
the part of the wall that the host's other load does not add (preemption shows as wall minus CPU). Torch's
threading is left as a user would have it; ``--threads`` sets it only when given
(tierstore's own copies decide their threads in ``tierstore.io.copies``).

Run (inside the ``sglang`` nox environment; see bench/README_sglang.md; without torchvision,
with ``PYTHONPATH=tests/integrations/sglang/stubs``)::

    .nox/sglang/bin/python bench/sglang_bench.py --runs 5 --json bench/sglang_results.json
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

if importlib.util.find_spec("torchvision") is None:  # SGLang's configs import torchvision.transforms
    sys.exit(
        "sglang_bench: SGLang imports torchvision, which is not installed here; install it, or put the "
        "test stand-in first: PYTHONPATH=tests/integrations/sglang/stubs (see its README.md)"
    )

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from tierstore.integrations.sglang import HiCacheTierStore
from tierstore.units import parse_size

#: name -> (layers, KV heads, head_dim, page_size); bf16
CLASSES = {"16KiB": (32, 1, 128, 1), "128KiB": (32, 8, 128, 1), "2MiB": (32, 8, 128, 16)}
GB = 1e9
_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str) -> None:
    """``syncfs(2)`` on the file system holding ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


def drop_file_cache(directory: str) -> None:
    """Write back, then drop from the page cache, every file in ``directory``."""
    os.sync()
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_pool(cls: str, n_pages: int) -> MHATokenToKVPoolHost:
    """SGLang's host pool with room for ``2 * n_pages`` pages (sources, destinations)."""
    layers, heads, head_dim, page = CLASSES[cls]
    dev = MHATokenToKVPool(
        size=page * 4,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )
    pool = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        page,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=page * 4,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=2 * n_pages * page,
    )
    g = torch.Generator().manual_seed(0)
    u8 = pool.kv_buffer.view(torch.uint8)
    for kv in range(2):
        u8[kv].copy_(torch.randint(0, 256, u8[kv].shape, dtype=torch.uint8, generator=g))
    return pool


def storage_config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="meta-llama/Llama-3.1-8B",
        extra_config=extra,
    )


def page_keys(n: int, tag: str) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class Pass:
    """One backend's pass: set every page, get them warm, get them cold."""

    def __init__(self, name: str, pool, backend, zero_copy: bool, directory: str):
        self.name, self.pool, self.b, self.zero_copy, self.dir = name, pool, backend, zero_copy, directory
        self.ctl = types.SimpleNamespace(
            storage_backend=backend, storage_host_pool=pool, page_size=pool.page_size
        )
        self.op = types.SimpleNamespace(request_id="bench", is_terminated=lambda: False)
        self.get_cpu_s = 0.0  # the calling thread's CPU time of the last get_all (time.thread_time)

    def _idx(self, first_page: int, n: int) -> torch.Tensor:
        p = self.pool.page_size
        return torch.arange(first_page * p, (first_page + n) * p, dtype=torch.int64)

    def set_all(self, keys: list[str]) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(keys), STORAGE_BATCH_SIZE):
            kb = keys[i : i + STORAGE_BATCH_SIZE]
            idx = self._idx(i, len(kb))
            info = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
            ok = (
                HiCacheController._page_set_zero_copy(self.ctl, kb, idx, info)
                if self.zero_copy
                else HiCacheController._generic_page_set(self.ctl, kb, idx, info)
            )
            if not ok:
                raise RuntimeError(f"{self.name}: set of batch {i // STORAGE_BATCH_SIZE} failed")
        return time.perf_counter() - t0

    def clear_destinations(self, n: int) -> None:
        """Zero the load destinations of ``n`` pages (so the check after a get sees what it loaded).

        Done before a get's ``sync`` and settle, not right before its timing: a 32 MiB ``zero_`` is
        one of torch's OpenMP parallel regions, and measured right before the timed loop it cost the
        get ~1 us a page of waiting (wall minus the thread's CPU, median; bench/README_sglang.md,
        session 40) that an engine's load does not pay."""
        self.pool.kv_buffer[:, n * self.pool.page_size :].zero_()

    def get_all(self, keys: list[str]) -> float:
        """Load every page into the destinations (cleared beforehand by :meth:`clear_destinations`),
        timed; check them against their sources (untimed)."""
        n = len(keys)
        dst = self.pool.kv_buffer[:, n * self.pool.page_size :]
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(0, n, STORAGE_BATCH_SIZE):
            kb = keys[i : i + STORAGE_BATCH_SIZE]
            idx = self._idx(n + i, len(kb))
            info = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
            got = (
                HiCacheController._page_get_zero_copy(self.ctl, self.op, kb, idx, info)
                if self.zero_copy
                else HiCacheController._generic_page_get(self.ctl, self.op, kb, idx, info)
            )
            if got != len(kb):
                raise RuntimeError(
                    f"{self.name}: get of batch {i // STORAGE_BATCH_SIZE} loaded {got}/{len(kb)}"
                )
        dt, self.get_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        src = self.pool.kv_buffer[:, : n * self.pool.page_size]
        if not torch.equal(src.view(torch.uint8), dst.view(torch.uint8)):
            raise RuntimeError(f"{self.name}: loaded pages differ from their sources")
        return dt


def run_pass(name: str, cls: str, pool, n_pages: int, root: str, args) -> dict:
    """One pass of ``name``: ``ts_mem`` (tierstore, host tier larger than the data),
    ``ts_nvme`` (tierstore, host tier ``--host-fraction`` of the data) or ``file``."""
    d = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
    page_bytes = pool.get_size_per_token() * pool.page_size
    total = n_pages * page_bytes
    keys = page_keys(n_pages, f"{cls}/{time.monotonic_ns()}")
    try:
        if name.startswith("ts_"):
            host = (
                total + 64 * page_bytes
                if name == "ts_mem"
                else max(page_bytes, int(total * args.host_fraction))
            )
            extra = {
                "backend_name": "tierstore",
                "module_path": "tierstore.integrations.sglang",
                "class_name": "HiCacheTierStore",
                "interface_v1": 1,
                "tiers": {
                    "host": {"capacity_bytes": host},
                    "nvme": {"path": d, "capacity_bytes": 2 * total + (256 << 20)},
                },
                "policies": {"promotion": "none"},
            }
            b = HiCacheTierStore(storage_config(extra), {})
            b.register_mem_pool_host(pool)
            zero_copy = True
        else:
            b = HiCacheFile(storage_config({"file_storage_path": d}))
            b.register_mem_pool_host(pool)
            zero_copy = False
        p = Pass(name, pool, b, zero_copy, d)
        os.sync()
        time.sleep(args.settle)
        set_s = p.set_all(keys)
        out = {"set_GBps": total / set_s / GB}
        if name == "file":
            t0 = time.perf_counter()
            syncfs(d)
            out["set_syncfs_GBps"] = total / (set_s + time.perf_counter() - t0) / GB
            p.clear_destinations(n_pages)
            os.sync()
            time.sleep(args.settle)
            out["get_warm_GBps"] = total / p.get_all(keys) / GB
            out["get_warm_cpu_us_per_page"] = p.get_cpu_s / n_pages * 1e6
            p.clear_destinations(n_pages)
            drop_file_cache(d)
            time.sleep(args.settle)
            out["get_cold_GBps"] = total / p.get_all(keys) / GB
            return out
        p.clear_destinations(n_pages)
        os.sync()
        time.sleep(args.settle)
        out["get_GBps"] = total / p.get_all(keys) / GB
        out["get_cpu_us_per_page"] = p.get_cpu_s / n_pages * 1e6
        s = b.store.stats()
        nv, host = s.get("load_bytes_nvme", 0), s.get("load_bytes_host", 0)
        out["nvme_share"] = nv / (nv + host) if nv + host else 0.0
        b.close()
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def summary(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", default="16KiB,128KiB,2MiB", help=f"page classes, of {list(CLASSES)}")
    ap.add_argument("--total", default="256m", help="bytes of pages per pass (each class)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the benchmark directories")
    ap.add_argument(
        "--host-fraction",
        type=float,
        default=0.125,
        help="tierstore host tier as a fraction of the data (a write buffer)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (torch.set_num_threads); default: torch's own setting, left alone",
    )
    ap.add_argument("--settle", type=float, default=1.0, help="idle seconds before each timed phase")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads is not None:  # only when asked: tierstore decides its copies' threads itself
        torch.set_num_threads(args.threads)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    total = parse_size(args.total, "total")
    results: dict = {
        "config": {
            **vars(args),
            "total_bytes": total,
            "batch_pages": STORAGE_BATCH_SIZE,
            "loadavg_start": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
        },
        "classes": {},
    }
    for cls in args.classes.split(","):
        layers, heads, head_dim, page = CLASSES[cls]
        page_bytes = 2 * layers * heads * head_dim * 2 * page
        n_pages = max(1, total // page_bytes)
        pool = make_pool(cls, n_pages)
        runs = []
        for r in range(args.runs):
            order = ["ts_mem", "file", "ts_nvme"] if r % 2 == 0 else ["ts_nvme", "file", "ts_mem"]
            one = {name: run_pass(name, cls, pool, n_pages, args.dir, args) for name in order}
            runs.append(one)
            m, f, n = one["ts_mem"], one["file"], one["ts_nvme"]
            print(
                f"[{cls} run {r + 1}/{args.runs} {'/'.join(order)}] "
                f"DRAM: set {m['set_GBps']:.3f} vs {f['set_GBps']:.3f}, get {m['get_GBps']:.3f} vs "
                f"{f['get_warm_GBps']:.3f} GB/s | disk: set {n['set_GBps']:.3f} vs "
                f"{f['set_syncfs_GBps']:.3f}, "
                f"get {n['get_GBps']:.3f} vs {f['get_cold_GBps']:.3f} GB/s (tierstore nvme_share "
                f"{n['nvme_share']:.2f}, ts_mem {m['nvme_share']:.2f})",
                flush=True,
            )
        del pool
        cls_out = {
            "page_bytes": page_bytes,
            "pages": n_pages,
            "runs": runs,
            "bandwidth_GBps": {},
            "cpu_us_per_page": {},  # the calling thread's CPU of each get
            "ratios": {},
        }
        for name in ("ts_mem", "ts_nvme", "file"):
            for k in runs[0][name]:
                kind = "cpu_us_per_page" if k.endswith("cpu_us_per_page") else "bandwidth_GBps"
                cls_out[kind][f"{name}_{k}"] = summary([x[name][k] for x in runs])
        pairs = {
            "set, DRAM: ts_mem vs HiCacheFile (page cache)": ("ts_mem", "set_GBps", "set_GBps"),
            "get, DRAM: ts_mem vs HiCacheFile warm": ("ts_mem", "get_GBps", "get_warm_GBps"),
            "set, disk: ts_nvme vs HiCacheFile+syncfs": ("ts_nvme", "set_GBps", "set_syncfs_GBps"),
            "get, disk: ts_nvme vs HiCacheFile cold": ("ts_nvme", "get_GBps", "get_cold_GBps"),
            "(ref) set: ts_nvme vs HiCacheFile (page cache)": ("ts_nvme", "set_GBps", "set_GBps"),
        }
        for label, (who, a, b) in pairs.items():
            cls_out["ratios"][label] = summary([x[who][a] / x["file"][b] for x in runs])
        results["classes"][cls] = cls_out
        print(
            f"\n{cls} pages ({page_bytes} B, {n_pages} pages per pass), median (min-max) of {args.runs} runs:"
        )
        for k, v in cls_out["bandwidth_GBps"].items():
            print(f"  {k:28s} {v['median']:7.3f} ({v['min']:.3f}-{v['max']:.3f})")
        for k, v in cls_out["cpu_us_per_page"].items():
            print(f"  {k:36s} {v['median']:7.2f} us ({v['min']:.2f}-{v['max']:.2f})")
        for k, v in cls_out["ratios"].items():
            print(f"  {k:48s} {v['median']:6.2f}x ({v['min']:.2f}-{v['max']:.2f})")
        print(flush=True)
    results["config"]["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
