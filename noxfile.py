"""Test sessions, one environment each, so engines' pins never collide.

The core suite runs in the project venv (README's test command); each engine
integration pins its own torch/transformers and runs in a nox session with its
own virtualenv under ``.nox/``:

    nox -s core        # the core suite in a fresh venv (same as `python -m pytest -q`)

Every session installs the CPU build of torch first (``torch==2.13.0``): a
bare ``torch`` requirement would pull a multi-GB CUDA build.
"""
from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

CPU_TORCH = "torch==2.13.0"


@nox.session(python=False)
def core(session: nox.Session) -> None:
    """The core suite in the current environment (what `.ci/run` uses first)."""
    session.run("python", "-m", "pytest", "-q", *session.posargs)
