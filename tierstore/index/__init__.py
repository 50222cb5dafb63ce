"""The block index: it decides, it never moves bytes (ARCHITECTURE.md, "Where things are decided").

:class:`BlockIndex` (``core.py``) answers every question under one lock, ``BlockIndex._lock``;
its rooms run under that lock and have none of their own: ``rows.py`` (:class:`RowTable`, the key
table and per-row arrays), and the others listed in ARCHITECTURE.md's layer table. Every name of
the contract (:mod:`tierstore.contract`) stays importable from here.
"""

from ..contract import (
    MEMORY_TIERS,
    BlockState,
    Demotion,
    Lease,
    LoadPlan,
    LookupResult,
    Medium,
    PromotePlan,
    Status,
    StorePlan,
    Tier,
)
from .core import BlockIndex, IndexRuntime, IndexShape
from .rows import EntryView, RowTable

__all__ = [
    "BlockIndex",
    "IndexShape",
    "IndexRuntime",
    "RowTable",
    "EntryView",
    "BlockState",
    "Demotion",
    "Lease",
    "LoadPlan",
    "LookupResult",
    "Medium",
    "MEMORY_TIERS",
    "PromotePlan",
    "Status",
    "StorePlan",
    "Tier",
]
