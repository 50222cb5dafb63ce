"""Import a ``bench/`` script as a module by its path (the scripts are not a package; no ``sys.path`` edit).

A script that fails to import fails the test that loads it (never a silent skip)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_tool(name: str) -> types.ModuleType:
    """``bench/<name>.py`` as the module ``name`` (registered in ``sys.modules``, as a dataclass or a
    pickled worker function of the script needs; loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
