"""Policy comparison grid: eviction x SSD admission x FDP placement x capacity, on real traces.

One command makes the table (markdown + CSV) and a PNG plot::

    python bench/policy_grid.py --out bench/results/policy_grid

For each trace (the Mooncake conversation trace and a synthetic agent workload,
:mod:`bench.agent_workload`), each eviction policy (``lru``, ``s3fifo``,
``cost``), SSD admission off/on (:class:`~tierstore.policies.admission.SecondSightingAdmission`)
and each capacity ``c`` (5%, 20%, 50% of the trace's unique full-block bytes;
host tier ``c/4``, NVMe tier ``c``, no HBM -- this machine has no GPU), the
trace is replayed through the real :class:`~tierstore.manager.TierManager`
(:func:`tierstore.replay.run_replay`).

NVMe stand-in. The NVMe tier is :class:`RecordingSlotStorage`: an in-memory
slot store (real bytes, real keys, so ``wrong_kv_blocks`` still checks every
load) that logs every write and delete with its slot, time and the predicted
lifetime class. After the replay the log is fed to the FTL model
(:class:`tierstore.fdp.ftl.FTLModel`; slot ``i`` = LBA range ``i * block_bytes``,
a delete is a TRIM) three times, for the three placements:

* ``none``      -- every write untagged (default handle);
* ``predicted`` -- handle = class from :class:`~tierstore.policies.lifetime.PrefixLifetimePredictor`;
* ``oracle``    -- handle = class of the block's true flash lifetime (known after the replay).

Placement only tags writes, it does not change which blocks are cached, so one
replay serves all three placements. True classes: flash lifetimes (write to
delete, trace seconds) split at their 33rd/67th percentiles (SHORT / MEDIUM /
LONG); blocks alive at the end count as LONG if already older than the 67th
percentile, else are left out. Prediction accuracy is against these classes
(a constant guess scores about 1/3).

Load latency is *modelled* (the stand-in has no device): per request,
``sum(load_s(tier, reference_block_bytes))`` over the loaded blocks, from the
cost model at the reference scale (512-token blocks of Llama-3.1-8B, 64 MiB;
host 20 GB/s, NVMe 2 GB/s, :class:`~tierstore.policies.cost.CostModel`
defaults). Saved prefill seconds use ``prefill_tokens_per_s`` (default 10,000 tok/s).

Determinism: the replay, the policies, admission and the agent generator
(fixed seed) are deterministic, so counts are identical run to run (noise 0);
``--repeats`` re-runs a cell to check that.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tierstore.api import KVStore  # noqa: E402
from tierstore.errors import Status  # noqa: E402
from tierstore.fdp.ftl import FTLModel  # noqa: E402
from tierstore.policies.admission import make_admission  # noqa: E402
from tierstore.policies.cost import CostModel  # noqa: E402
from tierstore.policies.lifetime import PrefixLifetimePredictor, true_class  # noqa: E402
from tierstore.replay import REFERENCE_BLOCK_BYTES, ReplayConfig, run_replay  # noqa: E402
from tierstore.tiers.storage import BlockStorage  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE = os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
BLOCK_BYTES = 4096
POLICIES = ("lru", "s3fifo", "cost")
ADMISSION = ("none", "second")
CAPACITIES = (0.05, 0.20, 0.50)
PLACEMENTS = ("none", "predicted", "oracle")
MIN_FTL_SLOTS = 256


class RecordingSlotStorage(BlockStorage):
    """In-memory slot store that logs writes/deletes for the FTL model.

    Parameters
    ----------
    capacity_bytes, block_bytes : int
    clock : callable
        Trace clock (seconds) stamped on every log record.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, clock) -> None:
        self.block_bytes = block_bytes
        self.n_slots = capacity_bytes // block_bytes
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._slot: dict[bytes, int] = {}
        self._data: dict[bytes, torch.Tensor] = {}
        self.clock = clock
        self.log: list[tuple] = []  # ("w", t_s, slot, placement, key) | ("d", t_s, slot, key)

    def capacity_blocks(self) -> int:
        return self.n_slots

    def free_blocks(self) -> int:
        return len(self._free)

    def put(self, keys, blocks, placements=None, ns_digests=None):
        out = []
        for i, (k, b) in enumerate(zip(keys, blocks)):
            if k in self._slot:
                out.append(Status.EXISTS)
                continue
            if not self._free:
                out.append(Status.NO_SPACE)
                continue
            s = self._free.pop()
            self._slot[k] = s
            self._data[k] = b.detach().to("cpu", copy=True).reshape(-1)
            self.log.append(("w", self.clock(), s, None if placements is None else placements[i], k))
            out.append(Status.OK)
        return out

    def get(self, keys, dests):
        out = []
        for k, d in zip(keys, dests):
            b = self._data.get(k)
            if b is None:
                out.append(Status.MISS)
            else:
                d.copy_(b)
                out.append(Status.OK)
        return out

    def delete(self, keys):
        for k in keys:
            s = self._slot.pop(k, None)
            if s is not None:
                del self._data[k]
                self._free.append(s)
                self.log.append(("d", self.clock(), s, k))

    def contains(self, key):
        return key in self._slot

    def keys(self):
        return []


