#!/usr/bin/env python3
"""Issue 26 items 2-3: the frontier through the REAL store (run_replay) onto the FTL model.

Per workload (``bench/frontier_sim.py``'s capacity points: ``excerpt``, ``conv10``, ``conv40``,
``agent10``, ``agent40``), utilisation (``--utils``) and isolation (``--isolations``; only
multi-handle configurations differ) it replays the trace through :func:`tierstore.replay.run_replay`
on ``tiers.nvme.device: sim`` (the FTL model of :mod:`tierstore.fdp.ftl`, **not an SSD**; RU =
device / 60) once per configuration of :data:`CONFIGS`:

* ``a`` region LRU (the default), ``b`` region FIFO + clock copy-forward, ``c`` per-block LRU on a
  conventional device (one handle), ``d-<name>`` per-block LRU with FDP placement by the
  classifier ``<name>`` of :data:`tierstore.policies.registry.CLASSIFIER`.

Each row holds saved prefill tokens, host WA, the model's device WAF and e2e WA (NAND bytes / bytes
the index asked NVMe to keep), NAND bytes, and the placement's accuracy against the true NVMe death
times (:class:`tierstore.bench.lifetimes.LifetimeRecorder`: tercile classes, the expected accuracy
of a random handle assignment with the same handle shares, Spearman), plus the features each write
had (``--features`` dumps them for the offline "learned mix" check, :func:`fit_mix`). Counts are
deterministic (trace time, no timing): the host's load does not change them; it is recorded anyway.

    python bench/frontier_store.py --workload excerpt --json R/rows.jsonl --resume
    python bench/frontier_store.py --report R/rows.jsonl --out R     # tables + one PNG per workload
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

import numpy as np

from tierstore import Namespace, Status
from tierstore.bench.lifetimes import LifetimeRecorder
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.identity import chain_ids
from tierstore.policies.registry import CLASSIFIER
from tierstore.replay import ReplayConfig, run_replay


def _sibling(name: str):
    """``bench/<name>.py`` as a module (the bench scripts are not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_fs = _sibling("frontier_sim")
load_workload, reference_row = _fs.load_workload, _fs.reference_row

_BLOCK = {"eviction_granularity": "block"}
#: ``name -> (what, policies overrides, nvme overrides)``; ``d-<classifier>`` are added per registry name.
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "a": ("region LRU (default), one handle", {}, {}),
    "b": ("region FIFO + clock copy-forward, one handle", {"reinsert": "clock"}, {"region_policy": "fifo"}),
    "c": (
        "per-block LRU, GC keeps hit (clock), conventional (one handle)",
        {"reinsert": "clock"},
        dict(_BLOCK),
    ),
}
for _n in CLASSIFIER.names():
    CONFIGS[f"d-{_n}"] = (
        f"per-block LRU, GC clock, FDP, placement by classifier {_n}",
        {"reinsert": "clock", "classifier": _n},
        {**_BLOCK, "fdp": {"enabled": True}},
    )
#: Engine lifetime hints a row's stores carry (``source -> what``); rows without one pass none, as
#: ``tierstore.replay`` and the SGLang connector do (a store without hints: ``entry.lifetime`` None).
HINT_SOURCES = {
    "engine": "the simulator's perfect engine class (frontier_sim.engine_classes): READS THE FUTURE",
    "engine-req10": "the same, 10 % of the requests give their new blocks one random class: READS THE FUTURE",
    "system14": "the vLLM connector's rule, system_prompt_blocks=14 'system', others 'conversation': honest",
}
#: ``config -> (base config, eviction policy, hint source)``: the class-first order (``class_lru``)
#: and the engine hints, on per-block LRU with placement by ``hint`` (``d-hint``).
HINTED = {
    "d-hint-cls": ("d-hint", "class_lru", None),
    "d-hint-eng": ("d-hint", "lru", "engine"),
    "d-hint-cls-eng": ("d-hint", "class_lru", "engine"),
    "d-hint-cls-eng10": ("d-hint", "class_lru", "engine-req10"),
    "d-hint-cls-sys": ("d-hint", "class_lru", "system14"),
}
for _n, (_base, _ev, _src) in HINTED.items():
    _w, _p, _v = CONFIGS[_base]
    CONFIGS[_n] = (f"{_w}; eviction {_ev}; engine hints: {_src or 'none'}", {**_p, "eviction": _ev}, _v)
