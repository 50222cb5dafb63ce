#!/usr/bin/env python
"""Shared capacity pays? Islands vs a shared Mooncake tier vs one instance (issue 16).

The Mooncake conversation trace is split across ``--instances`` engine
instances (each a real :class:`tierstore.KVStore` in its own process), and
replayed in trace order. Compared, saved prefill tokens each:

1. ``islands``: every instance has its own host tier of ``C / n`` bytes, nothing shared;
2. ``shared``: the same instances (same local tiers), plus a shared Mooncake
   tier of the same total bytes ``C``: each instance contributes a ``C / n``
   segment to one ``mooncake_master`` on 127.0.0.1 (the issue's setup; the
   instances hold ``2 C`` in all);
   ``shared_same_memory``: each instance splits its ``C / n`` into a local host
   tier of ``C / 2n`` and a segment of ``C / 2n`` (``C`` in all, like 1 and 3);
   ``shared_same_memory_evict``: the same with ``remote.publish: evict`` (blocks
   are published when they leave an instance's host tier, not when stored: the
   shared tier is a victim cache, so a block is rarely both local and remote);
3. ``one``: a single instance with a host tier of all the capacity ``C``, serving
   every request.

``C`` is ``--capacity-fraction`` of the trace's unique full-block bytes. Each
request does what tierstore's replay does (:mod:`tierstore.replay`): look up its
full blocks (``lookup_keys`` with its namespace, so remote hits are kept
locally when loaded), load the useful prefix, check every loaded block's bytes
(each carries its own key: a wrong block is counted and must stay 0), store the
blocks that missed (published to the shared tier by the store), release. After
each request the instance waits until its publish queue is empty (the trace's
requests are about 0.3 s apart, a publish takes milliseconds), so the order of
events is the trace's. Saved prefill tokens = blocks loaded x 512.

Routing: ``session`` (a session-affine router: a conversation's turns go to one
instance) and ``round_robin`` (a router that ignores sessions). Sessions: the
trace has no session ids; every request starts with the same block
(``hash_ids[0] == 0``, the shared system prompt) and a conversation's later
turns repeat its first turn's prompt, so a session is identified by its first
two block ids (7,373 sessions in 12,031 requests), hashed (BLAKE2b) to an
instance. ``--bounds-only`` prints the unbounded-capacity bounds (every block
ever computed kept) in seconds.

Usage::

    python bench/remote_capacity.py --json bench/results/remote/capacity_run1.json
    python bench/remote_capacity.py --bounds-only --json bench/results/remote/capacity_bounds.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierstore.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, read_mooncake  # noqa: E402

DEFAULT_TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def session_of(r: TraceRequest) -> tuple:
    """A request's session: its first two block ids (see the module docstring)."""
    return tuple(r.hash_ids[:2])


