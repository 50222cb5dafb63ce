"""The one way to assemble a store: :func:`build_store`.

Every entry point -- ``KVStore(...)``, ``KVStore.from_config``, the daemon, the
trace replay, the benchmark CLI, the engine connectors -- validates its input
into a :class:`~tierstore.config.StoreConfig` and calls :func:`assemble`, which
wires, from the typed parts:

* the memory tiers (:class:`~tierstore.tiers.memory.BlockPool`: HBM on CUDA when
  present, else a CPU stand-in; host memory pinned when CUDA is present);
* the NVMe tier (:class:`~tierstore.io.segments.SegmentStorage`) on the device
  the config names (``tiers.nvme.device``):

  - ``file``: a file or block device through the ``posix``/``uring`` engine,
    optionally watched by the FTL model (``model:``) so a run reports WAF --
    of a *model*, not of the disk below;
  - ``sim``: the simulated FDP SSD (:class:`~tierstore.fdp.simdevice.SimFdpDevice`
    over an :class:`~tierstore.fdp.ftl.FTLModel`), data in memory, in a file,
    or nowhere (``engine: null``);
  - ``fdp``: a real FDP namespace ``/dev/ngXnY`` (passthrough writes, nvme-cli
    discovery). **Not verified on hardware.**

  Its segment size is the device's reclaim-unit size where there is one, else
  chosen from the capacity (:func:`~tierstore.io.segments.choose_segment_size`),
  or, for a tier that exists, the one its label records. Before anything is
  opened for writing, the path passes :func:`tierstore.io.label.check_target`
  (tierstore writes only to what is empty or carries its label, unless
  ``format: true``), and a file this assembly created is removed again when
  the tier fails to open;
* the placement (:class:`~tierstore.fdp.placement.PlacementPolicy` from the
  device's RUH Status; ``fdp.enabled: false`` gives no placement);
* the block index (:class:`~tierstore.index.BlockIndex`) and its policies, the
  region listener (the index hears what NVMe evicts), and the recovered blocks;
* the mover (:class:`~tierstore.mover.Mover`);
* the shared remote tier, when the config has a ``remote`` section
  (:class:`~tierstore.remote.mooncake.MooncakeTier` on Mooncake Store, with its
  sharing admission rule; needs the ``tierstore[cluster]`` extra).
"""
from __future__ import annotations

import dataclasses
import errno
import os
from typing import Any, Callable

from .config import NvmeTierConfig, SimDeviceConfig, StoreConfig
from .contract import Tier
from .errors import ConfigError, TierStoreError
from .fdp.device import NOT_VERIFIED_ON_HARDWARE, PassthroughEngine, RuhUpdateShim, placement_policy
from .fdp.ftl import FTLModel
from .fdp.placement import PlacementPolicy
from .fdp.simdevice import SimFdpDevice
from .index import BlockIndex, IndexConfig
from .io.engine import IOEngine
from .io.factory import open_engine
from .io.null import NullEngine
from .io.label import Target, check_target, resolve_nvme_path
from .io.segments import MIN_SEGMENTS, SegmentStorage, choose_segment_size
from .layout import KVLayout
from .mover import Mover
from .policies.admission import make_admission
from .policies.cost import CostModel
from .policies.lifetime import make_classifier
from .policies.reinsert import make_reinsert
from .tiers.memory import BlockPool, cuda_available
from .tiers.storage import BlockStorage
from .units import format_bytes

__all__ = ["StoreParts", "assemble", "build_store", "file_tier_geometry"]


@dataclasses.dataclass
class StoreParts:
    """What :func:`assemble` wired (owned by the :class:`~tierstore.api.KVStore`)."""

    layout: KVLayout
    config: StoreConfig
    index: BlockIndex
    mover: Mover
    pools: dict
    nvme: BlockStorage | None
    placement: PlacementPolicy
    ftl: FTLModel | None = None
    device: Any = None
    shim: RuhUpdateShim | None = None
    geometry: dict = dataclasses.field(default_factory=dict)
    remote: Any = None
    share: Any = None