SIMULATED = "FTL model (tierstore/fdp/ftl.py), not an SSD"
_HINT_NAMES = {int(LifetimeClass.SHORT): "query", int(LifetimeClass.MEDIUM): "conversation", 2: "system"}


def hint_map(wl, source: str) -> dict[bytes, str]:
    """The engine hint of every block key the replay stores (:data:`HINT_SOURCES`): the replay's
    keys (``chain_ids`` of the replay's namespace) against the trace's chain ids (``wl.keys``)."""
    if source == "system14":
        cls = None
    else:
        cls = _fs.engine_classes(
            wl.keys, wl.n_blocks, 0.1 if source.endswith("req10") else 0.0, per_request=True
        )
    ns = Namespace(model="mooncake-trace", kv_dtype="bf16").digest()  # tierstore.replay's
    out: dict[bytes, str] = {}
    for r, ids in zip(wl.requests, wl.keys):
        for pos, (key, b) in enumerate(zip(chain_ids(ns, r.hash_ids[: r.full_blocks()]), ids)):
            if cls is None:
                out[key] = "system" if pos < 14 else "conversation"
            else:
                out[key] = _HINT_NAMES[cls[b]]
    return out


def hinted_stores(store, hints: dict[bytes, str]) -> None:
    """Make ``store.store_keys`` pass each block's engine hint, one call per run of equal hints (as
    the vLLM connector's ``_lifetime_runs`` does); after a run with a block not stored (neither OK
    nor EXISTS) the rest of the chain is not stored (``NO_SPACE``: it would be unreachable)."""
    plain = store.store_keys

    def store_keys(ns, keys, blocks, *, lifetime=None, first_position=0, wait=True):
        assert lifetime is None and wait, "the replay passes no hint and waits"
        out: list = []
        i = 0
        while i < len(keys):
            h = hints[keys[i]]
            j = i + 1
            while j < len(keys) and hints[keys[j]] == h:
                j += 1
            st = plain(ns, keys[i:j], blocks[i:j], lifetime=h, first_position=first_position + i)
            out += st
            if any(x not in (Status.OK, Status.EXISTS) for x in st):
                out += [Status.NO_SPACE] * (len(keys) - j)
                break
            i = j
        return out

    store.store_keys = store_keys


class FeatureRecorder(LifetimeRecorder):
    """:class:`LifetimeRecorder` that also keeps each write's features (hits, age_s, idle_s, position)."""

    def __init__(self, classify) -> None:
        super().__init__(classify)
        self.features: list[tuple[int, float, float, int]] = []

    def __call__(self, entry, now_s: float):
        n = len(self.writes)
        c = super().__call__(entry, now_s)
        if len(self.writes) > n:
            self.features.append(
                (entry.hits, now_s - entry.created_s, now_s - entry.last_access_s, entry.position)
            )
        return c


