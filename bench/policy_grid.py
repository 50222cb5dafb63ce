"""Policy comparison grid: configured policy sets x capacity x trace, through the real store onto the FTL model.

One command makes the table (markdown + CSV + JSON) and a PNG plot::

    python bench/policy_grid.py --out bench/results/policy_grid

Every cell is one replay of a trace (:func:`tierstore.replay.run_replay`, the
replay ``tierstore bench --rw=kvtrace`` runs) through a store built by
:func:`tierstore.build.build_store` from a :class:`~tierstore.config.StoreConfig`:
HBM stand-in -> host -> NVMe, the NVMe tier a
:class:`~tierstore.io.segments.SegmentStorage` on the simulated FDP SSD
(``device: sim``, memory engine, :class:`~tierstore.fdp.ftl.FTLModel`;
**every WAF figure is simulated, not an SSD**). A cell is named by

* a **policy set** (:data:`POLICY_SETS`): the ``policies`` fields
  (eviction, admission, promotion, reinsertion, classifier) and the NVMe tier's
  ``region_policy`` -- every choice is configuration, the code paths are the
  same;
* a **capacity** ``c``: the three tiers together hold ``c`` of the trace's
  unique full-block bytes, split as the replay's defaults split 40 %
  (HBM 5 %, host 20 %, NVMe 75 % of ``c``);
* a **trace**: the Mooncake conversation trace and the synthetic agent workload
  (:mod:`bench.agent_workload`).

Each row reports the hit ratio and its distance to the offline references of
the same total blocks (:mod:`tierstore.bench.references`: one flat LRU cache and
Belady's MIN), saved prefill, bytes written to NVMe (also at the real 64 MiB
block), host write amplification (copy-forward), the device's WAF and
end-to-end WA, and the lifetime-class prediction accuracy against the true
NVMe death times (:class:`tierstore.bench.lifetimes.LifetimeRecorder`).

Scale: a 512-token block is stored as ``--block-bytes`` (32 KiB default, the
replay's; Llama-3.1-8B's real block is 64 MiB). The simulated device has RU =
device/60 and the NVMe tier fills ``--utilization`` of it.

Determinism: the replay, the policies and the generator (fixed seed) are
deterministic, so counts are identical run to run; ``--repeats`` re-runs the
first cell to show it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from tierstore.bench.lifetimes import LifetimeRecorder
from tierstore.bench.references import distance, references
from tierstore.replay import REFERENCE_BLOCK_BYTES, ReplayConfig, run_replay
from tierstore.trace import read_mooncake

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl"))
BLOCK_BYTES = 32 << 10
CAPACITIES = (0.05, 0.10, 0.20, 0.40)
#: Tier split of a capacity (the replay's defaults 2 % / 8 % / 30 % are 5 % / 20 % / 75 % of 40 %).
SPLIT = {"hbm": 0.05, "host": 0.20, "nvme": 0.75}

#: Named policy sets: ``policies`` fields plus the NVMe tier's ``region_policy``.
#: ``default`` is whatever :class:`tierstore.config.PoliciesConfig` and
#: :class:`tierstore.config.NvmeTierConfig` default to (no field given).
POLICY_SETS: dict[str, dict] = {
    "default": {},
    "lru": {"eviction": "lru", "promotion": "top", "reinsert": "none", "region_policy": "lru"},
    "s3fifo": {"eviction": "s3fifo", "promotion": "top", "reinsert": "none", "region_policy": "lru"},
    "cost": {"eviction": "cost", "promotion": "top", "reinsert": "none", "region_policy": "lru"},
    "lru+second": {"eviction": "lru", "admission": "second", "promotion": "top", "reinsert": "none",
                   "region_policy": "lru"},
    "exclusive": {"eviction": "lru", "promotion": "none", "reinsert": "none", "region_policy": "lru"},
    "exclusive+fifo+clock": {"eviction": "lru", "promotion": "none", "reinsert": "clock", "region_policy": "fifo"},
    "top+fifo+clock": {"eviction": "lru", "promotion": "top", "reinsert": "clock", "region_policy": "fifo"},
    "exclusive+fifo+clock+b32": {"eviction": "lru", "promotion": "none", "reinsert": "clock", "region_policy": "fifo",
                                 "evict_batch_blocks": 32},
    "top+fifo+clock+b32": {"eviction": "lru", "promotion": "top", "reinsert": "clock", "region_policy": "fifo",
                           "evict_batch_blocks": 32},
}


def policy_set(name: str) -> tuple[dict, dict]:
    """``(policies fields, nvme fields)`` of a named set (or of a JSON object given as the name)."""
    spec = dict(POLICY_SETS[name]) if name in POLICY_SETS else json.loads(name)
    nv = {k: spec.pop(k) for k in ("region_policy",) if k in spec}
    return spec, nv


def tier_sizes(cap, unique_blocks: int, block_bytes: int) -> dict[str, int]:
    """Tier bytes of a capacity: a fraction of the unique full-block bytes split by
    :data:`SPLIT`, or ``"HBM/HOST/NVME"`` sizes (``"28m/112m/420m"``, as ``tierstore bench``'s flags)."""
    from tierstore.units import parse_size
    if isinstance(cap, str) and "/" in cap:
        h, c, n = (parse_size(x, "capacity") for x in cap.split("/"))
        return {"hbm": h, "host": c, "nvme": n}
    return {t: int(unique_blocks * float(cap) * f) * block_bytes for t, f in SPLIT.items()}


def run_cell(trace: str, set_name: str, cap, limit: int | None, block_bytes: int = BLOCK_BYTES,
             utilization: float = 0.9, dataplacement: str = "none", device: str = "sim") -> dict:
    """Replay one cell; returns its row (module doc).

    ``device="file"`` puts the NVMe tier in a file through the default engine,
    exactly as ``tierstore bench --rw=kvtrace`` does (its hit ratios are the
    main job's); ``"sim"`` uses the simulated FDP SSD (memory engine), which
    also reports device WAF.
    """
    import tempfile
    reqs = read_mooncake(trace, limit)
    pol, nv = policy_set(set_name)
    eviction = pol.pop("eviction", None)
    rec = LifetimeRecorder(pol.pop("classifier", "hint"))
    from tierstore.replay import unique_full_blocks
    uniq = unique_full_blocks(reqs)
    sizes = tier_sizes(cap, uniq, block_bytes)
    if device == "sim":
        nvme_opts = {"device": "sim", "engine": "memory", "model": {"utilization": utilization},
                     "fdp": {"enabled": dataplacement == "fdp"}, **nv}
    else:  # as tierstore bench: a file in a temporary directory, an FTL model observing it
        nvme_opts = {"device": "file", "engine": "auto", "model": {"op_fraction": 0.07},
                     "fdp": {"enabled": dataplacement == "fdp"}, **nv}
    kw = {} if eviction is None else {"eviction": eviction}
    tmp = tempfile.mkdtemp(prefix="policy-grid-") if device == "file" else None
    if tmp:
        nvme_opts["path"] = os.path.join(tmp, "kvtrace.0.0")
    cfg = ReplayConfig(trace=trace, limit=limit, block_bytes=block_bytes, hbm_bytes=sizes["hbm"],
                       host_bytes=sizes["host"], nvme_bytes=sizes["nvme"], sample_every=1, policies=pol,
                       nvme_options=nvme_opts, runtime={"classify": rec}, directory=tmp, **kw)
    t0 = time.perf_counter()
    try:
        rep = run_replay(cfg, on_open=rec.on_open, on_sample=rec.on_sample)
    finally:
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    kv, d = rep.kv, rep.device
    cap_blocks = (kv["hbm_capacity_bytes"] + kv["host_capacity_bytes"] + kv["nvme_capacity_bytes"]) // block_bytes
    ref = references(reqs, cap_blocks)
    dist = distance(kv["lookup_hit_ratio"], ref)
    life = rec.summary()
    scale = REFERENCE_BLOCK_BYTES / block_bytes
    return dict(
        trace=os.path.basename(trace).split(".")[0], policy_set=set_name, capacity=cap, dataplacement=dataplacement,
        device=device, nvme_capacity_blocks=kv["nvme_capacity_bytes"] // block_bytes,
        requests=kv["requests"], capacity_blocks=cap_blocks, capacity_fraction=ref["capacity_fraction"], lookup_hit_ratio=kv["lookup_hit_ratio"],
        useful_hit_ratio=kv["useful_hit_ratio"], flat_lru=ref["flat_lru"], belady=ref["belady"],
        vs_flat_lru=dist["vs_flat_lru"], gap_closed=dist["gap_closed"], ideal=kv["ideal_hit_ratio"],
        saved_prefill_tokens=kv["saved_prefill_tokens"], hit_blocks_hbm=kv["hit_blocks_hbm"],
        hit_blocks_host=kv["hit_blocks_host"], hit_blocks_nvme=kv["hit_blocks_nvme"],
        nvme_write_bytes=kv["nvme_write_bytes"], nvme_write_bytes_ref=int(kv["nvme_write_bytes"] * scale),
        kept_off_flash_bytes=int(rep.final_stats.get("admission_rejected_bytes", 0)),
        host_wa=d.get("host_write_amplification", float("nan")), device_waf=d.get("waf", float("nan")),
        e2e_wa=d.get("e2e_wa", float("nan")), lifetime_accuracy=life.get("accuracy", float("nan")),
        lifetime_chance=life.get("chance", float("nan")), lifetime_spearman=life.get("spearman", float("nan")),
        load_p50_ms=kv["load_lat_p50_ns"] / 1e6, load_p99_ms=kv["load_lat_p99_ns"] / 1e6,
        wrong_kv_blocks=kv["wrong_kv_blocks"], wall_s=round(wall, 1))


#: Wall-clock columns: they vary run to run (everything else is a deterministic count).
TIMING_COLS = ("load_p50_ms", "load_p99_ms", "wall_s")

COLS = ["trace", "policy_set", "capacity", "device", "dataplacement", "capacity_blocks", "lookup_hit_ratio", "flat_lru", "belady", "vs_flat_lru",
        "gap_closed", "saved_prefill_tokens", "hit_blocks_hbm", "hit_blocks_host", "hit_blocks_nvme",
        "nvme_write_bytes_ref", "kept_off_flash_bytes", "host_wa", "device_waf", "e2e_wa", "lifetime_accuracy",
        "lifetime_chance", "lifetime_spearman", "load_p50_ms", "load_p99_ms", "wrong_kv_blocks", "wall_s"]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def plot(rows, path: str) -> None:
    """Hit ratio vs capacity per policy set, one panel per trace, with the two references."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for j, tr in enumerate(traces):
        ax = axes[0, j]
        sel_t = [r for r in rows if r["trace"] == tr]
        for name in sorted({r["policy_set"] for r in sel_t}):
            sel = sorted((r for r in sel_t if r["policy_set"] == name), key=lambda r: r["capacity_fraction"])
            ax.plot([100 * r["capacity_fraction"] for r in sel], [r["lookup_hit_ratio"] for r in sel], marker="o", label=name)
        ref = sorted({(r["capacity_fraction"], r["flat_lru"], r["belady"]) for r in sel_t})
        ax.plot([100 * c for c, _, _ in ref], [x for _, x, _ in ref], "k--", label="flat LRU (offline)")
        ax.plot([100 * c for c, _, _ in ref], [x for _, _, x in ref], "k:", label="Belady MIN (offline)")
        ax.set_title(f"{tr}: hit ratio (simulated device)")
        ax.set_xlabel("capacity, % of unique full-block bytes")
        ax.set_ylabel("lookup hit ratio")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="policy set x capacity x trace grid (simulated FDP device)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "policy_grid"))
    ap.add_argument("--mooncake", default=MOONCAKE)
    ap.add_argument("--agent-sessions", type=int, default=400)
    ap.add_argument("--traces", default="mooncake,agent")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    ap.add_argument("--capacities", default=",".join(str(c) for c in CAPACITIES),
                    help="fractions of the unique bytes (split 5/20/75 %%) or HBM/HOST/NVME sizes, e.g. 28m/112m/420m")
    ap.add_argument("--sets", default="default,lru,s3fifo,cost,lru+second,exclusive+fifo+clock",
                    help=f"comma-separated policy sets ({', '.join(POLICY_SETS)}) or JSON objects")
    ap.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--device", default="sim", choices=("sim", "file"),
                    help="file: the NVMe tier as tierstore bench puts it (hit ratios = the main job's); "
                         "sim: the simulated FDP SSD (device WAF)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="re-run the first cell to show run-to-run noise")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from agent_workload import AgentWorkload
    agent = os.path.join(a.out, "agent_workload.jsonl")
    AgentWorkload(sessions=a.agent_sessions, seed=0).write(agent)
    paths = {"mooncake": a.mooncake, "agent": agent}
    sets = [s for s in a.sets.split(";" if "{" in a.sets else ",") if s]
    caps = [c if "/" in c else float(c) for c in a.capacities.split(",")]
    cells = [(paths[tr], s, c, a.limit, a.block_bytes, a.utilization, "none", a.device)
             for tr in a.traces.split(",") for c in caps for s in sets]
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for i, r in enumerate(ex.map(run_cell, *zip(*cells))):
            rows.append(r)
            print(f"[{i + 1}/{len(cells)} {time.perf_counter() - t0:.0f}s] {r['trace']} {r['policy_set']} "
                  f"cap={r['capacity']}: hit={r['lookup_hit_ratio']:.4f} (flat LRU {r['flat_lru']:.4f}, "
                  f"Belady {r['belady']:.4f}) host WA {r['host_wa']:.3f}", file=sys.stderr, flush=True)
        noise = [ex.submit(run_cell, *cells[0]).result()["saved_prefill_tokens"] for _ in range(a.repeats - 1)]
    if noise:
        print(f"repeat of cell 0: saved_prefill_tokens {[rows[0]['saved_prefill_tokens']] + noise}", file=sys.stderr)
    with open(os.path.join(a.out, "grid.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "grid.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "policy_sets": {s: policy_set(s) for s in sets}, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, "grid.md"), "w") as f:
        f.write("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(fmt(r[c]) for c in COLS) + " |\n")
    plot(rows, os.path.join(a.out, "grid.png"))
    print(f"wrote {a.out}/grid.md, grid.csv, grid.json, grid.png in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
