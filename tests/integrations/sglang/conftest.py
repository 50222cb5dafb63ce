"""SGLang suite: runs only where SGLang is installed (``nox -s sglang``).

The core suite (``python -m pytest -q`` in the project venv) has no SGLang,
so this directory is not collected there (``collect_ignore_glob``) and nothing
imports SGLang or :mod:`tierstore.integrations.sglang`.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None

if not HAVE_SGLANG:
    collect_ignore_glob = ["*"]
else:
    if importlib.util.find_spec("torchvision") is None:
        # test-only stand-in (see stubs/README.md); only in this environment
        sys.path.insert(0, str(pathlib.Path(__file__).parent / "stubs"))
    import torch

    # One intra-op thread: on a loaded 2-core machine a 2-thread OpenMP team spins at
    # barriers and a 64 KiB page copy takes ~0.5 ms instead of ~30 us (measured here);
    # the suite checks behaviour, bench/sglang_bench.py measures speed.
    torch.set_num_threads(1)
