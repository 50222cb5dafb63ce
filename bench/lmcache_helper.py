"""Drive LMCache's LocalDiskBackend (lmcache 0.5.6) for bench/io_bench.py.

Runs under LMCache's own venv (``/work/lmcache-venv/bin/python``), never under
tierstore's. One file per chunk, written by LMCache's disk worker pool
(``disk_io_threads``, default 4) with ``extra_config.use_odirect=True``; loads
use ``batched_get_blocking`` (its read thread pool). Prints one JSON object:
``{"write_s": [...], "read_s": [...], "total_bytes": N, "chunk_bytes": C}``.
"""

import argparse
import asyncio
import json
import mmap
import os
import shutil
import sys
import threading
import time

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--total-bytes", type=int, required=True)
    ap.add_argument("--chunk-bytes", type=int, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    n = a.total_bytes // a.chunk_bytes
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    write_s, read_s = [], []
    for run in range(a.runs):
        d = os.path.join(a.dir, f"lmc-{run}")
        os.makedirs(d, exist_ok=True)
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=(2 * a.total_bytes) / 2**30 + 0.5,
            local_disk=f"file://{d}/",
            max_local_disk_size=(2 * a.total_bytes) / 2**30,
            extra_config={"use_odirect": True, "disk_io_threads": a.threads},
        )
        # Page-aligned host memory (as LMCache's pinned allocators give on GPU
        # hosts): its O_DIRECT path needs aligned buffers, torch.empty is not.
        arena = mmap.mmap(-1, 2 * a.total_bytes + (64 << 20))
        alloc = TensorMemoryAllocator(torch.frombuffer(arena, dtype=torch.uint8))
        cpu = LocalCPUBackend(cfg, memory_allocator=alloc)
        disk = LocalDiskBackend(cfg, loop, cpu, "cpu")
        shape = torch.Size([a.chunk_bytes // 2])
        objs, keys = [], []
        for i in range(n):
            o = alloc.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if o is None:
                sys.exit("LMCache allocation failed")
            o.tensor.view(torch.uint8).fill_(i & 0xFF)
            objs.append(o)
            keys.append(CacheEngineKey("bench", 1, 0, run * 10**9 + i, torch.bfloat16))
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
        for _ in range(n):
            done.acquire()
        write_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = disk.batched_get_blocking(keys)
        read_s.append(time.perf_counter() - t0)
        if any(g is None for g in got):
            sys.exit("LMCache load returned a miss")
        if int(got[-1].tensor.view(torch.uint8)[0]) != (n - 1) & 0xFF:
            sys.exit("LMCache load returned wrong bytes")
        for g in got:
            g.ref_count_down()
        disk.close()
        del objs, got
        shutil.rmtree(d, ignore_errors=True)
    print(
        json.dumps(
            {
                "write_s": write_s,
                "read_s": read_s,
                "total_bytes": n * a.chunk_bytes,
                "chunk_bytes": a.chunk_bytes,
                "threads": a.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
