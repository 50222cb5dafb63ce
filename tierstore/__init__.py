"""tierstore: a tiered (HBM / pinned host DRAM / NVMe) KV-cache offload store.

The engine-facing API is :class:`tierstore.api.KVStore`; see ARCHITECTURE.md for
the layers.
"""
from .api import KVStore, leading_ok
from .errors import Status
from .identity import Namespace
from .layout import PRESETS, KVLayout, get_layout
from .index import Tier
from .build import build_store
from .config import StoreConfig

__version__ = "0.1.0"
__all__ = ["KVStore", "KVLayout", "Namespace", "PRESETS", "Status", "StoreConfig", "Tier", "build_store", "get_layout", "leading_ok",
           "__version__"]
