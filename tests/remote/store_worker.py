"""A KVStore with the shared remote tier, in its own process (tests/remote/test_store_sharing.py).

argv[1]: JSON ``{"remote": RemoteConfig fields, "host_blocks": int, "tenant": str}``.
Line protocol on stdin/stdout (one JSON object per line), as tests/remote/worker.py:
``{"op": "store", "prompts": [[seed, nblocks], ...]}`` stores each prompt
(deterministic tokens and KV from its seed) and waits until the publish queue is empty;
``{"op": "lookup", "prompts": [...]}`` looks each prompt up, loads the useful prefix,
checks every byte, and answers the matched/loaded block counts and the tiers;
``{"op": "stats"}``; ``{"op": "exit"}``.
"""
import json
import sys

import numpy as np
import torch

from tierstore import KVStore, KVLayout, Namespace, Status
from tierstore.api import leading_ok

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, tokens_per_block=16)


def prompt(seed: int, nblocks: int):
    tokens = np.random.default_rng(seed).integers(0, 30000, nblocks * LAYOUT.tokens_per_block)
    kv = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal(
        (nblocks, *LAYOUT.block_shape)).astype(np.float16))
    return tokens, kv


def main() -> None:
    opts = json.loads(sys.argv[1])
    ns = Namespace(model="shared-model@1", tenant=opts.get("tenant", "acme"))
    store = KVStore.from_config({"tiers": {"host": {"capacity_bytes": opts.get("host_blocks", 64) * LAYOUT.bytes_per_block}},
                                 "policies": {"promotion": "none"}, "remote": opts["remote"]}, LAYOUT)
    print(json.dumps({"ready": store.remote.state}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "store":
            st = [store.store(ns, *prompt(s, n)) for s, n in cmd["prompts"]]
            store.remote.flush(30)
            out = {"ok": sum(x is Status.OK for s in st for x in s)}
        elif op == "lookup":
            res = []
            for s, n in cmd["prompts"]:
                tokens, kv = prompt(s, n)
                hit = store.lookup(ns, tokens)
                statuses, blocks = store.load(hit.keys)
                k = leading_ok(statuses)
                wrong = sum(not torch.equal(blocks[i], kv[i]) for i in range(k))
                res.append({"matched": hit.matched_blocks, "loaded": k, "wrong": wrong,
                            "tiers": [t.label for t in hit.tiers]})
            out = {"results": res}
        elif op == "stats":
            out = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    main()
