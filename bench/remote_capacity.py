#!/usr/bin/env python
"""Shared capacity across instances: data preparation and the infinite-capacity bounds.

The issue-16 comparison replays the Mooncake conversation trace split across
4 instances by session, each with its own small tiers: (1) islands, (2) the
same instances with a shared Mooncake tier of the same total bytes, (3) one
instance with all the capacity; it reports saved prefill tokens. The finite-
capacity replays need the remote tier wired into the core (issue 13), so this
script does the part that does not:

* **Sessions.** The trace has no session ids. Every request starts with the
  same block (``hash_ids[0] == 0``, the shared system prompt); a conversation's
  later turns repeat its first turn's prompt, so a session is identified by its
  first two block ids (``hash_ids[:2]``: 7,373 sessions in 12,031 requests).
  Sessions go to instances by a stable hash (BLAKE2b of the two ids), as a
  session-affine router would send them.
* **Bounds.** Saved prefill tokens with unbounded capacity (every full
  512-token block ever computed is kept; exact-hit rule: only the leading run
  of full blocks seen before counts), for islands (each instance sees only its
  own sessions) and for one shared pool (= one instance), under session-affine
  and round-robin routing. With unbounded capacity, (2) equals (3); what
  islands lose here is only reuse across instances. The finite-capacity
  replays show what pooling capacity adds on top.

Usage::

    python bench/remote_capacity.py --trace /work/shared/traces/mooncake_conversation_trace.jsonl \\
        --instances 4 --json bench/results/remote_capacity_bounds.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierstore.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, read_mooncake  # noqa: E402


def session_of(r: TraceRequest) -> tuple:
    """A request's session: its first two block ids (see the module docstring)."""
    return tuple(r.hash_ids[:2])


def instance_of(session: tuple, n: int) -> int:
    h = hashlib.blake2b(repr(session).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % n


def split_by_session(reqs: list[TraceRequest], n: int) -> list[list[TraceRequest]]:
    """The requests of each of ``n`` instances, in trace order (session-affine routing)."""
    out: list[list[TraceRequest]] = [[] for _ in range(n)]
    for r in reqs:
        out[instance_of(session_of(r), n)].append(r)
    return out


def split_round_robin(reqs: list[TraceRequest], n: int) -> list[list[TraceRequest]]:
    """Request ``i`` to instance ``i % n`` (a router without session affinity)."""
    return [reqs[i::n] for i in range(n)]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="/work/shared/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    reqs = read_mooncake(a.trace)
    one_saved, total = saved_tokens_unbounded(reqs)
    res = {"trace": os.path.basename(a.trace), "requests": len(reqs), "prompt_tokens": total,
           "sessions": len({session_of(r) for r in reqs}), "instances": a.instances,
           "saved_tokens_unbounded_shared_or_one_instance": one_saved, "routing": {}}
    print(f"{len(reqs)} requests, {res['sessions']} sessions, {total} prompt tokens; saved prefill "
          f"tokens with unbounded capacity, shared pool / one instance: {one_saved} ({one_saved / total:.1%})")
    for routing, split in (("session", split_by_session), ("round_robin", split_round_robin)):
        parts = split(reqs, a.instances)
        isl = [saved_tokens_unbounded(p)[0] for p in parts]
        res["routing"][routing] = {"requests_per_instance": [len(p) for p in parts],
                                   "saved_tokens_unbounded_islands": sum(isl), "islands_per_instance": isl}
        print(f"  {routing:>11} routing: requests per instance {[len(p) for p in parts]}; islands save "
              f"{sum(isl)} ({sum(isl) / total:.1%}) = {sum(isl) / one_saved:.1%} of the shared pool")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
