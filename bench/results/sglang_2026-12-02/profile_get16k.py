"""cProfile of ``HiCacheTierStore.batch_get_v1`` on 16 KiB (or 128 KiB) pages from the host tier.

Builds the benchmark's 16KiB pool (Llama-3.1-8B, TP=8 rank, page size 1,
``page_first``), stores 4,096 pages into a host tier that holds them all, then
profiles one pass of ``batch_get_v1`` in SGLang's batches of 128 pages and
prints the top functions by own time and by cumulative time, plus the wall
time per page. Run from the repository root::

    .nox/sglang/bin/python bench/results/sglang_2026-12-02/profile_get16k.py
    PROFILE_CLASS=128KiB .nox/sglang/bin/python bench/results/sglang_2026-12-02/profile_get16k.py

(``PROFILE_CLASS=128KiB``: 1,024 pages of the benchmark's 128KiB class.)
"""
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import sglang_bench as sb  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
CLS = os.environ.get("PROFILE_CLASS", "16KiB")
N = {"16KiB": 4096, "128KiB": 1024}[CLS]
pool = sb.make_pool(CLS, N)
page_bytes = pool.get_size_per_token() * pool.page_size
d = tempfile.mkdtemp(dir=os.environ.get("PROFILE_DIR", "/work/wt-sglang"))
extra = {"backend_name": "tierstore", "module_path": "tierstore.integrations.sglang",
         "class_name": "HiCacheTierStore", "interface_v1": 1,
         "tiers": {"host": {"capacity_bytes": (N + 64) * page_bytes},
                   "nvme": {"path": d, "capacity_bytes": 2 * N * page_bytes + (256 << 20)}},
         "policies": {"promotion": "none"}}
b = sb.HiCacheTierStore(sb.storage_config(extra), {})
b.register_mem_pool_host(pool)
p = sb.Pass("ts_mem", pool, b, True, d)
keys = sb.page_keys(N, "profile")
p.set_all(keys)
p.get_all(keys)  # warm-up
t = p.get_all(keys)
print(f"unprofiled get: {t * 1e6 / N:.1f} us/page, {N * page_bytes / t / 1e9:.3f} GB/s; loadavg {os.getloadavg()}")
pr = cProfile.Profile()
pr.enable()
p.get_all(keys)
pr.disable()
st = pstats.Stats(pr)
print(f"profiled calls: {N} pages in {N // 128} batch_get_v1 calls")
st.sort_stats("tottime").print_stats(18)
st.sort_stats("cumulative").print_stats(30)
b.close()
shutil.rmtree(d, ignore_errors=True)
