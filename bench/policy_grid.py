"""Policy comparison grid: configured policy sets x capacity x trace, through the real store onto the FTL
model.

One command makes the table (markdown + CSV + JSON) and a PNG plot::

    python bench/policy_grid.py --out bench/results/policy_grid

``python bench/policy_grid.py sweep ...`` is the placement sweep (:data:`SWEEP_DOC`, was
``bench/fdp_trace.py``): the same replay onto the FTL model over utilisation x RU size x placement
(none, lifetime class, oracle).

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
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from tierstore.bench.lifetimes import LifetimeRecorder, OracleClassifier, tercile_bounds
from tierstore.bench.references import distance, references
from tierstore.replay import REFERENCE_BLOCK_BYTES, ReplayConfig, run_replay, unique_full_blocks
from tierstore.trace import read_mooncake

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE = os.path.normpath(
    os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
)
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
    "lru+second": {
        "eviction": "lru",
        "admission": "second",
        "promotion": "top",
        "reinsert": "none",
        "region_policy": "lru",
    },
    "exclusive": {"eviction": "lru", "promotion": "none", "reinsert": "none", "region_policy": "lru"},
    "exclusive+fifo+clock": {
        "eviction": "lru",
        "promotion": "none",
        "reinsert": "clock",
        "region_policy": "fifo",
    },
    "top+fifo+clock": {"eviction": "lru", "promotion": "top", "reinsert": "clock", "region_policy": "fifo"},
    "exclusive+fifo+clock+b32": {
        "eviction": "lru",
        "promotion": "none",
        "reinsert": "clock",
        "region_policy": "fifo",
        "evict_batch_blocks": 32,
    },
    "top+fifo+clock+b32": {
        "eviction": "lru",
        "promotion": "top",
        "reinsert": "clock",
        "region_policy": "fifo",
        "evict_batch_blocks": 32,
    },
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


def run_cell(
    trace: str,
    set_name: str,
    cap,
    limit: int | None,
    block_bytes: int = BLOCK_BYTES,
    utilization: float = 0.9,
    dataplacement: str = "none",
    device: str = "sim",
) -> dict:
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
    uniq = unique_full_blocks(reqs)
    sizes = tier_sizes(cap, uniq, block_bytes)
    if device == "sim":
        nvme_opts = {
            "device": "sim",
            "engine": "memory",
            "model": {"utilization": utilization},
            "fdp": {"enabled": dataplacement == "fdp"},
            **nv,
        }
    else:  # as tierstore bench: a file in a temporary directory, an FTL model observing it
        nvme_opts = {
            "device": "file",
            "engine": "auto",
            "model": {"op_fraction": 0.07},
            "fdp": {"enabled": dataplacement == "fdp"},
            **nv,
        }
    kw = {} if eviction is None else {"eviction": eviction}
    tmp = tempfile.mkdtemp(prefix="policy-grid-") if device == "file" else None
    if tmp:
        nvme_opts["path"] = os.path.join(tmp, "kvtrace.0.0")
    cfg = ReplayConfig(
        trace=trace,
        limit=limit,
        block_bytes=block_bytes,
        hbm_bytes=sizes["hbm"],
        host_bytes=sizes["host"],
        nvme_bytes=sizes["nvme"],
        sample_every=1,
        policies=pol,
        nvme_options=nvme_opts,
        runtime={"classify": rec},
        directory=tmp,
        **kw,
    )
    t0 = time.perf_counter()
    try:
        rep = run_replay(cfg, on_open=rec.on_open, on_sample=rec.on_sample)
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    kv, d = rep.kv, rep.device
    cap_blocks = (
        kv["hbm_capacity_bytes"] + kv["host_capacity_bytes"] + kv["nvme_capacity_bytes"]
    ) // block_bytes
    ref = references(reqs, cap_blocks)
    dist = distance(kv["lookup_hit_ratio"], ref)
    life = rec.summary()
    scale = REFERENCE_BLOCK_BYTES / block_bytes
    return dict(
        trace=os.path.basename(trace).split(".")[0],
        policy_set=set_name,
        capacity=cap,
        dataplacement=dataplacement,
        device=device,
        nvme_capacity_blocks=kv["nvme_capacity_bytes"] // block_bytes,
        requests=kv["requests"],
        capacity_blocks=cap_blocks,
        capacity_fraction=ref["capacity_fraction"],
        lookup_hit_ratio=kv["lookup_hit_ratio"],
        useful_hit_ratio=kv["useful_hit_ratio"],
        flat_lru=ref["flat_lru"],
        belady=ref["belady"],
        vs_flat_lru=dist["vs_flat_lru"],
        gap_closed=dist["gap_closed"],
        ideal=kv["ideal_hit_ratio"],
        saved_prefill_tokens=kv["saved_prefill_tokens"],
        hit_blocks_hbm=kv["hit_blocks_hbm"],
        hit_blocks_host=kv["hit_blocks_host"],
        hit_blocks_nvme=kv["hit_blocks_nvme"],
        nvme_write_bytes=kv["nvme_write_bytes"],
        nvme_write_bytes_ref=int(kv["nvme_write_bytes"] * scale),
        kept_off_flash_bytes=int(rep.final_stats.get("admission_rejected_bytes", 0)),
        host_wa=d.get("host_write_amplification", float("nan")),
        device_waf=d.get("waf", float("nan")),
        e2e_wa=d.get("e2e_wa", float("nan")),
        lifetime_accuracy=life.get("accuracy", float("nan")),
        lifetime_chance=life.get("chance", float("nan")),
        lifetime_spearman=life.get("spearman", float("nan")),
        load_p50_ms=kv["load_lat_p50_ns"] / 1e6,
        load_p99_ms=kv["load_lat_p99_ns"] / 1e6,
        wrong_kv_blocks=kv["wrong_kv_blocks"],
        wall_s=round(wall, 1),
    )


#: Wall-clock columns: they vary run to run (everything else is a deterministic count).
TIMING_COLS = ("load_p50_ms", "load_p99_ms", "wall_s")

COLS = [
    "trace",
    "policy_set",
    "capacity",
    "device",
    "dataplacement",
    "capacity_blocks",
    "lookup_hit_ratio",
    "flat_lru",
    "belady",
    "vs_flat_lru",
    "gap_closed",
    "saved_prefill_tokens",
    "hit_blocks_hbm",
    "hit_blocks_host",
    "hit_blocks_nvme",
    "nvme_write_bytes_ref",
    "kept_off_flash_bytes",
    "host_wa",
    "device_waf",
    "e2e_wa",
    "lifetime_accuracy",
    "lifetime_chance",
    "lifetime_spearman",
    "load_p50_ms",
    "load_p99_ms",
    "wrong_kv_blocks",
    "wall_s",
]


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
            ax.plot(
                [100 * r["capacity_fraction"] for r in sel],
                [r["lookup_hit_ratio"] for r in sel],
                marker="o",
                label=name,
            )
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


def main(argv=None) -> int:
    """The grid; ``sweep ...``: the placement sweep (:func:`sweep_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        return sweep_main(argv[1:])
    ap = argparse.ArgumentParser(description="policy set x capacity x trace grid (simulated FDP device)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "policy_grid"))
    ap.add_argument("--mooncake", default=MOONCAKE)
    ap.add_argument("--agent-sessions", type=int, default=400)
    ap.add_argument("--traces", default="mooncake,agent")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    ap.add_argument(
        "--capacities",
        default=",".join(str(c) for c in CAPACITIES),
        help="fractions of the unique bytes (split 5/20/75 %%) or HBM/HOST/NVME sizes, e.g. 28m/112m/420m",
    )
    ap.add_argument(
        "--sets",
        default="default,lru,s3fifo,cost,lru+second,exclusive+fifo+clock",
        help=f"comma-separated policy sets ({', '.join(POLICY_SETS)}) or JSON objects",
    )
    ap.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument(
        "--device",
        default="sim",
        choices=("sim", "file"),
        help="file: the NVMe tier as tierstore bench puts it (hit ratios = the main job's); "
        "sim: the simulated FDP SSD (device WAF)",
    )
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
    cells = [
        (paths[tr], s, c, a.limit, a.block_bytes, a.utilization, "none", a.device)
        for tr in a.traces.split(",")
        for c in caps
        for s in sets
    ]
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for i, r in enumerate(ex.map(run_cell, *zip(*cells))):
            rows.append(r)
            print(
                f"[{i + 1}/{len(cells)} {time.perf_counter() - t0:.0f}s] {r['trace']} {r['policy_set']} "
                f"cap={r['capacity']}: hit={r['lookup_hit_ratio']:.4f} (flat LRU {r['flat_lru']:.4f}, "
                f"Belady {r['belady']:.4f}) host WA {r['host_wa']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        noise = [
            ex.submit(run_cell, *cells[0]).result()["saved_prefill_tokens"] for _ in range(a.repeats - 1)
        ]
    if noise:
        print(
            f"repeat of cell 0: saved_prefill_tokens {[rows[0]['saved_prefill_tokens']] + noise}",
            file=sys.stderr,
        )
    with open(os.path.join(a.out, "grid.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "grid.json"), "w") as f:
        json.dump(
            {"argv": sys.argv[1:], "policy_sets": {s: policy_set(s) for s in sets}, "rows": rows}, f, indent=1
        )
    with open(os.path.join(a.out, "grid.md"), "w") as f:
        f.write("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(fmt(r[c]) for c in COLS) + " |\n")
    plot(rows, os.path.join(a.out, "grid.png"))
    print(
        f"wrote {a.out}/grid.md, grid.csv, grid.json, grid.png in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    return 0


# ------------------------------------------------------------------------------------------------
# ``policy_grid.py sweep``: the placement sweep (was bench/fdp_trace.py, issues 4 and 18)

SWEEP_DOC = """The Mooncake trace through the real store onto the FDP model (issues 4 and 18).

For every (utilisation, RU size) point and every configured policy set, the
placements are replayed through the real block index and segment store (HBM
stand-in -> host -> NVMe, built by :func:`tierstore.build.build_store` from a
:class:`~tierstore.config.StoreConfig` with ``tiers.nvme.device: sim``: a
:class:`~tierstore.io.segments.SegmentStorage`, segment = RU, on
:class:`~tierstore.fdp.simdevice.SimFdpDevice` over
:class:`~tierstore.fdp.ftl.FTLModel`). **Every WAF/WA figure is simulated.**

* ``none``   -- no placement: every write untagged (default handle);
* ``class``  -- lifetime-class placement: the index's classifier
  (``policies.classifier``, or ``--classifier``) -> RUH -> PID from the
  device's RUH Status; a RUH Update when a segment opens;
* ``oracle`` -- a first pass (``none``, same point) records, per NVMe write of
  a key, when that copy left NVMe (:class:`tierstore.bench.lifetimes.LifetimeRecorder`);
  the second pass places each write by its bucketed true remaining lifetime
  (terciles of the first pass's lifetimes -> SHORT/MEDIUM/LONG handles).  The
  second pass evolves a little differently, so the oracle is exact only for the
  first pass.

Every row also gives the lifetime-class prediction accuracy against the true
death times of that replay.

Scaling: the trace's 512-token blocks are stored as ``--block-bytes`` (default
32 KiB, the replay default; 2048x smaller than Llama-3.1-8B's 64 MiB).  The
device's user capacity is 30 % of the trace's unique full-block bytes rounded
to a multiple of 240 x 64 KiB, so RU = device/240, /60, /15 are whole 64 KiB
multiples (a 16 GiB RU on a ~960 GiB SSD is 1/60).  The NVMe tier holds
``utilisation x device`` (whole RUs); HBM and host are 2 % and 8 % of unique
bytes, as in the default replay.

End-to-end WA = MBMW (NAND bytes the model wrote: headers, padding, host
copy-forward and device GC included) / bytes the index wrote to NVMe.

Usage::

    python bench/policy_grid.py sweep --json fdp_trace.json                       # full sweep
    python bench/policy_grid.py sweep --limit 600 --quick                         # smoke (~1 min)
    python bench/policy_grid.py sweep --utilizations 0.9 --ru-fractions 60 --configs default,lru
"""
DEVICE_FRACTION = 0.30  # device user capacity / unique trace bytes
RU_GRAIN = 240 * (64 << 10)


def run_point(args: dict) -> dict:
    """Replay one (placement, utilisation, RU) point; returns a result row.

    The store is built from a :class:`~tierstore.config.StoreConfig` (``device:
    sim``: :class:`~tierstore.fdp.simdevice.SimFdpDevice` over an
    :class:`~tierstore.fdp.ftl.FTLModel`, memory engine, or ``engine: null``
    with ``--no-data``); the classifier is recorded by
    :class:`~tierstore.bench.lifetimes.LifetimeRecorder`, which also finds every NVMe
    copy's true death time in the event stream.
    """
    util, ru, dev, mode = args["util"], args["ru"], args["device_bytes"], args["mode"]
    classifier = args.get("classifier", "hint")
    if mode == "oracle":
        classifier = OracleClassifier(args["deaths"], args["bounds_s"])
    rec = LifetimeRecorder(classifier)
    nvme_opts = {
        "device": "sim",
        "engine": args.get("engine", "memory"),
        "model": {
            "device_bytes": dev,
            "utilization": util,
            "ru_size_bytes": ru,
            "op_fraction": args["op"],
            "isolation": args["isolation"],
            "gc": args["gc"],
            **({"page_bytes": args["page_bytes"]} if args.get("page_bytes") else {}),
        },
        "fdp": {"enabled": mode != "none"},
    }
    if args.get("region_policy"):
        nvme_opts["region_policy"] = args["region_policy"]
    pol = dict(args.get("policies") or {})
    cfg = ReplayConfig(
        trace=args["trace"],
        limit=args["limit"],
        block_bytes=args["block_bytes"],
        nvme_bytes=0,
        eviction=args.get("eviction", "lru"),
        sample_every=1,
        policies=pol,
        nvme_options=nvme_opts,
        runtime={"classify": rec},
        keep_data=not args.get("no_data", False),
    )
    t0 = time.perf_counter()
    rep = run_replay(cfg, on_open=rec.on_open, on_sample=rec.on_sample)
    wall = time.perf_counter() - t0
    d = rep.device
    life = rec.summary()
    row = {
        "placement": mode,
        "config": args.get("config", "default"),
        "eviction": args.get("eviction", "lru"),
        "policies": pol,
        "classifier": classifier if isinstance(classifier, str) else type(classifier).__name__,
        "utilization": round(d["utilization"], 4),
        "ru_size_bytes": ru,
        "ru_fraction": f"1/{round(dev / ru)}",
        "device_bytes": dev,
        "nvme_bytes": d["nvme_bytes"],
        "saved_prefill_tokens": rep.kv["saved_prefill_tokens"],
        "hit_ratio": rep.kv["lookup_hit_ratio"],
        "ideal_hit_ratio": rep.kv["ideal_hit_ratio"],
        "wrong_kv_blocks": rep.kv["wrong_kv_blocks"],
        "e2e_wa": d["e2e_wa"],
        "device_waf": d["waf"],
        "host_wa": d["host_write_amplification"],
        "format_overhead": d["engine_write_bytes"] / max(1, d["host_user_bytes"] + d["host_gc_bytes"]),
        "tier_write_bytes": d["tier_write_bytes"],
        "mbmw_bytes": d["mbmw_bytes"],
        "hbmw_bytes": d["hbmw_bytes"],
        "mbe_bytes": d["mbe_bytes"],
        "ruh_bytes": d.get("ruh_bytes", {}),
        "ruh_gc_bytes": d.get("ruh_gc_bytes", {}),
        "device_gc_runs": d.get("gc_runs"),
        "ruh_updates": d.get("ruh_updates", 0),
        "replay_wall_s": round(wall, 1),
        "nvme_hits": rep.kv["hit_blocks_nvme"],
        "dropped_blocks": rep.kv["dropped_blocks"],
        "lifetime_accuracy": life.get("accuracy"),
        "lifetime_chance": life.get("chance"),
        "lifetime_spearman": life.get("spearman"),
        "lifetime_confusion": life.get("confusion"),
    }
    if mode == "oracle":
        row["oracle_unknown_writes"] = classifier.unknown
    if args.get("record"):
        row["_rec"] = rec
    return row


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """``policy_grid.py sweep``: the placement sweep (:data:`SWEEP_DOC`)."""
    ap = argparse.ArgumentParser(prog="policy_grid.py sweep", description=SWEEP_DOC.split("\n")[0])
    ap.add_argument("--trace", default=MOONCAKE, help="Mooncake JSONL (empty: the packaged excerpt)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--block-bytes", type=int, default=32 << 10)
    ap.add_argument("--utilizations", default="0.5,0.9,1.0")
    ap.add_argument("--ru-fractions", default="240,60,15", help="RU = device / N (swept at --sweep-util)")
    ap.add_argument("--base-ru-fraction", type=int, default=60, help="RU = device / N at every utilisation")
    ap.add_argument("--sweep-util", type=float, default=0.9)
    ap.add_argument("--op", type=float, default=0.07)
    ap.add_argument("--isolation", default="initial")
    ap.add_argument("--gc", default="greedy")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument(
        "--configs",
        default="default",
        help="policy sets (POLICY_SETS names, or JSON) replayed at every point",
    )
    ap.add_argument(
        "--placements",
        default="none,class,oracle",
        help="none, class (lifetime-class PIDs), "
        "oracle (a first 'none' pass records the true death times; the second places by them)",
    )
    ap.add_argument("--classifier", default="hint", help="classifier of the class placement")
    ap.add_argument(
        "--baseline-configs",
        default="lru,s3fifo,cost",
        help="further policy sets run without placement at the sweep point only "
        "(the 'best no-placement' reference)",
    )
    ap.add_argument(
        "--engine",
        default="memory",
        choices=("memory", "null"),
        help="null: account extents, keep no data (loads from NVMe then miss; for real block sizes)",
    )
    ap.add_argument(
        "--no-data",
        action="store_true",
        help="the accounting mode (tiers.keep_data: false, engine: null): real extent headers and "
        "padding, no payload bytes; NVMe hits count as hits (for 64 MiB blocks)",
    )
    ap.add_argument(
        "--page-bytes",
        type=int,
        default=None,
        help="the FTL model's mapping unit (default: the sim device's 4 KiB)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke: utilisation 0.9, RU 1/60 only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.trace = a.trace or None  # empty: the packaged 1,000-request excerpt
    reqs = read_mooncake(a.trace, a.limit)
    uniq_bytes = unique_full_blocks(reqs) * a.block_bytes
    dev = max(1, int(uniq_bytes * DEVICE_FRACTION) // RU_GRAIN) * RU_GRAIN
    utils = [float(x) for x in a.utilizations.split(",")]
    points = [(u, a.base_ru_fraction) for u in utils]
    points += [
        (a.sweep_util, f) for f in (int(x) for x in a.ru_fractions.split(",")) if f != a.base_ru_fraction
    ]
    if a.quick:
        points = [(a.sweep_util, a.base_ru_fraction)]
    base = {
        "trace": a.trace,
        "limit": a.limit,
        "block_bytes": a.block_bytes,
        "device_bytes": dev,
        "op": a.op,
        "isolation": a.isolation,
        "gc": a.gc,
        "engine": "null" if a.no_data else a.engine,
        "no_data": a.no_data,
        "page_bytes": a.page_bytes,
    }
    placements = a.placements.split(",")

    def conf(name):
        pol, nv = policy_set(name)
        return {
            "config": name,
            "eviction": pol.pop("eviction", "lru"),
            "policies": pol,
            "region_policy": nv.get("region_policy"),
        }

    jobs = []
    for u, f in points:
        args = {**base, "util": u, "ru": dev // f}
        for name in filter(None, a.configs.split(";" if "{" in a.configs else ",")):
            c = {**args, **conf(name)}
            if "class" in placements:
                jobs.append(("class", {**c, "classifier": a.classifier}))
            if "oracle" in placements:
                jobs.append(("pair", c))
            elif "none" in placements:
                jobs.append(("none", c))
        if (u, f) == (a.sweep_util, a.base_ru_fraction):
            for name in filter(None, a.baseline_configs.split(",")):
                jobs.append(("none", {**args, **conf(name)}))
    print(
        f"trace {a.trace}: {len(reqs)} requests, unique bytes {uniq_bytes}, block {a.block_bytes} B; "
        f"device {dev} B; {len(points)} points, {len(jobs)} jobs",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    if a.procs > 1:
        with mp.get_context("fork").Pool(a.procs) as pool:
            results = pool.map(_run_job, jobs)
    else:
        results = [_run_job(j) for j in jobs]
    rows = []
    for r in results:
        rows.extend(r)
    rows.sort(
        key=lambda r: (
            r["ru_size_bytes"],
            r["utilization"],
            ["none", "class", "oracle"].index(r["placement"]),
            r["config"],
        )
    )
    print_sweep_table(rows)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "config": {
                        **base,
                        "device_fraction_of_unique": DEVICE_FRACTION,
                        "requests": len(reqs),
                        "unique_bytes": uniq_bytes,
                        "simulated": "every WAF/WA figure is from the FTL model, not an SSD",
                    },
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


def _run_job(job) -> list[dict]:
    kind, args = job
    if kind in ("class", "none"):
        return [run_point({**args, "mode": kind})]
    a = run_point({**args, "mode": "none", "record": True})
    rec = a.pop("_rec")
    life, died, _ = rec.lifetimes()
    bounds = tercile_bounds(life[died]) if died.sum() >= 3 else (60.0, 600.0)
    c = run_point({**args, "mode": "oracle", "deaths": rec.deaths(), "bounds_s": bounds})
    c["oracle_bounds_s"] = list(bounds)
    return [a, c]


def print_sweep_table(rows: list[dict]) -> None:
    """Markdown table of the rows (simulated: every WA figure is the FTL model's)."""
    best_none: dict = {}
    for r in rows:
        if r["placement"] == "none" and r["e2e_wa"] <= 1.02:
            key = (r["ru_size_bytes"], r["utilization"])
            best_none[key] = max(best_none.get(key, 0), r["saved_prefill_tokens"])
    print(
        "| RU (of device) | utilisation | placement | config | saved prefill tokens | vs best none "
        "(WA<=1.02) | "
        "hit ratio | end-to-end WA | device WAF | host WA | format overhead | lifetime acc. | replay s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = best_none.get((r["ru_size_bytes"], r["utilization"]))
        rel = f"{100 * (r['saved_prefill_tokens'] / ref - 1):+.2f}%" if ref else "-"
        acc = r.get("lifetime_accuracy")
        print(
            f"| {r['ru_fraction']} ({r['ru_size_bytes'] / 2**20:.1f} MiB) | {r['utilization']:.2f} | "
            f"{r['placement']} | {r['config']} | {r['saved_prefill_tokens']:,} | {rel} | "
            f"{r['hit_ratio']:.4f} | "
            f"{r['e2e_wa']:.4f} | {r['device_waf']:.4f} | {r['host_wa']:.4f} | {r['format_overhead']:.4f} | "
            f"{'-' if acc is None else f'{acc:.3f}'} | {r['replay_wall_s']} |"
        )


if __name__ == "__main__":
    sys.exit(main())
