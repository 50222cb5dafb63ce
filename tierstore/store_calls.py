"""The calls every store states alike, once: :class:`StoreCalls` and :class:`KeyLookup`.

:class:`~tierstore.api.KVStore`, :class:`tierstore.client.RemoteKVStore` and
:class:`tierstore.node.client.NodeKVStore` store the same way: the same signatures (the
parity tests compare them), the same documentation and the same input checks, before anything
is stored (a bad input raises :class:`~tierstore.errors.LayoutError` and stores nothing).
:class:`StoreCalls` states ``store``, ``store_fragments`` and ``store_keys`` once; each store
implements only :meth:`StoreCalls._store_checked`, which stores checked blocks under checked
keys its own way (the embedded store's transfers, the daemon's requests, the node service's
tickets), and may replace how keys, blocks and fragments are checked (the daemon client sends
raw bytes: it gathers fragments itself). :class:`KeyLookup` does the same for ``lookup_keys``
of the embedded store and the node client (the daemon client's takes other options)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np
import torch

from .contract import LookupResult
from .errors import LayoutError, Status
from .fdp.lifetime import class_from_hint
from .identity import Namespace, check_chain_positions
from .io.inputs import check_keys, check_start_block, plan_block, plan_sources, refuse_numpy
from .layout import KVLayout

__all__ = ["CheckedStore", "KeyLookup", "StoreCalls"]


class CheckedStore(NamedTuple):
    """A store call's arguments, checked: what :meth:`StoreCalls._store_checked` stores."""

    #: the namespace's 32-byte digest (:meth:`StoreCalls.digest`)
    ns: bytes
    #: 32-byte block keys, in chain order
    keys: list[bytes]
    #: one copy source per key (a store's own form: planned blocks, or raw bytes)
    sources: Sequence[Any]
    #: the engine's placement hint, as given (``None``: the store classifies)
    lifetime: str | None
    #: chain position of ``keys[0]``
    first_position: int
    #: the prompt's token ids (a token-level call), ``None`` for ``store_keys``
    token_ids: Sequence[int] | np.ndarray | None
    #: ``False``: return a Future of the statuses
    wait: bool


