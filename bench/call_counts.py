#!/usr/bin/env python3
"""Python-level calls per 64-block call through the public API: a load-independent figure of
per-block Python work (issue 25 item 2).

``cProfile`` counts every call the interpreter makes (Python functions and C functions called
from Python; not C calling C, e.g. ``map(od.move_to_end, keys)`` counts once). Runs ``store``
and ``lookup`` by tokens and ``lookup_keys`` of ``--prompts`` 64-block prompts of 64 B blocks
into a host tier (embedded defaults) after a warm-up, and prints one JSON line of calls per call.
Run it with ``PYTHONPATH`` set to each checkout to compare them.

Example::

    PYTHONPATH=/tmp/base python bench/call_counts.py; PYTHONPATH=$PWD python bench/call_counts.py
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--chain", type=int, default=64, help="blocks a prompt")
    a = ap.parse_args()
    import numpy as np
    import torch

    from tierstore import KVStore, Namespace
    from tierstore.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, tokens_per_block=16)
    chain, n = a.chain, a.prompts
    s = KVStore(lay, host_bytes=(chain * (n + 20) + chain) * lay.bytes_per_block, device="cpu")
    ns = Namespace(model="calls")
    blk = torch.zeros(chain, *lay.block_shape, dtype=lay.dtype)
    prompts = [np.arange(chain * 16, dtype=np.int64) + i * 10_000_000 for i in range(n + 20)]
    for p in prompts[n:]:  # warm-up: every path taken once before counting
        s.store(ns, p, blk)
        s.lookup(ns, p)
        s.lookup_keys(s.keys_for(ns, p))
    keys = [s.keys_for(ns, p) for p in prompts[:n]]
    out = {}
    for what, fn in (
        ("store_tokens", lambda i: s.store(ns, prompts[i], blk)),
        ("lookup_tokens", lambda i: s.lookup(ns, prompts[i])),
        ("lookup_keys", lambda i: s.lookup_keys(keys[i])),
    ):
        pr = cProfile.Profile()
        pr.enable()
        for i in range(n):
            fn(i)
        pr.disable()
        out[f"{what}_calls_per_call"] = pstats.Stats(pr).total_calls / n
    s.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