def run_one(
    wl, name: str, util: float, isolation: str, device: dict | None = None, on_open_also=None
) -> tuple[dict, FeatureRecorder]:
    """One configuration through the real store (module doc).

    ``device``: ``None`` for the FTL model (``device: sim``, RU = segment = device / 60); else
    further ``tiers.nvme`` fields that name a real device (``device: fdp``, ``path``,
    ``segment_size_bytes``, ``journal_path``, ``model`` ...; ``bench/fdp_vm_handles.py``), the
    configuration's own fields on top. ``on_open_also(store)`` runs once the store is open.
    """
    what, pol, nv_over = CONFIGS[name]
    rec = FeatureRecorder(pol.get("classifier", "hint"))
    if device is None:
        nv = {"device": "sim", "engine": "memory", "model": {"utilization": util, "isolation": isolation}}
    else:
        nv = dict(device)
    nv.update(nv_over)
    src = HINTED.get(name, (None, None, None))[2]
    hints = hint_map(wl, src) if src else None
    placed: dict = {}

    def on_open(store) -> None:
        rec.on_open(store)
        if hints is not None:
            hinted_stores(store, hints)
        pl = store.placement
        if pl is not None and pl.enabled:  # the PID each lifetime class is written with
            placed.update({c.name: int(p) for c, p in pl.class_pid.items()}, default=int(pl.default_pid))
        if on_open_also is not None:
            on_open_also(store)

    t0 = time.perf_counter()
    l0 = os.getloadavg()[0]
    rep = run_replay(
        ReplayConfig(
            trace=wl.trace,
            limit=wl.limit,
            block_bytes=wl.block_bytes,
            hbm_bytes=wl.hbm_bytes,
            host_bytes=wl.host_bytes,
            nvme_bytes=wl.nvme_bytes,
            nvme_options=nv,
            policies=pol,
            runtime={"classify": rec},
            sample_every=1,
        ),
        on_sample=rec.on_sample,
        on_open=on_open,
    )
    kv, d = rep.kv, rep.device
    nb = rep.final_stats.get("nvme_backend", {})
    acc = rec.summary()
    row = {
        "workload": wl.name,
        "config": name,
        "what": what,
        "hints": src,
        "hints_read_future": bool(src and "FUTURE" in HINT_SOURCES[src]),
        "util": util,
        "isolation": isolation,
        "requests": kv["requests"],
        "hit_ratio": kv["lookup_hit_ratio"],
        "saved_prefill_tokens": kv["saved_prefill_tokens"],
        "hit_blocks_nvme": kv["hit_blocks_nvme"],
        "nvme_write_bytes": kv["nvme_write_bytes"],
        "host_wa": d.get("host_write_amplification"),
        "device_waf": d.get("waf"),
        "e2e_wa": d.get("e2e_wa"),
        "nand_bytes": d.get("mbmw_bytes"),
        "gc_bytes_written": nb.get("gc_bytes_written"),
        "block_evictions": nb.get("block_evictions", 0),
        "gc_evicted_blocks": nb.get("gc_evicted_blocks", 0),
        "trimmed_bytes": nb.get("trimmed_bytes", 0),
        "segment_size_bytes": d.get("segment_size_bytes"),
        "ruh_bytes": d.get("ruh_bytes"),
        "class_pid": placed,
        "wrong_kv_blocks": kv["wrong_kv_blocks"],
        "placement": acc,
        "simulated": SIMULATED,
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_start": round(l0, 2),
        "loadavg_end": round(os.getloadavg()[0], 2),
    }
    return row, rec


def fit_mix(feats: np.ndarray, life: np.ndarray, died: np.ndarray, shares, seed: int = 0) -> dict:
    """The "learned mix" check: fit a 3-class multinomial logistic regression on the first half of
    the writes (features ``log1p`` of hits, age_s, idle_s, position; labels: tercile classes of the
    true lifetimes) and score the second half, its expected class cut into the given ``shares`` of
    the handles (thirds: every handle used). Returns its accuracy, the same-shares chance and the
    number of writes judged."""
    from tierstore.bench.lifetimes import tercile_bounds
    from tierstore.policies.lifetime import true_class

    if died.sum() < 30:
        return {"accuracy": float("nan")}
    lo, hi = tercile_bounds(life[died])
    judged = died | (life >= hi)
    x = np.log1p(np.maximum(feats[judged], 0.0))
    y = np.array([int(true_class(v, lo, hi)) for v in life[judged]])
    half = x.shape[0] // 2
    mu, sd = x[:half].mean(0), x[:half].std(0) + 1e-9
    z = np.c_[(x - mu) / sd, np.ones(x.shape[0])]
    w = np.zeros((z.shape[1], 3))
    onehot = np.eye(3)[y[:half]]
    for _ in range(300):  # plain gradient descent on the softmax cross-entropy (no library needed)
        p = np.exp(z[:half] @ w)
        p /= p.sum(1, keepdims=True)
        w -= 0.5 * z[:half].T @ (p - onehot) / half
    score = z[half:] @ w
    # expected class (0..2) as one score; cut at the shares so the handle shares match the rule's
    s = (np.exp(score) / np.exp(score).sum(1, keepdims=True)) @ np.arange(3)
    cuts = np.quantile(s, np.cumsum(shares)[:2])
    pred = np.searchsorted(cuts, s, side="right")
    t = y[half:]
    ps, ts = np.bincount(pred, minlength=3) / t.size, np.bincount(t, minlength=3) / t.size
    return {
        "accuracy": float((pred == t).mean()),
        "chance_same_shares": float(ps @ ts),
        "judged": int(t.size),
    }


