"""One pool of the node store: :class:`NodeCore`.

A pool is one block class (bytes and tokens per block): a :class:`~tierstore.api.KVStore` whose
host tier is the host slots of a shared segment (:class:`~tierstore.node.segment.Segment`, built
through :func:`tierstore.build.assemble` with ``host_pool=``: one way to build a store), the
segment's staging slots, the split execution of its plans (:class:`~tierstore.node.tickets.
PlanService`: tickets, their ready queue) and a background thread that aborts tickets past their
lease and keeps the coldest host blocks clean (written to NVMe), so that most store tickets find
victims that leave without an NVMe write and are ready at once. The node service (issue 24, N5)
serves one ``NodeCore`` per pool to engine processes (tickets over the UNIX socket, the segment
over ``SCM_RIGHTS``) and the same :attr:`NodeCore.store` over HTTP; in an engine's scheduler
process it is the embedded leader's store. It imports no engine integration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..api import KVStore, transfers_of
from ..closing import Closing
from ..config import StoreConfig
from ..contract import Tier
from ..errors import ConfigError, InvariantError, StoreClosedError, TierStoreError
from ..layout import KVLayout
from ..tiers.memory import BlockPool
from .segment import Segment
from .tickets import PlanService, Ticket

_log = logging.getLogger(__name__)


class NodeCore(Closing):
    """A store over a shared segment, with tickets and a background cleaner.

    Parameters
    ----------
    name : str
        The pool's name (the memfd is ``tierstore-<name>``; ``[A-Za-z0-9._-]``).
    config : StoreConfig or dict
        The store's configuration: ``tiers.host.capacity_bytes`` gives the segment's host slots
        (at least one block); no HBM tier (engine memory is the engines' own).
    layout : KVLayout
        The block class; ``bytes_per_block`` is the logical block (all ranks' shards).
    staging_blocks : int
        Staging slots: blocks bound for NVMe only or read from NVMe, in flight at once.
    lease_s : float
        A ticket not completed this long after it was prepared is aborted (its client is gone).
    quarantine_expired : bool
        Quarantine such a ticket instead (its client may still be alive and write its slots;
        the node service then aborts it once the client is known to be done:
        :meth:`PlanService.quarantine`).
    tick_s : float
        Period of the background thread (expiry, cleaning).
    clean_below : float
        Fraction of host slots: while fewer are free, the coldest memory-only host blocks are
        written to NVMe in the background, ``evict_batch_blocks`` at a time.
    clock : callable
        Seconds, monotonic, for ticket leases.
    **runtime
        Run-time objects for :func:`tierstore.build.assemble` (``clock`` excepted: the index
        keeps the monotonic clock; ``nvme``, ``cost``, ...).

    Raises
    ------
    ConfigError
        For an HBM tier, a host tier below one block, bad numbers, or a bad store config.
    SegmentError
        When the segment cannot be made.

    Attributes
    ----------
    store : KVStore
        The pool's store: lookups, references, pins, invalidation, statistics, close.
    segment : Segment
        The owner's mapping.
    tickets : PlanService
        Split execution of stores and loads.
    """

    def __init__(
        self,
        name: str,
        config: StoreConfig | dict,
        layout: KVLayout,
        *,
        staging_blocks: int = 256,
        lease_s: float = 60.0,
        quarantine_expired: bool = False,
        tick_s: float = 0.5,
        clean_below: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        **runtime,
    ) -> None:
        cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
        bb = layout.bytes_per_block
        host = cfg.tiers.host.capacity_bytes // bb
        if cfg.tiers.hbm.capacity_bytes:
            raise ConfigError(
                "the node store has no HBM tier (tiers.hbm.capacity_bytes must be 0): "
                "engine memory belongs to the engines"
            )
        if host < 1:
            raise ConfigError(
                f"the node store's host tier (tiers.host.capacity_bytes="
                f"{cfg.tiers.host.capacity_bytes}) must hold at least one {bb}-byte block"
            )
        if staging_blocks < 0 or tick_s <= 0 or not 0 <= clean_below <= 1:
            raise ConfigError(
                f"staging_blocks={staging_blocks} (>= 0), tick_s={tick_s} (> 0), "
                f"clean_below={clean_below} (in [0, 1])"
            )
        self.name = name
        self.layout = layout
        self.segment = Segment.create(name, bb, host, staging_blocks)
        try:
            pool = BlockPool.from_tensor("host", self.segment.host_rows())
            self.store = KVStore.from_config(cfg, layout, host_pool=pool, **runtime)
        except BaseException:
            self.segment.close()
            raise
        self._transfers = transfers_of(self.store)
        self.index = self._transfers.index
        self.tickets = PlanService(self._transfers, self.segment, lease_s, clock)
        self.quarantine_expired = bool(quarantine_expired)
        self.tick_s = float(tick_s)
        self.clean_below = float(clean_below)
        self._cleaning: Future | None = None
        self._closing = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._background, daemon=True, name=f"tierstore-node-{name}")
        self._thread.start()

    # ------------------------------------------------------------------ tickets
    def _check_open(self, what: str) -> None:
        if self._closing.is_set() or self.store.closed:  # close the pool with close(), not its store's
            raise StoreClosedError(f"NodeCore.{what}: the pool {self.name!r} is closed")

    def prepare_store(
        self,
        ns: bytes,
        keys,
        lifetime=None,
        first_position: int = 0,
        tokens=None,
        *,
        ranks: int = 1,
        wait: bool = False,
        on_ready=None,
    ) -> Ticket:
        """:meth:`PlanService.prepare_store`; :class:`StoreClosedError` once closing."""
        self._check_open("prepare_store")
        return self.tickets.prepare_store(
            ns, keys, lifetime, first_position, tokens, ranks=ranks, wait=wait, on_ready=on_ready
        )

    def prepare_load(self, keys, *, ranks: int = 1, wait: bool = False, on_ready=None) -> Ticket:
        """:meth:`PlanService.prepare_load`; :class:`StoreClosedError` once closing."""
        self._check_open("prepare_load")
        return self.tickets.prepare_load(keys, ranks=ranks, wait=wait, on_ready=on_ready)

    def complete_store(self, plan_id: int, ok, rank: int = 0, *, wait: bool = True):
        """:meth:`PlanService.complete_store`."""
        return self.tickets.complete_store(plan_id, ok, rank, wait=wait)

    def complete_load(self, plan_id: int, ok, rank: int = 0):
        """:meth:`PlanService.complete_load`."""
        return self.tickets.complete_load(plan_id, ok, rank)

    def abort(self, plan_id: int) -> bool:
        """:meth:`PlanService.abort`."""
        return self.tickets.abort(plan_id)

    def poll(self):
        """:meth:`PlanService.poll`."""
        return self.tickets.poll()

    # ------------------------------------------------------------------ key-level calls by digest
    def lookup(self, keys, request_id=None, ns: bytes | None = None):
        """Longest resident prefix of ``keys`` (:class:`~tierstore.contract.LookupResult`);
        ``request_id`` holds references as :meth:`KVStore.lookup_keys`. ``ns`` is a namespace
        *digest* the client computed (used as is, never digested again; only the remote tier
        reads it)."""
        self._check_open("lookup")
        return self._transfers.lookup(list(keys), None, request_id, None, ns)

    def pin(self, ns: bytes, keys, lease_s: float | None = None):
        """Pin the resident ``keys`` of namespace digest ``ns`` (used as is): a
        :class:`~tierstore.contract.Lease`; :class:`~tierstore.errors.QuotaExceeded` past the quota."""
        self._check_open("pin")
        return self.index.pin(ns, list(keys), lease_s)

    def invalidate(self, ns: bytes) -> int:
        """Drop every block of namespace digest ``ns`` (used as is); returns blocks dropped."""
        self._check_open("invalidate")
        return self._transfers.invalidate(ns)

    # ------------------------------------------------------------------ background
    def _background(self) -> None:
        while not self._closing.wait(self.tick_s):
            try:
                self.tickets.expire(quarantine=self.quarantine_expired)
                self.keep_clean()
            except (TierStoreError, OSError) as e:  # said and counted; the thread goes on
                self.index.metrics.inc("node_background_errors")
                _log.warning("node pool %r: background expiry/cleaning failed: %s", self.name, e)

    def keep_clean(self) -> Future | None:
        """Queue one background cleaning (the coldest memory-only host blocks to NVMe) when
        fewer than ``clean_below`` of the host slots are free and none is queued; its Future,
        else ``None``."""
        alloc = self.index.placement.alloc[Tier.HOST]
        if alloc.free >= self.clean_below * alloc.capacity:
            return None
        if self._cleaning is not None and not self._cleaning.done():
            return None
        self._cleaning = self._transfers.clean_in_background(self.index.settings.evict_batch_blocks)
        return self._cleaning

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        """The store's :meth:`KVStore.stats` with a ``node`` section: open tickets, staging and
        host slots (``host_free``: host slots neither holding a block nor handed out), lookup
        references (``references``: blocks referenced, summed over requests) and live pin leases
        (``leases``), the segment's size: what a client that holds nothing should see drop to 0
        (the node soak's leak check, ``bench/node_soak.py``)."""
        out = self.store.stats()
        h = self.segment.header
        out["node"] = {
            "pool": self.name,
            "open_tickets": self.tickets.open_tickets(),
            "quarantined_slots": self.tickets.quarantined_slots(),
            "references": sum(self.store.references().values()),
            "leases": len(self.store.leases()),
            "staging_slots": h.staging_slots,
            "staging_free": self.tickets.staging.free,
            "host_slots": h.host_slots,
            "host_free": self.index.placement.alloc[Tier.HOST].free,
            "slot_bytes": h.slot_bytes,
            "segment_bytes": h.segment_bytes,
        }
        return out

    def check_invariants(self, quiescent: bool = False) -> None:
        """The tickets' and the store's invariants (``quiescent``: also no ticket open, nothing
        held, after the submitted work).

        Raises
        ------
        InvariantError
        """
        if quiescent:
            self.store.drain()
        self.tickets.check_invariants()
        if quiescent and self.tickets.open_tickets():
            raise InvariantError(f"{self.tickets.open_tickets()} tickets open")
        self.store.check_invariants(quiescent)

    def close(self, *, flush: bool | None = None) -> int:
        """Stop the background thread, abort the tickets still open (the caller makes sure no
        client copies any more), close the store (``flush``: as :meth:`KVStore.close`) and the
        segment. Idempotent; returns the blocks the store's close wrote to NVMe."""
        if self._closed:
            return 0
        self._closed = True
        self._closing.set()
        self._thread.join()
        self.store.drain()
        for plan_id in self.tickets.open_ids():
            self.tickets.abort(plan_id)
        self.store.drain()
        written = self.store.close(flush=flush)
        self.segment.close()
        return written