def instance_of(session: tuple, n: int) -> int:
    h = hashlib.blake2b(repr(session).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % n


def route(reqs: list[TraceRequest], n: int, routing: str) -> list[int]:
    """The instance of each request."""
    if routing == "session":
        return [instance_of(session_of(r), n) for r in reqs]
    if routing == "round_robin":
        return [i % n for i in range(len(reqs))]
    raise SystemExit(f"--routing {routing!r}: session or round_robin")


def saved_tokens_unbounded(reqs: list[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[int, int]:
    """(saved prefill tokens, prompt tokens) when every full block computed is kept."""
    seen: set[tuple] = set()
    saved = total = 0
    for r in reqs:
        full = r.full_blocks(block_tokens)
        ids = tuple(r.hash_ids[:full])
        hit = 0
        while hit < full and ids[:hit + 1] in seen:
            hit += 1
        saved += hit * block_tokens
        total += r.input_length
        for k in range(hit + 1, full + 1):
            seen.add(ids[:k])
    return saved, total


def bounds(reqs: list[TraceRequest], n: int) -> dict:
    one_saved, total = saved_tokens_unbounded(reqs)
    res = {"requests": len(reqs), "prompt_tokens": total, "sessions": len({session_of(r) for r in reqs}),
           "instances": n, "saved_tokens_unbounded_one_instance": one_saved, "routing": {}}
    for routing in ("session", "round_robin"):
        inst = route(reqs, n, routing)
        parts = [[r for r, i in zip(reqs, inst) if i == k] for k in range(n)]
        isl = [saved_tokens_unbounded(p)[0] for p in parts]
        res["routing"][routing] = {"requests_per_instance": [len(p) for p in parts],
                                   "saved_tokens_unbounded_islands": sum(isl)}
    return res


# ---------------------------------------------------------------- instance process
def worker_main(opts: dict) -> None:
    """One engine instance: a KVStore (optionally on the shared tier), driven by request indices on stdin."""
    import numpy as np  # noqa: F401  (torch needs it loaded first on some builds)
    import torch

    from tierstore import KVStore, Namespace, Status
    from tierstore.api import leading_ok
    from tierstore.identity import chain_ids
    from tierstore.replay import ReplayConfig

    reqs = read_mooncake(opts["trace"], opts.get("limit"))
    layout = ReplayConfig(block_bytes=opts["block_bytes"]).layout()
    bb = layout.bytes_per_block

    class Clock:
        now_s = 0.0

        def __call__(self) -> float:
            return self.now_s
    clock = Clock()
    kw = {"remote": opts["remote"]} if opts.get("remote") else {}
    store = KVStore(layout, host_bytes=opts["host_bytes"], eviction="lru", clock=clock, **kw)
    if store.remote is not None and not store.remote.wait_ok(30):
        raise SystemExit(f"remote tier not connected: {store.remote.stats()['degraded_reason']}")
    ns = Namespace(model="mooncake-trace", kv_dtype="bf16")
    template = torch.arange(bb, dtype=torch.int64).to(torch.uint8)
    tot = {"requests": 0, "lookup_blocks": 0, "hit_blocks": 0, "loaded_blocks": 0, "wrong_kv_blocks": 0,
           "remote_hit_blocks": 0, "stored_blocks": 0, "seconds": 0.0}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        t0 = time.perf_counter()
        for i in cmd["requests"]:
            r = reqs[i]
            clock.now_s = r.timestamp_s
            full = r.full_blocks()
            keys = chain_ids(store.digest(ns), r.hash_ids[:full])
            rid = ("trace", i)
            res = store.lookup_keys(keys, request_id=rid, num_prompt_tokens=r.input_length, ns=ns)
            tot["lookup_blocks"] += full
            tot["hit_blocks"] += res.matched_blocks
            tot["remote_hit_blocks"] += sum(t.label == "remote" for t in res.tiers)
            n_ok = 0
            if res.useful_blocks:
                st, outs = store.load(res.useful_keys)
                n_ok = leading_ok(st)
                for k, o in zip(res.useful_keys[:n_ok], outs[:n_ok]):
                    if bytes(o.reshape(-1).view(torch.uint8)[:32].numpy()) != k:
                        tot["wrong_kv_blocks"] += 1
            tot["loaded_blocks"] += n_ok
            new = keys[n_ok:]
            if new:
                blocks = []
                for k in new:
                    b = template.clone()
                    b[:32] = torch.frombuffer(bytearray(k), dtype=torch.uint8)
                    blocks.append(b)
                st = store.store_keys(ns, new, blocks, first_position=n_ok)
                tot["stored_blocks"] += sum(s is Status.OK for s in st)
            store.release(rid)
            if store.remote is not None:
                store.remote.flush(30)
            tot["requests"] += 1
        tot["seconds"] += time.perf_counter() - t0
        print(json.dumps({"done": len(cmd["requests"])}), flush=True)
    s = store.stats()
    out = dict(tot, saved_prefill_tokens=tot["loaded_blocks"] * MOONCAKE_BLOCK_TOKENS,
               host_capacity_bytes=opts["host_bytes"],
               store={k: v for k, v in s.items() if isinstance(v, (int, float))})
    if store.remote is not None:
        out["remote"] = {k: v for k, v in s["remote"].items() if isinstance(v, (int, float, str))}
    store.check_invariants(quiescent=True)
    store.close()
    print(json.dumps({"result": out}), flush=True)


class Instance:
    def __init__(self, opts: dict, log_path: pathlib.Path) -> None:
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", MC_TCP_BIND_ADDRESS="127.0.0.1"))

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"instance exited {self.proc.poll()}; see {self.log.name}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def finish(self) -> dict:
        self.send(op="exit")
        r = self.reply()
        self.proc.wait(60)
        self.log.close()
        return r["result"]


def run_config(name: str, reqs, inst_of: list[int], n: int, host_bytes: int, segment_bytes: int,
               args, workdir: pathlib.Path, publish: str = "store") -> dict:
    """Replay the trace through ``n`` instances (``inst_of[i]`` serves request ``i``), in trace order."""
    from tierstore.remote.local_master import LocalMaster
    master = None
    if segment_bytes:
        master = LocalMaster(workdir, metadata="p2p", extra_args=tuple(args.master_arg)).start()
    try:
        base = {"trace": args.trace, "limit": args.limit, "block_bytes": args.block_bytes, "host_bytes": host_bytes}
        if master is not None:
            base["remote"] = {"master": master.address, "metadata": master.metadata, "local_hostname": "127.0.0.1",
                              "segment_bytes": segment_bytes, "local_buffer_bytes": 4 << 20,
                              "publish_queue_blocks": 1024, "max_batch_blocks": 64, "timeout_s": 5.0,
                              "cluster": "capacity", "publish": publish}
        insts = [Instance(base, workdir / f"{name}-{k}.log") for k in range(n)]
        for it in insts:
            assert it.reply().get("ready")
        t0 = time.perf_counter()
        # consecutive requests of one instance go as one batch (the order across instances is kept)
        i = 0
        while i < len(reqs):
            j = i
            while j < len(reqs) and inst_of[j] == inst_of[i]:
                j += 1
            insts[inst_of[i]].send(requests=list(range(i, j)))
            insts[inst_of[i]].reply()
            if args.progress and i // 1000 != j // 1000:
                print(f"  {name}: {j}/{len(reqs)} requests, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            i = j
        wall = time.perf_counter() - t0
        per = [it.finish() for it in insts]
    finally:
        if master is not None:
            master.kill()
    saved = sum(p["saved_prefill_tokens"] for p in per)
    return {"config": name, "publish": publish if segment_bytes else None, "instances": n, "host_bytes_per_instance": host_bytes,
            "segment_bytes_per_instance": segment_bytes, "total_bytes": n * (host_bytes + segment_bytes),
            "saved_prefill_tokens": saved, "loaded_blocks": sum(p["loaded_blocks"] for p in per),
            "remote_hit_blocks": sum(p["remote_hit_blocks"] for p in per),
            "wrong_kv_blocks": sum(p["wrong_kv_blocks"] for p in per), "wall_s": wall,
            "remote": {k: sum(p["remote"].get(k, 0) for p in per) for k in
                       ("published_blocks", "put_no_space", "put_failed", "dropped_queue_full", "get_hits",
                        "get_misses", "get_errors", "corrupt_objects", "timeouts")} if segment_bytes else None,
            "per_instance": per}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
        return
    from tierstore.replay import ReplayConfig, unique_full_blocks
    from tierstore.units import parse_size
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--block-bytes", type=parse_size, default=parse_size("8k"),
                    help="bytes stored per 512-token block (scaled, as tierstore's replay; default 8k)")
    ap.add_argument("--capacity-fraction", type=float, default=0.08,
                    help="C, all the capacity, as a fraction of the trace's unique full-block bytes")
    ap.add_argument("--routing", default="session,round_robin")
    ap.add_argument("--configs", default="one,islands,shared,shared_same_memory,shared_same_memory_evict")
    ap.add_argument("--master-arg", action="append", default=[],
                    help="extra mooncake_master flag (e.g. --eviction_high_watermark_ratio=0.98)")
    ap.add_argument("--bounds-only", action="store_true")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--workdir", help="keep the instances' and master's logs here (default: a temp dir)")
    ap.add_argument("--json")
    a = ap.parse_args()
    reqs = read_mooncake(a.trace, a.limit)
    n = a.instances
    res = {"trace": os.path.basename(a.trace), "bounds": bounds(reqs, n)}
    b = res["bounds"]
    print(f"{len(reqs)} requests, {b['sessions']} sessions, {b['prompt_tokens']} prompt tokens; unbounded capacity "
          f"saves {b['saved_tokens_unbounded_one_instance']} tokens in one instance; islands: "
          + ", ".join(f"{k} routing {v['saved_tokens_unbounded_islands']}" for k, v in b["routing"].items()))
    if not a.bounds_only:
        bb = ReplayConfig(block_bytes=a.block_bytes).layout().bytes_per_block
        uniq = unique_full_blocks(reqs)
        cap = int(uniq * a.capacity_fraction) * bb
        res.update(block_bytes=bb, unique_blocks=uniq, capacity_fraction=a.capacity_fraction, capacity_bytes=cap,
                   master_args=a.master_arg, runs=[])
        print(f"C = {a.capacity_fraction:.0%} of {uniq} unique blocks = {cap / 2**20:.1f} MiB "
              f"({cap // bb} blocks of {bb} bytes)")
        configs = a.configs.split(",")
        with tempfile.TemporaryDirectory(prefix="tierstore-capacity-") as td:
            wd = pathlib.Path(a.workdir or td)
            wd.mkdir(parents=True, exist_ok=True)
            if "one" in configs:
                r = run_config("one", reqs, [0] * len(reqs), 1, cap, 0, a, wd)
                r["routing"] = None
                res["runs"].append(r)
                print(f"  one instance, C local: saved {r['saved_prefill_tokens']} tokens "
                      f"(wrong {r['wrong_kv_blocks']}, {r['wall_s']:.0f} s)", flush=True)
            for routing in a.routing.split(","):
                inst = route(reqs, n, routing)
                for name in configs:
                    if name == "one":
                        continue
                    host, seg = {"islands": (cap // n, 0), "shared": (cap // n, cap // n),
                                 "shared_same_memory": (cap // (2 * n), cap // (2 * n)),
                                 "shared_same_memory_evict": (cap // (2 * n), cap // (2 * n))}[name]
                    host = host // bb * bb
                    if 0 < seg < 16 << 20:
                        raise SystemExit(f"{name}: a segment of {seg} bytes; Mooncake mounts 16 MiB at least: "
                                         "raise --capacity-fraction or --block-bytes")
                    r = run_config(f"{name}-{routing}", reqs, inst, n, host, seg, a, wd,
                                   publish="evict" if name.endswith("_evict") else "store")
                    r["routing"] = routing
                    res["runs"].append(r)
                    rem = r["remote"] or {}
                    print(f"  {routing:>11} {name:<18}: saved {r['saved_prefill_tokens']} tokens, remote hits "
                          f"{r['remote_hit_blocks']} blocks, put_no_space {rem.get('put_no_space', 0)}, "
                          f"wrong {r['wrong_kv_blocks']} ({r['wall_s']:.0f} s)", flush=True)
        one = next((r for r in res["runs"] if r["config"] == "one"), None)
        if one is not None:
            for r in res["runs"]:
                r["of_one_instance"] = r["saved_prefill_tokens"] / max(1, one["saved_prefill_tokens"])
    if a.json:
        pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
