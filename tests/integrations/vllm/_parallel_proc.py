"""Start a vLLM engine with the tierstore connector and a parallel set-up, in a fresh process.

``python _parallel_proc.py '<json>'`` with ``model`` (a local model directory), ``nvme_dir`` and
``engine`` (extra ``LLM(...)`` arguments, e.g. ``{"tensor_parallel_size": 2,
"distributed_executor_backend": "mp"}``). Prints ``STARTED`` if the engine came up, else the
error's type and message on a line ``REFUSED <type>: <message>`` and exits 3. Used by the test of
the refusal's timing (tests/integrations/vllm/test_engine.py): nothing here imports
tierstore.integrations.vllm before vLLM does, as with ``vllm serve``.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import connector_config, engine_kwargs, shutdown


def main() -> int:
    args = json.loads(sys.argv[1])
    from vllm import LLM

    t0 = time.monotonic()
    try:
        llm = LLM(
            **engine_kwargs(args["model"], **args["engine"]),
            kv_transfer_config=connector_config(
                {"tiers": {"nvme": {"path": args["nvme_dir"], "capacity_bytes": "64MiB"}}}
            ),
        )
    except Exception as e:  # noqa: BLE001 (the refusal, however vLLM wraps it: printed)
        print(f"REFUSED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        return 3
    print(f"STARTED after {time.monotonic() - t0:.1f} s", flush=True)
    shutdown(llm)
    return 0


if __name__ == "__main__":  # vLLM's mp executor spawns workers that import this file
    sys.exit(main())
