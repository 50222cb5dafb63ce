"""Policies: eviction (victim selection), admission, lifetime prediction, cost model."""
from .base import EvictionPolicy, make_policy, policy_names, register_policy
from .lru import LRUPolicy

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy", "policy_names", "register_policy"]