def _default_ru(device_bytes: int, page_bytes: int) -> int:
    """``device / 60`` (a 16 GiB RU on a ~960 GiB SSD), whole MiB (or pages below 4 MiB)."""
    ru = device_bytes // 60
    unit = 1 << 20 if ru >= 4 << 20 else page_bytes
    return max(page_bytes, ru // unit * unit)


def _open_file_engine(kind: str, path: str, size_bytes: int, iodepth: int, what: str):
    """``open_engine`` on a file or block device; an ``OSError`` becomes a
    :class:`ConfigError` naming the path and what to do."""
    try:
        return open_engine(kind, path, size_bytes, iodepth=iodepth)
    except OSError as e:
        if isinstance(e, TierStoreError):
            raise
        hint = {errno.EFBIG: f": {size_bytes} bytes is larger than a file may be on this file system; lower "
                             "capacity_bytes",
                errno.EINVAL: ": the file system refuses O_DIRECT (e.g. tmpfs); use a directory on a disk",
                errno.ENOSPC: f": smaller than the {size_bytes} bytes asked for",
                errno.ENOENT: " (no file can be created there)", errno.EROFS: " (a read-only file system)",
                errno.EACCES: " (not writable by this user)", errno.EPERM: " (not writable by this user)",
                }.get(e.errno, "")
        raise ConfigError(f"{what}: cannot open {path}: {e.strerror or e}{hint}") from None


def file_tier_geometry(target: Target, nv: NvmeTierConfig, block_bytes: int) -> tuple[int, int]:
    """``(segment bytes, engine bytes)`` of a file tier: the label's segment size
    when the tier exists (fixed for its life; a reopen with another capacity
    changes the number of segments only), else one chosen from the capacity.

    Raises
    ------
    ConfigError
        Another block size or segment size than the label's, or a capacity
        that holds fewer than ``MIN_SEGMENTS`` of the label's segments.
    """
    old, cap, path = target.label, nv.capacity_bytes, target.path
    if old is None:
        seg = choose_segment_size(cap, block_bytes, nv.segment_size_bytes)
        return seg, cap // seg * seg
    seg = old.segment_size_bytes
    if old.block_bytes != block_bytes:
        raise ConfigError(f"{path}: holds blocks of [{old.block_bytes}] bytes, but was opened for {block_bytes}-byte "
                          "blocks (another KV layout?); open it with the layout it was written with, or use "
                          "another path. Nothing was changed.")
    if nv.segment_size_bytes is not None and nv.segment_size_bytes != seg:
        raise ConfigError(f"tiers.nvme.segment_size_bytes={nv.segment_size_bytes}: {path} was formatted with "
                          f"{seg}-byte segments, and a tier keeps its segment size; remove the key or set it to "
                          f"{seg}, or use another path. Nothing was changed.")
    if cap // seg < MIN_SEGMENTS:
        raise ConfigError(f"tiers.nvme.capacity_bytes={cap} ({format_bytes(cap)}): {path} was formatted with "
                          f"{seg}-byte segments (as a {format_bytes(old.n_segments * seg)} tier); {cap} bytes hold "
                          f"{cap // seg} of them, fewer than the {MIN_SEGMENTS} region eviction needs: give at least "
                          f"{MIN_SEGMENTS * seg} bytes, or another path. Nothing was changed.")
    return seg, max(cap // seg * seg, old.n_segments * seg)


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
    return PlacementPolicy(class_pid={LifetimeClass.LONG: f.long_pid, LifetimeClass.MEDIUM: f.medium_pid,
                                      LifetimeClass.SHORT: f.short_pid},
                           default_pid=f.default_pid or 0, rgif=0)


def _open_nvme(nv: NvmeTierConfig, block_bytes: int, geo: dict) -> tuple[IOEngine, int, int, Any, Any]:
    """Engine, tier bytes, segment bytes, the device model (or None) and its stats source."""
    if nv.device == "fdp":
        return _open_real_device(nv, block_bytes, geo)
    if nv.device == "sim":
        m = nv.model or SimDeviceConfig()
        pb = m.page_bytes
        dev = m.device_bytes
        if dev is None:
            dev = int(nv.capacity_bytes / m.utilization)
        ru = m.ru_size_bytes or nv.segment_size_bytes or _default_ru(dev, pb)
        if ru % pb or ru % 4096:
            raise ConfigError(f"ru_size_bytes={ru}: must be a multiple of page_bytes={pb} and 4096")
        dev = dev // ru * ru
        n_ru = (nv.capacity_bytes // ru) if nv.capacity_bytes is not None else int(m.utilization * dev + 1e-6) // ru
        tier = n_ru * ru
        if tier > dev or n_ru < 2:
            raise ConfigError(f"NVMe tier of {n_ru} RUs of {ru} bytes does not fit a {dev}-byte device "
                              "(need >= 2 RUs: one open segment and the GC reserve); use smaller RUs")
        kind = "memory" if nv.engine == "auto" else nv.engine
        if kind not in ("memory", "null"):  # the simulated device's data in a file
            if nv.path is None:
                raise ConfigError(f"device: sim with engine: {kind} needs a path")
            geo["path"] = resolve_nvme_path(nv.path)
            geo["target"] = check_target(geo["path"], format=nv.format)
        ftl = FTLModel(dev, ru, m.op_fraction, num_ruh=m.num_ruh, isolation=m.isolation, gc=m.gc, page_bytes=pb)
        device = SimFdpDevice(ftl)
        if kind == "null":
            engine: IOEngine = NullEngine(dev)
        elif kind == "memory":
            engine = open_engine(kind, None, dev, iodepth=nv.iodepth)
        else:
            engine = _open_file_engine(kind, geo["path"], dev, nv.iodepth, f"tiers.nvme.path={nv.path!r}")
        geo.update(device_bytes=dev, ru_size_bytes=ru, segment_size_bytes=ru, nvme_bytes=tier,
                   utilization=tier / dev, op_fraction=m.op_fraction, num_ruh=m.num_ruh, isolation=m.isolation,
                   gc=m.gc, page_bytes=pb,
                   description=f"sim (FTL model, {kind} engine): {dev} B user capacity, RU {ru} B, "
                               f"OP {m.op_fraction}, {m.num_ruh} RUHs, {m.isolation} isolation, {m.gc} GC; "
                               "a simulation, not an SSD")
        return engine, tier, ru, ftl, device
    # device == "file"
    kind = nv.engine  # "auto": io_uring where this process can use it, else posix (io.factory)
    path = geo["path"] = resolve_nvme_path(nv.path)
    target = geo["target"] = check_target(path, format=nv.format)  # before anything is written
    seg, size = file_tier_geometry(target, nv, block_bytes)
    tier = nv.capacity_bytes // seg * seg
    engine = _open_file_engine(kind, path, size, nv.iodepth, f"tiers.nvme.path={nv.path!r}")
    _warn_if_sparse_overcommit(path, tier, geo)
    geo.update(device_bytes=tier, ru_size_bytes=seg, segment_size_bytes=seg, nvme_bytes=tier, utilization=1.0,
               description=f"file ({kind} engine) {path}")
    ftl = device = None
    if nv.model is not None:
        m = nv.model
        try:
            ftl = FTLModel(tier, seg, m.op_fraction, num_ruh=m.num_ruh, isolation=m.isolation, gc=m.gc,
                           page_bytes=m.page_bytes)
        except ConfigError as exc:
            geo["description"] += f"; no FTL model ({exc})"
        else:
            device = SimFdpDevice(ftl)
            geo.update(op_fraction=m.op_fraction, num_ruh=m.num_ruh, isolation=m.isolation, gc=m.gc,
                       page_bytes=m.page_bytes)
            geo["description"] += (f"; WAF from an FTL model observing the engine (a model, not this file "
                                   f"system's device): RU = segment = {seg} B, OP {m.op_fraction}")
    return engine, tier, seg, ftl, device


def _warn_if_sparse_overcommit(path: str, tier_bytes: int, geo: dict) -> None:
    """A sparse file accepts any size; say so when the tier exceeds the free space
    (plus what the tier's file already holds, in allocated blocks)."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize + (os.stat(path).st_blocks * 512 if os.path.exists(path) else 0)
    except OSError:
        return
    if tier_bytes > free:
        import logging
        msg = (f"NVMe tier of {tier_bytes} bytes is larger than the {free} bytes free on the file system of "
               f"{path}: writes will fail with no space once it fills")
        logging.getLogger("tierstore").warning(msg)
        geo["warning"] = msg


def _open_real_device(nv: NvmeTierConfig, block_bytes: int, geo: dict):
    """``device: fdp``: the FDP namespace ``/dev/ngXnY``, found by
    :func:`tierstore.fdp.device.discover_namespace` (the one discovery the bench
    and the daemon share); placed writes by passthrough, RUH Update on segment
    open, every PID checked against RUH Status. With ``model:``, an FTL model of
    the namespace's geometry observes the writes and RUH Updates (``KVStore.ftl``),
    for comparison with the device's own counters."""
    from .fdp.device import discover_namespace
    from .fdp.nvme_cli import FdpDeviceStats
    path = geo["path"] = nv.path
    if not os.path.basename(path).startswith("ng"):
        raise ConfigError(f"device: fdp needs path=/dev/ngXnY (got {path!r})")
    ns = discover_namespace(path)
    if nv.fdp.enabled:
        ns.require_fdp()
    fdp_on = bool(ns.info.fdp_enabled)
    runs = ns.info.config.runs_bytes if fdp_on else None
    ru = nv.segment_size_bytes or runs
    if ru is None:
        raise ConfigError("device: fdp without FDP needs segment_size_bytes")
    tier = nv.capacity_bytes // ru * ru
    if tier > ns.size_bytes:
        raise ConfigError(f"capacity_bytes={nv.capacity_bytes}: the namespace {path} has {ns.size_bytes} bytes")
    ruh_update = nv.fdp.ruh_update_on_segment_open
    if ruh_update is None:
        ruh_update = nv.fdp.enabled
    engine = PassthroughEngine(ns.char_dev, tier, ns.nsid, ns.lba_bytes,
                               pid_table=ns.pid_table if fdp_on else None,
                               max_transfer_bytes=ns.max_transfer_bytes,
                               ruh_update_segment_bytes=ru if (ruh_update and fdp_on) else None,
                               ru_nominal_bytes=runs)
    geo.update(device_bytes=ns.size_bytes, ru_size_bytes=runs or ru, segment_size_bytes=ru, nvme_bytes=tier,
               utilization=tier / ns.size_bytes, lba_bytes=ns.lba_bytes,
               description=f"{path} (FDP namespace {ns.nsid} of {ns.ctrl_dev} via NVMe passthrough; "
                           f"{NOT_VERIFIED_ON_HARDWARE})",
               discovery=ns)
    ftl = None
    if nv.model is not None and fdp_on:
        m, cfg = nv.model, ns.info.config
        try:
            ftl = FTLModel(tier, runs, m.op_fraction, num_ruh=cfg.nruh, isolation=m.isolation, gc=m.gc,
                           page_bytes=m.page_bytes, num_rg=max(1, cfg.nrg), rgif=cfg.rgif)
        except ConfigError as exc:
            geo["description"] += f"; no FTL model ({exc})"
        else:
            engine.add_observer(SimFdpDevice(ftl))
            geo["description"] += "; an FTL model observes its writes and RUH Updates (KVStore.ftl)"
    return engine, tier, ru, ftl, FdpDeviceStats(ns.ctrl_dev, ns.endgid)


def assemble(cfg: StoreConfig, layout: KVLayout, *, clock: Callable[[], float] | None = None,
             classify: Callable | None = None, admit: Callable | None = None,
             reinsert: Callable | None = None, cost: CostModel | None = None,
             nvme: BlockStorage | None = None) -> StoreParts:
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

    Raises
    ------
    ConfigError
        Inconsistent sizes or choices.
    OSError
        A file or device cannot be opened.
    """
    bb = layout.bytes_per_block
    t, p = cfg.tiers, cfg.policies
    geo: dict = {}
    pools: dict[Tier, BlockPool] = {}
    dev = t.hbm.device
    if dev == "cuda" and not cuda_available():
        raise ConfigError("device='cuda' but CUDA is not available (torch.cuda.is_available() is "
                          "False); use device='auto' to fall back to host memory")
    hbm_dev = ("cuda" if cuda_available() else "cpu") if dev == "auto" else dev
    if not t.keep_data:  # the accounting mode (TiersConfig): pools without bytes
        hbm_dev = "meta"
    for name, tier_cfg in (("hbm", t.hbm), ("host", t.host)):
        if 0 < tier_cfg.capacity_bytes < bb:  # not "disabled": too small for one block
            raise ConfigError(f"the {name} tier's capacity, {tier_cfg.capacity_bytes} bytes "
                              f"({format_bytes(tier_cfg.capacity_bytes)}), is below one block of this layout "
                              f"({bb} bytes, {format_bytes(bb)}): give at least {bb} bytes, or 0 to disable the tier "
                              f"(tiers.{name}.capacity_bytes; {name}_bytes in KVStore; --{name}_size in tierstore bench)")
    nh, nc = t.hbm.capacity_bytes // bb, t.host.capacity_bytes // bb
    if nh:
        pools[Tier.HBM] = BlockPool("hbm", nh, bb, hbm_dev)
    if nc:
        pools[Tier.HOST] = BlockPool("host", nc, bb, "cpu" if t.keep_data else "meta",
                                     pin_memory=cuda_available() and t.keep_data)
    placement = PlacementPolicy.disabled()
    ftl = device = shim = opened = None
    nv = t.nvme
    if nvme is None and nv is not None:
        engine, tier, seg, ftl, device = _open_nvme(nv, bb, geo)
        path = geo.pop("path", None)
        geo.pop("target", None)
        try:
            if nv.fdp.enabled:
                f = nv.fdp
                explicit = (f.long_pid, f.medium_pid, f.short_pid, f.default_pid)
                if "discovery" in geo:
                    placement = geo["discovery"].placement(f.plids, explicit)
                elif isinstance(device, SimFdpDevice):
                    placement = placement_policy(device.ruh_status(), device.configs().configs[0].rgif, f.plids,
                                                 explicit)
                else:
                    raise ConfigError("fdp.enabled needs an FDP device whose RUH Status gives the PIDs: device: fdp "
                                      "(/dev/ngXnY), device: sim, or a file with model: {...}; the posix and "
                                      "uring engines on a file or block device cannot place writes")
            geo.pop("discovery", None)
            # a tier in a file or on a device carries its label (tierstore.io.label); a simulated
            # device in memory does not outlive the process
            nvme = SegmentStorage(path, tier, bb, segment_size_bytes=seg,
                                  engine=engine, owns_engine=True, extent_size_bytes=nv.extent_size_bytes,
                                  region_policy=nv.region_policy, keep_data=t.keep_data,
                                  invalidation_log=(path + ".invalidations") if path and nv.device != "fdp"
                                  else False, label=path is not None, format=nv.format,
                                  metadata_placement=placement.placement_for_metadata())
            # the device model observes the tier's writes from here on (not the label's)
            ruh_update = nv.fdp.ruh_update_on_segment_open
            if ruh_update is None:
                ruh_update = nv.fdp.enabled
            if isinstance(device, SimFdpDevice) and nv.device != "fdp":
                if ruh_update:
                    shim = RuhUpdateShim(device, seg)
                    engine.add_observer(shim)
                else:
                    engine.add_observer(device)
            opened = nvme
        except BaseException:
            engine.close()
            if getattr(engine, "created", False):  # a file this assembly created: leave nothing behind
                os.unlink(path)
            raise
    elif nvme is not None and nv is not None and nv.fdp.enabled:
        # a caller-given backend on a device it placed itself (e.g. a tenant's
        # range of a shared simulated SSD): the explicit PIDs are the placement
        placement = _explicit_placement(nv)
        if placement is None:
            raise ConfigError("an NVMe backend given by the caller with fdp.enabled needs explicit "
                              "long_pid/medium_pid/short_pid")
    try:
        geo.setdefault("description", "memory only" if nvme is None else "NVMe backend given by the caller")
        admit = admit if admit is not None else make_admission(p.admission)
        icfg = IndexConfig(
            block_bytes=bb, tokens_per_block=layout.tokens_per_block, hbm_blocks=nh, host_blocks=nc,
            nvme=nvme is not None, nvme_blocks=nvme.capacity_blocks() if nvme is not None else 0,
            promotion=p.promotion, eviction=p.eviction, evict_batch_blocks=p.evict_batch_blocks,
            write_policy=p.write_policy, verify_tokens=p.verify_tokens, pin_quota_bytes=p.pin_quota_bytes,
            default_lease_s=p.default_lease_s, admit_to_nvme=admit,
            remote_victims=cfg.remote is not None and cfg.remote.publish == "evict",
            classify=classify if classify is not None else make_classifier(p.classifier),
            reinsert=make_reinsert(reinsert if reinsert is not None else p.reinsert),
            cost=cost if cost is not None else CostModel())
        if clock is not None:
            icfg.clock = clock
        index = BlockIndex(icfg)
        if nvme is not None:
            if nvme.block_bytes != bb:
                raise ConfigError(f"NVMe backend block_bytes={nvme.block_bytes} != layout {bb}")
            nvme.set_listener(index)
            stored = nvme.scan()
            index.adopt_nvme(stored.keys, stored.ns_digests)
        remote = share = None
        if cfg.remote is not None:
            remote, share = _open_remote(cfg, bb, index)
        mover = Mover(pools, nvme, placement.placement_for if placement.enabled else None, remote)
        if remote is not None:  # remote loads are priced from measured Mooncake transfers
            remote.set_load_observer(lambda n, secs: index.config.cost.observe_load("remote", n * bb, secs, n))
        return StoreParts(layout, cfg, index, mover, pools, nvme, placement, ftl, device, shim, geo, remote, share)
    except BaseException:
        if opened is not None:  # the NVMe tier this assembly opened: closed, and a file it created removed
            opened.close()
            if getattr(opened.engine, "created", False):
                os.unlink(opened.path)
        raise


def _open_remote(cfg: StoreConfig, block_bytes: int, index: BlockIndex):
    """The shared remote tier (:mod:`tierstore.remote`; needs ``tierstore[cluster]``)."""
    from .remote.admission import ShareAdmission
    from .remote.mooncake import MooncakeSettings, MooncakeTier
    r = cfg.remote
    doc = r.model_dump(exclude={"engine", "admission", "publish"})
    secret = doc.pop("name_secret")
    settings = MooncakeSettings.from_mapping(doc, name_secret=None if secret is None else secret.encode())
    return MooncakeTier(settings, block_bytes), ShareAdmission(mode=r.admission)


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
