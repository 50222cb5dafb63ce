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

**Exact-hit rule.** Only full blocks of ``layout.tokens_per_block`` tokens are
hashed, stored and matched; a partial tail is always recomputed. A lookup
reports ``matched_tokens`` as a multiple of the block size, and the metric
``partial_tail_tokens`` counts the tokens that could never be shared.

**Useful hits.** A matched block is *useful* only when loading it is faster than
recomputing it (:class:`tierstore.policies.cost.CostModel`); load
``LookupResult.useful_keys``, not all matched keys.

Errors: :class:`~tierstore.errors.LayoutError` for buffers that do not match
the layout, :class:`~tierstore.errors.ConfigError` for bad configuration,
:class:`~tierstore.errors.QuotaExceeded` for pins over quota. Misses, no space
and I/O errors are :class:`~tierstore.errors.Status` values, never exceptions.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch

from .config import StoreConfig
from .errors import ConfigError, LayoutError, Status
from .identity import DigestCache, Namespace, block_hashes
from .io.pages import FragmentPlan, check_distinct_destinations, plan_fragments
from .layout import KVLayout
from .manager import Lease, LookupResult, ManagerConfig, Tier, TierManager
from .tiers.storage import BlockStorage


def leading_ok(statuses: Sequence[Status]) -> int:
    """Length of the leading run of ``Status.OK``: the blocks an engine may use."""
    n = 0
    for s in statuses:
        if s is not Status.OK:
            break
        n += 1
    return n


def _check_keys(keys) -> list[bytes]:
    """Block keys as a list of 32-byte ``bytes``.

    Raises
    ------
    LayoutError
        For a key of another length or type (e.g. a truncated hex decode).
    """
    out = list(keys)
    for k in out:
        if not isinstance(k, (bytes, bytearray)) or len(k) != 32:
            raise LayoutError(f"block keys are 32-byte SHA-256 digests; got {type(k).__name__} "
                              f"of length {len(k) if hasattr(k, '__len__') else '?'}")
    return [bytes(k) for k in out]


