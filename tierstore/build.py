"""The one way to assemble a store: :func:`build_store`.

Every entry point -- ``KVStore(...)``, ``KVStore.from_config``, the daemon, the
trace replay, the benchmark CLI, the engine connectors -- validates its input
into a :class:`~tierstore.config.StoreConfig` and calls :func:`assemble`, which
wires, from the typed parts:

* the memory tiers (:class:`~tierstore.tiers.memory.BlockPool`: HBM on CUDA when
  present, else a CPU stand-in; host memory pinned when CUDA is present);
* the NVMe device the config names (:func:`tierstore.devices.open_device`:
  ``file``, ``sim`` or ``fdp``) and the tier on it
  (:class:`~tierstore.io.segments.SegmentStorage`); a file this assembly
  created is removed again when the tier fails to open;
* the placement (:class:`~tierstore.fdp.placement.PlacementPolicy` from the
  device's RUH Status; ``fdp.enabled: false`` gives no placement);
* the block index (:class:`~tierstore.index.BlockIndex`) and its policies, the
  region listener (the index hears what NVMe evicts), and the recovered blocks;
* the movers (:class:`~tierstore.movers.Movers`, a handler per transfer kind);
* the shared remote tier, when the config has a ``remote`` section
  (:class:`~tierstore.remote.mooncake.MooncakeTier` on Mooncake Store, with its
  sharing admission rule; needs the ``tierstore[cluster]`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .config import NVME_OPTIONS, OPTION_ALIASES, NvmeTierConfig, PoliciesConfig, StoreConfig, TiersConfig
from .contract import Tier
from .devices import DeviceStatsSource, NvmeGeometry, OpenedDevice, file_tier_geometry, open_device
from .errors import ConfigError
from .fdp.device import RuhUpdateShim, placement_policy
from .fdp.ftl import FTLModel
from .fdp.placement import PlacementPolicy
from .index import BlockIndex, IndexRuntime, IndexShape
from .io import format as fmt
from .io.file import undo_open
from .io.segments import SegmentStorage
from .layout import KVLayout
from .movers import Movers, make_movers
from .planner import RemotePlanner
from .policies.admission import make_admission
from .policies.base import make_policy
from .policies.cost import CostModel
from .policies.lifetime import make_classifier
from .policies.reinsert import make_reinsert
from .tiers.memory import BlockPool, cuda_available
from .tiers.storage import BlockStorage
from .units import format_bytes

_log = logging.getLogger("tierstore.build")

__all__ = [
    "FlushSettings",
    "StoreParts",
    "assemble",
    "assemble_config",
    "assemble_options",
    "build_store",
    "file_tier_geometry",
    "remote_planner",
]

#: ``KVStore`` keyword options that are policies (``policies:`` section of the config).
POLICY_OPTIONS = frozenset(PoliciesConfig.model_fields)
#: Run-time objects a config file cannot carry (:func:`assemble`'s keyword arguments).
RUNTIME_OPTIONS = frozenset({"clock", "classify", "admit", "reinsert", "cost", "nvme", "host_pool"})
#: NVMe tier options (:data:`tierstore.config.NVME_OPTIONS` and the ``nvme_*`` aliases).
NVME_KEYWORDS = frozenset(NVME_OPTIONS) | {
    k for k, v in OPTION_ALIASES.items() if v.startswith("tiers.nvme.")
}


@dataclasses.dataclass(frozen=True)
class FlushSettings:
    """What :meth:`KVStore.close <tierstore.api.KVStore.close>` writes down to NVMe: the
    ``flush_on_close``, ``flush_timeout_s`` (seconds) and ``flush_max_bytes`` (``None``: no cap)
    of :class:`~tierstore.config.NvmeTierConfig`; a store without an NVMe section has the defaults."""

    on_close: bool = True
    timeout_s: float | None = 30.0
    max_bytes: int | None = None

    @classmethod
    def of(cls, nv: NvmeTierConfig | None) -> FlushSettings:
        """The settings of the ``tiers.nvme`` section ``nv`` (``None``: the defaults)."""
        return cls() if nv is None else cls(nv.flush_on_close, nv.flush_timeout_s, nv.flush_max_bytes)


@dataclasses.dataclass
class StoreParts:
    """What :func:`assemble` wired (owned by the :class:`~tierstore.api.KVStore`)."""

    layout: KVLayout
    config: StoreConfig
    index: BlockIndex
    mover: Movers
    pools: dict[Tier, BlockPool]
    nvme: BlockStorage | None
    placement: PlacementPolicy
    geometry: NvmeGeometry
    ftl: FTLModel | None = None
    stats_source: DeviceStatsSource | None = None
    shim: RuhUpdateShim | None = None
    remote: Any = None
    share: Any = None
    flush: FlushSettings = dataclasses.field(default_factory=FlushSettings)

    def stats(self) -> dict:
        """The store's counters (:meth:`KVStore.stats <tierstore.api.KVStore.stats>`): the index's
        metrics, ``bytes_per_tier``, ``load_latency_ns`` percentiles, ``index_bytes``, ``blocks``,
        and the NVMe backend's (``nvme_backend``) and remote tier's (``remote``) stats when present."""
        ix = self.index
        out = ix.metrics.snapshot()
        out["bytes_per_tier"] = ix.bytes_per_tier()
        out["load_latency_ns"] = ix.metrics.latency_percentiles_ns()
        out["index_bytes"] = ix.nbytes()
        out["blocks"] = len(ix)
        if self.nvme is not None:
            out["nvme_backend"] = self.nvme.stats()
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def capacity_bytes(self) -> dict[str, int]:
        """Capacity per enabled tier in bytes (``hbm``, ``host``, ``nvme``)."""
        bb = self.layout.bytes_per_block
        out = {t.label: p.num_blocks * bb for t, p in self.pools.items()}
        if self.nvme is not None:
            out["nvme"] = self.nvme.capacity_blocks() * bb
        return out


def _explicit_placement(nv: NvmeTierConfig) -> PlacementPolicy | None:
    """The placement of a caller-given NVMe backend: the explicit ``long_pid``,
    ``medium_pid`` and ``short_pid`` of ``nv.fdp`` (``None`` when none is given).

    For a backend the caller placed on its own device (a tenant's range of a
    shared simulated SSD), whose RUH Status this assembly cannot read.
    """
    from .fdp.lifetime import LifetimeClass

    f = nv.fdp
    pids = (f.long_pid, f.medium_pid, f.short_pid)
    if all(p is None for p in pids):
        return None
    if any(p is None for p in pids):
        raise ConfigError("fdp: give all of long_pid, medium_pid, short_pid, or none")
    return PlacementPolicy(
        class_pid={
            LifetimeClass.LONG: f.long_pid,
            LifetimeClass.MEDIUM: f.medium_pid,
            LifetimeClass.SHORT: f.short_pid,
        },
        default_pid=f.default_pid or 0,
        rgif=0,
    )


def assemble(
    cfg: StoreConfig,
    layout: KVLayout,
    *,
    clock: Callable[[], float] | None = None,
    classify: Callable | None = None,
    admit: Callable | None = None,
    reinsert: Callable | None = None,
    cost: CostModel | None = None,
    nvme: BlockStorage | None = None,
    host_pool: BlockPool | None = None,
) -> StoreParts:
    """Wire a store from its typed config (module doc).

    Parameters
    ----------
    cfg : StoreConfig
    layout : KVLayout
    clock, classify, admit, reinsert, cost :
        Run-time objects that a YAML file cannot carry (a trace clock, a
        custom classifier or admission, a calibrated cost model); each
        overrides its config name.
    nvme : BlockStorage, optional
        A ready NVMe backend (tests), instead of ``cfg.tiers.nvme``.
    host_pool : BlockPool, optional
        The host tier's memory, made by the caller (the node store: its shared segment's host
        slots, :meth:`BlockPool.from_tensor <tierstore.tiers.memory.BlockPool.from_tensor>`),
        instead of one allocated here; ``cfg.tiers.host.capacity_bytes`` must give its number
        of blocks.

    Raises
    ------
    ConfigError
        Inconsistent sizes or choices (a ``host_pool`` of another block size or block count
        than the config's host tier).
    OSError
        A file or device cannot be opened.
    """
    bb = layout.bytes_per_block
    pools = _open_pools(cfg.tiers, bb, host_pool is None)
    if host_pool is not None:
        pools[Tier.HOST] = _checked_host_pool(host_pool, cfg.tiers, bb)
    nv = cfg.tiers.nvme
    opened: OpenedDevice | None = None
    shim = None
    if nvme is None and nv is not None:
        opened = open_device(nv, bb)
        placement, nvme, shim = _open_storage(nv, cfg.tiers.keep_data, bb, opened)
    else:
        placement = _placement(nv, None)
    try:
        runtime = _index_runtime(cfg, nvme, clock, classify, admit, reinsert, cost)
        return _wire(cfg, layout, pools, nvme, placement, opened, shim, runtime)
    except BaseException:
        if opened is not None:  # the NVMe tier this assembly opened: closed, its file as it was found
            nvme.close()
            undo_open(nvme.engine, nvme.path)
        raise


def _wire(
    cfg: StoreConfig,
    layout: KVLayout,
    pools: dict[Tier, BlockPool],
    nvme: BlockStorage | None,
    placement: PlacementPolicy,
    opened: OpenedDevice | None,
    shim: RuhUpdateShim | None,
    runtime: IndexRuntime,
) -> StoreParts:
    """The index, the remote tier and the movers over the open tiers, as :class:`StoreParts`."""
    bb = layout.bytes_per_block
    nv = cfg.tiers.nvme
    geometry = (
        opened.geometry
        if opened is not None
        else NvmeGeometry("memory only" if nvme is None else "NVMe backend given by the caller")
    )
    index = _open_index(cfg, layout, nvme, runtime)
    remote = share = None
    if cfg.remote is not None:
        remote, share = _open_remote(cfg, bb, index)
    mover = make_movers(pools, nvme, placement.placement_for if placement.enabled else None, remote)
    if remote is not None:  # remote loads are priced from measured Mooncake transfers
        remote.set_load_observer(lambda n, secs: index.runtime.cost.observe_load("remote", n * bb, secs, n))
    return StoreParts(
        layout,
        cfg,
        index,
        mover,
        pools,
        nvme,
        placement,
        geometry,
        opened.ftl if opened is not None else None,
        opened.stats_source if opened is not None else None,
        shim,
        remote,
        share,
        FlushSettings.of(nv),
    )


def _checked_host_pool(host_pool: BlockPool, t: TiersConfig, bb: int) -> BlockPool:
    """``host_pool``, the caller's host tier, when it has the config's block size and count."""
    want = t.host.capacity_bytes // bb
    if host_pool.block_bytes != bb or host_pool.num_blocks != want:
        raise ConfigError(
            f"host_pool of {host_pool.num_blocks} blocks of {host_pool.block_bytes} bytes; "
            f"the config's host tier has {want} blocks of {bb} bytes"
        )
    return host_pool


def _index_runtime(
    cfg: StoreConfig,
    nvme: BlockStorage | None,
    clock: Callable[[], float] | None,
    classify: Callable | None,
    admit: Callable | None,
    reinsert: Callable | None,
    cost: CostModel | None,
) -> IndexRuntime:
    """The index's run-time objects: each one :func:`assemble` was given, else the one its config
    name makes (the classifier, admission, reinsertion and, in block mode, the NVMe block order)."""
    block_mode = nvme is not None and nvme.eviction_granularity == "block"
    return IndexRuntime(
        clock=clock if clock is not None else time.monotonic,
        classify=classify if classify is not None else make_classifier(cfg.policies.classifier),
        admit=admit if admit is not None else make_admission(cfg.policies.admission),
        reinsert=make_reinsert(reinsert if reinsert is not None else cfg.policies.reinsert),
        cost=cost if cost is not None else CostModel(),
        remote_victims=cfg.remote is not None and cfg.remote.publish == "evict",
        nvme_policy=make_policy(cfg.policies.eviction) if block_mode else None,
        key_table=nvme.key_table if isinstance(nvme, SegmentStorage) else None,
    )


def _open_pools(t: TiersConfig, bb: int, host: bool = True) -> dict[Tier, BlockPool]:
    """The HBM and host pools of ``bb``-byte blocks (a tier of capacity 0 has none; no host
    pool without ``host``: the caller gives it).

    Raises
    ------
    ConfigError
        ``device='cuda'`` without CUDA, or a capacity below one block.
    """
    dev = t.hbm.device
    if dev == "cuda" and not cuda_available():
        raise ConfigError(
            "device='cuda' but CUDA is not available (torch.cuda.is_available() is "
            "False); use device='auto' to fall back to host memory"
        )
    hbm_dev = ("cuda" if cuda_available() else "cpu") if dev == "auto" else dev
    if not t.keep_data:  # the accounting mode (TiersConfig): pools without bytes
        hbm_dev = "meta"
    for name, tier_cfg in (("hbm", t.hbm), ("host", t.host)):
        if 0 < tier_cfg.capacity_bytes < bb:  # not "disabled": too small for one block
            raise ConfigError(
                f"the {name} tier's capacity, {tier_cfg.capacity_bytes} bytes "
                f"({format_bytes(tier_cfg.capacity_bytes)}), is below one block of this layout "
                f"({bb} bytes, {format_bytes(bb)}): give at least {bb} bytes, or 0 to disable the tier "
                f"(tiers.{name}.capacity_bytes; {name}_bytes in KVStore; --{name}_size in tierstore bench)"
            )
    pools: dict[Tier, BlockPool] = {}
    nh, nc = t.hbm.capacity_bytes // bb, t.host.capacity_bytes // bb
    if nh:
        pools[Tier.HBM] = BlockPool("hbm", nh, bb, hbm_dev)
    if nc and host:
        pools[Tier.HOST] = BlockPool(
            "host", nc, bb, "cpu" if t.keep_data else "meta", pin_memory=cuda_available() and t.keep_data
        )
    return pools


def open_host_pool(t: TiersConfig, bb: int) -> BlockPool | None:
    """The host tier's pool of ``bb``-byte blocks as :func:`assemble` would allocate it (``None``
    without a host tier), for a caller that prepares it first and gives it back as ``host_pool``
    (the daemon faults its pages in: :meth:`BlockPool.prefault
    <tierstore.tiers.memory.BlockPool.prefault>`).

    Raises
    ------
    ConfigError
        As :func:`assemble` for the tiers' sizes.
    """
    return _open_pools(t, bb).get(Tier.HOST)


def _placement(nv: NvmeTierConfig | None, opened: OpenedDevice | None) -> PlacementPolicy:
    """The lifetime class -> PID table: from the opened device's RUH Status, or the
    explicit PIDs of a caller-given backend (``opened`` is ``None``); disabled
    without ``fdp.enabled``.

    Raises
    ------
    ConfigError
        ``fdp.enabled`` on a device that cannot place writes, or on a
        caller-given backend without explicit PIDs.
    """
    if nv is None or not nv.fdp.enabled:
        return PlacementPolicy.disabled()
    f = nv.fdp
    if opened is None:
        # a caller-given backend on a device it placed itself (e.g. a tenant's
        # range of a shared simulated SSD): the explicit PIDs are the placement
        placement = _explicit_placement(nv)
        if placement is None:
            raise ConfigError(
                "an NVMe backend given by the caller with fdp.enabled needs explicit "
                "long_pid/medium_pid/short_pid"
            )
        return placement
    explicit = (f.long_pid, f.medium_pid, f.short_pid, f.default_pid)
    if opened.discovery is not None:
        return opened.discovery.placement(f.plids, explicit)
    if opened.device is not None:
        return placement_policy(
            opened.device.ruh_status(), opened.device.configs().configs[0].rgif, f.plids, explicit
        )
    raise ConfigError(
        "fdp.enabled needs an FDP device whose RUH Status gives the PIDs: device: fdp "
        "(/dev/ngXnY), device: sim, or a file with model: {...}; the posix and "
        "uring engines on a file or block device cannot place writes"
    )


def _open_storage(
    nv: NvmeTierConfig, keep_data: bool, bb: int, opened: OpenedDevice
) -> tuple[PlacementPolicy, SegmentStorage, RuhUpdateShim | None]:
    """The placement, the segment store on the opened device, and the RUH Update
    shim (the device model observes the tier's writes from here on, not the
    label's). On any failure the engine is closed and a file that
    :func:`~tierstore.devices.open_device` created is removed."""
    engine, path, seg = opened.engine, opened.path, opened.segment_bytes
    try:
        placement = _placement(nv, opened)
        # a tier in a file or on a device carries its label (tierstore.io.label); a simulated
        # device in memory does not outlive the process
        nvme = SegmentStorage(
            path,
            opened.tier_bytes,
            bb,
            segment_size_bytes=seg,
            engine=engine,
            owns_engine=True,
            extent_size_bytes=nv.extent_size_bytes,
            region_policy=nv.region_policy,
            keep_data=keep_data,
            invalidation_log=None,  # beside a file, in the label page of a device (never beside its node)
            label=path is not None,
            format=nv.format,
            metadata_placement=placement.placement_for_metadata(),
            eviction_granularity=nv.eviction_granularity,
            live_fraction=nv.live_fraction,
            trim_min_bytes=nv.trim_min_bytes,
            journal_path=nv.journal_path,
        )
        ruh_update = nv.fdp.ruh_update_on_segment_open
        if ruh_update is None:
            ruh_update = nv.fdp.enabled
        shim = None
        if opened.device is not None:  # a simulated or modelled device (device: fdp has none)
            if ruh_update:
                shim = RuhUpdateShim(opened.device, seg)
                engine.add_observer(shim)
            else:
                engine.add_observer(opened.device)
        return placement, nvme, shim
    except BaseException:
        engine.close()
        undo_open(engine, path)  # a file this assembly created or grew: as it was found
        raise


#: A one-block extent's header share of the NVMe tier above which the build says what the tier holds:
#: a quarter (blocks of 12 KiB or less). The packaged trace's 32 KiB blocks (11 %) stay quiet, so the
#: README's first command prints no warning.
_HEADER_SHARE_SAID = 0.25


def _say_header_share(
    tier_bytes: int, blocks: int, most_blocks: int, block_bytes: int, live_budget: int | None = None
) -> None:
    """One warning when small blocks leave much of the NVMe tier to extent headers.

    The tier is sized for the worst case, one block per extent: ``blocks``
    (:meth:`~tierstore.io.segment_manager.SegmentManager.capacity_blocks`); each extent starts
    with a header of at least 4096 bytes (:func:`tierstore.io.format.header_bytes_for`), which
    with 4 KiB blocks is half of the tier. Blocks stored in one batch share extents, and so
    headers, up to ``most_blocks`` when every extent is full
    (:meth:`~tierstore.io.segment_manager.SegmentManager.packed_capacity_blocks`). Block mode
    keeps at most ``live_budget`` of them live (``live_fraction`` of ``most_blocks``), which
    small extents' headers can exceed: the segments then fill first and single blocks are evicted.
    """
    header, extent = fmt.header_bytes_for(1), fmt.extent_bytes_for(1, block_bytes)
    if header / extent < _HEADER_SHARE_SAID:
        return
    _log.warning(
        "NVMe tier of %d bytes (%s) holds at least %d blocks of %d bytes, i.e. %d bytes (%s) of KV, "
        "when each block is stored alone: an extent of its own, whose %d-byte header is %.0f%% of it "
        "at this block size; blocks stored in batches share extents and headers, up to %d blocks "
        "when every extent is full%s. Larger blocks (more tokens_per_block) lose less",
        tier_bytes,
        format_bytes(tier_bytes),
        blocks,
        block_bytes,
        blocks * block_bytes,
        format_bytes(blocks * block_bytes),
        header,
        100.0 * header / extent,
        most_blocks,
        ""
        if live_budget is None
        else f"; block eviction keeps at most {live_budget} of them live (live_budget_blocks: "
        "live_fraction of those), fewer when the extents are small and fill the segments first",
    )


#: below this share of the tier holding KV (every extent full), the segment size is said to waste it
_SEGMENT_FIT_SAID = 2 / 3


def _say_segment_fit(tier_bytes: int, segment_bytes: int, most_blocks: int, block_bytes: int) -> None:
    """One warning when the segments fit so few whole extents that much of the tier can never hold
    KV, e.g. 2 MiB blocks in 4 MiB segments: an extent of two blocks needs 4 MiB plus its 4096-byte
    header (:func:`tierstore.io.format.extent_bytes_for`), so each segment holds one block and half
    the tier is never written. Names a ``segment_size_bytes`` that holds whole extents."""
    kv = most_blocks * block_bytes
    if kv >= _SEGMENT_FIT_SAID * tier_bytes:
        return
    k = max(1, segment_bytes // block_bytes)
    fit = -(-fmt.extent_bytes_for(k, block_bytes) // fmt.ALIGN_BYTES) * fmt.ALIGN_BYTES
    _log.warning(
        "NVMe tier of %s in %s segments holds at most %d blocks of %s in all (whole extents with "
        "their headers): at most %s (%.0f%%) of the tier can hold KV; segment_size_bytes=%d (one "
        "extent of %d blocks) would let batched stores fill about %.0f%% of it",
        format_bytes(tier_bytes),
        format_bytes(segment_bytes),
        most_blocks,
        format_bytes(block_bytes),
        format_bytes(kv),
        100.0 * kv / tier_bytes,
        fit,
        k,
        100.0 * k * block_bytes / fit,
    )


def _open_index(
    cfg: StoreConfig, layout: KVLayout, nvme: BlockStorage | None, runtime: IndexRuntime
) -> BlockIndex:
    """The block index over the tiers, listening to the NVMe tier and holding the
    blocks it recovered.

    Raises
    ------
    ConfigError
        An NVMe backend of another block size than the layout's.
    """
    bb, t = layout.bytes_per_block, cfg.tiers
    shape = IndexShape(
        bb,
        layout.tokens_per_block,
        hbm_blocks=t.hbm.capacity_bytes // bb,
        host_blocks=t.host.capacity_bytes // bb,
        nvme_blocks=nvme.capacity_blocks() if nvme is not None else None,
    )
    if nvme is not None and isinstance(nvme, SegmentStorage):
        least, most = nvme.segment_capacity_blocks()
        budget = shape.nvme_blocks if nvme.eviction_granularity == "block" else None
        _say_header_share(nvme.n_segments * nvme.segment_size_bytes, least, most, bb, budget)
        _say_segment_fit(nvme.n_segments * nvme.segment_size_bytes, nvme.segment_size_bytes, most, bb)
    index = BlockIndex(shape, cfg.policies, runtime)
    if nvme is not None:
        if nvme.block_bytes != bb:
            raise ConfigError(f"NVMe backend block_bytes={nvme.block_bytes} != layout {bb}")
        nvme.set_listener(index.listener)
        stored = nvme.scan()
        index.listener.adopt(stored.keys, stored.ns_digests, stored.write_seqs)
    return index


def _open_remote(cfg: StoreConfig, block_bytes: int, index: BlockIndex):
    """The shared remote tier (:mod:`tierstore.remote`; needs ``tierstore[cluster]``)."""
    from .remote.admission import ShareAdmission
    from .remote.mooncake import MooncakeTier

    r = cfg.remote
    return MooncakeTier(r, block_bytes), ShareAdmission(mode=r.admission)


def remote_planner(parts: StoreParts) -> RemotePlanner | None:
    """The remote tier's :class:`~tierstore.planner.RemotePlanner` for a store that has one."""
    if parts.remote is None:
        return None
    return RemotePlanner(
        parts.index,
        parts.remote,
        parts.share,
        parts.config.remote.publish,
        parts.layout.bytes_per_block,
        parts.layout.tokens_per_block,
    )


def assemble_options(
    layout: KVLayout,
    hbm_bytes: int | str = 0,
    host_bytes: int | str = 0,
    nvme_path: str | None = None,
    nvme_bytes: int | str = 0,
    **options,
) -> StoreParts:
    """Wire the store ``KVStore(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, **options)`` opens.

    ``options`` are those :meth:`StoreConfig.from_options <tierstore.config.StoreConfig.from_options>`
    takes and the run-time objects of :func:`assemble` (:data:`RUNTIME_OPTIONS`). With a ready NVMe
    backend (``nvme=...``) the NVMe options set only the flush on close (as given, unchecked) and
    ``nvme_path``/``nvme_bytes`` are not used.

    Raises
    ------
    ConfigError
        An unknown option (the message lists the accepted ones) or a bad value.
    """
    unknown = set(options) - POLICY_OPTIONS - RUNTIME_OPTIONS - NVME_KEYWORDS - {"device", "remote"}
    if unknown:
        raise ConfigError(
            f"KVStore: unknown option(s) {sorted(unknown)}; accepted: "
            f"{sorted(POLICY_OPTIONS | RUNTIME_OPTIONS | NVME_KEYWORDS | {'device', 'remote'})}"
        )
    runtime = {k: options.pop(k) for k in list(options) if k in RUNTIME_OPTIONS}
    flush = None
    if runtime.get("nvme") is not None:  # a ready NVMe backend: its options set only the flush on close
        given = {k: options.pop(k) for k in list(options) if k in NVME_KEYWORDS}
        flush = FlushSettings(
            given.get("flush_on_close", True),
            given.get("flush_timeout_s", 30.0),
            given.get("flush_max_bytes"),
        )
        nvme_path, nvme_bytes = None, 0
    parts = assemble(
        StoreConfig.from_options(hbm_bytes, host_bytes, nvme_path, nvme_bytes, **options), layout, **runtime
    )
    if flush is not None:
        parts.flush = flush
    return parts


def assemble_config(config: StoreConfig | dict, layout: KVLayout | None = None, **runtime) -> StoreParts:
    """Wire the store of a typed config (or a dict to validate); ``layout`` overrides ``config.layout``
    and ``runtime`` takes the run-time objects of :func:`assemble`.

    Raises
    ------
    ConfigError
        Invalid configuration, an unknown run-time option, no layout given either way, or a
        ``store.url`` (a node service's store is not built here).
    """
    cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
    if cfg.store.url is not None:
        raise ConfigError(
            f"store.url={cfg.store.url!r} names the node service's store, which is not built "
            f"here: open it with tierstore.integrations._common.open_store (a NodeKVStore)"
        )
    if layout is None:
        if cfg.layout is None:
            raise ConfigError("the store config has no 'layout' and none was given")
        layout = cfg.layout.build()
    unknown = set(runtime) - RUNTIME_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown run-time option(s) {sorted(unknown)}; accepted: {sorted(RUNTIME_OPTIONS)}"
        )
    return assemble(cfg, layout, **runtime)


def build_store(config: StoreConfig | dict, layout: KVLayout | None = None, **runtime):
    """Open a :class:`~tierstore.api.KVStore` from a typed config (or a dict to validate).

    ``runtime`` takes the run-time objects of :func:`assemble`.

    Raises
    ------
    ConfigError
        Invalid configuration, or no layout given either way.
    """
    from .api import KVStore

    return KVStore.from_config(config, layout, **runtime)