def lifetimes(log, end_s: float):
    """Per write record index: (lifetime_s, died). Writes are matched to the next delete of their key."""
    open_w: dict[bytes, int] = {}
    out = {}
    for i, rec in enumerate(log):
        if rec[0] == "w":
            open_w[rec[4]] = i
        else:
            j = open_w.pop(rec[3], None)
            if j is not None:
                out[j] = (rec[1] - log[j][1], True)
    for k, j in open_w.items():
        out[j] = (end_s - log[j][1], False)
    return out


def ftl_waf(log, n_slots: int, block_bytes: int, placement_of) -> float:
    """Feed the write/trim log to an FTL model; returns its WAF (MBMW / HBMW).

    ``nan`` for a tier under ``MIN_FTL_SLOTS`` blocks: too few reclaim units for
    the open streams plus the GC reserve at 7% over-provisioning.
    """
    if n_slots < MIN_FTL_SLOTS:
        return float("nan")
    page = 4096
    cap = n_slots * block_bytes // page * page
    ru = max(4, n_slots // 256) * page  # ~256 RUs: small enough that open RUs + GC reserve fit the OP
    ftl = FTLModel(capacity_bytes=cap, ru_size_bytes=ru, op_fraction=0.07, num_ruh=3, page_bytes=page,
                   gc_free_ru_min=3)
    for i, rec in enumerate(log):
        if rec[0] == "w":
            ftl.write(rec[2] * block_bytes, block_bytes, placement_of(i))
        else:
            ftl.trim(rec[2] * block_bytes, block_bytes)
    return ftl.stats()["waf"]


def run_cell(trace: str, policy: str, admission: str, cap: float, limit: int | None) -> dict:
    """Replay one cell; returns a row per placement."""
    predictor = PrefixLifetimePredictor()
    scale = REFERENCE_BLOCK_BYTES / BLOCK_BYTES
    cost = CostModel()  # load model at the reference block size: bandwidth scaled down by ``scale``
    cost.bandwidth_bytes_per_s = {t: bw / scale for t, bw in cost.bandwidth_bytes_per_s.items()}
    holder = {"lat": []}
    ref_cost = CostModel()

    def factory(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, clock):
        nv = RecordingSlotStorage(nvme_bytes, layout.bytes_per_block, clock)
        holder["nv"], holder["clock"] = nv, clock
        store = KVStore(layout, hbm_bytes=0, host_bytes=host_bytes, nvme=nv, eviction=policy, clock=clock,
                        admit_to_nvme=make_admission(admission), classify=predictor,
                        placement_of=lambda c: int(c), cost=cost)
        m = store.manager
        orig_load = m.load

        def load(keys, dests=None, promote=True):  # record the modelled load time of each load call
            tiers = [m.index[k].top_tier.label for k in keys if k in m.index]
            holder["lat"].append(sum(ref_cost.load_s(t, REFERENCE_BLOCK_BYTES) for t in tiers))
            return orig_load(keys, dests, promote)
        m.load = load
        return store

    def on_sample(store, sample):
        holder["snap"] = store.manager.metrics.snapshot()

    cfg = ReplayConfig(trace=trace, limit=limit, block_bytes=BLOCK_BYTES, hbm_fraction=0.0,
                       host_fraction=cap / 4, nvme_fraction=cap, eviction=policy, sample_every=10 ** 9)
    t0 = time.perf_counter()
    rep = run_replay(cfg, store_factory=factory, on_sample=on_sample)
    wall = time.perf_counter() - t0
    kv = rep.kv
    nv = holder["nv"]
    end_s = holder["clock"]()
    life = lifetimes(nv.log, end_s)
    died = np.array([lt for lt, d in life.values() if d])
    if died.size >= 3:
        t_short, t_med = np.percentile(died, [33.3, 66.7])
    else:
        t_short = t_med = float("inf")
    truth = {}
    for j, (lt, d) in life.items():
        if d or lt >= t_med:
            truth[j] = true_class(lt, t_short, t_med)
    pred = {j: nv.log[j][3] for j in truth}
    acc = float(np.mean([int(pred[j]) == int(truth[j]) for j in truth])) if truth else float("nan")
    snap = holder["snap"]
    lat = np.asarray(holder["lat"]) if holder["lat"] else np.zeros(1)
    rows = []
    base = dict(trace=os.path.basename(trace).split(".")[0], eviction=policy, admission=admission,
                capacity=cap, requests=kv["requests"], lookup_hit_ratio=kv["lookup_hit_ratio"],
                useful_hit_ratio=kv["useful_hit_ratio"], saved_prefill_tokens=kv["saved_prefill_tokens"],
                saved_prefill_s=kv["saved_prefill_tokens"] / ref_cost.prefill_tokens_per_s,
                hit_blocks_host=kv["hit_blocks_host"], hit_blocks_nvme=kv["hit_blocks_nvme"],
                nvme_write_bytes=kv["nvme_write_bytes"],
                nvme_write_bytes_ref=int(kv["nvme_write_bytes"] * scale),
                kept_off_flash_bytes=int(snap.get("admission_rejected_bytes", 0)),
                admission_lost_blocks=int(snap.get("admission_lost_blocks", 0)),
                load_p50_ms=float(np.percentile(lat, 50)) * 1e3, load_p99_ms=float(np.percentile(lat, 99)) * 1e3,
                wrong_kv_blocks=kv["wrong_kv_blocks"], lifetime_accuracy=acc, wall_s=wall)
    for pl in PLACEMENTS:
        if pl == "none":
            f = lambda i: None  # noqa: E731
        elif pl == "predicted":
            f = lambda i: int(nv.log[i][3])  # noqa: E731
        else:
            def f(i, _life=life):
                lt, _ = _life[i]
                return int(true_class(lt, t_short, t_med))
        rows.append(dict(base, placement=pl, waf=ftl_waf(nv.log, nv.n_slots, BLOCK_BYTES, f)))
    return rows


COLS = ["trace", "eviction", "admission", "capacity", "placement", "lookup_hit_ratio", "useful_hit_ratio",
        "saved_prefill_tokens", "saved_prefill_s", "nvme_write_bytes_ref", "kept_off_flash_bytes",
        "admission_lost_blocks", "waf", "lifetime_accuracy", "load_p50_ms", "load_p99_ms", "wrong_kv_blocks",
        "wall_s"]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def plot(rows, path: str) -> None:
    """Saved prefill tokens vs capacity per policy (admission off/on), one panel per trace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(2, len(traces), figsize=(6 * len(traces), 8), squeeze=False)
    for j, tr in enumerate(traces):
        for pol in POLICIES:
            for adm, ls in (("none", "-"), ("second", "--")):
                sel = sorted((r for r in rows if r["trace"] == tr and r["eviction"] == pol and r["admission"] == adm
                              and r["placement"] == "none"), key=lambda r: r["capacity"])
                if not sel:
                    continue
                x = [100 * r["capacity"] for r in sel]
                axes[0, j].plot(x, [r["saved_prefill_tokens"] / 1e6 for r in sel], ls, marker="o",
                                label=f"{pol}, admission={adm}")
                axes[1, j].plot(x, [r["nvme_write_bytes_ref"] / 2 ** 40 for r in sel], ls, marker="o",
                                label=f"{pol}, admission={adm}")
        axes[0, j].set_title(f"{tr}: saved prefill tokens")
        axes[0, j].set_ylabel("saved prefill tokens (M)")
        axes[1, j].set_title(f"{tr}: NVMe bytes written (64 MiB blocks)")
        axes[1, j].set_ylabel("TiB written")
        for a in axes[:, j]:
            a.set_xlabel("NVMe capacity, % of unique bytes (host = 1/4 of it)")
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="eviction x admission x placement x capacity grid")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "policy_grid"))
    ap.add_argument("--mooncake", default=MOONCAKE)
    ap.add_argument("--agent-sessions", type=int, default=600)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="re-run the first cell to measure run-to-run noise")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from agent_workload import AgentWorkload  # bench/ is on sys.path when run as a script
    agent = os.path.join(a.out, "agent_workload.jsonl")
    AgentWorkload(sessions=a.agent_sessions, seed=0).write(agent)
    cells = [(tr, p, ad, c, a.limit) for tr in (a.mooncake, agent) for c in CAPACITIES for p in POLICIES
             for ad in ADMISSION]
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for i, res in enumerate(ex.map(run_cell, *zip(*cells))):
            rows.extend(res)
            r = res[0]
            print(f"[{i + 1}/{len(cells)} {time.perf_counter() - t0:.0f}s] {r['trace']} {r['eviction']} "
                  f"adm={r['admission']} cap={r['capacity']}: saved={r['saved_prefill_tokens']} "
                  f"hit={r['lookup_hit_ratio']:.3f}", file=sys.stderr, flush=True)
        noise = []
        for _ in range(a.repeats - 1):
            noise.append(ex.submit(run_cell, *cells[0]).result()[0]["saved_prefill_tokens"])
    if noise:
        print(f"repeat of cell 0: saved_prefill_tokens {[rows[0]['saved_prefill_tokens']] + noise}", file=sys.stderr)
    with open(os.path.join(a.out, "grid.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "grid.md"), "w") as f:
        f.write("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(fmt(r[c]) for c in COLS) + " |\n")
    plot(rows, os.path.join(a.out, "grid.png"))
    print(f"wrote {a.out}/grid.md, grid.csv, grid.png in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