def _row_with_refs(row: dict, ref: dict, rec: FeatureRecorder) -> dict:
    row.update(
        flat_lru=ref["flat_lru"],
        flat_lru_saved_tokens=ref["flat_lru_saved_tokens"],
        belady=ref["belady"],
        belady_saved_tokens=ref["belady_saved_tokens"],
    )
    if row["config"].startswith("d-") and rec.features:
        life, died, _ = rec.lifetimes()
        row["placement"]["learned_mix"] = fit_mix(
            np.asarray(rec.features, dtype=float), life, died, [1 / 3] * 3
        )
    return row


def sweep(a) -> None:
    """Run ``a.configs`` x ``a.utils`` x ``a.isolations`` on ``a.workload``, one JSON row each."""
    wl = load_workload(a.workload, a.trace, a.limit, 32 << 10, a.agent_trace)
    ref = reference_row(wl)
    done = set()
    if a.resume and a.json and os.path.exists(a.json):
        with open(a.json) as f:
            done = {(r["workload"], r["config"], r["util"], r["isolation"]) for r in map(json.loads, f)}
    for name in a.configs.split(","):
        multi = CONFIGS[name][2].get("fdp", {}).get("enabled", False)
        for u in (float(x) for x in a.utils.split(",")):
            for iso in a.isolations.split(",") if multi else ["initial"]:
                if (wl.name, name, u, iso) in done:
                    continue
                row, rec = run_one(wl, name, u, iso)
                row = _row_with_refs(row, ref, rec)
                if a.features:
                    np.savez_compressed(
                        f"{a.features}_{wl.name}_{name}_{u}_{iso}.npz",
                        features=np.asarray(rec.features),
                        life=rec.lifetimes()[0],
                        died=rec.lifetimes()[1],
                        pred=rec.lifetimes()[2],
                    )
                p = row["placement"]
                print(
                    f"{wl.name} {name} u={u} {iso}: saved {row['saved_prefill_tokens']:,} "
                    f"(flat LRU {row['flat_lru_saved_tokens']:,}) e2e WA {row['e2e_wa']:.4f} "
                    f"(FTL model) acc {p.get('accuracy', float('nan')):.3f} "
                    f"chance {p.get('chance_same_shares', float('nan')):.3f} {row['wall_s']} s "
                    f"load {row['loadavg_end']}",
                    flush=True,
                )
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _pct(v: int, flat: int) -> str:
    return f"{100 * (v - flat) / flat:+.2f} %"


