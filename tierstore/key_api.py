"""The key-level half of the Python API: :class:`KeyAPI`, the calls by block key.

:class:`~tierstore.api.KVStore` is a :class:`KeyAPI`: engines that hash their blocks themselves
(SGLang's page hashes scoped with :func:`tierstore.identity.scoped_key`, vLLM's offloading tier,
the node store and the daemon) call these directly; the token-level calls of
:class:`~tierstore.api.KVStore` (``store``, ``lookup``, ``prefetch``, ``pin``) hash a prompt's
full blocks (:meth:`~tierstore.api.KVStore.keys_for`) and go the same way. Every call checks its
input (:mod:`tierstore.io.inputs`: keys of 32 bytes, blocks, fragments and destinations of the
layout) and runs through :class:`tierstore.transfers.Transfers`; :func:`open_call` makes a call
refuse to start once the store is closing (``StoreClosedError``) and lets ``close`` wait for it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from .contract import LookupResult, Tier
from .errors import ConfigError, Status
from .identity import DigestCache, Namespace
from .io.inputs import check_keys, plan_destinations, plan_fragment_destinations
from .layout import KVLayout
from .store_calls import KeyLookup, StoreCalls
from .transfers import Transfers

__all__ = ["KeyAPI", "open_call"]


def open_call(fn):
    """Run a :class:`KVStore` method only while the store is open: after
    :meth:`KVStore.close` began it raises :class:`StoreClosedError`, and
    ``close`` waits for the calls in progress."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        calls = self._transfers.calls
        calls.enter(name)
        try:
            return fn(self, *args, **kwargs)
        finally:
            calls.leave()

    return call


class KeyAPI(StoreCalls, KeyLookup):
    """The key-level half of :class:`~tierstore.api.KVStore`: the calls that move or drop blocks
    by their 32-byte keys (module doc). :class:`~tierstore.api.KVStore` adds the token-level calls,
    its construction and ``close``; the state used here is the store's (set by ``KVStore._init``).
    """

    layout: KVLayout
    _digests: DigestCache
    _transfers: Transfers

    #: Longest wait for another load's read of the same block (a delay hit), seconds.
    MERGE_WAIT_S = 30.0

    # -------------------------------------------------------------- identity
    def digest(self, ns: Namespace | bytes) -> bytes:
        """Namespace digest, scoped by this store's layout (cached)."""
        return self._digests(ns)

    # -------------------------------------------------------------- store
    store_keys = open_call(StoreCalls.store_keys)

    # -------------------------------------------------------------- lookup
    lookup_keys = open_call(KeyLookup.lookup_keys)

    def _lookup_checked(
        self, keys: list[bytes], request_id: object, num_prompt_tokens: int | None, d: bytes | None
    ) -> LookupResult:
        return self._transfers.lookup(keys, None, request_id, num_prompt_tokens, d)

    # -------------------------------------------------------------- load
    @open_call
    def load(
        self,
        keys: Sequence[bytes] | LookupResult,
        dests: Sequence[torch.Tensor] | None = None,
        promote: bool = True,
        *,
        wait: bool = True,
        timeout_s: float | None = None,
    ):
        """Load blocks (default: a lookup's useful keys) into ``dests`` or new tensors.

        Parameters
        ----------
        keys : sequence of bytes or LookupResult
        dests : sequence of torch.Tensor, optional
            Per key a contiguous ``uint8`` tensor of ``bytes_per_block`` or a
            typed block of the layout, on any device; new CPU tensors otherwise.
        promote : bool
            Copy NVMe/host hits into a faster memory tier (``promotion`` policy).
        wait : bool
            ``False`` returns a Future of the result pair.
        timeout_s : float, optional
            Deadline: blocks not delivered by then are ``MISS``.

        Returns
        -------
        statuses : list of Status
            Use :func:`leading_ok`: a failed block is never reported as loaded.
        tensors : list of torch.Tensor or None
            The destination of each ``OK`` block (typed blocks when new), else ``None``.
        """
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = check_keys(keys)
        plans, finish = plan_destinations(len(keys), dests, self.layout)
        return self._transfers.load(keys, plans, promote, wait, timeout_s, finish, self.MERGE_WAIT_S)

    @open_call
    def load_fragments(
        self,
        keys: Sequence[bytes] | LookupResult,
        dest_fragments_per_block: Sequence[Sequence[torch.Tensor]],
        *,
        wait: bool = True,
        timeout_s: float | None = None,
    ) -> list[Status] | Future:
        """Load blocks and scatter each straight into its destination fragments.

        ``dest_fragments_per_block`` is as in :meth:`store_fragments` (fragment
        tensors, contiguous or not, or ``KVPagePool.plans(block_ids,
        destination=True)``). Destinations are checked before anything is
        loaded; a block whose status is not ``OK`` leaves its destination
        untouched. Returns per-block statuses, or with ``wait=False`` a
        :class:`concurrent.futures.Future` of them (destinations must not be
        read before it resolves). ``timeout_s`` is a deadline as in :meth:`load`.

        Raises
        ------
        LayoutError
            A wrong fragment count or size, or not one destination per key.
        """
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = check_keys(keys)
        plans = plan_fragment_destinations(len(keys), dest_fragments_per_block, self.layout)
        return self._transfers.load(keys, plans, True, wait, timeout_s, lambda st: st, self.MERGE_WAIT_S)

    @open_call
    def prefetch_keys(self, keys: Sequence[bytes], tier: str = "host") -> Future:
        """:meth:`prefetch` by key."""
        try:
            t = Tier[str(tier).upper()]
        except KeyError:
            raise ConfigError(f"tier={tier!r}: accepted values are ['hbm', 'host']") from None
        return self._transfers.prefetch(check_keys(keys), t)

    # -------------------------------------------------------------- removal
    @open_call
    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove blocks by key from every tier; returns how many were resident."""
        return self._transfers.remove(check_keys(keys))

    @open_call
    def evict(self, tier: Tier | str, n: int) -> int:
        """Evict ``n`` unprotected blocks of a memory tier now (demoting them as
        the policies decide); returns ``n``, or 0 if that many cannot be found."""
        t = tier if isinstance(tier, Tier) else Tier[str(tier).upper()]
        return self._transfers.evict(t, n)