def open_nvme_storage(path: str, capacity_bytes: int, block_bytes: int, backend: str = "auto",
                      **kwargs) -> BlockStorage:
    """Open the NVMe tier backend.

    Parameters
    ----------
    path : str
        A directory (a file is created inside it) or a file path.
    capacity_bytes : int
        Space the backend may use.
    block_bytes : int
        Block size.
    backend : str
        ``"segment"`` (log-structured, crash-recoverable, batched: :mod:`tierstore.io`),
        ``"slot"`` (fixed slots, :class:`tierstore.tiers.nvme.SlotFileStorage`) or
        ``"auto"`` (segment when available).

    Raises
    ------
    ConfigError
        For an unknown backend.
    """
    if backend not in ("auto", "segment", "slot"):
        raise ConfigError(f"nvme_backend={backend!r}: accepted values are ['auto', 'segment', 'slot']")
    if os.path.isdir(path):
        path = os.path.join(path, "tierstore.nvme")
    if backend in ("auto", "segment"):
        try:
            from .io import SegmentStorage  # noqa: F401
        except ImportError:
            if backend == "segment":
                raise ConfigError("nvme_backend='segment' needs tierstore.io.SegmentStorage") from None
        else:
            if "segment_size_bytes" not in kwargs:
                # ~64 segments per tier, 1 MiB .. 256 MiB, whole MiB (a real FDP RU is far larger;
                # pass segment_size_bytes=RU size on a device)
                seg = max(1 << 20, min(256 << 20, capacity_bytes // 64)) >> 20 << 20
                kwargs["segment_size_bytes"] = seg
            return SegmentStorage(path, capacity_bytes=capacity_bytes, block_bytes=block_bytes, **kwargs)
    from .tiers.nvme import SlotFileStorage
    return SlotFileStorage(path, capacity_bytes, block_bytes, **kwargs)


class KVStore:
    """Tiered prefix KV store (HBM -> pinned host -> NVMe).

    Parameters
    ----------
    layout : KVLayout
        KV geometry of the engine.
    hbm_bytes, host_bytes : int
        Memory tier capacities in bytes (0 disables a tier).
    nvme_path : str, optional
        Directory or file for the NVMe tier; ``None`` disables it.
    nvme_bytes : int
        NVMe tier capacity in bytes.
    nvme_backend : str
        See :func:`open_nvme_storage`.
    nvme : BlockStorage, optional
        A ready backend (overrides ``nvme_path``).
    **manager_options
        Further :class:`~tierstore.manager.ManagerConfig` fields (``eviction``,
        ``promotion``, ``verify_tokens``, ``pin_quota_bytes``, ...).
    """

    def __init__(self, layout: KVLayout, hbm_bytes: int = 0, host_bytes: int = 0,
                 nvme_path: str | None = None, nvme_bytes: int = 0, nvme_backend: str = "auto",
                 nvme: BlockStorage | None = None, **manager_options) -> None:
        if nvme is None and nvme_path is not None and nvme_bytes > 0:
            nvme = open_nvme_storage(nvme_path, nvme_bytes, layout.bytes_per_block, nvme_backend)
        cfg = ManagerConfig(layout=layout, hbm_bytes=hbm_bytes, host_bytes=host_bytes, **manager_options)
        self.layout = layout
        self.manager = TierManager(cfg, nvme)
        self._digests = DigestCache(scope=layout.fingerprint())  # other layouts never match
        self._rids = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: "StoreConfig | dict", layout: KVLayout | None = None) -> "KVStore":
        """Open a store from its typed configuration (:class:`tierstore.config.StoreConfig`).

        Parameters
        ----------
        config : StoreConfig or dict
            A dict is validated first (unknown keys are errors): the engine
            connectors pass their extra-config dict here.
        layout : KVLayout, optional
            Overrides ``config.layout`` (a connector derives it from the engine).

        Raises
        ------
        ConfigError
            Invalid configuration, or no layout given either way.
        """
        cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
        if layout is None:
            if cfg.layout is None:
                raise ConfigError("the store config has no 'layout' and none was given")
            layout = cfg.layout.build()
        t, p = cfg.tiers, cfg.policies
        nvme = t.nvme
        opts: dict = dict(eviction=p.eviction, promotion=p.promotion)
        return cls(layout, hbm_bytes=t.hbm.capacity_bytes, host_bytes=t.host.capacity_bytes,
                   nvme_path=nvme.path if nvme else None, nvme_bytes=nvme.capacity_bytes if nvme else 0, **opts)

    # -------------------------------------------------------------- identity
    def digest(self, ns: Namespace | bytes) -> bytes:
        """Namespace digest (cached)."""
        return self._digests(ns)

    def keys_for(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` under ``ns``."""
        return block_hashes(self.digest(ns), token_ids, self.layout.tokens_per_block)

    def _token_blocks(self, token_ids, n: int) -> list[np.ndarray]:
        arr = np.asarray(token_ids, dtype=np.int64)
        b = self.layout.tokens_per_block
        return [arr[i * b:(i + 1) * b] for i in range(n)]

    # -------------------------------------------------------------- requests
    @contextlib.contextmanager
    def request(self) -> Iterator[int]:
        """A request id whose references are released on exit, also on an exception
        (then counted as an abort)."""
        rid = ("req", next(self._rids))
        try:
            yield rid
        except BaseException:
            self.manager.cancel(rid)
            raise
        else:
            self.manager.release(rid)

    def release(self, request_id: object) -> int:
        """Release every block reference held by ``request_id``."""
        return self.manager.release(request_id)

    def cancel(self, request_id: object) -> int:
        """Abort ``request_id``: release its references."""
        return self.manager.cancel(request_id)

    # -------------------------------------------------------------- store
    def store(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray,
              kv_blocks: torch.Tensor | Sequence[torch.Tensor], start_block: int = 0,
              lifetime: str | None = None) -> list[Status]:
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
            Extra blocks beyond the prompt's full blocks are an error.
        start_block : int
            Index of the first block given (blocks before it are already stored).
        lifetime : str, optional
            Engine hint for placement: ``"system"``, ``"conversation"``, ``"query"``.

        Returns
        -------
        list of Status
            One per block given.

        Raises
        ------
        LayoutError
            On a shape/dtype mismatch or more blocks than full blocks in the prompt.
        """
        keys = self.keys_for(ns, token_ids)
        blocks = list(kv_blocks) if not isinstance(kv_blocks, torch.Tensor) or kv_blocks.dim() > 1 else [kv_blocks]
        if start_block < 0 or start_block + len(blocks) > len(keys):
            raise LayoutError(f"{len(blocks)} blocks from block {start_block} exceed the prompt's "
                              f"{len(keys)} full blocks (partial tails are never stored)")
        sel = keys[start_block:start_block + len(blocks)]
        toks = self._token_blocks(token_ids, len(keys))[start_block:start_block + len(blocks)]
        return self.manager.store(self.digest(ns), sel, blocks, toks, lifetime, start_block)

    def store_keys(self, ns: Namespace | bytes, keys: Sequence[bytes], blocks, *, lifetime: str | None = None,
                   first_position: int = 0, wait: bool = True) -> list[Status] | Future:
        """Store blocks under keys the caller computed (key-level API).

        For engines that hash blocks themselves (SGLang page hashes scoped with
        :func:`tierstore.identity.scoped_key`, vLLM block hashes) or that keep
        keys from an earlier :meth:`keys_for`.

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
            ``OK``, ``EXISTS`` or ``NO_SPACE`` per block.

        Raises
        ------
        LayoutError
            Malformed keys, or a block of the wrong size or dtype (nothing is stored).
        """
        keys = _check_keys(keys)
        blocks = list(blocks)
        if len(blocks) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(blocks)} blocks")
        digest = self.digest(ns)

        def run() -> list[Status]:
            return self.manager.store(digest, keys, self._as_blocks(blocks), None, lifetime, first_position)
        return run() if wait else self._submit(run)

    def _as_blocks(self, blocks) -> list[torch.Tensor]:
        """Tensors for the manager: fragment lists and plans are gathered into blocks."""
        out = []
        for b in blocks:
            if isinstance(b, torch.Tensor):
                out.append(b)
                continue
            plan = self._plan(b, destination=False)
            blk = torch.empty(self.layout.bytes_per_block, dtype=torch.uint8)
            plan.gather(blk, 0)
            out.append(blk)
        return out

    def _submit(self, fn) -> Future:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-api")
            return self._pool.submit(fn)

    def store_fragments(self, ns: Namespace | bytes, token_ids, fragments_per_block: Sequence[Sequence[torch.Tensor]],
                        start_block: int = 0, lifetime: str | None = None, *,
                        wait: bool = True) -> list[Status] | Future:
        """Store blocks given as engine fragments.

        Parameters
        ----------
        fragments_per_block : sequence
            Per block, either its ``2 * num_layers`` fragment tensors (order
            layer0-K, layer0-V, layer1-K, ...; each ``layout.fragment_bytes``,
            any dtype, CPU or CUDA), or a
            :class:`~tierstore.io.pages.FragmentPlan` from
            :meth:`KVPagePool.plans(block_ids) <tierstore.io.pages.KVPagePool.plans>`,
            which skips the per-fragment check. Fragments that are views of one
            pool at a constant stride are copied with one strided copy per block.

        wait : bool
            ``False`` returns a :class:`concurrent.futures.Future` of the
            statuses; the fragments must stay untouched until it resolves.

        Other parameters and the return value are those of :meth:`store`.

        Raises
        ------
        LayoutError
            A wrong fragment count or size (the message names the fragment).
        """
        keys = self.keys_for(ns, token_ids)
        plans = [self._plan(frags, destination=False) for frags in list(fragments_per_block)]
        if start_block < 0 or start_block + len(plans) > len(keys):
            raise LayoutError(f"{len(plans)} blocks from block {start_block} exceed the prompt's "
                              f"{len(keys)} full blocks (partial tails are never stored)")
        return self.store_keys(ns, keys[start_block:start_block + len(plans)], plans, lifetime=lifetime,
                               first_position=start_block, wait=wait)

    def _plan(self, frags: Sequence[torch.Tensor], destination: bool) -> FragmentPlan:
        """Check a block's fragments and plan the copy: views of one KV pool at
        a constant stride move as one strided copy (:mod:`tierstore.io.pages`)."""
        lay = self.layout
        if isinstance(frags, FragmentPlan):  # e.g. from KVPagePool.plans(block_ids)
            grid = tuple(frags.strided.shape[:-1]) if frags.strided is not None and frags.strided.dim() == 3 else None
            if (frags.nbytes != lay.bytes_per_block or frags.count not in (None, lay.num_fragments)
                    or grid not in (None, lay.fragment_grid)):
                raise LayoutError(f"planned block of {frags.count} fragments {grid or ''}, {frags.nbytes} bytes; "
                                  f"the layout ({lay.block_order}) has {lay.num_fragments} fragments "
                                  f"{lay.fragment_grid}, {lay.bytes_per_block} bytes")
            if frags.dtype not in (None, lay.dtype, torch.uint8):
                raise LayoutError(f"planned block of dtype {frags.dtype}; the layout's is {lay.dtype}")
            return plan_fragments(frags, destination=destination)  # a reading plan is no destination
        if isinstance(frags, torch.Tensor) or not hasattr(frags, "__len__"):
            raise LayoutError("each block's fragments must be a list of tensors (or a FragmentPlan)")
        if len(frags) != lay.num_fragments:
            raise LayoutError(f"expected {lay.num_fragments} fragments, got {len(frags)}")
        plan = plan_fragments(frags, destination=destination)
        if (plan.strided is None or plan.strided.shape[-1] != lay.fragment_bytes
                or plan.dtype not in (lay.dtype, torch.uint8)):
            lay.check_fragments(frags)  # names the wrong fragment
        return plan

    # -------------------------------------------------------------- lookup / load
    def lookup(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray,
               request_id: object = None) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (full blocks only).

        With ``request_id`` the matched blocks are referenced (ACTIVE) until
        :meth:`release`. See :meth:`tierstore.manager.TierManager.lookup`.
        """
        keys = self.keys_for(ns, token_ids)
        toks = self._token_blocks(token_ids, len(keys)) if self.manager.config.verify_tokens else None
        return self.manager.lookup(keys, toks, request_id, num_prompt_tokens=len(token_ids))

    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens without taking references or touching recency."""
        return self.manager.probe(self.keys_for(ns, token_ids)) * self.layout.tokens_per_block

    def lookup_keys(self, keys: Sequence[bytes], request_id: object = None) -> LookupResult:
        """Longest cached prefix of ``keys`` (key-level :meth:`lookup`).

        Raises
        ------
        LayoutError
            For a key that is not 32 bytes.
        """
        return self.manager.lookup(_check_keys(keys), None, request_id)

    def exists(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` resident in any tier.

        A pure probe: it takes no reference, renews no lease, does not touch
        recency and counts no hit, so it never keeps a block from eviction
        (SGLang's ``batch_exists``, Mooncake's ``batch_is_exist``).
        """
        return self.manager.probe(_check_keys(keys))

    def load(self, keys: Sequence[bytes] | LookupResult, dests: Sequence[torch.Tensor] | None = None,
             promote: bool = True, *, wait: bool = True):
        """Load blocks (default: a lookup's useful keys) into ``dests`` or new tensors.

        Returns per-block statuses and the filled tensors; use :func:`leading_ok`.
        Returned new tensors are typed blocks of ``layout.block_shape``. With
        ``wait=False`` a :class:`concurrent.futures.Future` of that pair.
        """
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = _check_keys(keys)

        def run():
            st, outs = self.manager.load(keys, dests, promote)
            if dests is None:
                outs = [None if o is None else self.layout.block_view(o) for o in outs]
            return st, outs
        return run() if wait else self._submit(run)

    def load_fragments(self, keys: Sequence[bytes] | LookupResult,
                       dest_fragments_per_block: Sequence[Sequence[torch.Tensor]], *,
                       wait: bool = True) -> list[Status] | Future:
        """Load blocks and scatter each into its destination fragments.

        ``dest_fragments_per_block`` is as in :meth:`store_fragments` (fragment
        tensors, contiguous or not, or ``KVPagePool.plans(block_ids,
        destination=True)``). Destinations are checked before anything is
        loaded; a block whose status is not ``OK`` leaves its destination
        untouched. Returns per-block statuses, or with ``wait=False`` a
        :class:`concurrent.futures.Future` of them (destinations must not be
        read before it resolves).

        Raises
        ------
        LayoutError
            A wrong fragment count or size, or not one destination per key.
        """
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = _check_keys(keys)
        dest_fragments_per_block = list(dest_fragments_per_block)
        if len(dest_fragments_per_block) != len(keys):
            raise LayoutError(f"{len(keys)} blocks to load but {len(dest_fragments_per_block)} destinations")
        plans = [self._plan(frags, destination=True) for frags in dest_fragments_per_block]
        check_distinct_destinations(plans)

        def run() -> list[Status]:
            st, outs = self.manager.load(keys, None)
            for s, raw, plan in zip(st, outs, plans):
                if s is Status.OK:
                    plan.scatter(raw.reshape(-1).view(torch.uint8), 0)
            return st
        return run() if wait else self._submit(run)

    # -------------------------------------------------------------- pins / admin
    def pin(self, ns: Namespace | bytes, token_ids, lease_s: float | None = None) -> Lease:
        """Pin the resident full blocks of a prefix for ``lease_s`` seconds."""
        return self.manager.pin(self.digest(ns), self.keys_for(ns, token_ids), lease_s)

    def prefetch(self, ns: Namespace | bytes, token_ids, tier: str = "host") -> Future:
        """Bring the resident full blocks of a prefix up to ``tier`` (``"host"`` or
        ``"hbm"``) in the background, before a request needs them.

        Returns a :class:`concurrent.futures.Future` of the number of blocks
        brought up. See :meth:`tierstore.manager.TierManager.prefetch`.

        Raises
        ------
        ConfigError
            For an unknown or disabled tier.
        """
        try:
            t = Tier[str(tier).upper()]
        except KeyError:
            raise ConfigError(f"tier={tier!r}: accepted values are ['hbm', 'host']") from None
        return self.manager.prefetch(self.keys_for(ns, token_ids), t)

    def unpin(self, lease: Lease | int) -> bool:
        """End a pin lease early."""
        return self.manager.unpin(lease.lease_id if isinstance(lease, Lease) else lease)

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every block of a namespace."""
        return self.manager.invalidate(self.digest(ns))

    def stats(self) -> dict:
        """Counters, per-tier bytes and load-latency percentiles."""
        m = self.manager
        out = m.metrics.snapshot()
        out["bytes_per_tier"] = m.bytes_per_tier()
        out["load_latency_ns"] = m.metrics.latency_percentiles_ns()
        if m.nvme is not None:
            out["nvme_backend"] = m.nvme.stats()
        return out

    def close(self) -> None:
        """Finish submitted asynchronous calls and close the NVMe backend."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.manager.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["KVStore", "Namespace", "KVLayout", "Status", "Tier", "leading_ok", "open_nvme_storage"]
