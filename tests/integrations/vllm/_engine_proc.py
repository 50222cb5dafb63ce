"""Run one vLLM engine with the tierstore connector in a fresh process and print a JSON result.

Used by the restart-persistence test: ``python _engine_proc.py '<json args>'``
with ``model``, ``revision``, ``nvme_dir``, ``prompts`` (token-id lists) and
``max_tokens``. Prints one line ``RESULT {...}``: generated tokens,
``num_cached_tokens`` per prompt and the store's counters. ``mode``
``"closed"``: also call the store and the connector after shutdown and
report what each call raised. ``then_refuse`` (a path): after all that, try
an engine on that NVMe path and report its error chain as ``refusal`` (one
process start instead of two: each costs ~1 min of CI on a 2-core VM).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import connector_config, engine_kwargs, shutdown


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tierstore.integrations.vllm import engine_ids, engine_namespace, engine_store

    extra = {"tiers": {"nvme": {"path": args["nvme_dir"], "capacity_bytes": "64MiB"}}}
    mode = args.get("mode", "serve")
    llm = LLM(
        **engine_kwargs(args["model"], revision=args.get("revision")),
        kv_transfer_config=connector_config(extra),
    )
    sp = SamplingParams(max_tokens=args["max_tokens"], temperature=0)
    eid = engine_ids()[0]
    store = engine_store(eid)
    outs = []
    for p in args["prompts"]:  # one at a time: each sees what the earlier ones stored
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        outs.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens})
        keys = store.keys_for(engine_namespace(eid), p)
        deadline = time.monotonic() + 60
        while store.exists(keys) < len(keys) and time.monotonic() < deadline:  # stores are asynchronous
            llm.llm_engine.step()
            time.sleep(0.005)
    stats = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    ns = engine_namespace(eid)  # the engine's registry entry goes with the shutdown
    shutdown(llm)  # closes the store: a restart must find everything on NVMe
    after = {}
    if mode == "closed":  # every call after shutdown raises StoreClosedError, the store's and the connector's
        from tierstore.errors import StoreClosedError

        req = type("Req", (), {"request_id": "after-shutdown"})()
        calls = {
            "store.lookup": lambda: store.lookup(ns, args["prompts"][0]),
            "store.store_keys": lambda: store.store_keys(ns, [bytes(32)], [bytes(1)]),
            "connector.get_num_new_matched_tokens": lambda: connector.get_num_new_matched_tokens(req, 0),
            "connector.request_finished": lambda: connector.request_finished(req, []),
        }
        for name, call in calls.items():
            try:
                call()
                after[name] = "returned"
            except StoreClosedError as e:
                after[name] = f"StoreClosedError: {e}"
            except Exception as e:  # noqa: BLE001 -- reported, the test names what it expected
                after[name] = f"{type(e).__name__}: {e}"
        connector.shutdown()  # idempotent
    refusal = None
    if args.get("then_refuse"):  # last: a refused start may leave vLLM's state half built
        print(REFUSAL_MARK, flush=True)
        print(REFUSAL_MARK, file=sys.stderr, flush=True)
        refusal = try_refused(LLM, args["model"], args["then_refuse"])
    res = {"outputs": outs, "stats": stats, "after_shutdown": after, "refusal": refusal}
    print("RESULT " + json.dumps(res), flush=True)


#: Printed on stdout and stderr before ``then_refuse``'s attempt: the log before it is the engine's.
REFUSAL_MARK = "=== then_refuse: a second engine on another NVMe path ==="


def try_refused(LLM, model: str, nvme_path: str) -> dict:
    """Try to start an engine whose connector's NVMe tier is ``nvme_path``; report whether it
    started and, if not, the error chain (whatever vLLM wrapped the connector's error in)."""
    extra = {"tiers": {"nvme": {"path": nvme_path, "capacity_bytes": "64MiB"}}}
    try:
        LLM(**engine_kwargs(model), kv_transfer_config=connector_config(extra))
    except Exception as e:  # noqa: BLE001 -- whatever vLLM wraps it in: report the chain
        chain, cur = [], e
        while cur is not None:
            chain.append(f"{type(cur).__name__}: {cur}")
            cur = cur.__cause__ or cur.__context__
        return {"started": False, "errors": chain}
    return {"started": True, "errors": []}


if __name__ == "__main__":
    main()
