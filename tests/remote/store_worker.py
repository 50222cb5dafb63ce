"""A KVStore with the shared remote tier, in its own process (tests/remote/test_store_sharing.py).

argv[1]: JSON ``{"remote": RemoteConfig fields, "host_blocks": int, "tenant": str,
"prefill_tokens_per_s": float}`` (the last: the engine's prefill rate for the cost model).
Line protocol on stdin/stdout (one JSON object per line), as tests/remote/worker.py:

* ``{"op": "store", "prompts": [[seed, nblocks], ...]}`` stores each prompt
  (deterministic tokens and KV from its seed) and waits until the publish queue
  is empty; answers the OK count.
* ``{"op": "lookup", "prompts": [...]}`` looks each prompt up, loads the
  matched prefix, checks every byte, and answers per prompt the matched and
  loaded block counts, the wrong blocks (must be 0), the tiers and the seconds,
  and the lookup's ``useful`` count and ``not_useful_reason``. With
  ``"useful": true`` it loads the lookup result itself (``load(hit)``: its
  useful prefix) instead of every matched key.
* ``{"op": "cost"}``: the cost model's estimates per tier for this layout
  (:meth:`CostModel.estimates <tierstore.policies.cost.CostModel.estimates>`).
* ``{"op": "corrupt", "seed": s, "nblocks": n, "block": i, "how": "payload"|"garbage"}``
  puts a bad object under block ``i``'s object name with Mooncake's own client
  (a raw ``MooncakeDistributedStore.put``: a foreign or hostile writer).
* ``{"op": "stats"}``: the store's counters, and the remote tier's as
  ``tier_<counter>`` (``tier_state``, ``tier_corrupt_payload_crc``, ...).
* ``{"op": "exit"}``.

Every command may carry ``"tenant"`` (default: the process's).
"""

import faulthandler
import json
import sys
import time

import numpy as np
import torch

from tierstore import KVLayout, KVStore, Namespace, Status
from tierstore.api import leading_ok
from tierstore.policies.cost import CostModel

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, tokens_per_block=16)


def prompt(seed: int, nblocks: int):
    tokens = np.random.default_rng(seed).integers(0, 30000, nblocks * LAYOUT.tokens_per_block)
    kv = torch.from_numpy(
        np.random.default_rng(seed + 1).standard_normal((nblocks, *LAYOUT.block_shape)).astype(np.float16)
    )
    return tokens, kv


def corrupt(store: KVStore, ns: Namespace, seed: int, nblocks: int, block: int, how: str) -> dict:
    from mooncake.store import MooncakeDistributedStore

    from tierstore.remote.format import HEADER_BYTES, ObjectNamer

    tokens, _ = prompt(seed, nblocks)
    key = store.keys_for(ns, tokens)[block]
    s = store.remote.config
    name = ObjectNamer(s.cluster, s.name_secret_bytes)(key)
    raw = MooncakeDistributedStore()
    rc = raw.setup(s.local_hostname, s.metadata, 0, 16 << 20, s.protocol, s.device, s.master)
    if rc != 0:
        return {"rc": rc}
    size = HEADER_BYTES + LAYOUT.bytes_per_block
    if how == "garbage":
        obj = bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))
    else:  # the block's true object, one payload byte flipped
        buf = bytearray(size)
        got = raw.get(name)
        buf[: len(got)] = got
        buf[-1] ^= 0x5A
        obj = bytes(buf)
    # the master keeps the first object under a name: remove it first; a read lease
    # (ours from the get above) refuses the remove with -706 until it ends
    deadline = time.monotonic() + 10
    while (rc := raw.remove(name)) not in (0, -704) and time.monotonic() < deadline:
        time.sleep(0.1)
    if rc not in (0, -704):
        raw.close()
        return {"rc": rc, "what": "remove"}
    rc = raw.put(name, obj)
    raw.close()
    return {"rc": rc}


def main() -> None:
    faulthandler.enable()
    opts = json.loads(sys.argv[1])
    tenant = opts.get("tenant", "acme")
    runtime = {}
    if "prefill_tokens_per_s" in opts:
        runtime["cost"] = CostModel(prefill_tokens_per_s=opts["prefill_tokens_per_s"])
    store = KVStore(
        LAYOUT,
        host_bytes=opts.get("host_blocks", 64) * LAYOUT.bytes_per_block,
        promotion="none",
        remote=opts["remote"],
        **runtime,
    )
    store.remote.wait_ok(10)
    print(json.dumps({"ready": store.remote.state}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        ns = Namespace(model="shared-model@1", tenant=cmd.get("tenant", tenant))
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
                t0 = time.monotonic()
                hit = store.lookup(ns, tokens)
                statuses, blocks = store.load(hit if cmd.get("useful") else hit.keys)
                dt = time.monotonic() - t0
                k = leading_ok(statuses)
                wrong = sum(not torch.equal(blocks[i], kv[i]) for i in range(k))
                res.append(
                    {
                        "matched": hit.matched_blocks,
                        "loaded": k,
                        "wrong": wrong,
                        "seconds": dt,
                        "tiers": [t.label for t in hit.tiers],
                        "status": [x.value for x in statuses],
                        "useful": hit.useful_blocks,
                        "not_useful_reason": hit.not_useful_reason,
                    }
                )
            out = {"results": res}
        elif op == "cost":
            out = store.cost_model.estimates(LAYOUT.bytes_per_block)
        elif op == "corrupt":
            out = corrupt(store, ns, cmd["seed"], cmd["nblocks"], cmd["block"], cmd.get("how", "payload"))
        elif op == "stats":
            s = store.stats()
            out = {k: v for k, v in s.items() if isinstance(v, (int, float))}
            r = s.get("remote", {})
            out.update({f"tier_{k}": v for k, v in r.items() if isinstance(v, (int, float, str))})
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    main()
