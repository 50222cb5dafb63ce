#!/usr/bin/env python
"""Where does a tierstore replay lose capacity? Measure the three hypotheses of issue 18.

A trace is replayed through the real store (:func:`tierstore.replay.run_replay`,
the same replay ``tierstore bench --rw=kvtrace`` runs) with the index's event
stream on (:meth:`tierstore.api.KVStore.record_events`); the future of every
block is known from the trace, so each event can be judged offline:

1. **Duplicate copies across tiers.** Sampled every ``--sample-every``
   requests: copies held in all tiers (``bytes_per_tier``) minus distinct
   visible blocks (:meth:`~tierstore.api.KVStore.namespaces`), as a share of
   the total capacity in blocks (time average).
2. **Whole-segment (region) eviction drops reused blocks.** Every block that
   left the cache (``dropped`` event) is classified by the tier it left last
   and by whether the trace uses it again (a *premature* drop) and how soon
   (requests until its next use). The same is computed for one flat LRU cache
   of the same total blocks (:mod:`bench.cache_reference`), so the drops of the
   store can be compared with those of the reference.
3. **Single-use KV admitted everywhere.** Share of the blocks written to each
   tier (stores and demotions) that the trace never uses again, and the
   time-averaged share of resident copies that will never be used again.

Usage::

    python bench/capacity_diagnose.py --trace /work/shared/traces/mooncake_conversation_trace.jsonl \\
        --hbm-size 28m --host-size 112m --nvme-size 420m [--limit 3000] [--policies '{"promotion": "none"}'] \\
        [--nvme '{"region_policy": "fifo"}'] [--json out.json]

Figures are counts from one deterministic replay; the store's NVMe tier is the
default device of the replay (a file) unless ``--nvme`` says otherwise.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
from collections import OrderedDict
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tierstore.identity import Namespace, chain_ids  # noqa: E402
from tierstore.replay import ReplayConfig, run_replay  # noqa: E402
from tierstore.trace import read_mooncake  # noqa: E402
from tierstore.units import parse_size  # noqa: E402

from cache_reference import chain_keys, references  # noqa: E402

#: The replay's namespace (:func:`tierstore.replay._replay`): keys are ``chain_ids(NS, hash_ids)``.
REPLAY_NS = Namespace(model="mooncake-trace", kv_dtype="bf16").digest()


def future_uses(requests) -> dict[bytes, list[int]]:
    """``key -> sorted request indices that use it`` (full blocks, replay keys)."""
    uses: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(requests):
        for k in chain_ids(REPLAY_NS, r.hash_ids[:r.full_blocks()]):
            uses[k].append(i)
    return uses


def next_use(uses: dict, key, i: int) -> int | None:
    """First request index > ``i`` that uses ``key``, or None."""
    lst = uses.get(key)
    if not lst:
        return None
    j = bisect.bisect_right(lst, i)
    return lst[j] if j < len(lst) else None


def flat_lru_drops(keys_per_request: list[list[int]], capacity_blocks: int) -> dict:
    """Premature drops of one flat LRU cache of ``capacity_blocks`` (reference for hypothesis 2)."""
    uses: dict[int, list[int]] = collections.defaultdict(list)
    for i, ks in enumerate(keys_per_request):
        for k in ks:
            uses[k].append(i)
    lru: OrderedDict[int, None] = OrderedDict()
    dropped = premature = 0
    dist = []
    for i, ks in enumerate(keys_per_request):
        for k in ks:
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = None
            if len(lru) > capacity_blocks:
                v, _ = lru.popitem(last=False)
                dropped += 1
                nu = next_use(uses, v, i)
                if nu is not None:
                    premature += 1
                    dist.append(nu - i)
    return {"dropped_blocks": dropped, "premature_drops": premature,
            "premature_share": premature / max(1, dropped),
            "next_use_requests_p50": float(np.median(dist)) if dist else None}


def diagnose(trace: str | None, limit: int | None, hbm: int | None, host: int | None, nvme: int | None,
             block_bytes: int,
             policies: dict, nvme_options: dict, eviction: str = "lru", sample_every: int = 25) -> dict:
    """Replay once with events on and judge every event against the trace's future (module doc)."""
    reqs = read_mooncake(trace, limit)
    uses = future_uses(reqs)
    state = {"i": -1, "dup": [], "never": [], "written": collections.Counter(),
             "written_single": collections.Counter(), "drops": collections.Counter(),
             "premature": collections.Counter(), "premature_dist": collections.defaultdict(list),
             "last_tier": {}}

    def judge(store, i: int) -> None:
        for kind, key, tier in store.take_events():
            if kind in ("stored", "demoted", "promoted") and tier is not None:
                if kind != "promoted":
                    state["written"][tier] += 1
                    if next_use(uses, key, i) is None:
                        state["written_single"][tier] += 1
                state["last_tier"][key] = tier
            elif kind == "removed" and tier is not None:
                state["last_tier"][key] = tier
            elif kind == "dropped":
                t = state["last_tier"].pop(key, "?")
                state["drops"][t] += 1
                nu = next_use(uses, key, i)
                if nu is not None:
                    state["premature"][t] += 1
                    state["premature_dist"][t].append(nu - i)

    def on_sample(store, sample):
        i = state["i"] = state["i"] + 1
        judge(store, i)
        if i % sample_every == 0:
            bpt = store.bytes_per_tier()
            state.setdefault("occ", []).append([bpt.get(t, 0) // block_bytes for t in ("hbm", "host", "nvme")])
            copies = sum(bpt.values()) // block_bytes
            distinct = sum(store.namespaces().values())
            state["dup"].append((copies - distinct))
            # resident copies never used again (sampled on a subset of keys for speed)
            ks = [k for d in store.namespaces() for k in store.keys_of_namespace(d)]
            if ks:
                never = sum(1 for k in ks if next_use(uses, k, i) is None)
                state["never"].append(never / len(ks))

    def on_open(store):
        store.record_events(True)

    cfg = ReplayConfig(trace=trace, limit=limit, block_bytes=block_bytes, hbm_bytes=hbm, host_bytes=host,
                       nvme_bytes=nvme, eviction=eviction, sample_every=1, policies=dict(policies),
                       nvme_options=dict(nvme_options))
    rep = run_replay(cfg, on_sample=on_sample, on_open=on_open)
    kv = rep.kv
    cap_blocks = (kv["hbm_capacity_bytes"] + kv["host_capacity_bytes"] + kv["nvme_capacity_bytes"]) // block_bytes
    ref = references(reqs, cap_blocks)
    lru = flat_lru_drops(chain_keys(reqs), cap_blocks)
    out = {
        "requests": len(reqs), "capacity_blocks": cap_blocks, "hit_ratio": kv["lookup_hit_ratio"],
        "flat_lru": ref["flat_lru"], "belady": ref["belady"],
        "resident_copies_mean_blocks": dict(zip(("hbm", "host", "nvme"),
                                                np.mean(state["occ"][len(state["occ"]) // 2:], axis=0).round(1).tolist()))
        if state.get("occ") else {},
        "h1_duplicate_copies_mean_blocks": float(np.mean(state["dup"])) if state["dup"] else 0.0,
        "h1_duplicate_share_of_capacity": float(np.mean(state["dup"])) / cap_blocks if state["dup"] else 0.0,
        "h2_drops_by_tier": dict(state["drops"]),
        "h2_premature_drops_by_tier": dict(state["premature"]),
        "h2_premature_share": sum(state["premature"].values()) / max(1, sum(state["drops"].values())),
        "h2_premature_next_use_requests_p50": {t: float(np.median(v)) for t, v in state["premature_dist"].items()},
        "h2_flat_lru": lru,
        "h3_written_by_tier": dict(state["written"]),
        "h3_written_never_reused_share": {t: state["written_single"][t] / n for t, n in state["written"].items() if n},
        "h3_resident_never_reused_share_mean": float(np.mean(state["never"])) if state["never"] else None,
        "nvme_backend": {k: rep.store_stats.get(k) for k in ("host_write_amplification", "regions_evicted",
                                                             "region_evicted_blocks", "region_kept_blocks")},
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--block-bytes", default="32k")
    ap.add_argument("--hbm-size", default="28m")
    ap.add_argument("--host-size", default="112m")
    ap.add_argument("--nvme-size", default="420m")
    ap.add_argument("--capacity", type=float, default=None,
                    help="instead of sizes: this fraction of the unique bytes, split 5/20/75 %% as the replay's defaults")
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--policies", default="{}", help="PoliciesConfig fields as JSON")
    ap.add_argument("--nvme", default="{}", help="NvmeTierConfig fields as JSON")
    ap.add_argument("--sample-every", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bb = parse_size(a.block_bytes, "block_bytes")
    sizes = [parse_size(a.hbm_size, "hbm_size"), parse_size(a.host_size, "host_size"), parse_size(a.nvme_size, "nvme_size")]
    if a.capacity is not None:
        from tierstore.replay import unique_full_blocks
        u = unique_full_blocks(read_mooncake(a.trace, a.limit))
        sizes = [int(u * a.capacity * f) * bb for f in (0.05, 0.20, 0.75)]
    out = diagnose(a.trace, a.limit, *sizes, bb,
                   json.loads(a.policies), json.loads(a.nvme), a.eviction, a.sample_every)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
