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