def summary(rows: list[dict], wa_max: float = 1.10) -> list[str]:
    """Per workload and utilisation: the flat LRU, the best (d) at e2e WA <= ``wa_max`` (initial
    isolation; rows whose hints read the future are left out) and its gap, and what the same
    per-block eviction costs on a conventional device (c)."""
    out = [
        f"| workload | util | flat LRU saved tokens | best (d) at e2e WA <= {wa_max} (else best) "
        "| saved (vs flat LRU) | "
        "e2e WA, FDP (device WAF), FTL model | (c) conventional: saved | e2e WA (device WAF), FTL model | "
        "(a) region default: saved (e2e WA) | (b) region FIFO+clock: saved (e2e WA) | (d) wins? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for u in sorted({r["util"] for r in rows if r["workload"] == wl}):
            rs = {
                r["config"]: r
                for r in rows
                if r["workload"] == wl and r["util"] == u and r["isolation"] == "initial"
            }
            flat = next(iter(rs.values()))["flat_lru_saved_tokens"]
            every = [r for n, r in rs.items() if n.startswith("d-") and not r.get("hints_read_future")]
            ds = [r for r in every if r["e2e_wa"] <= wa_max] or every  # none within the bound: the best
            d = max(ds, key=lambda r: (r["saved_prefill_tokens"], -r["e2e_wa"]), default=None)
            c, a, b = rs.get("c"), rs.get("a"), rs.get("b")

            def cell(r):
                return "-" if r is None else f"{r['saved_prefill_tokens']:,} ({r['e2e_wa']:.4f})"

            out.append(
                f"| {wl} | {u:.2f} | {flat:,} | "
                + (
                    f"`{d['config']}`{'' if d['e2e_wa'] <= wa_max else ' (over the bound)'} | "
                    f"{d['saved_prefill_tokens']:,} "
                    f"({_pct(d['saved_prefill_tokens'], flat)}) | "
                    f"{d['e2e_wa']:.4f} ({d['device_waf']:.4f})"
                    if d
                    else "none | - | -"
                )
                + (
                    f" | {c['saved_prefill_tokens']:,} | {c['e2e_wa']:.4f} ({c['device_waf']:.4f})"
                    if c
                    else " | - | -"
                )
                + f" | {cell(a)} | {cell(b)} | "
                + ("yes" if d and d["saved_prefill_tokens"] >= flat and d["e2e_wa"] <= wa_max else "**no**")
                + " |"
            )
    return out


def fdp_vs_conventional(rows: list[dict], placed: str = "d-hint") -> list[str]:
    """The same per-block eviction on a conventional device (c) and with FDP placement (``placed``,
    the default classifier; both isolation types): saved prefill, device WAF and e2e WA."""
    out = [
        "| workload | util | saved prefill tokens, conventional / FDP | device WAF: conventional "
        "| FDP initially "
        "isolated | FDP persistently isolated | e2e WA: conventional | FDP initially isolated | "
        "FDP persistently isolated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for u in sorted({r["util"] for r in rows if r["workload"] == wl}):
            at = {(r["config"], r["isolation"]): r for r in rows if r["workload"] == wl and r["util"] == u}
            c, di, dp = at.get(("c", "initial")), at.get((placed, "initial")), at.get((placed, "persistent"))
            if c is None or di is None:
                continue

            def f(r, k):
                return "-" if r is None else f"{r[k]:.4f}"

            out.append(
                f"| {wl} | {u:.2f} | {c['saved_prefill_tokens']:,} / {di['saved_prefill_tokens']:,} | "
                f"{f(c, 'device_waf')} | {f(di, 'device_waf')} | {f(dp, 'device_waf')} | {f(c, 'e2e_wa')} | "
                f"{f(di, 'e2e_wa')} | {f(dp, 'e2e_wa')} |"
            )
    return out


def report(rows: list[dict], out_dir: str | None = None, wa_max: float = 1.10) -> str:
    """Markdown tables (frontier, placement accuracy, FDP vs conventional) and one PNG per workload."""
    out = [f"(every WA: {SIMULATED})", "", *summary(rows, wa_max), "", *fdp_vs_conventional(rows), ""]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == wl]
        flat = rs[0]["flat_lru_saved_tokens"]
        out += [
            f"**{wl}**: flat LRU {flat:,} saved tokens ({rs[0]['flat_lru']:.4f}), Belady "
            f"{rs[0]['belady_saved_tokens']:,} ({rs[0]['belady']:.4f})",
            "",
            "| config | util | isolation | saved prefill tokens | vs flat LRU | host WA "
            "| device WAF (FTL model) "
            "| e2e WA (FTL model) | placement accuracy | chance (same shares) | Spearman |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rs, key=lambda r: (r["util"], r["config"], r["isolation"])):
            p = r["placement"]
            acc = (
                f"{p['accuracy']:.3f}" if r["config"].startswith("d-") and "chance_same_shares" in p else "-"
            )
            ch = f"{p['chance_same_shares']:.3f}" if acc != "-" else "-"
            sp = f"{p['spearman']:.3f}" if acc != "-" else "-"
            out.append(
                f"| `{r['config']}` | {r['util']:.2f} | {r['isolation']} | {r['saved_prefill_tokens']:,} | "
                f"{_pct(r['saved_prefill_tokens'], flat)} | {r['host_wa']:.4f} | {r['device_waf']:.4f} | "
                f"{r['e2e_wa']:.4f} | {acc} | {ch} | {sp} |"
            )
        win = [
            r
            for r in rs
            if r["config"].startswith("d-") and r["e2e_wa"] <= wa_max and r["saved_prefill_tokens"] >= flat
        ]
        out += [
            "",
            f"(d) at saved >= flat LRU and e2e WA <= {wa_max} (FTL model): "
            + (
                ", ".join(
                    f"`{r['config']}` u={r['util']}"
                    + (" (its hints READ THE FUTURE)" if r.get("hints_read_future") else "")
                    for r in win
                )
                or "**none**"
            ),
            "",
        ]
        if out_dir:
            _plot(rs, wl, os.path.join(out_dir, f"frontier_store_{wl}.png"), wa_max)
    return "\n".join(out)


def _plot(rows: list[dict], wl: str, path: str, wa_max: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    color = {"a": "tab:blue", "b": "tab:cyan", "c": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        c = color.get(r["config"], "tab:red")
        filled = r["util"] < 0.95
        mk = "o" if r["isolation"] == "initial" else "^"
        ax.scatter(
            r["e2e_wa"],
            r["saved_prefill_tokens"] / 1e6,
            s=30,
            marker=mk if filled else "s",
            facecolors=c if filled else "none",
            edgecolors=c,
        )
        ax.annotate(
            f"{r['config']}",
            (r["e2e_wa"], r["saved_prefill_tokens"] / 1e6),
            fontsize=6,
            xytext=(2, 2),
            textcoords="offset points",
        )
    flat, opt = rows[0]["flat_lru_saved_tokens"] / 1e6, rows[0]["belady_saved_tokens"] / 1e6
    ax.axhline(flat, color="k", ls="--", lw=1, label="flat LRU, same blocks")
    ax.axhline(opt, color="k", ls=":", lw=1, label="Belady MIN, same blocks")
    ax.axvspan(1.0, wa_max, color="0.9", zorder=0, label=f"e2e WA <= {wa_max}")
    for name, c in [
        ("a region LRU", "tab:blue"),
        ("b region FIFO+clock", "tab:cyan"),
        ("c per-block, one handle", "tab:orange"),
        ("d per-block + placement (FDP)", "tab:red"),
    ]:
        ax.scatter([], [], color=c, label=name)
    ax.scatter([], [], marker="o", color="0.5", label="util 0.90 (triangle: persistent isolation)")
    ax.scatter([], [], marker="s", facecolors="none", edgecolors="0.5", label="util 1.00")
    ax.set_xlabel("end-to-end WA (NAND bytes / bytes the index wrote) - FTL model, not an SSD")
    ax.set_ylabel("saved prefill tokens (millions)")
    ax.set_title(f"{wl}: real store (run_replay) on the FTL model (bench/frontier_store.py)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="excerpt", help="excerpt, conv10, conv40, agent10, agent40")
    ap.add_argument("--trace", default=None)
    ap.add_argument(
        "--agent-trace", default=None, help="bench/agent_workload.py --sessions 200 --seed 0 output"
    )
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--configs",
        default=",".join(n for n in CONFIGS if n not in HINTED),
        help="default: every config without engine hints (HINTED ones are named explicitly)",
    )
    ap.add_argument("--utils", default="0.9,1.0")
    ap.add_argument("--isolations", default="initial,persistent")
    ap.add_argument("--json", default=None, help="append one row per run")
    ap.add_argument("--resume", action="store_true", help="skip rows already in --json")
    ap.add_argument("--features", default=None, help="path prefix: dump each run's write features (.npz)")
    ap.add_argument("--report", default=None, metavar="JSONL")
    ap.add_argument("--out", default=None, help="directory of --report's PNGs")
    a = ap.parse_args(argv)
    if a.report:
        print(report(load(a.report), a.out))
        return 0
    sweep(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
