"""tierstore as SGLang's HiCache L3: a ``HiCacheStorage`` backend.

SGLang's HiCache keeps HBM as L1, host memory as L2 (``HostKVCache``) and puts
a pluggable :class:`~sglang.srt.mem_cache.hicache_storage.HiCacheStorage`
behind them as L3. :class:`HiCacheTierStore` is such a backend; SGLang loads it
with its ``dynamic`` backend factory, no patch to SGLang::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tierstore",
            "module_path": "tierstore.integrations.sglang", "class_name": "HiCacheTierStore",
            "interface_v1": 1, "tenant": "acme",
            "tiers": {"host": {"capacity_bytes": "8GiB"},
                      "nvme": {"path": "/mnt/nvme/sglang", "capacity_bytes": "1TiB"}}}'

That store is embedded in the server's process (one per TP rank). With ``"store": {"url":
"unix:///run/tierstore/node.sock"}`` in place of ``tiers``, every rank of every server on the node
uses the node service's one store (``tierstore serve --node``); ranks stay apart by their keys.

Continued in ``docs/INTEGRATIONS.md`` (``tierstore/integrations/sglang.py``): data path; page vs
block; keys and isolation; the node service; host pool layouts; lifetime hints (FDP placement).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from ..api import KVStoreProtocol
from ..config import StoreConfig
from ..errors import ConfigError, LayoutError, Status, StoreClosedError
from ..identity import Namespace, scoped_keys
from ..io.label import resolve_nvme_path
from ..io.pages import FragmentPlan, KVPagePool
from ..layout import KVLayout, dtype_name
from ._common import close_store_logged, log_store_opened, open_store, split_extra_config

_log = logging.getLogger(__name__)

#: Host pool layouts this backend moves bit-exactly.
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: SGLang write policies (``--hicache-write-policy``, ``HiCacheController``).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_GIB = float(1 << 30)
#: Names the extra config in error messages.
_EXTRA_CONFIG = "SGLang --hicache-storage-backend-extra-config"


class SGLangStorageConfig(BaseModel):
    """The backend's own keys in ``--hicache-storage-backend-extra-config``, validated at start-up.

    The same dict carries tierstore's ``tiers`` and ``policies`` sections
    (:class:`tierstore.config.TiersConfig`, :class:`tierstore.config.PoliciesConfig`):
    :meth:`from_extra_config` splits the two. Unknown keys are errors; the block layout is
    derived from SGLang's host pool, so there is no ``layout`` section.

    Attributes
    ----------
    backend_name, module_path, class_name : str
        SGLang's ``dynamic`` loader keys (``StorageBackendFactory``).
    interface_v1 : int
        1 makes SGLang call the zero-copy ``batch_get_v1``/``batch_set_v1``;
        0 the copying ``batch_get``/``batch_set`` (both work).
    tenant : str, optional
        Tenant scope of every page this server stores and finds.
    extra_backend_tag : str, optional
        SGLang's per-deployment tag (Mooncake, SiMM); the tenant when
        ``tenant`` is not given. Both given and different is an error.
    write_policy : str, optional
        ``--hicache-write-policy``; read from SGLang's runtime config when left out.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend_name: str = "tierstore"
    module_path: str = "tierstore.integrations.sglang"
    class_name: str = "HiCacheTierStore"
    interface_v1: Literal[0, 1] = 1
    tenant: str | None = Field(None, min_length=1)
    extra_backend_tag: str | None = Field(None, min_length=1)
    write_policy: Literal["write_through", "write_through_selective", "write_back"] | None = None

    @field_validator("interface_v1", mode="before")
    @classmethod
    def _v1(cls, v):
        return int(v) if isinstance(v, bool) else v

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> tuple[StoreConfig, SGLangStorageConfig]:
        """Validate SGLang's extra-config dict into the store's sections (``tiers``,
        ``policies``) and the backend's own keys
        (:func:`tierstore.integrations._common.split_extra_config`).

        Raises
        ------
        ConfigError
            For an unknown key, a bad value, a ``layout``/``remote`` section,
            an HBM tier, no tier at all, or ``tenant`` and
            ``extra_backend_tag`` that disagree.
        """
        store_cfg, cfg = split_extra_config(
            extra,
            None,
            cls,
            _EXTRA_CONFIG,
            refuse={
                "layout": "'layout' is derived from SGLang's host pool (page size, layers, heads, dtype); "
                "remove it",
                "remote": "'remote' is not supported by this backend (SGLang's own 'mooncake' backend "
                "reaches Mooncake Store)",
            },
            secondary="SGLang owns HBM (its L1), tierstore serves as L3 (host and NVMe tiers)",
        )
        if cfg.tenant and cfg.extra_backend_tag and cfg.tenant != cfg.extra_backend_tag:
            raise ConfigError(
                f"invalid {_EXTRA_CONFIG}: tenant={cfg.tenant!r} and extra_backend_tag="
                f"{cfg.extra_backend_tag!r} disagree; give one of them"
            )
        return store_cfg, cfg

    @property
    def tenant_scope(self) -> str:
        """The tenant of the namespace: ``tenant``, else ``extra_backend_tag``, else ``"default"``."""
        return self.tenant or self.extra_backend_tag or "default"


