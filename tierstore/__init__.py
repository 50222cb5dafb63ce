"""tierstore: a tiered (HBM / pinned host DRAM / NVMe) KV-cache offload store.

The engine-facing API is :class:`tierstore.api.KVStore`; see ARCHITECTURE.md for
the layers.

The names below are imported on first use (PEP 562 ``__getattr__``): importing
the package, or the ``tierstore`` command, does not load torch until a command
needs it, so ``tierstore --help`` is quick and a Ctrl-C during start-up ends in
the command's own handler (exit 130, one line) rather than in a traceback from
inside an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> submodule that defines it
_EXPORTS = {
    "KVStore": "api",
    "leading_ok": "api",
    "Status": "errors",
    "Namespace": "identity",
    "PRESETS": "layout",
    "KVLayout": "layout",
    "get_layout": "layout",
    "Tier": "contract",
    "build_store": "build",
    "StoreConfig": "config",
}

__all__ = [
    "KVStore",
    "KVLayout",
    "Namespace",
    "PRESETS",
    "Status",
    "StoreConfig",
    "Tier",
    "build_store",
    "get_layout",
    "leading_ok",
    "__version__",
]

if TYPE_CHECKING:  # static tools see the eager imports
    from .api import KVStore, leading_ok
    from .build import build_store
    from .config import StoreConfig
    from .contract import Tier
    from .errors import Status
    from .identity import Namespace
    from .layout import PRESETS, KVLayout, get_layout


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
