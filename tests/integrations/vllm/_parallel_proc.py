"""Start a vLLM engine with the tierstore connector and a parallel set-up, in a fresh process.

``python _parallel_proc.py '<json>'`` with ``model`` (a local model directory), ``nvme_dir`` and
``engine`` (extra ``LLM(...)`` arguments, e.g. ``{"tensor_parallel_size": 2,
"distributed_executor_backend": "mp"}``). Prints ``STARTED`` if the engine came up, else the
error's type and message on a line ``REFUSED <type>: <message>`` and exits 3. With ``attempts``
(a list of ``{nvme_dir, engine, env}``) it tries each in turn, in this one process. Used by the test of
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


def attempt(LLM, model: str, nvme_dir: str, engine: dict) -> int:
    """One ``LLM(...)``: print ``STARTED after S s`` (and shut it down) or ``REFUSED <type> after S s:
    <message>``; return 0 or 3."""
    t0 = time.monotonic()
    try:
        llm = LLM(
            **engine_kwargs(model, **engine),
            kv_transfer_config=connector_config(
                {"tiers": {"nvme": {"path": nvme_dir, "capacity_bytes": "64MiB"}}}
            ),
        )
    except Exception as e:  # noqa: BLE001 (the refusal, however vLLM wraps it: printed)
        print(f"REFUSED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        return 3
    print(f"STARTED after {time.monotonic() - t0:.1f} s", flush=True)
    shutdown(llm)
    return 0


def main() -> int:
    args = json.loads(sys.argv[1])
    from vllm import LLM

    if "attempts" not in args:
        return attempt(LLM, args["model"], args["nvme_dir"], args["engine"])
    # Several refusals in one process (one import of vLLM, ~30 s of a 2-core VM, instead of one
    # each): each attempt's environment as given (None: unset), each preceded by its mark line on
    # stdout and stderr; the exit status is the last attempt's.
    rc = 0
    for i, a in enumerate(args["attempts"]):
        for k, v in a.get("env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        print(ATTEMPT_MARK.format(i), flush=True)
        print(ATTEMPT_MARK.format(i), file=sys.stderr, flush=True)
        rc = attempt(LLM, args["model"], a["nvme_dir"], a["engine"])
    return rc


#: The line before attempt ``i`` (stdout and stderr) when ``attempts`` are given.
ATTEMPT_MARK = "=== attempt {} ==="


if __name__ == "__main__":  # vLLM's mp executor spawns workers that import this file
    sys.exit(main())
