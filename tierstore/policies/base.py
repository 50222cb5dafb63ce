"""Eviction policy contract: a policy only *picks victims*.

Modelled on vLLM's ``CachePolicy`` (``v1/kv_offload``): the manager owns
refcounts, free lists and events; a policy tracks the keys resident in one tier
and answers :meth:`EvictionPolicy.evict` with exactly ``n`` unprotected keys or
with nothing (all or nothing). A policy never gates admission (LMCache's mistake
of letting LRU decide SSD admission is avoided: admission is a separate
component, :mod:`tierstore.policies.admission`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..fdp.lifetime import LifetimeClass


class EntryInfo(Protocol):
    """What a policy may read about an entry (the manager's ``Entry`` satisfies it).

    Attributes: ``key`` (bytes), ``size_bytes`` (int), ``hits`` (int),
    ``last_access_s`` (float), ``created_s`` (float), ``position`` (int, block
    index in its prefix chain), ``lifetime`` (LifetimeClass or None), ``nvme_written_s`` (float).
    """

    # read-only (properties): the index's EntryView computes them from its row arrays
    @property
    def key(self) -> bytes: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def hits(self) -> int: ...

    @property
    def last_access_s(self) -> float: ...

    @property
    def created_s(self) -> float: ...

    @property
    def position(self) -> int: ...

    @property
    def lifetime(self) -> LifetimeClass | None: ...

    @property
    def nvme_written_s(self) -> float: ...


class EvictionPolicy(abc.ABC):
    """Victim selection for one tier."""

    name = "abstract"
    #: ``evict(k)`` returns what ``k`` successive ``evict(1)`` calls would (each excluding the keys
    #: already taken) and changes no state, and :meth:`evict_upto` answers in one pass: a caller
    #: short of victims then takes the partial answer from one call
    #: (:func:`tierstore.index.placement.choose_victims`). Off unless a policy says so.
    evict_is_prefix = False

    @abc.abstractmethod
    def on_insert(self, entry: EntryInfo, now_s: float) -> None:
        """``entry`` became resident in this tier."""

    @abc.abstractmethod
    def on_access(self, entry: EntryInfo, now_s: float) -> None:
        """``entry`` was hit in this tier."""

    def on_insert_many(self, keys: Sequence[bytes], entry: Callable[[int], EntryInfo], now_s: float) -> None:
        """:meth:`on_insert` for several keys at once (a store of a chain).

        ``entry(i)`` makes the :class:`EntryInfo` of ``keys[i]``; a policy that
        needs only keys overrides this and never asks for it (the block index
        keeps no object per block: a view costs a call). Same outcome as
        calling :meth:`on_insert` for each key in order.
        """
        for i in range(len(keys)):
            self.on_insert(entry(i), now_s)

    def on_access_many(self, keys: Sequence[bytes], entry: Callable[[int], EntryInfo], now_s: float) -> None:
        """:meth:`on_access` for several keys at once (a lookup's hits); see :meth:`on_insert_many`."""
        for i in range(len(keys)):
            self.on_access(entry(i), now_s)

    @abc.abstractmethod
    def on_remove(self, key: bytes) -> None:
        """``key`` left this tier (evicted, demoted, invalidated). Unknown keys are ignored."""

    @abc.abstractmethod
    def evict(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        """Pick ``n`` victims for which ``protected(key)`` is false.

        Returns exactly ``n`` keys, or ``[]`` when that many cannot be found.
        The keys stay tracked until the manager calls :meth:`on_remove`.
        ``max_scan`` bounds the candidates examined (the coldest first, in the
        policy's order): the index asks for a victim that leaves without an
        NVMe write among the coldest few only, instead of scanning a tier
        whose blocks mostly have no lower copy.
        """

    def evict_upto(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        """Up to ``n`` victims: what successive ``evict(1, ..., max_scan + taken)`` calls return,
        each with the keys taken so far protected, until the first refusal.

        For a tier holding fewer evictable keys than a store needs
        (:func:`tierstore.index.placement.choose_victims`). This default makes
        those calls, each of which may scan the policy's order again from its
        coldest end: a policy that can answer in one pass overrides it (LRU
        does). ``protected`` may also offer ``protected.many(keys) -> bool
        array`` (the block index's does): a policy may then test its
        candidates a chunk at a time. Changes no state.
        """
        taken: set = set()

        def one(k: bytes) -> bool:
            return protected(k) or k in taken

        out: list[bytes] = []
        while len(out) < n:
            v = self.evict(1, one, now_s, None if max_scan is None else max_scan + len(taken))
            if not v:
                break
            taken.update(v)
            out.extend(v)
        return out

    @abc.abstractmethod
    def __len__(self) -> int:
        """Keys tracked."""


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make a policy constructible by name (``eviction=`` in configs, ``KVStore`` keywords, extra
    configs and the bench CLI: :data:`tierstore.policies.registry.EVICTION`); a name registered
    before is replaced."""
    from .registry import EVICTION

    EVICTION.register(name, factory, replace=True)


def make_policy(name: str) -> EvictionPolicy:
    """Construct a registered policy (:data:`tierstore.policies.registry.EVICTION`).

    Raises
    ------
    ConfigError
        For an unknown name; the message lists the registered ones.
    """
    from .registry import EVICTION

    return EVICTION.make(name)


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    from .registry import EVICTION

    return sorted(EVICTION.names())
