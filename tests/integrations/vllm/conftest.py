"""vLLM connector tests: collected only where vLLM is installed (``nox -s vllm``).

The core suite (``python -m pytest -q`` in the project venv) has no vLLM: this
conftest then ignores the directory, so nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # one process for the engine core, scheduler and worker (the connector's
    # supported set-up, and ~15 s per engine instead of 30-70 s)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