def _mla_views(pool: Any, buf: torch.Tensor, layout: str, n_pages: int, P: int, L: int) -> tuple:
    """``(heads, head_dim, block order, layer tensors, block_dim, kv_dim)`` of an MLA host pool's
    ``kv_buffer`` in ``layout`` (the latent of a token split in two halves, as K and V)."""
    C = int(pool.kv_cache_dim)
    if C % 2:
        raise ConfigError(
            f"MLA latent width kv_cache_dim={C} is odd; tierstore's layout splits a "
            "token's latent into two equal halves"
        )
    heads, head_dim = 1, C // 2
    if layout == "page_first":  # (pages*P, L, 1, C): a page is one run, cut in two halves
        order = "kv_layer"
        layers = [buf.view(n_pages, 2, P * L * C // 2)]
        block_dim, kv_dim = 0, 1
    elif layout == "layer_first":  # (L, pages*P, 1, C)
        order = "layer_fused"
        layers = [buf[layer].view(n_pages, P * C) for layer in range(L)]
        block_dim, kv_dim = 0, None
    else:  # page_first_direct (pages, L, P, 1, C)
        order = "layer_fused"
        layers = [buf[:, layer].reshape(n_pages, P * C) for layer in range(L)]
        block_dim, kv_dim = 0, None
    return heads, head_dim, order, layers, block_dim, kv_dim


def _mha_views(pool: Any, buf: torch.Tensor, layout: str, n_pages: int, P: int, L: int) -> tuple:
    """``(heads, head_dim, block order, layer tensors, block_dim, kv_dim)`` of an MHA host pool's
    ``kv_buffer`` in ``layout``."""
    H, D = int(pool.head_num), int(pool.head_dim)
    if int(getattr(pool, "v_head_dim", D)) != D:
        raise ConfigError("K and V head dims differ; tierstore's layout has one head_dim")
    heads, head_dim = H, D
    if layout == "page_first":  # (2, pages*P, L, H, D)
        order = "kv_layer"
        layers = [buf.view(2, n_pages, P * L * H * D)]
    elif layout == "layer_first":  # (2, L, pages*P, H, D)
        order = "layer_kv"
        v = buf.view(2, L, n_pages, P * H * D)
        layers = [v[:, layer] for layer in range(L)]
    else:  # page_first_direct (2, pages, L, P, H, D)
        order = "layer_kv"
        v = buf.view(2, n_pages, L, P * H * D)
        layers = [v[:, :, layer] for layer in range(L)]
    block_dim, kv_dim = 1, 0
    return heads, head_dim, order, layers, block_dim, kv_dim


class HostPoolView:
    """SGLang's host KV pool seen as tierstore blocks (one block = one page).

    Parameters
    ----------
    pool : MHATokenToKVPoolHost or MLATokenToKVPoolHost
        SGLang's registered host pool (``HiCacheController.storage_host_pool``).

    Attributes
    ----------
    layout : KVLayout
        The store's layout: ``tokens_per_block = page_size``, ``block_order``
        per the module table.
    pages : KVPagePool
        The pool's buffer addressed by page number (``host index // page_size``).
    page_size : int
        Tokens per page.
    is_mla : bool
        One latent per token (no K/V split).

    Raises
    ------
    ConfigError
        For a pool type or layout this backend does not move bit-exactly
        (see the module docstring), with the reason.
    """

    def __init__(self, pool: Any) -> None:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        kind = type(pool)
        if kind not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
            raise ConfigError(
                f"tierstore's SGLang backend moves MHATokenToKVPoolHost and MLATokenToKVPoolHost "
                f"pages; got {kind.__name__} (asymmetric K/V, MXFP8 scales, hybrid and "
                "sidecar pools are not supported)"
            )
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ConfigError(
                f"--hicache-mem-layout {layout!r} is not supported by tierstore's SGLang backend; "
                f"accepted values are {list(SUPPORTED_LAYOUTS)}"
            )
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise ConfigError(
                f"{kind.__name__} has no materialised kv_buffer (allocator-only pool); "
                "tierstore needs the host pages"
            )
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(
                f"the host pool's kv_buffer must be a contiguous CPU tensor, got "
                f"device={buf.device}, contiguous={buf.is_contiguous()}"
            )
        P = int(pool.page_size)
        L = int(pool.layer_num)
        n_pages = int(pool.size) // P
        if int(pool.size) % P:
            raise ConfigError(f"host pool size {pool.size} is not a multiple of page_size {P}")
        self.page_size = P
        self.num_pages = n_pages
        self.is_mla = kind is MLATokenToKVPoolHost
        self.host_layout = layout
        self.dtype = buf.dtype
        views = _mla_views if self.is_mla else _mha_views
        heads, head_dim, order, layers, block_dim, kv_dim = views(pool, buf, layout, n_pages, P, L)
        self.layout = KVLayout(L, heads, head_dim, buf.dtype, P, f"sglang-{layout}", order)
        self.pages = KVPagePool(layers, block_dim=block_dim, kv_dim=kv_dim)
        if self.pages.block_bytes != self.layout.bytes_per_block:
            raise LayoutError(
                f"host page of {self.pages.block_bytes} bytes but the layout's block is "
                f"{self.layout.bytes_per_block} bytes"
            )
        self.page_bytes = self.layout.bytes_per_block

    def page_ids(self, host_indices: torch.Tensor, n_keys: int) -> Sequence[int]:
        """Page numbers of ``n_keys`` pages given as SGLang host token indices.

        Parameters
        ----------
        host_indices : torch.Tensor
            1-D integer tensor of ``n_keys * page_size`` host token indices;
            each page's run must be ``start, start + 1, ...`` with ``start`` a
            multiple of ``page_size`` (what SGLang's page allocator hands out).

        Returns
        -------
        range or list of int
            A ``range`` when the pages are consecutive (most calls: then
            :meth:`KVPagePool.batch` checks them without a pass over them), else a list.
            Bounds are checked by :meth:`KVPagePool.batch`.

        Raises
        ------
        LayoutError
            For a wrong count, dtype, or a run that is not one whole page.
        """
        P = self.page_size
        if (
            not isinstance(host_indices, torch.Tensor)
            or host_indices.is_floating_point()
            or host_indices.dim() != 1
        ):
            raise LayoutError("host_indices must be a 1-D integer tensor")
        if host_indices.numel() != n_keys * P:
            raise LayoutError(
                f"{n_keys} keys need {n_keys * P} host indices (page_size {P}), got {host_indices.numel()}"
            )
        if n_keys == 0:
            return []
        # numpy on the CPU copy: a few vectorised passes per call (torch's per-op dispatch cost
        # ~10 us an op, several ops a call, more than the check itself)
        if host_indices.dtype != torch.int64 or host_indices.device.type != "cpu":
            host_indices = host_indices.to("cpu", torch.int64)
        idx = host_indices.numpy()
        if P == 1:  # every index is a whole page
            pages = idx.tolist()
        else:
            idx = idx.reshape(n_keys, P)
            starts = idx[:, 0]
            q, rem = np.divmod(starts, P)
            if rem.any() or (idx != starts[:, None] + np.arange(P)).any():
                raise LayoutError(
                    "host_indices are not whole pages (runs of page_size consecutive indices "
                    "starting at a multiple of page_size)"
                )
            pages = q.tolist()
        a = pages[0]  # consecutive pages as a range: one C-level comparison, no numpy call
        if pages[-1] - a == n_keys - 1 and pages == list(range(a, a + n_keys)):
            return range(a, a + n_keys)
        return pages

    def flat_plan(self, flat: torch.Tensor, destination: bool) -> FragmentPlan:
        """A plan for one page held as SGLang's flat data page (the copying
        ``get``/``set`` path: ``get_data_page(i, flat=True)``,
        ``get_dummy_flat_data_page()``).

        The flat page's element order is the host layout's own page slice:
        ``(2, L, P, H, D)`` for ``layer_first`` and ``page_first_direct``,
        ``(2, P, L, H, D)`` for ``page_first``; MLA ``(L, P, 1, C)`` or
        ``(P, L, 1, C)``. The plan views it in the block order of
        :attr:`layout`, so both paths store identical blocks.

        Raises
        ------
        LayoutError
            If ``flat`` is not a contiguous CPU tensor of one page's bytes.
        """
        if (
            not isinstance(flat, torch.Tensor)
            or flat.device.type != "cpu"
            or not flat.is_contiguous()
            or flat.numel() * flat.element_size() != self.page_bytes
        ):
            raise LayoutError(f"a flat page must be a contiguous CPU tensor of {self.page_bytes} bytes")
        u8 = flat.reshape(-1).view(torch.uint8)
        lay = self.layout
        outer, inner = lay.fragment_grid
        f = lay.fragment_bytes
        if lay.block_order == "layer_kv":  # flat (2, L, F): fragment (l, kv) at kv * L * F + l * F
            view = u8.as_strided((outer, inner, f), (f, outer * f, 1))
        else:  # kv_layer (1, 2, F) or layer_fused (L, 1, F): the flat page is the block's byte order
            view = u8.view(outer, inner, f)
        return FragmentPlan(None, self.page_bytes, view, flat.dtype, outer * inner, destination)


#: Engine keys whose scoped keys :class:`_ScopedMemo` keeps (~0.3 KB each with SGLang's 64-char
#: page hashes: ~5 MiB a rank at most); when full it starts again empty.
MEMO_KEYS = 1 << 14


class _ScopedMemo:
    """:func:`~tierstore.identity.scoped_keys` of one namespace, remembered for recent keys.

    SGLang asks about the same page hashes in consecutive calls (``batch_exists`` then
    ``batch_get_v1`` in a prefetch; a backup's ``batch_set_v1``, then later loads), and a
    SHA-256 a key is ~0.6 us on this host, the largest per-page cost of a hit after the copy.
    A scoped key depends on nothing but the namespace digest and the engine key, so a remembered
    one is the one :func:`scoped_keys` would compute. Thread-safe: each ``dict`` call is atomic,
    and two threads that both compute a key store the same bytes.
    """

    __slots__ = ("digest", "cap", "memo")

    def __init__(self, digest: bytes, cap: int = MEMO_KEYS) -> None:
        self.digest = digest
        self.cap = int(cap)
        self.memo: dict[Any, bytes] = {}

    def __call__(self, keys: Sequence[Any]) -> list[bytes]:
        """Scoped keys of ``keys``, in order. Raises as :func:`scoped_keys`."""
        memo = self.memo
        try:
            got = list(map(memo.get, keys))  # C-level: no Python frame a key
        except TypeError:  # an unhashable key (bytearray): computed, not remembered
            return scoped_keys(self.digest, keys)
        if None not in got:
            return got  # type: ignore[return-value]  # no None in it
        if got.count(None) == len(got):
            miss, out = list(keys), scoped_keys(self.digest, keys)
            new = out
        else:
            miss = [k for k, g in zip(keys, got) if g is None]
            new = scoped_keys(self.digest, miss)
            it = iter(new)
            out = [g if g is not None else next(it) for g in got]
        if len(memo) + len(miss) > self.cap:
            memo.clear()
        memo.update(zip(miss, new))
        return out


def _sglang_write_policy() -> str | None:
    """``--hicache-write-policy`` from SGLang's runtime config, or None outside a server."""
    try:
        from sglang.srt.runtime_context import get_memory

        return getattr(get_memory(), "hicache_write_policy", None)
    except (ImportError, ValueError, AttributeError):  # config bag not published (tests, tools)
        return None


def _rank_file_name(model: str, cfg: HiCacheStorageConfig) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")[:48] or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return (
        f"sglang_{slug}-{digest}_tp{cfg.tp_rank}-{cfg.tp_size}_pp{cfg.pp_rank}-{cfg.pp_size}"
        f"_dp{getattr(cfg, 'dp_rank', 0)}.nvme"
    )


class HiCacheTierStore(HiCacheStorage):
    """SGLang HiCache L3 storage on a tierstore :class:`~tierstore.api.KVStore` (embedded) or the
    node service's store (:class:`~tierstore.node.client.NodeKVStore`, ``store.url``).

    Parameters
    ----------
    storage_config : HiCacheStorageConfig
        SGLang's storage config (ranks, ``is_mla_model``, ``model_name``,
        ``extra_config``).
    kwargs : dict, optional
        Extra arguments of SGLang's dynamic factory (unused).

    The store opens when SGLang registers its host pool
    (:meth:`register_mem_pool_host`), which fixes the block layout. See the
    module docstring for keys, layouts, lifetime hints and what is refused.

    Raises
    ------
    ConfigError
        Invalid extra config or an unsupported parallel setup (at start-up); from
        :meth:`register_mem_pool_host`, a node service that refuses this server's pages.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self._store_cfg, self.cfg = SGLangStorageConfig.from_extra_config(storage_config.extra_config)
        if not storage_config.model_name:
            raise ConfigError(
                "HiCacheStorageConfig.model_name is empty; tierstore scopes pages by model "
                "(set --served-model-name or --model-path)"
            )
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError(
                "decode context parallel (dcp_size > 1) is not supported by tierstore's SGLang "
                "backend: its per-shard page identity has no namespace field yet"
            )
        if getattr(storage_config, "attn_cp_size", 1) > 1:
            raise ConfigError(
                "attention context parallel (attn_cp_size > 1) is not supported by tierstore's "
                "SGLang backend: each CP rank holds a slice of every page"
            )
        if storage_config.is_mla_model and storage_config.tp_size > 1 and self._store_cfg.store.url is None:
            raise ConfigError(
                "MLA with tp_size > 1: SGLang writes replicated MLA pages from TP rank 0 only "
                "(is_storage_writer), so the other ranks' embedded stores would never hit; give "
                "store.url (the node service, which every rank reads) or run tp_size=1 per store"
            )
        self.storage_config = storage_config
        self.write_policy = self.cfg.write_policy or _sglang_write_policy()
        if self.write_policy is not None and self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy={self.write_policy!r}: accepted values are {list(WRITE_POLICIES)}"
            )
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self.store: KVStoreProtocol | None = None
        self._closed = False
        self.view: HostPoolView | None = None
        self.namespace: Namespace | None = None
        self._digest: bytes | None = None
        self._scoped: _ScopedMemo | None = None  # the namespace's scoped keys, set with the store
        self._who = "SGLang HiCache L3"
        self._rids = itertools.count(1)
        self._metrics_lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    # ------------------------------------------------------------------ set-up
    @property
    def lifetime_hint(self) -> str | None:
        """The hint passed with every store (module docstring, "Lifetime hints")."""
        return "conversation" if self.write_policy == "write_through_selective" else None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check SGLang's host pool, derive the block layout and open the store.

        Raises
        ------
        ConfigError
            An unsupported pool or layout, or a bad NVMe path (SGLang's attach
            then fails, so the server does not start).
        """
        if self._closed:
            raise StoreClosedError("HiCacheTierStore is closed (SGLang detached the backend)")
        if self.store is not None:
            if mem_pool_host is self.mem_pool_host:
                return
            raise ConfigError("HiCacheTierStore is already bound to another host pool")
        view = HostPoolView(mem_pool_host)
        sc = self.storage_config
        mla = bool(sc.is_mla_model)
        ns = Namespace(
            model=sc.model_name,
            kv_dtype=dtype_name(view.dtype),
            tp_rank=0 if mla else sc.tp_rank,
            tp_size=1 if mla else sc.tp_size,
            pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
            tenant=self.cfg.tenant_scope,
        )
        store = open_store(self._store_config(sc), view.layout)
        who = (
            f"SGLang HiCache L3 (model {sc.model_name}, tp {sc.tp_rank}/{sc.tp_size}, "
            f"pp {sc.pp_rank}/{sc.pp_size})"
        )
        try:  # the node service's store connects here: a refusal stops the start-up
            log_store_opened(
                _log,
                who,
                store,
                f"{view.host_layout} layout, {view.page_size}-token pages of {view.page_bytes} bytes, "
                f"tenant {ns.tenant!r}, write policy {self.write_policy}",
            )
        except ConfigError:
            store.close()
            raise
        super().register_mem_pool_host(mem_pool_host)
        self.view, self.namespace, self.store, self._who = view, ns, store, who
        self._digest = store.digest(ns)
        self._scoped = _ScopedMemo(self._digest)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Refuse extra host pools (hybrid models' sidecars): only the KV pool is moved.

        Raises
        ------
        ConfigError
            For any pool other than the KV pool.
        """
        if str(host_pool_name) != "kv":
            raise ConfigError(
                f"host pool {host_pool_name!r}: tierstore's SGLang backend stores the KV pool "
                "only (hybrid/sidecar pools use the v2 interface, not supported)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _store_config(self, sc: HiCacheStorageConfig) -> StoreConfig:
        if self._store_cfg.store.url is not None:  # the node service's store: its tiers, its files
            return self._store_cfg
        tiers = self._store_cfg.tiers
        nv = tiers.nvme
        if nv is not None and nv.path is not None and nv.device in ("file", "sim"):
            # the one path rule (tierstore.io.label): a directory gets one file per rank
            path = resolve_nvme_path(nv.path, file_name=_rank_file_name(sc.model_name, sc))
            tiers = tiers.model_copy(update={"nvme": nv.model_copy(update={"path": path})})
        return StoreConfig(tiers=tiers, policies=self._store_cfg.policies)

    def _require(self) -> tuple[KVStoreProtocol, HostPoolView]:
        store, view = self.store, self.view  # read before the flag: close() sets it first
        if self._closed:
            raise StoreClosedError("HiCacheTierStore is closed (SGLang detached the backend)")
        if store is None or view is None:
            raise ConfigError(
                "HiCacheTierStore: no host pool registered yet (SGLang calls "
                "register_mem_pool_host when it attaches the backend)"
            )
        return store, view

    def _batch(
        self, keys: list[str], host_indices: torch.Tensor
    ) -> tuple[KVStoreProtocol, HostPoolView, Sequence[int]] | None:
        """The store, the host pool and the page of each key of a zero-copy batch call; ``None``
        for no keys. Raises as :meth:`HostPoolView.page_ids`, before anything is moved."""
        store, view = self._require()
        if not keys:
            return None
        return store, view, view.page_ids(host_indices, len(keys))

    def _keys(self, keys: list[str]) -> list[bytes]:
        return self._scoped(keys)  # type: ignore[misc]  # set with the store (_require passed)

    @staticmethod
    def _position(extra_info: HiCacheStorageExtraInfo | None) -> int:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return len(prefix) if prefix else 0

    def _record(self, pages: list, bandwidth: list, n: int, dt_s: float) -> None:
        if self.enable_storage_metrics and n:
            with self._metrics_lock:
                pages.append(n)
                bandwidth.append(n * self.view.page_bytes / _GIB / max(dt_s, 1e-9))

    # ------------------------------------------------------------------ zero-copy v1
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading ``keys`` in the store (a pure probe: no reference,
        no lease, no recency, no hit)."""
        store, _ = self._require()
        return store.exists(self._keys(keys)) if keys else 0

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store host pages under their page hashes.

        Parameters
        ----------
        keys : list of str
            SGLang page hashes, in chain order.
        host_indices : torch.Tensor
            ``len(keys) * page_size`` host token indices, one page-aligned run per key.
        extra_info : HiCacheStorageExtraInfo, optional
            ``prefix_keys`` (when SGLang passes them) give the chain position.

        Returns
        -------
        list of bool
            True for a page now stored or already present; False for one the
            store had no room for (SGLang stops that backup there).

        Raises
        ------
        LayoutError
            Malformed ``host_indices`` (nothing is stored).
        """
        batch = self._batch(keys, host_indices)
        if batch is None:
            return []
        store, view, ids = batch
        skeys = self._keys(keys)
        if store.exists(skeys) == len(keys):  # all stored already: nothing to copy
            return [True] * len(keys)
        # Pages already stored go along (answered EXISTS): within one call they are
        # protected from the evictions the new pages cause, so a chain's head is
        # never evicted to make room for its own tail.
        t0 = time.perf_counter()
        st = store.store_keys(
            self.namespace,
            skeys,
            view.pages.batch(ids),
            lifetime=self.lifetime_hint,
            first_position=self._position(extra_info),
        )
        self._record(
            self.backup_pgs, self.backup_bandwidth, sum(s is Status.OK for s in st), time.perf_counter() - t0
        )
        return [s in (Status.OK, Status.EXISTS) for s in st]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load pages into the host pool at ``host_indices``.

        Only the leading run of stored pages is loaded (SGLang uses only the
        leading run of ``True``); each loaded page counts as a hit.

        Returns
        -------
        list of bool
            True for a page written into the host pool; False for a miss, an
            I/O error or a corrupt page (its host page is left untouched).
            A malformed ``host_indices`` raises as in :meth:`batch_set_v1`
            (nothing is loaded).
        """
        batch = self._batch(keys, host_indices)
        if batch is None:
            return []
        store, view, ids = batch
        rid = ("sglang", next(self._rids))
        t0 = time.perf_counter()
        try:
            hit = store.lookup_keys(self._keys(keys), request_id=rid)
            n = hit.matched_blocks
            st = store.load_fragments(hit.keys, view.pages.batch(ids[:n], destination=True)) if n else []
        finally:
            store.release(rid)
        dt = time.perf_counter() - t0
        n_ok = st.count(Status.OK)
        ok = [True] * n if n_ok == n else [s is Status.OK for s in st]
        self._record(self.prefetch_pgs, self.prefetch_bandwidth, n_ok, dt)
        return ok + [False] * (len(keys) - n)

    # ------------------------------------------------------------------ copying interface
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (a pure probe)."""
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """Load one page into a flat page tensor (``get_dummy_flat_data_page()``;
        one is allocated when ``target_location`` is None); None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Load pages into flat page tensors (SGLang's copying path).

        Returns
        -------
        list
            The filled tensor per key of the leading stored run, else None.

        Raises
        ------
        LayoutError
            A target that is not one contiguous flat page.
        """
        store, view = self._require()
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(targets)} target locations")
        targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in targets]
        plans = [view.flat_plan(t, destination=True) for t in targets]
        rid = ("sglang", next(self._rids))
        t0 = time.perf_counter()
        try:
            hit = store.lookup_keys(self._keys(keys), request_id=rid)
            n = hit.matched_blocks
            st = store.load_fragments(hit.keys, plans[:n]) if n else []
        finally:
            store.release(rid)
        self._record(
            self.prefetch_pgs,
            self.prefetch_bandwidth,
            sum(s is Status.OK for s in st),
            time.perf_counter() - t0,
        )
        return [t if s is Status.OK else None for t, s in zip(targets, st)] + [None] * (len(keys) - n)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page (``get_data_page(i, flat=True)``)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat pages (SGLang's copying path); True when all are stored or present.

        Raises
        ------
        LayoutError
            A value that is not one flat page (nothing is stored).
        """
        store, view = self._require()
        if not keys:
            return True
        values = list(values or [])
        if len(values) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(values)} values")
        plans = [
            view.flat_plan(v if v.is_contiguous() else v.contiguous(), destination=False) for v in values
        ]
        t0 = time.perf_counter()
        st = store.store_keys(self.namespace, self._keys(keys), plans, lifetime=self.lifetime_hint)
        self._record(
            self.backup_pgs, self.backup_bandwidth, sum(s is Status.OK for s in st), time.perf_counter() - t0
        )
        return all(s in (Status.OK, Status.EXISTS) for s in st)

    # ------------------------------------------------------------------ admin
    def clear(self) -> bool:
        """Drop every page of this server's namespace (SGLang's ``flush_cache``).

        Pages already on NVMe may come back after a restart until their
        segment is reclaimed (deletes are volatile, :mod:`tierstore.io.format`);
        they are still the right bytes for their keys. With the node service's store,
        the pages of this rank's namespace are dropped from the service; while it is
        down, nothing is dropped and the answer is False (SGLang's file backend's
        convention for a failed clear).
        """
        store, _ = self._require()
        try:
            n = store.invalidate(self.namespace)
        except StoreClosedError as e:  # only the node service's client: the service is down
            _log.error("tierstore HiCache L3: nothing cleared: %s", e)
            return False
        _log.info("tierstore HiCache L3: cleared %d pages", n)
        return True

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (empty unless storage
        metrics are enabled)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self.prefetch_pgs)
            m.backup_pgs.extend(self.backup_pgs)
            m.prefetch_bandwidth.extend(self.prefetch_bandwidth)
            m.backup_bandwidth.extend(self.backup_bandwidth)
            self.prefetch_pgs.clear()
            self.backup_pgs.clear()
            self.prefetch_bandwidth.clear()
            self.backup_bandwidth.clear()
        return m

    def close(self) -> None:
        """Close the store (SGLang calls this when it detaches the backend); every
        later call raises :class:`~tierstore.errors.StoreClosedError`. Idempotent."""
        self._closed = True
        store, self.store = self.store, None
        if store is not None:
            close_store_logged(_log, self._who, store)


__all__ = ["HiCacheTierStore", "HostPoolView", "SGLangStorageConfig", "SUPPORTED_LAYOUTS"]
