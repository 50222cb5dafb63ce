"""Policies: eviction (victim selection), admission, lifetime prediction, cost model."""

from .admission import PredictedReuseAdmission, SecondSightingAdmission, make_admission
from .base import EvictionPolicy, make_policy, policy_names, register_policy
from .classlru import ClassLRUPolicy
from .costaware import CostAwarePolicy
from .lifetime import PrefixLifetimePredictor
from .lru import LRUPolicy
from .registry import ADMISSION, CLASSIFIER, EVICTION, REINSERT
from .s3fifo import S3FIFOPolicy

__all__ = [
    "ADMISSION",
    "CLASSIFIER",
    "ClassLRUPolicy",
    "EVICTION",
    "REINSERT",
    "CostAwarePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PredictedReuseAdmission",
    "PrefixLifetimePredictor",
    "S3FIFOPolicy",
    "SecondSightingAdmission",
    "make_admission",
    "make_policy",
    "policy_names",
    "register_policy",
]
