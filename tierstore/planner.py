"""Every decision about the shared remote tier (:mod:`tierstore.remote`): :class:`RemotePlanner`.

* **lookup** (:meth:`RemotePlanner.extend_lookup`): a local match is extended with the
  blocks the remote tier holds next in the chain, then the blocks resident here again
  after those, and so on (at most :attr:`~RemotePlanner.REMOTE_ROUNDS` remote calls);
  the useful prefix is recomputed over the whole match;
* **remote load** (:meth:`RemotePlanner.plan_load`): locally missed blocks a lookup found
  remotely under a known namespace are a cache fill (indexed here); the others are
  fetched into their destinations only; a namespace invalidated by this store is a miss;
* **publish** (:meth:`RemotePlanner.publishable`): which stored or reused blocks are
  offered to the remote tier (its admission rule, ``remote.publish``, barred namespaces);
* **invalidate** (:meth:`RemotePlanner.bar`): a namespace is never served from the
  remote tier again by this store.

It holds the state of those decisions (the namespace of remote-hit keys, bounded, and
the barred namespaces) and makes no transfer: :class:`tierstore.transfers.Transfers`
runs the movers on its plans. ``exists_prefix`` is network I/O: it is called with no
lock held (the index's ``probe``/``tiers_of`` lock briefly).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .contract import LookupResult, Tier
from .index import BlockIndex
from .remote.admission import ShareAdmission
from .tiers.storage import RemoteBlockTier


@dataclasses.dataclass
class RemoteLoadPlan:
    """Where each locally missed block of a load comes from (positions in the load).

    Attributes
    ----------
    fill : dict of bytes to list of int
        Namespace digest -> positions found remotely under it: fetched into the host
        tier and indexed (a cache fill).
    staged : list of int
        Positions fetched into their destinations only (no known namespace).
    barred : list of int
        Positions of a namespace this store invalidated: a miss, never loaded.
    """

    fill: dict[bytes, list[int]]
    staged: list[int]
    barred: list[int]


@dataclasses.dataclass(eq=False, repr=False)
class RemotePlanner:
    """The remote tier's decisions and their state (see the module docstring).

    Parameters
    ----------
    index : BlockIndex
        The store's index (probes, metrics, the cost model).
    tier : RemoteBlockTier
        The shared remote tier.
    share : ShareAdmission
        Its admission rule.
    publish : {"store", "evict"}
        ``remote.publish``: blocks are offered when stored, or when evicted (then the
        index's demotions publish them and :meth:`publishable` offers nothing).
    block_bytes, tokens_per_block : int
        The layout's block size in bytes and tokens (for the cost model).
    """

    #: Bound on remembered remote-hit keys (for indexing fetched blocks under their namespace).
    REMOTE_NS_MAX = 1 << 16

    #: Remote calls a lookup makes at most (a chain split remote / local / remote ...).
    REMOTE_ROUNDS = 4

    index: BlockIndex
    tier: RemoteBlockTier
    share: ShareAdmission
    publish: Literal["store", "evict"]
    block_bytes: int
    tokens_per_block: int
    #: namespace digest of keys a lookup found remotely (bounded): a remote
    #: block is indexed locally under the namespace it was looked up in
    _remote_ns: dict[bytes, bytes] = dataclasses.field(default_factory=dict, init=False)
    #: namespaces invalidated by this store: never served from the remote tier again
    _remote_barred: set[bytes] = dataclasses.field(default_factory=set, init=False)

    def barred(self, digest: bytes) -> bool:
        """Whether this store invalidated the namespace ``digest``."""
        return digest in self._remote_barred

    @property
    def publishes_reused(self) -> bool:
        """Whether a local hit is offered again (admission mode ``reused``)."""
        return self.share.mode == "reused"

    def extend_lookup(self, res: LookupResult, keys: list[bytes], digest: bytes | None) -> LookupResult:
        """Extend a local match with the shared remote tier: the blocks it holds
        next in the chain (one ``batch_is_exist``), then the blocks resident
        here again after those, and so on (at most :attr:`REMOTE_ROUNDS`
        remote calls): a chain can be split between the tiers, e.g. with
        ``publish: evict`` the remote tier holds the blocks this store evicted
        while later ones are still here. Blocks found here after a remote run
        are probed (no reference taken; one evicted before the load is a miss
        then). The useful prefix is recomputed over the whole match."""
        if res.matched_blocks >= len(keys) or (digest is not None and digest in self._remote_barred):
            return res
        out_keys, tiers = list(res.keys), list(res.tiers)
        pos, n_remote, n_local = res.matched_blocks, 0, 0
        for _ in range(self.REMOTE_ROUNDS):
            n = self.tier.exists_prefix(keys[pos:])
            if n <= 0:
                break
            more = list(keys[pos : pos + n])
            if digest is not None:
                self._remember(more, digest)
            out_keys += more
            tiers += [Tier.REMOTE] * n
            pos += n
            n_remote += n
            m = self.index.probe(keys[pos:]) if pos < len(keys) else 0
            for k in keys[pos : pos + m]:
                here = self.index.tiers_of(k)
                if not here:
                    m = 0
                    break
                out_keys.append(k)
                tiers.append(here[0])
                pos += 1
                n_local += 1
            if m <= 0 or pos >= len(keys):
                break
        if n_remote == 0:
            return res
        return self._priced(res, out_keys, tiers, n_remote, n_local)

    def _remember(self, keys: list[bytes], digest: bytes) -> None:
        for k in keys:
            self._remote_ns[k] = digest
        while len(self._remote_ns) > self.REMOTE_NS_MAX:
            self._remote_ns.pop(next(iter(self._remote_ns)))

    def _priced(
        self, res: LookupResult, out_keys: list[bytes], tiers: list[Tier], n_remote: int, n_local: int
    ) -> LookupResult:
        """The extended match with its load estimate and useful prefix (counted)."""
        cost, bb = self.index.runtime.cost, self.block_bytes
        labels = [t.label for t in tiers]
        load_s = cost.chain_load_s(labels, bb)  # remote estimates: measured Mooncake loads (build wires them)
        useful = cost.useful_prefix(load_s, self.tokens_per_block)
        reason = cost.not_useful_reason(labels, load_s, useful, bb, self.tokens_per_block)
        self.index.metrics.add(
            {
                "remote_hit_blocks": n_remote,
                "hit_blocks": n_remote + n_local,
                "useful_blocks": useful - res.useful_blocks,
            }
        )
        return LookupResult(
            out_keys,
            tiers,
            load_s,
            useful,
            res.requested_blocks,
            res.tokens_per_block,
            res.request_id,
            reason,
        )

    def plan_load(self, keys: list[bytes], missed: list[int]) -> RemoteLoadPlan:
        """Split the locally missed positions ``missed`` of a load of ``keys`` into a
        cache fill per namespace, fetches into destinations only, and barred misses."""
        plan = RemoteLoadPlan({}, [], [])
        for i in missed:
            d = self._remote_ns.get(keys[i])
            if d is None:
                plan.staged.append(i)
            elif d in self._remote_barred:
                plan.barred.append(i)
            else:
                plan.fill.setdefault(d, []).append(i)
        return plan

    def publishable(self, keys: list[bytes], hits: int) -> list[int]:
        """Positions of ``keys`` to offer to the remote tier now: none with ``remote.publish:
        evict`` (the index's demotions publish then), else those its admission rule takes
        (``hits``: 0 for a store, 1 for a local hit re-offered)."""
        if not keys or self.publish != "store":
            return []
        return [j for j, k in enumerate(keys) if self.share.admit(k, hits)]

    def bar(self, digest: bytes) -> list[bytes]:
        """Never serve the namespace ``digest`` from the remote tier again; returns its
        resident keys here, to remove from the remote tier."""
        self._remote_barred.add(digest)
        return self.index.keys_of_namespace(digest)


__all__ = ["RemoteLoadPlan", "RemotePlanner"]
