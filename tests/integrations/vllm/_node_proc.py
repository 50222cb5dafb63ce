"""Run one vLLM engine whose connector uses a node service (``store.url``), in a fresh process.

``python _node_proc.py '<json>'`` with ``model``, ``url`` (the service's ``unix://`` URL),
``prompts`` (token-id lists), ``max_tokens``, ``engine`` (extra ``LLM(...)`` arguments, e.g.
``{"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}``), ``layout`` (the keyword
arguments of one rank's ``KVLayout``, dtype by name: the client that waits for the stores) and
``wait_blocks`` (per prompt, the blocks the service must hold before the next prompt, or the
exit, is sent; 0: no wait. The connector stores after the forward pass, in the background).
Prints one line ``RESULT {...}``: ``outputs`` (tokens and ``num_cached_tokens`` per prompt).

vLLM's own multiprocessing stays as the caller's environment sets it: by default the engine core
and, on the CPU backend, the worker in processes of their own, each opening its own client of
``store.url``; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` all in this process.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import connector_config, engine_kwargs


def _generate(llm, prompts: list, max_tokens: int, wait=None) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs = []
    for i, p in enumerate(prompts):  # one at a time: each sees what the earlier ones stored
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        outs.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens})
        if wait is not None:
            outs[-1]["blocks_in_service"] = wait(i)
    return outs


def _wait_stored(url: str, layout: dict, n_blocks: int, timeout_s: float = 120.0) -> int:
    import torch

    from tierstore.layout import KVLayout
    from tierstore.node.client import NodeKVStore

    lay = KVLayout(**dict(layout, dtype=getattr(torch, layout["dtype"])))
    deadline = time.monotonic() + timeout_s
    with NodeKVStore(url, lay, timeout_s=10) as c:
        while True:
            have = int(c.stats().get("blocks", 0))
            if have >= n_blocks or time.monotonic() > deadline:
                return have
            time.sleep(0.05)


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM

    res: dict = {}
    llm = LLM(
        **engine_kwargs(args["model"], **args["engine"]),
        kv_transfer_config=connector_config({"store": {"url": args["url"], "timeout_s": 10}}),
    )
    res["outputs"] = _generate(
        llm,
        args["prompts"],
        args["max_tokens"],
        lambda i: _wait_stored(args["url"], args["layout"], args["wait_blocks"][i]),
    )
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":  # vLLM's mp executor spawns workers that import this file
    main()
