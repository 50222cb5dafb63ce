#!/usr/bin/env python
"""TTFT benchmark: cold prefill vs warm (tierstore hit from HBM / host / NVMe + suffix prefill).

One command (defaults: ~246M-parameter random Llama, fp32, CPU, prompts 1K..4K)::

    python bench/ttft_bench.py                      # writes bench/ttft_results.json and prints tables
    python bench/ttft_bench.py --lengths 16384      # the 16K prompt, where the machine allows it

For every prompt length ``n`` the prompt is ``n`` random tokens; an earlier request is
assumed to have stored its first ``prefix = floor((n - suffix) / T) * T`` tokens (the
conversation so far), and the measured request brings ``n - prefix`` new tokens.

* **cold TTFT**: full prefill of the ``n`` tokens (no store) + argmax of the last logits.
* **warm TTFT** per tier: ``lookup`` + ``load`` of the prefix blocks from a store that
  holds them only in that tier (HBM stand-in = a CPU block pool on a machine without
  GPU; host = a host block pool; NVMe = ``SegmentStorage`` with O_DIRECT reads on a
  file, so the page cache is bypassed), conversion into a ``DynamicCache``, prefill of
  the suffix, argmax.

Every figure is the median of ``--runs`` runs, with min and max. The warm first token
is checked against the cold one (and the max first-token logit difference recorded).
The break-even section times, for small cached prefixes ``p``, cold prefill of
``p + suffix`` tokens against NVMe load of ``p`` tokens + prefill of the suffix.
A least-squares fit ``t(n) = a + b n + c n^2`` of the cold times extrapolates to
lengths that were not run (reported as an extrapolation, never as a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tierstore import KVStore
from tierstore.integrations.hf import HFPrefixCache, cache_to_blocks
from tierstore.layout import dtype_from_name
from tierstore.policies.cost import CostModel

TIERS = ("hbm", "host", "nvme")


def build_model(args):
    """Seeded random Llama from ``LlamaConfig`` (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(32768, 2 * max(args.lengths)),
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(dtype_from_name(args.dtype)).eval()
    if torch.cuda.is_available() and not args.cpu:
        model = model.cuda()
    return model


def summarize(xs: list[float]) -> dict:
    """Median, min, max and all samples (seconds)."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def make_stores(
    layout, max_blocks: int, nvme_dir: str, prefill_tok_s: float, tiers: tuple = TIERS
) -> dict[str, KVStore]:
    """One store per tier, each holding the blocks only in that tier (promotion off);
    the NVMe tier in a fresh file under ``nvme_dir``."""
    cap = int(max_blocks * layout.bytes_per_block * 1.25) + (16 << 20)
    out = {}
    nvme_dir = tempfile.mkdtemp(prefix="store_", dir=nvme_dir)
    for t in tiers:
        kw = dict(promotion="none", cost=CostModel(prefill_tokens_per_s=prefill_tok_s, measured_window=0))
        if t == "hbm":
            out[t] = KVStore(layout, hbm_bytes=cap, **kw)
        elif t == "host":
            out[t] = KVStore(layout, host_bytes=cap, device="cpu", **kw)
        else:
            out[t] = KVStore(layout, nvme_path=nvme_dir, nvme_bytes=cap + (64 << 20), **kw)
    return out


def timed_cold(ref: HFPrefixCache, ids: np.ndarray):
    """Full prefill + argmax. Returns (wall s, process CPU s, first token, PrefillResult)."""
    c0, t0 = time.process_time(), time.perf_counter()
    pr = ref.prefill(ids)
    tok = int(torch.argmax(pr.logits))
    return time.perf_counter() - t0, time.process_time() - c0, tok, pr


def timed_warm(adapter: HFPrefixCache, ids: np.ndarray):
    """Lookup + load + suffix prefill + argmax inside one request. Same returns as :func:`timed_cold`."""
    store = adapter.store
    with store.request() as rid:
        c0, t0 = time.process_time(), time.perf_counter()
        pr = adapter.prefill(ids, rid)
        tok = int(torch.argmax(pr.logits))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return dt, dc, tok, pr


def measure_length(model, ref, adapters, n: int, args, rng) -> dict:
    """Cold runs, then warm runs with the tiers interleaved (hbm, host, nvme, hbm, ...) so
    that bursts of load from other jobs on a shared machine hit every tier alike; one
    discarded warm-up run per tier first."""
    T = args.tokens_per_block
    ids = rng.integers(0, args.vocab, size=n, dtype=np.int64)
    prefix = max(0, (n - args.suffix) // T * T)
    load0 = os.getloadavg()[0]
    cold, cold_cpu, cold_tok, cold_logits = [], [], None, None
    for r in range(args.runs):
        dt, dc, tok, pr = timed_cold(ref, ids)
        cold.append(dt)
        cold_cpu.append(dc)
        if r == 0:
            cold_tok, cold_logits = tok, pr.logits.float().cpu()
            blocks = cache_to_blocks(pr.cache, ref.layout, 0, prefix // T) if prefix else None
        else:
            assert tok == cold_tok
        del pr
    if blocks is not None:
        for a in adapters.values():
            st = a.store.store(a.namespace, ids[:prefix], blocks)
            assert all(s.value in ("ok", "exists") for s in st), st
    del blocks
    res = {
        "n": n,
        "prefix": prefix,
        "suffix": n - prefix,
        "cold_s": summarize(cold),
        "cold_cpu_s": statistics.median(cold_cpu),
        "warm": {},
        "kv_bytes_loaded": prefix * ref.layout.bytes_per_token,
    }
    max_diff = 0.0
    samples = {
        t: {"ttft_s": [], "cpu_s": [], "lookup_s": [], "load_s": [], "prefill_s": []} for t in adapters
    }
    for i in range(args.warm_runs + 1):
        for t, a in adapters.items():
            dt, dc, tok, pr = timed_warm(a, ids)
            assert pr.reused_tokens == prefix, (t, pr.reused_tokens, prefix)
            assert set(pr.hit_tiers) <= {t}, (t, pr.hit_tiers)
            assert tok == cold_tok, (t, tok, cold_tok)
            max_diff = max(max_diff, float((pr.logits.float().cpu() - cold_logits).abs().max()))
            if i:  # run 0 is the discarded warm-up
                s = samples[t]
                s["ttft_s"].append(dt)
                s["cpu_s"].append(dc)
                for k in ("lookup_s", "load_s", "prefill_s"):
                    s[k].append(getattr(pr, k))
            del pr
    for t, s in samples.items():
        res["warm"][t] = {
            "ttft_s": summarize(s["ttft_s"]),
            **{k: statistics.median(v) for k, v in s.items() if k != "ttft_s"},
            "speedup_median": statistics.median(cold) / statistics.median(s["ttft_s"]),
            "speedup_cpu": statistics.median(cold_cpu) / statistics.median(s["cpu_s"]),
        }
    res["max_first_logit_abs_diff"] = max_diff
    res["loadavg_1m"] = [load0, os.getloadavg()[0]]
    return res


def fit_cold(points: list[tuple[int, float]]) -> list[float] | None:
    """Least-squares ``t = b n + c n^2`` (linear layers + attention; no constant term, so
    3 lengths still leave a residual), ``c >= 0``. Returns ``[0, b, c]`` (needs >= 2 lengths)."""
    if len(points) < 2:
        return None
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    A = np.stack([n, n * n], axis=1)
    coef, *_ = np.linalg.lstsq(A, t, rcond=None)
    if coef[1] < 0:  # noise bent the fit down; attention cost is never negative: fit b n
        coef = np.array([float(np.dot(n, t) / np.dot(n, n)), 0.0])
    return [0.0, float(coef[0]), float(coef[1])]


def table(results: dict) -> str:
    """Markdown tables of the results."""
    out = [
        "| prompt tokens | cached prefix | cold TTFT s (median [min, max]) | "
        + " | ".join(f"warm {t} s" for t in TIERS)
        + " | "
        + " | ".join(f"x {t}" for t in TIERS)
        + " | x nvme (CPU s) |",
        "|---:|---:|---|" + "---|" * len(TIERS) + "---:|" * (len(TIERS) + 1),
    ]
    for r in results["lengths"]:
        c = r["cold_s"]
        cells = [f"{r['n']}", f"{r['prefix']}", f"{c['median']:.3f} [{c['min']:.3f}, {c['max']:.3f}]"]
        for t in TIERS:
            w = r["warm"][t]["ttft_s"]
            cells.append(f"{w['median']:.4f} [{w['min']:.4f}, {w['max']:.4f}]")
        cells += [f"{r['warm'][t]['speedup_median']:.1f}" for t in TIERS]
        cells.append(f"{r['warm']['nvme'].get('speedup_cpu', float('nan')):.1f}")
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Warm breakdown (medians, s): lookup / load (incl. blocks -> DynamicCache) / suffix prefill",
        "",
        "| prompt tokens | KV loaded MiB | " + " | ".join(TIERS) + " |",
        "|---:|---:|" + "---|" * len(TIERS),
    ]
    for r in results["lengths"]:
        cells = [f"{r['n']}", f"{r['kv_bytes_loaded'] / 2**20:.1f}"]
        for t in TIERS:
            w = r["warm"][t]
            cells.append(f"{w['lookup_s']:.4f} / {w['load_s']:.4f} / {w['prefill_s']:.4f}")
        out.append("| " + " | ".join(cells) + " |")
    be = results.get("break_even")
    if be:
        out += [
            "",
            "Break-even (NVMe): cold prefill of p + suffix tokens vs NVMe load of p + suffix prefill",
            "",
            "| cached prefix p | cold s (median [min, max]) | warm NVMe s (median [min, max]) | "
            "NVMe load s | winner |",
            "|---:|---|---|---:|---|",
        ]
        for r in be["points"]:
            c, w = r["cold_s"], r["warm"]["nvme"]["ttft_s"]
            win = "load" if w["median"] < c["median"] else "recompute"
            out.append(
                f"| {r['prefix']} | {c['median']:.4f} [{c['min']:.4f}, {c['max']:.4f}] | "
                f"{w['median']:.4f} [{w['min']:.4f}, {w['max']:.4f}] | {r['warm']['nvme']['load_s']:.5f} | "
                f"{win} |"
            )
        out.append("")
        out.append(
            f"Break-even prefix (smallest measured p from which NVMe load wins at every larger p, medians): "
            f"{be['break_even_tokens']}"
        )
    fit = results.get("cold_fit")
    if fit:
        out += [
            "",
            f"Cold fit t(n) = {fit['coef'][0]:.3g} + {fit['coef'][1]:.3g} n + {fit['coef'][2]:.3g} n^2 s; "
            f"extrapolated (NOT measured): "
            + ", ".join(f"{k} tokens -> {v:.1f} s" for k, v in fit["extrapolated_s"].items()),
        ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1024, 2048, 4096],
        help="prompt lengths in tokens (comma separated)",
    )
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the cached prefix (~)")
    p.add_argument(
        "--break-even",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[16, 32, 64, 128],
        help="cached prefix lengths for the break-even sweep ('' to skip)",
    )
    p.add_argument("--runs", type=int, default=3, help="cold runs per length")
    p.add_argument("--warm-runs", type=int, default=5, help="warm runs per length and tier (after 1 warm-up)")
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is present")
    p.add_argument(
        "--cost-prefill-tok-s",
        type=float,
        default=None,
        help="prefill rate the stores' cost model assumes (default: the calibrated rate). "
        "Tiny models prefill so fast that the cost model rightly prefers recompute over "
        "an NVMe load; pass a low rate to measure the warm path anyway (smoke tests)",
    )
    p.add_argument("--extrapolate", type=lambda s: [int(x) for x in s.split(",") if x], default=[8192, 16384])
    p.add_argument("--nvme-dir", default=None, help="directory for the NVMe tier file (default: a temp dir)")
    p.add_argument("--render", default=None, help="only re-render the tables (and refit) from a results JSON")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ttft_results.json")
    )
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        coef = fit_cold([(r["n"], r["cold_s"]["median"]) for r in results["lengths"]])
        if coef:
            results["cold_fit"] = {
                "coef": coef,
                "extrapolated_s": {str(n): coef[0] + coef[1] * n + coef[2] * n * n for n in args.extrapolate},
            }
        print(table(results))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model = build_model(args)
    nparams = sum(x.numel() for x in model.parameters())
    ref = HFPrefixCache(model, None)
    layout = HFPrefixCache.layout_for(model, args.tokens_per_block)
    rng = np.random.default_rng(args.seed)
    # warm-up (first calls pay one-off allocation/dispatch costs) + prefill-rate calibration
    ref.prefill(rng.integers(0, args.vocab, size=64))
    dt, _, _, _ = timed_cold(ref, rng.integers(0, args.vocab, size=256))
    prefill_tok_s = 256 / dt
    cost_tok_s = args.cost_prefill_tok_s or prefill_tok_s
    max_len = max(args.lengths + [p_ + args.suffix for p_ in args.break_even])
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(
        prefix="ttft_nvme_", dir=os.environ.get("TTFT_NVME_DIR", "/var/tmp")
    )
    os.makedirs(nvme_dir, exist_ok=True)
    results = {
        "model": {
            "params": nparams,
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "device": str(ref.device),
        },
        "layout": layout.to_dict(),
        "runs": args.runs,
        "warm_runs": args.warm_runs,
        "suffix": args.suffix,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "calibrated_prefill_tok_s": prefill_tok_s,
        "nvme_dir": nvme_dir,
        "lengths": [],
    }
    import transformers

    results["machine"]["transformers"] = transformers.__version__
    print(
        f"model {nparams / 1e6:.1f}M params, KV {layout.bytes_per_token} B/token, "
        f"prefill ~{prefill_tok_s:.0f} tok/s (256-token calibration)",
        flush=True,
    )
    for n in sorted(args.lengths):
        stores = make_stores(layout, max_len // args.tokens_per_block + 1, nvme_dir, cost_tok_s)
        adapters = {
            t: HFPrefixCache(model, s, fingerprint=ref.fingerprint, store_decode=False)
            for t, s in stores.items()
        }
        r = measure_length(model, ref, adapters, n, args, rng)
        r["store_stats"] = {}
        for t, s in stores.items():
            r["store_stats"][t] = {
                k: v for k, v in s.stats().items() if k.startswith(("hit_blocks_", "nvme_read", "loaded"))
            }
            s.close()
        results["lengths"].append(r)
        print(
            f"n={n}: cold {r['cold_s']['median']:.3f} s, warm "
            + ", ".join(f"{t} {r['warm'][t]['ttft_s']['median']:.4f} s" for t in TIERS)
            + f" (load avg {r['loadavg_1m']})",
            flush=True,
        )
    if args.break_even:
        pts = []
        stores = make_stores(layout, max_len // args.tokens_per_block + 1, nvme_dir, cost_tok_s, ("nvme",))
        adapters = {
            "nvme": HFPrefixCache(model, stores["nvme"], fingerprint=ref.fingerprint, store_decode=False)
        }
        for p_ in sorted(args.break_even):
            pts.append(measure_length(model, ref, adapters, p_ + args.suffix, args, rng))
            r = pts[-1]
            print(
                f"break-even p={r['prefix']}: cold {r['cold_s']['median']:.4f} s, warm nvme "
                f"{r['warm']['nvme']['ttft_s']['median']:.4f} s",
                flush=True,
            )
        for s in stores.values():
            s.close()
        # smallest measured p from which NVMe load wins at every larger measured p
        be = None
        for r in reversed(pts):
            if r["warm"]["nvme"]["ttft_s"]["median"] >= r["cold_s"]["median"]:
                break
            be = r["prefix"]
        results["break_even"] = {"points": pts, "break_even_tokens": be}
    coef = fit_cold([(r["n"], r["cold_s"]["median"]) for r in results["lengths"]])
    if coef:
        results["cold_fit"] = {
            "coef": coef,
            "extrapolated_s": {str(n): coef[0] + coef[1] * n + coef[2] * n * n for n in args.extrapolate},
        }
    if not args.nvme_dir:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    results["total_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"\nwrote {args.out} (total {results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
