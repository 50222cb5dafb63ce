"""The Python API that engines plug into: :class:`KVStore`.

Typical use by an engine (one request)::

    store = KVStore(KVLayout(...), hbm_bytes=..., host_bytes=..., nvme_path="/mnt/nvme/kv", nvme_bytes=...)
    ns = Namespace(model="llama-3.1-8b@<rev>", tokenizer="...", tenant="acme")
    with store.request() as rid:
        hit = store.lookup(ns, prompt_ids, request_id=rid)     # references the matched blocks
        statuses, blocks = store.load(hit.useful_keys)          # or load(..., dests=engine_buffers)
        n_ok = leading_ok(statuses)                             # use only the leading run of OK blocks
        ... prefill prompt_ids[n_ok * B:] ...
        store.store(ns, prompt_ids, new_kv_blocks)               # full blocks only
    # leaving the block releases the references, also on an exception

Page-pool engines pass fragment plans (:class:`tierstore.io.pages.KVPagePool`): ``store_fragments``
gathers each block from the engine's pages into its slot, ``load_fragments`` scatters it back.
:class:`KVStore` checks the input (:mod:`tierstore.io.inputs`) and runs each call through
:class:`tierstore.transfers.Transfers` (the index decides, the movers move, the index records;
``wait=False``: a Future; ``timeout_s``: a deadline, late blocks are ``MISS``).
Only full blocks are stored and matched; load ``LookupResult.useful_keys`` (the blocks faster to
load than to recompute, :class:`tierstore.policies.cost.CostModel`). ``close`` writes memory-only
blocks down to NVMe (bounded), so a restart on the same path finds them; ``invalidate`` is durable.
Errors: ``LayoutError`` (input), ``ConfigError``, ``QuotaExceeded`` (pins), ``StoreClosedError``
(after ``close``); misses, no space and I/O errors are :class:`~tierstore.errors.Status` values.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .build import StoreParts, assemble_config, assemble_options, remote_planner
from .config import StoreConfig
from .contract import Lease, LookupResult, Tier
from .errors import Status
from .identity import DigestCache, Namespace, block_hashes
from .io.inputs import check_keys, token_blocks
from .key_api import KeyAPI
from .key_api import open_call as _open_call
from .layout import KVLayout
from .store_calls import CheckedStore, StoreCalls
from .transfers import Transfers


def leading_ok(statuses: Sequence[Status]) -> int:
    """Length of the leading run of ``Status.OK``: the blocks an engine may use."""
    n = 0
    for s in statuses:
        if s is not Status.OK:
            break
        n += 1
    return n


@runtime_checkable
class KVStoreProtocol(Protocol):
    """The interface :class:`KVStore` and :class:`tierstore.client.RemoteKVStore` share.

    Signatures are checked for parity by ``tests/server/test_client_parity.py``.
    """

    def digest(self, ns: Namespace | bytes) -> bytes: ...
    def keys_for(self, ns: Namespace | bytes, token_ids) -> list[bytes]: ...
    def request(self) -> contextlib.AbstractContextManager: ...
    def release(self, request_id: object) -> int: ...
    def cancel(self, request_id: object) -> int: ...

    def store(
        self,
        ns,
        token_ids,
        kv_blocks,
        start_block: int = 0,
        lifetime: str | None = None,
        *,
        wait: bool = True,
    ): ...
    def store_keys(
        self, ns, keys, blocks, *, lifetime: str | None = None, first_position: int = 0, wait: bool = True
    ): ...
    def store_fragments(
        self,
        ns,
        token_ids,
        fragments_per_block,
        start_block: int = 0,
        lifetime: str | None = None,
        *,
        wait: bool = True,
    ): ...
    def lookup(self, ns, token_ids, request_id: object = None) -> LookupResult: ...
    def lookup_keys(self, keys, request_id: object = None) -> LookupResult: ...
    def probe(self, ns, token_ids) -> int: ...
    def exists(self, keys) -> int: ...
    def load(
        self, keys, dests=None, promote: bool = True, *, wait: bool = True, timeout_s: float | None = None
    ): ...
    def load_fragments(
        self, keys, dest_fragments_per_block, *, wait: bool = True, timeout_s: float | None = None
    ): ...
    def prefetch(self, ns, token_ids, tier: str = "host") -> Future: ...
    def pin(self, ns, token_ids, lease_s: float | None = None) -> Lease: ...
    def unpin(self, lease: Lease | int) -> bool: ...
    def invalidate(self, ns) -> int: ...
    def stats(self) -> dict: ...
    def close(self) -> object: ...


class KVStore(KeyAPI):
    """Tiered prefix KV store (HBM -> pinned host -> NVMe).

    Parameters
    ----------
    layout : KVLayout
        KV geometry of the engine.
    hbm_bytes, host_bytes : int or str
        Memory tier capacities in bytes or size strings (``"64MiB"``); 0 disables a tier.
    nvme_path : str, optional
        Directory (ends in ``/`` or exists; the tier is ``tierstore.nvme``
        in it), file or device for the NVMe tier; ``None`` disables it.
        tierstore writes only to a path that is empty or carries its label
        (:mod:`tierstore.io.label`); ``nvme_format=True`` lets it format
        anything else, destroying what it holds.
    nvme_bytes : int or str
        NVMe tier capacity in bytes or a size string; with ``nvme_path`` or not at all.
    **options
        Policy fields of :class:`~tierstore.config.PoliciesConfig`
        (``eviction``, ``promotion``, ``write_policy``, ``admission``,
        ``verify_tokens``, ``pin_quota_bytes``, ...); NVMe fields
        (``segment_size_bytes``, ``region_policy``, ``flush_on_close``, ...);
        ``device`` (``"auto"``, ``"cpu"``, ``"cuda"``) for the HBM tier;
        ``remote`` (a :class:`~tierstore.config.RemoteConfig` or its dict: the
        shared tier on Mooncake Store, needs ``tierstore[cluster]``); and
        run-time objects: ``clock``, ``classify``, ``admit``, ``reinsert``,
        ``cost``, ``nvme`` (a ready NVMe backend).

    The store is built by :func:`tierstore.build.assemble` from a
    :class:`~tierstore.config.StoreConfig`, as :meth:`from_config` does.

    **After close.** Every call that stores, finds, loads, pins, evicts or
    removes blocks, or reports on them (``store*``, ``lookup*``, ``probe``,
    ``exists``, ``load*``, ``prefetch*``, ``pin*``, ``unpin``, ``invalidate``,
    ``remove``, ``clear``, ``evict``, ``flush``, ``resident``, ``block_info``,
    ``state_of``, ``tiers_of``, ``namespaces``, ``keys_of_namespace``, entering
    ``request()`` or ``with store``) raises :class:`~tierstore.errors.StoreClosedError`
    once :meth:`close` began; ``close`` waits for the calls already in
    progress, so an acknowledged store is written down with the rest. Still
    answered after close: ``close`` itself and ``__exit__`` (idempotent),
    ``release``/``cancel`` (references are in memory; cleanup paths call
    them), the counters and configuration (``stats``, ``device_stats``,
    ``capacity_bytes``, ``bytes_per_tier``, ``references``, ``leases``,
    ``tiers``, ``cost_model``, ``placement``, ``ftl``, ``take_events``,
    ``drain``, ``check_invariants``), and the pure functions ``digest`` and
    ``keys_for``.

    Raises
    ------
    ConfigError
        Invalid or unknown options (the message lists the accepted ones).
    ForeignDataError
        ``nvme_path`` holds data tierstore did not write (:mod:`tierstore.io.label`).
    StoreLockedError
        Another store (this process or another) has ``nvme_path`` open.
    """

    def __init__(
        self,
        layout: KVLayout,
        hbm_bytes: int = 0,
        host_bytes: int = 0,
        nvme_path: str | None = None,
        nvme_bytes: int | str = 0,
        **options,
    ) -> None:
        self._init(assemble_options(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, **options))

    @classmethod
    def from_config(cls, config: StoreConfig | dict, layout: KVLayout | None = None, **runtime) -> KVStore:
        """Open a store from its typed configuration (:class:`tierstore.config.StoreConfig`).

        Parameters
        ----------
        config : StoreConfig or dict
            A dict is validated first (unknown keys are errors): the engine
            connectors pass their extra-config dict here.
        layout : KVLayout, optional
            Overrides ``config.layout`` (a connector derives it from the engine).
        **runtime
            Run-time objects (``clock``, ``classify``, ``admit``, ``reinsert``,
            ``cost``, ``nvme``, ``host_pool``), see :func:`tierstore.build.assemble`.

        Raises
        ------
        ConfigError
            Invalid configuration, or no layout given either way.
        """
        self = cls.__new__(cls)
        self._init(assemble_config(config, layout, **runtime))
        return self

    def _init(self, parts: StoreParts) -> None:
        self.layout = parts.layout
        self._bb = parts.layout.bytes_per_block
        self.config = parts.config
        self._parts = parts
        self._index = parts.index
        self._mover = parts.mover
        self.nvme = parts.nvme
        self._digests = DigestCache(scope=self.layout.fingerprint())  # other layouts never match
        self._rids = itertools.count(1)
        self.remote = parts.remote
        self._planner = remote_planner(parts)
        #: runs every prepare -> move -> complete; holds the open/closed state and the calls in progress
        self._transfers = Transfers(parts.index, parts.mover, self._planner, parts.nvme, parts.layout)

    def _check_open(self, what: str) -> None:
        self._transfers.calls.check(what)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._transfers.calls.closed

    # -------------------------------------------------------------- identity
    def keys_for(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` under ``ns``."""
        return block_hashes(self.digest(ns), token_ids, self.layout.tokens_per_block)

    @property
    def tiers(self) -> list[Tier]:
        """Enabled tiers, fastest first."""
        return list(self._index.tiers)

    # -------------------------------------------------------------- requests
    @contextlib.contextmanager
    def request(self) -> Iterator[object]:
        """A request id whose references are released on exit, also on an exception
        (then counted as an abort)."""
        self._check_open("request")
        rid = ("req", next(self._rids))
        try:
            yield rid
        except BaseException:
            self._index.cancel(rid)
            raise
        else:
            self._index.release(rid)

    def release(self, request_id: object) -> int:
        """Release every block reference held by ``request_id``."""
        return self._index.release(request_id)

    def cancel(self, request_id: object) -> int:
        """Abort ``request_id``: release its references."""
        return self._index.cancel(request_id)

    # -------------------------------------------------------------- store
    store = _open_call(StoreCalls.store)
    store_fragments = _open_call(StoreCalls.store_fragments)

    def _store_checked(self, call: CheckedStore) -> list[Status] | Future:
        """Store through :class:`~tierstore.transfers.Transfers`, with the prompt's tokens of
        these blocks when ``verify_tokens`` is on (:meth:`StoreCalls._store_checked`)."""
        first, toks = call.first_position, None
        if call.token_ids is not None and self._index.settings.verify_tokens:
            toks = token_blocks(call.token_ids, first + len(call.keys), self.layout)[first:]
        return self._transfers.store(call.ns, call.keys, call.sources, call.lifetime, first, toks, call.wait)

    # -------------------------------------------------------------- lookup
    @_open_call
    def lookup(
        self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray, request_id: object = None
    ) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (full blocks only).

        With ``request_id`` the matched blocks are referenced (ACTIVE) until
        :meth:`release`. See :meth:`tierstore.index.BlockIndex.lookup`.
        """
        d = self.digest(ns)  # once: a Namespace's digest lookup hashes its fields
        keys = block_hashes(d, token_ids, self.layout.tokens_per_block)
        toks = token_blocks(token_ids, len(keys), self.layout) if self._index.settings.verify_tokens else None
        return self._transfers.lookup(keys, toks, request_id, len(token_ids), d)

    @_open_call
    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens without taking references or touching recency."""
        return self._index.probe(self.keys_for(ns, token_ids)) * self.layout.tokens_per_block

    @_open_call
    def exists(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` resident in any tier.

        A pure probe: it takes no reference, renews no lease, does not touch
        recency and counts no hit, so it never keeps a block from eviction
        (SGLang's ``batch_exists``, Mooncake's ``batch_is_exist``).
        """
        return self._index.probe(check_keys(keys))

    # -------------------------------------------------------------- prefetch / pins / admin
    @_open_call
    def prefetch(self, ns: Namespace | bytes, token_ids, tier: str = "host") -> Future:
        """Bring the resident full blocks of a prefix up to ``tier`` (``"host"`` or
        ``"hbm"``) in the background, before a request needs them.

        Prefetch takes no request reference and counts no hit; it takes a slot
        only when one is free or held by a block with a lower copy.

        Returns
        -------
        concurrent.futures.Future
            Resolves to the number of blocks brought up.

        Raises
        ------
        ConfigError
            For an unknown or disabled tier.
        """
        return self.prefetch_keys(self.keys_for(ns, token_ids), tier)

    @_open_call
    def pin(self, ns: Namespace | bytes, token_ids, lease_s: float | None = None) -> Lease:
        """Pin the resident full blocks of a prefix for ``lease_s`` seconds."""
        return self._index.pin(self.digest(ns), self.keys_for(ns, token_ids), lease_s)

    @_open_call
    def pin_keys(self, ns: Namespace | bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """:meth:`pin` by key."""
        return self._index.pin(self.digest(ns), check_keys(keys), lease_s)

    @_open_call
    def unpin(self, lease: Lease | int) -> bool:
        """End a pin lease early."""
        return self._index.unpin(lease.lease_id if isinstance(lease, Lease) else lease)

    def leases(self) -> dict[int, Lease]:
        """Live pin leases by id."""
        return self._index.leases

    @_open_call
    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every block of a namespace, durably: after a restart on the same
        NVMe path nothing of it is served again. Returns blocks dropped."""
        return self._transfers.invalidate(self.digest(ns))

    @_open_call
    def clear(self) -> int:
        """Remove every block."""
        return self._transfers.clear()

    @property
    def cost_model(self):
        """The load-versus-recompute model (:class:`tierstore.policies.cost.CostModel`)."""
        return self._index.runtime.cost

    @_open_call
    def flush(self, timeout_s: float | None = None, max_bytes: int | None = None) -> int:
        """Write blocks that live only in memory to the NVMe tier; returns blocks written.

        Stops after ``timeout_s`` seconds or ``max_bytes`` bytes (each checked
        between batches of ``evict_batch_blocks * 8`` blocks).
        """
        return self._transfers.flush(timeout_s, max_bytes)

    # -------------------------------------------------------------- introspection
    def stats(self) -> dict:
        """Counters, per-tier bytes, load-latency percentiles and NVMe backend stats
        (:meth:`tierstore.build.StoreParts.stats`).

        The NVMe tier's own counters are under ``"nvme_backend"``, not at the top level: among
        them ``recovered_blocks`` and ``recovery_dropped_blocks`` (blocks found at open and not
        kept: past a smaller capacity's end, beyond block mode's live budget, failing their
        CRC), e.g. ``store.stats()["nvme_backend"]["recovery_dropped_blocks"]``."""
        return self._parts.stats()

    def device_stats(self) -> dict:
        """The NVMe device's view: its description and, with an FDP device (real
        or modelled), HBMW/MBMW/MBE/WAF, per-RUH bytes and end-to-end WA.

        ``e2e_wa`` = media bytes written / bytes the index wrote to the NVMe tier
        (``nvme_write_bytes``): it counts segment headers, padding, host
        copy-forward and the device's GC.
        """
        from .devices import device_report

        return device_report(self._parts, int(self._index.metrics.snapshot().get("nvme_write_bytes", 0)))

    @property
    def placement(self) -> Any:
        """The lifetime class -> PID table in use (:class:`tierstore.fdp.placement.PlacementPolicy`)."""
        return self._parts.placement

    @property
    def ftl(self) -> Any:
        """The FTL model of a simulated or modelled device, or ``None``."""
        return self._parts.ftl

    @_open_call
    def resident(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is resident (any tier). A pure probe like :meth:`exists`."""
        return self._index.resident(check_keys(keys))

    def capacity_bytes(self) -> dict[str, int]:
        """Capacity per enabled tier in bytes."""
        return self._parts.capacity_bytes()

    def references(self) -> dict[object, int]:
        """Open request references: ``request_id -> blocks referenced`` (empty when
        every request was released)."""
        return self._index.references()

    @_open_call
    def block_info(self, key: bytes) -> dict | None:
        """What the index knows of one block (tiers, state, hits, position, lifetime
        hint, the lifetime class it was last written to NVMe with), or ``None``."""
        return self._index.block_info(bytes(key))

    def bytes_per_tier(self) -> dict[str, int]:
        """Resident bytes per tier (``hbm``, ``host``, ``nvme``)."""
        return self._index.bytes_per_tier()

    @_open_call
    def state_of(self, key: bytes):
        """Ownership state of a block (:class:`tierstore.index.BlockState`) or ``None``."""
        return self._index.state_of(key)

    @_open_call
    def tiers_of(self, key: bytes) -> list[Tier]:
        """Tiers holding a readable copy of ``key``."""
        return self._index.tiers_of(key)

    @_open_call
    def namespaces(self) -> dict[bytes, int]:
        """Resident blocks per namespace, keyed by this store's digest of it
        (:meth:`digest`)."""
        return self._index.namespaces()

    @_open_call
    def keys_of_namespace(self, digest: bytes) -> list[bytes]:
        """Resident keys of a namespace, given as this store's digest (:meth:`digest`)."""
        return self._index.keys_of_namespace(bytes(digest))

    def record_events(self, on: bool = True) -> None:
        """Start (or stop) recording index events for :meth:`take_events`."""
        self._index.record_events = on

    def take_events(self) -> list[tuple]:
        """Drain recorded ``(kind, key, tier)`` events."""
        return self._index.take_events()

    def drain(self) -> None:
        """Wait for every call submitted so far (``wait=False`` calls, background cleaning)."""
        self._mover.drain()

    def check_invariants(self, quiescent: bool = False) -> None:
        """Raise :class:`~tierstore.errors.InvariantError` if the index is inconsistent
        (see :meth:`tierstore.index.BlockIndex.check_invariants`); ``quiescent``
        first waits for submitted work (:meth:`drain`)."""
        if quiescent:
            self.drain()
        self._index.check_invariants(quiescent)

    # -------------------------------------------------------------- close
    def close(self, *, flush: bool | None = None) -> int:
        """Refuse new calls, finish the calls in progress and the submitted ones,
        write memory-only blocks to NVMe (``flush``, default: the
        ``flush_on_close`` setting) and close the NVMe tier. Idempotent; a call
        that starts once ``close`` began raises :class:`StoreClosedError`.

        Returns
        -------
        int
            Blocks written down to NVMe by this close (0 without NVMe, with
            ``flush`` off, or when the store was closed already).
        """
        if not self._transfers.calls.close():
            return 0
        self._mover.shutdown()
        f = self._parts.flush
        written = 0
        if self.nvme is not None and (f.on_close if flush is None else flush):
            written = self._transfers.flush(f.timeout_s, f.max_bytes)
        if self.nvme is not None:
            self.nvme.close()
        if self.remote is not None:
            self.remote.close()
        return written

    def __enter__(self) -> KVStore:
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def transfers_of(store: KVStore) -> Transfers:
    """The :class:`~tierstore.transfers.Transfers` a store runs its calls on: for the node store
    (:mod:`tierstore.node.core`), whose tickets execute plans of the same store in two halves
    (:class:`tierstore.node.tickets.PlanService`) while its other calls go through ``store``."""
    return store._transfers


__all__ = ["KVStore", "KVStoreProtocol", "Namespace", "KVLayout", "Status", "Tier", "leading_ok"]
