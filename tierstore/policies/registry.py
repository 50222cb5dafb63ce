"""The policy families: one :class:`~tierstore.registry.Registry` each.

Every entry point that names a policy -- ``PoliciesConfig`` (YAML, ``KVStore(...)`` keywords, an
engine's extra config), the ``make_*`` factories the store is built with, and the bench CLI's
choices -- asks these registries, so they accept exactly the same names (aliases included) and
refuse the others with one message.

========== ==================================== ==========================================
family     canonical names (aliases)            member
========== ==================================== ==========================================
eviction   ``lru``, ``s3fifo``, ``cost``,        an :class:`~.base.EvictionPolicy`
           ``class_lru``
admission  ``all`` (``none``), ``reused``         ``None`` (admit every block), a
           (``second``, ``second_hit``),          :class:`~.admission.SecondSightingAdmission`,
           ``predicted``                          a :class:`~.admission.PredictedReuseAdmission`
classifier ``hint``, ``reuse``, ``prefix``,     ``f(entry, now_s) -> LifetimeClass``
           ``demotion``
reinsert   ``none``, ``hits``, ``predicted``,     ``None`` (keep blocks in use only) or
           ``clock``                              ``f(entry, now_s) -> bool``
========== ==================================== ==========================================

The NVMe region policy (``region_policy``) is a family of the I/O layer's segment policies.
"""

from __future__ import annotations

from ..registry import Registry
from .admission import PredictedReuseAdmission, SecondSightingAdmission
from .base import EvictionPolicy
from .classlru import ClassLRUPolicy
from .costaware import CostAwarePolicy
from .lifetime import DemotionClassifier, PrefixLifetimePredictor, ReuseEntryClassifier, default_classify
from .lru import LRUPolicy
from .reinsert import ClockReinsertion, HitsReinsertion, PredictedReinsertion
from .s3fifo import S3FIFOPolicy

__all__ = ["ADMISSION", "CLASSIFIER", "EVICTION", "REINSERT"]

#: Eviction policies of the memory tiers (registration order is the order the CLI lists).
EVICTION: Registry[EvictionPolicy] = Registry("eviction")
EVICTION.register("lru", LRUPolicy)
EVICTION.register("s3fifo", S3FIFOPolicy)
EVICTION.register("cost", CostAwarePolicy)
EVICTION.register("class_lru", ClassLRUPolicy)

#: SSD admission of blocks demoted from the last memory tier.
ADMISSION: Registry = Registry("admission")
ADMISSION.register("all", lambda: None, aliases=("none",))
ADMISSION.register("reused", SecondSightingAdmission, aliases=("second", "second_hit"))
ADMISSION.register("predicted", lambda: PredictedReuseAdmission(PrefixLifetimePredictor().reuse_probability))

#: The store's one lifetime classifier (FDP placement).
CLASSIFIER: Registry = Registry("classifier")
CLASSIFIER.register("hint", lambda: default_classify)
CLASSIFIER.register("reuse", ReuseEntryClassifier)
CLASSIFIER.register("prefix", PrefixLifetimePredictor)
CLASSIFIER.register("demotion", DemotionClassifier)

#: Which blocks of an NVMe region being evicted are copied forward.
REINSERT: Registry = Registry("reinsert")
REINSERT.register("none", lambda: None)
REINSERT.register("hits", HitsReinsertion)
REINSERT.register("predicted", PredictedReinsertion)
REINSERT.register("clock", ClockReinsertion)
