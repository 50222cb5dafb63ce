"""``PoliciesConfig``: the ``policies`` section of a store's configuration.

Every policy name is checked against its family's registry
(:mod:`tierstore.policies.registry`), the same table the ``make_*`` factories and the bench
CLI read, so YAML, ``KVStore(...)`` keywords and an engine's extra config accept the same names.
A name is kept as spelled (an alias stays an alias). Re-exported by :mod:`tierstore.config`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ..registry import Registry
from ..schema import DurationS, SizeBytes, StrictModel
from ..units import MAX_DURATION_S
from .registry import ADMISSION, CLASSIFIER, EVICTION, REINSERT

__all__ = ["PoliciesConfig"]


def _registered(registry: Registry):
    """A field validator: the value is a name (or alias) of ``registry``; it is kept as spelled."""

    def check(v):
        if v not in registry:
            raise ValueError(f"accepted values are {sorted(registry.names())}")
        return v

    return field_validator(registry.family)(check)


class PoliciesConfig(StrictModel):
    """Placement and eviction policies. ``eviction``, ``admission``, ``classifier`` and
    ``reinsert`` accept the names (and aliases) of their registry in
    :mod:`tierstore.policies.registry`, as every other entry point does."""

    eviction: str = "lru"
    admission: str = "all"
    promotion: Literal["top", "one", "none"] = "top"
    write_policy: Literal["write_back", "write_through"] = "write_back"
    classifier: str = "hint"
    reinsert: str = "none"
    evict_batch_blocks: int = Field(8, ge=1)
    verify_tokens: bool = False
    pin_quota_bytes: SizeBytes = 1 << 62
    default_lease_s: DurationS = Field(60.0, gt=0, le=MAX_DURATION_S)
    _ev = _registered(EVICTION)
    _ad = _registered(ADMISSION)
    _cl = _registered(CLASSIFIER)
    _re = _registered(REINSERT)