class StoreCalls:
    """``store``, ``store_fragments`` and ``store_keys`` of a store (module doc).

    A subclass sets ``layout`` and implements ``digest``, ``keys_for`` and
    :meth:`_store_checked`.
    """

    layout: KVLayout

    def digest(self, ns: Namespace | bytes) -> bytes:
        """The namespace's 32-byte digest, scoped to the layout."""
        raise NotImplementedError

    def keys_for(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` under ``ns``."""
        raise NotImplementedError

    def store(
        self,
        ns: Namespace | bytes,
        token_ids: Sequence[int] | np.ndarray,
        kv_blocks: torch.Tensor | Sequence[torch.Tensor],
        start_block: int = 0,
        lifetime: str | None = None,
        *,
        wait: bool = True,
    ) -> list[Status] | Future:
        """Store KV of the full blocks of a prompt.

        Parameters
        ----------
        ns : Namespace or bytes
            Identity (or its 32-byte digest).
        token_ids : sequence of int
            The prompt's token ids, shape ``(num_tokens,)``.
        kv_blocks : torch.Tensor or sequence of torch.Tensor
            KV of blocks ``start_block, start_block + 1, ...``: either a tensor of
            shape ``(n, *layout.block_shape)`` and dtype ``layout.dtype``, or a
            list of typed blocks / raw ``uint8`` blocks of ``bytes_per_block``.
        start_block : int
            Index of the first block given (blocks before it are already stored).
        lifetime : str, optional
            Engine hint for placement: ``"system"``, ``"conversation"``, ``"query"``.
        wait : bool
            ``False`` returns a Future of the statuses (see :meth:`store_keys`).

        Returns
        -------
        list of Status
            ``OK``, ``EXISTS`` or ``NO_SPACE`` per block given (a client: ``REJECTED``
            while its service is down or when it refuses the store).

        Raises
        ------
        LayoutError
            On a shape/dtype mismatch or more blocks than full blocks in the
            prompt (nothing is stored then).
        ConfigError
            An unknown ``lifetime`` hint (nothing is stored or sent).
        """
        check_start_block(start_block)
        class_from_hint(lifetime)
        keys = self.keys_for(ns, token_ids)
        return self._store_prompt(ns, token_ids, keys, self._sources(kv_blocks), start_block, lifetime, wait)

    def store_fragments(
        self,
        ns: Namespace | bytes,
        token_ids,
        fragments_per_block: Sequence[Sequence[torch.Tensor]],
        start_block: int = 0,
        lifetime: str | None = None,
        *,
        wait: bool = True,
    ) -> list[Status] | Future:
        """Store blocks given as engine fragments; the other parameters and the return value
        are those of :meth:`store`.

        Parameters
        ----------
        fragments_per_block : sequence
            Per block, either its fragments in the layout's order
            (``layout.num_fragments`` tensors, each ``layout.fragment_bytes``,
            any dtype, CPU or CUDA), or a :class:`~tierstore.io.pages.FragmentPlan`
            from :meth:`KVPagePool.plans(block_ids) <tierstore.io.pages.KVPagePool.plans>`,
            which skips the per-fragment check. Each block is gathered straight
            into its tier slot or the NVMe staging extent (one copy).
        wait : bool
            ``False`` returns a :class:`concurrent.futures.Future` of the
            statuses; the fragments must stay untouched until it resolves.

        Raises
        ------
        LayoutError
            A wrong fragment count or size (the message names the fragment).
        """
        check_start_block(start_block)
        class_from_hint(lifetime)
        sources = self._fragment_sources(fragments_per_block)
        keys = self.keys_for(ns, token_ids)
        return self._store_prompt(ns, token_ids, keys, sources, start_block, lifetime, wait)

    def store_keys(
        self,
        ns: Namespace | bytes,
        keys: Sequence[bytes],
        blocks,
        *,
        lifetime: str | None = None,
        first_position: int = 0,
        wait: bool = True,
    ) -> list[Status] | Future:
        """Store blocks under keys the caller computed (key-level API).

        For engines that hash blocks themselves (SGLang page hashes scoped with
        :func:`tierstore.identity.scoped_key`) or that keep keys from an
        earlier :meth:`keys_for`.

        Parameters
        ----------
        ns : Namespace or bytes
            The namespace the keys belong to (for invalidation and quotas).
        keys : sequence of bytes
            32-byte block keys, in chain order.
        blocks : sequence
            One per key: a typed block (``layout.block_shape``, ``layout.dtype``),
            a raw ``uint8`` block of ``bytes_per_block``, a list of fragments,
            or a :class:`~tierstore.io.pages.FragmentPlan`.
        lifetime : str, optional
            Placement hint: ``"system"``, ``"conversation"``, ``"query"``.
        first_position : int
            Chain position of ``keys[0]``.
        wait : bool
            ``False`` returns a :class:`concurrent.futures.Future` of the
            statuses; the source memory must stay untouched until it resolves.

        Returns
        -------
        list of Status or Future

        Raises
        ------
        LayoutError
            Malformed keys, a block of the wrong size or dtype, or a ``first_position`` that is
            not an int in ``[0, POSITION_MAX - len(keys) + 1]``
            (:func:`tierstore.identity.check_chain_positions`); nothing is stored or sent.
        ConfigError
            An unknown ``lifetime`` hint (:func:`tierstore.fdp.lifetime.class_from_hint`).
        """
        keys = self._checked_keys(keys)
        check_chain_positions(first_position, len(keys))
        class_from_hint(lifetime)
        sources = self._sources(blocks)
        if len(sources) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(sources)} blocks")
        return self._store_checked(
            CheckedStore(self.digest(ns), keys, sources, lifetime, first_position, None, wait)
        )

    def _store_prompt(
        self, ns, token_ids, keys: list[bytes], sources, start_block: int, lifetime, wait: bool
    ) -> list[Status] | Future:
        """Store ``sources`` as the prompt's blocks ``start_block, ...`` (its ``keys``)."""
        if start_block + len(sources) > len(keys):
            raise LayoutError(
                f"{len(sources)} blocks from block {start_block} exceed the prompt's "
                f"{len(keys)} full blocks (partial tails are never stored)"
            )
        end = start_block + len(sources)
        return self._store_checked(
            CheckedStore(
                self.digest(ns), keys[start_block:end], sources, lifetime, start_block, token_ids, wait
            )
        )

    # ------------------------------------------------------------------ what a store may replace
    def _checked_keys(self, keys) -> list[bytes]:
        """``keys`` checked (:func:`tierstore.io.inputs.check_keys`)."""
        return check_keys(keys)

    def _sources(self, blocks) -> Sequence:
        """The blocks of a store, one source per block (:func:`tierstore.io.inputs.plan_sources`)."""
        return plan_sources(blocks, self.layout)

    def _fragment_sources(self, fragments_per_block) -> Sequence:
        """Each block's fragments checked and planned as a copy source."""
        refuse_numpy(fragments_per_block, "fragments_per_block")
        return [plan_block(frags, self.layout, destination=False) for frags in list(fragments_per_block)]

    def _store_checked(self, call: CheckedStore) -> list[Status] | Future:
        """Store ``call.sources`` under ``call.keys``, its own way; ``call.wait=False``: a Future."""
        raise NotImplementedError


class KeyLookup:
    """``lookup_keys`` of :class:`~tierstore.api.KVStore` and
    :class:`~tierstore.node.client.NodeKVStore` (the daemon client's takes other options).

    A subclass implements ``digest`` and :meth:`_lookup_checked`.
    """

    def digest(self, ns: Namespace | bytes) -> bytes:
        """The namespace's 32-byte digest, scoped to the layout."""
        raise NotImplementedError

    def lookup_keys(
        self,
        keys: Sequence[bytes],
        request_id: object = None,
        *,
        num_prompt_tokens: int | None = None,
        ns: Namespace | bytes | None = None,
    ) -> LookupResult:
        """Longest cached prefix of ``keys`` (key-level :meth:`lookup`);
        ``num_prompt_tokens`` feeds the partial-tail metric.

        ``ns``, the namespace the keys belong to, matters only with a shared
        remote tier: blocks found there are then kept locally when loaded (a
        cache fill, indexed under ``ns``); without it they are loaded into the
        destinations only.

        Raises
        ------
        LayoutError
            For a key that is not 32 bytes.
        """
        keys = check_keys(keys)
        return self._lookup_checked(
            keys, request_id, num_prompt_tokens, None if ns is None else self.digest(ns)
        )

    def _lookup_checked(
        self, keys: list[bytes], request_id: object, num_prompt_tokens: int | None, d: bytes | None
    ) -> LookupResult:
        """Look ``keys`` (checked) up, ``d``: the namespace's digest or ``None``."""
        raise NotImplementedError
