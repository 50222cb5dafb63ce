"""Assemble a :class:`~tierstore.api.KVStore` whose NVMe tier sits on FDP placement.

:func:`build_store` wires, from one typed :class:`StoreConfig`:

* the NVMe tier: a log-structured :class:`~tierstore.io.segments.SegmentStorage`
  whose **segment size equals the reclaim-unit (RU) size**, so a whole-segment
  reclaim trims whole RUs, on one of three backends (``mode``):

  - ``"file"``: a file through the ``posix`` or ``uring`` engine.  An
    :class:`~tierstore.fdp.ftl.FTLModel` may observe the engine
    (``model_observer=True``) so write amplification is reported for every
    run; it is a *model*, the file system below is not an FDP device.
  - ``"sim"``: the simulated FDP device: a ``memory`` (or file) engine observed
    by a :class:`~tierstore.fdp.simdevice.SimFdpDevice`, whose geometry
    (capacity, RU size, over-provisioning, RUH count, isolation, GC) comes from
    the config.  The placement policy is built from the device's RUH Status,
    exactly as for a real device.
  - ``"device"``: a real ``/dev/ngXnY`` FDP namespace (writes through NVMe
    passthrough with the PID in DSPEC, discovery through nvme-cli).
    **Not verified on hardware**: written against the real APIs of
    :mod:`tierstore.fdp.passthrough` and :mod:`tierstore.fdp.nvme_cli`; this
    host has no NVMe device.

* the placement: :class:`~tierstore.fdp.placement.PlacementPolicy` maps a
  lifetime class to a reclaim unit handle and its PID; its
  :meth:`~tierstore.fdp.placement.PlacementPolicy.placement_for` becomes
  ``ManagerConfig.placement_of``.  ``dataplacement="none"`` gives ``None`` for
  every write (everything lands in the default handle).
* the classifier (``ManagerConfig.classify``): pluggable, any
  ``f(entry, now_s) -> LifetimeClass``; names ``"hint"`` (engine hint, then hit
  count: :func:`tierstore.manager.default_classify`) and ``"reuse"``
  (:class:`ReuseEntryClassifier`).

RUH Update on segment open
--------------------------
A segment is sealed when its tail cannot take one more extent, so a few KiB at
the end of a segment stay unwritten.  A device fills its RUs in write order and
knows nothing of segments, so without help the next segment's first pages land
in the previous RU's tail; the offset drifts, and soon every RU holds the end
of one segment and the start of the next: trimming one segment leaves valid
pages in two RUs and the device's GC copies them.  FDP has the command for
this: I/O Management Send, *Reclaim Unit Handle Update* (TP4146), which points
a handle at a fresh RU.  With ``ruh_update_on_segment_open=True`` (the default
with FDP placement) the wiring issues it when the first write of a segment
arrives (a write at a segment boundary), so every segment starts a fresh RU.
Without FDP (``dataplacement="none"``) a conventional drive has no such
command and the drift stays -- that is part of what placement buys.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from .api import KVStore
from .errors import ConfigError
from .fdp.ftl import ISOLATION_INITIAL, FTLModel
from .fdp.lifetime import LifetimeClass
from .fdp.placement import PlacementPolicy
from .fdp.simdevice import SimFdpDevice
from .io.engine import IOEngine, IOFuture
from .io.factory import open_engine
from .io.segments import SegmentStorage
from .layout import KVLayout
from .manager import Entry, default_classify

__all__ = ["StoreConfig", "WiredStore", "build_store", "ReuseEntryClassifier", "make_classifier",
           "RuhUpdateShim", "MODES", "NOT_VERIFIED_ON_HARDWARE"]

MODES = ("file", "sim", "device")
#: Marker put into device descriptions of the real-device path.
NOT_VERIFIED_ON_HARDWARE = "not verified on hardware"


class ReuseEntryClassifier:
    """Classify a block from the reuse the manager observed on its entry.

    Engine hint first; else, with ``hits`` lookups that matched the block since
    it was stored and ``interval_s = (last_access_s - created_s) / hits``:

    * ``hits >= long_min_hits`` and ``interval_s <= long_max_interval_s`` -> LONG;
    * ``hits >= 1`` and idle ``now_s - last_access_s <= medium_max_idle_s`` -> MEDIUM;
    * otherwise SHORT.

    Same rule as :class:`tierstore.fdp.lifetime.ReuseLifetimeClassifier`, read
    from the entry instead of a separate key history.  Thresholds are
    engineering defaults, not fitted to a trace.

    Parameters
    ----------
    long_min_hits : int
    long_max_interval_s : float
    medium_max_idle_s : float
    """

    def __init__(self, long_min_hits: int = 3, long_max_interval_s: float = 600.0,
                 medium_max_idle_s: float = 600.0) -> None:
        if long_min_hits < 1 or long_max_interval_s <= 0 or medium_max_idle_s <= 0:
            raise ConfigError("ReuseEntryClassifier: thresholds must be positive")
        self.long_min_hits = int(long_min_hits)
        self.long_max_interval_s = float(long_max_interval_s)
        self.medium_max_idle_s = float(medium_max_idle_s)

    def __call__(self, entry: Entry, now_s: float) -> LifetimeClass:
        if entry.lifetime is not None:
            return entry.lifetime
        if entry.hits >= self.long_min_hits:
            if (entry.last_access_s - entry.created_s) / entry.hits <= self.long_max_interval_s:
                return LifetimeClass.LONG
        if entry.hits >= 1 and now_s - entry.last_access_s <= self.medium_max_idle_s:
            return LifetimeClass.MEDIUM
        return LifetimeClass.SHORT


def make_classifier(spec: str | Callable | None) -> Callable[[Entry, float], LifetimeClass]:
    """Turn a classifier spec into ``f(entry, now_s) -> LifetimeClass``.

    Parameters
    ----------
    spec : {"hint", "reuse"} or callable or None
        ``None``/``"hint"``: :func:`tierstore.manager.default_classify`;
        ``"reuse"``: :class:`ReuseEntryClassifier`; a callable is used as is
        (the plug-in point for better predictors).

    Raises
    ------
    ConfigError
        For an unknown name.
    """
    if spec is None or spec == "hint":
        return default_classify
    if spec == "reuse":
        return ReuseEntryClassifier()
    if callable(spec):
        return spec
    raise ConfigError(f"classifier={spec!r}: accepted 'hint', 'reuse' or a callable f(entry, now_s)")


class RuhUpdateShim:
    """I/O observer in front of an FDP device: RUH Update when a segment opens.

    Forwards every write/trim to ``target``; before a write that starts at a
    segment boundary (``offset_bytes % segment_bytes == 0``, the first extent
    of a freshly opened segment) it calls ``ruh_update(placement)`` so the
    handle points at a fresh RU (TP4146 I/O Management Send, Reclaim Unit
    Handle Update).

    Parameters
    ----------
    target : object
        Has ``on_write``, ``on_trim`` and ``ruh_update(placement)``.
    segment_bytes : int
        Segment (= RU) size.
    """

    def __init__(self, target: Any, segment_bytes: int) -> None:
        self.target = target
        self.segment_bytes = int(segment_bytes)
        self.ruh_updates = 0

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        if offset_bytes % self.segment_bytes == 0:
            self.target.ruh_update(placement)
            self.ruh_updates += 1
        self.target.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        self.target.on_trim(offset_bytes, nbytes)


@dataclasses.dataclass
class StoreConfig:
    """Everything :func:`build_store` needs.

    Parameters
    ----------
    layout : KVLayout
        KV geometry.
    hbm_bytes, host_bytes : int
        Memory tier capacities.
    nvme_bytes : int or None
        NVMe tier capacity.  ``None`` with ``mode="sim"``/``"device"``:
        ``utilization x device_bytes`` (whole segments).
    mode : {"file", "sim", "device"}
        Backend of the NVMe tier (see module doc).
    path : str or None
        ``file``: a directory or file; ``sim``: a file when ``engine`` is not
        ``"memory"``; ``device``: the ``/dev/ngXnY`` namespace.
    engine : str
        ``file``: ``"posix"`` or ``"uring"``; ``sim``: ``"memory"`` (default) or
        ``"posix"``/``"uring"`` on ``path``.
    dataplacement : {"none", "fdp"}
        ``"fdp"`` tags writes with the PID of their lifetime class.
    device_bytes : int or None
        User capacity of the simulated device; ``None``: ``nvme_bytes / utilization``.
    utilization : float
        Share of the device's user capacity the NVMe tier occupies, (0, 1].
    ru_size_bytes : int or None
        Reclaim unit size (= segment size).  ``None``: ``device_bytes / 60``
        (a 16 GiB RU on a ~960 GiB SSD) rounded down to whole MiB (or pages).
    op_fraction : float
        Over-provisioning of the simulated device.
    num_ruh : int
        Reclaim unit handles of the simulated device.
    isolation : {"initial", "persistent"}
    gc : {"greedy", "cost_benefit"}
    page_bytes : int
        Mapping unit of the FTL model.
    plids : tuple of int
        Indices into the RUH Status list for LONG, MEDIUM, SHORT (cycled); empty:
        the placement module's table.
    classifier : str or callable
        See :func:`make_classifier`.
    ruh_update_on_segment_open : bool or None
        See module doc; ``None``: on with FDP placement, off without.
    model_observer : bool
        ``mode="file"``: attach an FTL model (capacity = the tier, RU = segment).
    extent_size_bytes : int or None
        SegmentStorage extent size (default: its own).
    clock : callable or None
        Manager clock.
    manager_options : dict
        Further :class:`~tierstore.manager.ManagerConfig` fields.
    endgid, nsid : int
        ``mode="device"``: endurance group and namespace id.
    """

    layout: KVLayout
    hbm_bytes: int = 0
    host_bytes: int = 0
    nvme_bytes: int | None = None
    mode: str = "sim"
    path: str | None = None
    engine: str | None = None
    dataplacement: str = "none"
    device_bytes: int | None = None
    utilization: float = 0.9
    ru_size_bytes: int | None = None
    op_fraction: float = 0.07
    num_ruh: int = 8
    isolation: str = ISOLATION_INITIAL
    gc: str = "greedy"
    page_bytes: int = 4096
    plids: tuple = ()
    classifier: Any = "hint"
    ruh_update_on_segment_open: bool | None = None
    model_observer: bool = True
    extent_size_bytes: int | None = None
    clock: Callable[[], float] | None = None
    manager_options: dict = dataclasses.field(default_factory=dict)
    endgid: int = 1
    nsid: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: accepted values are {list(MODES)}")
        if self.dataplacement not in ("none", "fdp"):
            raise ConfigError(f"dataplacement={self.dataplacement!r}: accepted values are ['fdp', 'none']")
        if not 0 < self.utilization <= 1:
            raise ConfigError(f"utilization={self.utilization}: must be in (0, 1]")


@dataclasses.dataclass
class WiredStore:
    """What :func:`build_store` assembled.

    Attributes
    ----------
    store : KVStore
    nvme : SegmentStorage or None
    ftl : FTLModel or None
        The model observing the NVMe engine (``sim`` always, ``file`` optionally).
    device : SimFdpDevice or None
    policy : PlacementPolicy
    geometry : dict
        Sizes actually used (bytes) and the device description.
    shim : RuhUpdateShim or None
    """

    store: KVStore
    nvme: SegmentStorage | None
    ftl: FTLModel | None
    device: SimFdpDevice | None
    policy: PlacementPolicy
    geometry: dict
    shim: RuhUpdateShim | None = None
    stats_source: Any = None

    def device_stats(self) -> dict:
        """Device section: HBMW/MBMW/MBE/WAF, per-RUH bytes and end-to-end WA.

        ``e2e_wa`` = media bytes written / bytes the tier manager wrote to the
        NVMe tier (``nvme_write_bytes``): it counts segment headers, padding,
        host copy-forward (SegmentStorage GC) and the device's GC.
        """
        out: dict = {"device": self.geometry["description"]}
        for k in ("mode", "dataplacement", "device_bytes", "nvme_bytes", "ru_size_bytes",
                  "segment_size_bytes", "utilization", "op_fraction", "num_ruh", "isolation", "gc",
                  "page_bytes"):
            if k in self.geometry:
                out[k] = self.geometry[k]
        written = int(self.store.manager.metrics.snapshot().get("nvme_write_bytes", 0))
        out["tier_write_bytes"] = written
        if self.nvme is not None:
            st = self.nvme.stats()
            out["host_user_bytes"] = int(st["user_bytes_written"])
            out["host_gc_bytes"] = int(st["gc_bytes_written"])
            out["host_write_amplification"] = float(st["host_write_amplification"])
            out["engine_write_bytes"] = int(st["engine"]["bytes_written"])
            out["engine_trim_bytes"] = int(st["engine"]["bytes_trimmed"])
        src = self.stats_source
        if src is not None:
            s = src.stats()
            for k in ("hbmw_bytes", "mbmw_bytes", "mbe_bytes", "waf", "gc_runs", "trimmed_bytes",
                      "invalid_pid_writes", "valid_bytes"):
                if k in s:
                    out[k] = s[k]
            if "ruh_host_bytes" in s:
                out["ruh_bytes"] = {str(i): int(v) for i, v in enumerate(s["ruh_host_bytes"]) if v}
                out["ruh_gc_bytes"] = {str(i): int(v) for i, v in enumerate(s["ruh_gc_bytes"]) if v}
            out["e2e_wa"] = s["mbmw_bytes"] / written if written else float("nan")
        if self.shim is not None:
            out["ruh_updates"] = self.shim.ruh_updates
        return out

    def close(self) -> None:
        """Close the store (and with it the NVMe tier)."""
        self.store.close()


def _default_ru(device_bytes: int, page_bytes: int) -> int:
    ru = device_bytes // 60
    unit = 1 << 20 if ru >= 4 << 20 else page_bytes
    return max(page_bytes, ru // unit * unit)


def _placement(cfg: StoreConfig, source: SimFdpDevice | None, ruh_status=None, rgif: int = 0) -> PlacementPolicy:
    if cfg.dataplacement == "none":
        return PlacementPolicy.disabled()
    if source is not None:
        ruh_status = source.ruh_status()
        rgif = source.configs().configs[0].rgif
    if ruh_status is None:
        raise ConfigError("dataplacement=fdp needs a device with an RUH Status (mode='sim' or 'device')")
    handles = None
    if cfg.plids:
        descs = ruh_status.descs
        for i in cfg.plids:
            if not 0 <= i < len(descs):
                raise ConfigError(f"plids: index {i} outside the device's {len(descs)} RUH Status entries")
        from .fdp.placement import split_pid
        picks = [split_pid(descs[cfg.plids[j % len(cfg.plids)]].pid, rgif)[1] for j in range(3)]
        handles = {LifetimeClass.LONG: picks[0], LifetimeClass.MEDIUM: picks[1], LifetimeClass.SHORT: picks[2]}
    return PlacementPolicy.from_ruh_status(ruh_status, rgif, 0, class_handles=handles)


def build_store(cfg: StoreConfig) -> WiredStore:
    """Assemble the store described by ``cfg``.

    Returns
    -------
    WiredStore

    Raises
    ------
    ConfigError
        Inconsistent sizes (an RU larger than the tier, too few RUs for the
        handles, ...), an unknown mode, engine or placement.
    OSError
        A file or device cannot be opened.
    """
    bb = cfg.layout.bytes_per_block
    pb = cfg.page_bytes
    geo: dict = {"mode": cfg.mode, "dataplacement": cfg.dataplacement}
    ftl: FTLModel | None = None
    device: SimFdpDevice | None = None
    shim: RuhUpdateShim | None = None
    stats_source: Any = None
    if cfg.mode == "device":
        return _build_real_device(cfg)
    if cfg.mode == "sim":
        dev = cfg.device_bytes
        if dev is None:
            if cfg.nvme_bytes is None:
                raise ConfigError("mode='sim' needs device_bytes or nvme_bytes")
            dev = int(cfg.nvme_bytes / cfg.utilization)
        ru = cfg.ru_size_bytes or _default_ru(dev, pb)
        if ru % pb or ru % 4096:
            raise ConfigError(f"ru_size_bytes={ru}: must be a multiple of page_bytes={pb} and 4096")
        dev = dev // ru * ru
        n_ru_tier = int(cfg.utilization * dev + 1e-6) // ru if cfg.nvme_bytes is None or cfg.device_bytes \
            else cfg.nvme_bytes // ru
        tier = n_ru_tier * ru
        if tier > dev or n_ru_tier < 2:
            raise ConfigError(f"NVMe tier of {n_ru_tier} RUs of {ru} bytes does not fit a {dev}-byte device "
                              "(need >= 2 RUs: one open segment and the GC reserve); use smaller RUs")
        ftl = FTLModel(dev, ru, cfg.op_fraction, num_ruh=cfg.num_ruh, isolation=cfg.isolation,
                       gc=cfg.gc, page_bytes=pb)
        device = SimFdpDevice(ftl)
        stats_source = device
        eng_kind = cfg.engine or "memory"
        if eng_kind != "memory" and cfg.path is None:
            raise ConfigError(f"mode='sim' with engine={eng_kind!r} needs a path")
        path = cfg.path
        if path is not None and os.path.isdir(path):
            path = os.path.join(path, "tierstore.nvme")
        engine = open_engine(eng_kind, path, dev)
        geo.update(device_bytes=dev, ru_size_bytes=ru, segment_size_bytes=ru, nvme_bytes=tier,
                   utilization=tier / dev, op_fraction=cfg.op_fraction, num_ruh=cfg.num_ruh,
                   isolation=cfg.isolation, gc=cfg.gc, page_bytes=pb,
                   description=f"sim (FTL model, {eng_kind} engine): {dev} B user capacity, RU {ru} B, "
                               f"OP {cfg.op_fraction}, {cfg.num_ruh} RUHs, {cfg.isolation} isolation, "
                               f"{cfg.gc} GC")
    else:
        if cfg.path is None:
            raise ConfigError("mode='file' needs a path")
        if cfg.nvme_bytes is None:
            raise ConfigError("mode='file' needs nvme_bytes")
        eng_kind = cfg.engine or "posix"
        if eng_kind not in ("posix", "uring"):
            raise ConfigError(f"mode='file': engine={eng_kind!r}; accepted 'posix', 'uring'")
        ru = cfg.ru_size_bytes or max(1 << 20, min(256 << 20, cfg.nvme_bytes // 64)) >> 20 << 20
        tier = cfg.nvme_bytes // ru * ru
        dev = tier
        if tier // ru < 2:
            raise ConfigError(f"nvme_bytes={cfg.nvme_bytes} holds fewer than 2 segments of {ru} bytes")
        path = cfg.path
        if os.path.isdir(path):
            path = os.path.join(path, "tierstore.nvme")
        engine = open_engine(eng_kind, path, tier)
        geo.update(device_bytes=dev, ru_size_bytes=ru, segment_size_bytes=ru, nvme_bytes=tier,
                   utilization=1.0, description=f"file ({eng_kind} engine) {path}")
        if cfg.model_observer:
            try:
                ftl = FTLModel(dev, ru, cfg.op_fraction, num_ruh=cfg.num_ruh, isolation=cfg.isolation,
                               gc=cfg.gc, page_bytes=pb)
            except ConfigError as exc:
                geo["description"] += f"; no FTL model ({exc})"
            else:
                device = SimFdpDevice(ftl)
                stats_source = device
                geo.update(op_fraction=cfg.op_fraction, num_ruh=cfg.num_ruh, isolation=cfg.isolation,
                           gc=cfg.gc, page_bytes=pb)
                geo["description"] += (f"; WAF from an FTL model observing the engine (a model, not this "
                                       f"file system's device): RU = segment = {ru} B, OP {cfg.op_fraction}")
        if cfg.dataplacement == "fdp" and device is None:
            raise ConfigError("mode='file' with dataplacement=fdp needs the FTL model (model_observer=True)")
    policy = _placement(cfg, device)
    ruh_update = cfg.ruh_update_on_segment_open
    if ruh_update is None:
        ruh_update = cfg.dataplacement == "fdp"
    if device is not None:
        if ruh_update:
            shim = RuhUpdateShim(ftl, ru)
            engine.add_observer(shim)
        else:
            engine.add_observer(device)
    seg_kwargs = {}
    if cfg.extent_size_bytes is not None:
        seg_kwargs["extent_size_bytes"] = cfg.extent_size_bytes
    nvme = SegmentStorage(path if cfg.mode == "file" else None, tier, bb, segment_size_bytes=ru,
                          engine=engine, **seg_kwargs)
    store = _make_kvstore(cfg, nvme, policy)
    geo.setdefault("description", cfg.mode)
    return WiredStore(store, nvme, ftl, device, policy, geo, shim, stats_source)


def _make_kvstore(cfg: StoreConfig, nvme, policy: PlacementPolicy) -> KVStore:
    opts = dict(cfg.manager_options)
    if cfg.clock is not None:
        opts["clock"] = cfg.clock
    opts["classify"] = make_classifier(cfg.classifier)
    opts["placement_of"] = policy.placement_for if policy.enabled else None
    return KVStore(cfg.layout, hbm_bytes=cfg.hbm_bytes, host_bytes=cfg.host_bytes, nvme=nvme, **opts)


class PassthroughEngine(IOEngine):
    """Real FDP namespace: reads/trims on the block device, placed writes by passthrough.

    **Not verified on hardware** (no NVMe device on the development host).
    Writes go through :class:`tierstore.fdp.passthrough.PassthroughWriter` on
    ``/dev/ngXnY`` with the PID in DSPEC; reads, deallocates and flushes use the
    matching block device ``/dev/nvmeXnY`` through the ``posix`` engine (O_DIRECT).

    Parameters
    ----------
    char_dev : str
        ``/dev/ngXnY``.
    size_bytes : int
        Bytes of the namespace to use.
    nsid : int
        Namespace id.
    lba_bytes : int
        Logical block size.
    """

    kind = "fdp-passthrough"

    def __init__(self, char_dev: str, size_bytes: int, nsid: int, lba_bytes: int = 4096) -> None:
        import ctypes
        import re

        from .fdp.passthrough import PassthroughWriter
        super().__init__(size_bytes, lba_bytes)
        m = re.search(r"ng(\d+)n(\d+)$", char_dev)
        if m is None:
            raise ConfigError(f"device={char_dev!r}: expected an NVMe generic character device /dev/ngXnY")
        self._ctypes = ctypes
        self.block_dev = os.path.join(os.path.dirname(char_dev), f"nvme{m.group(1)}n{m.group(2)}")
        self._rw = open_engine("posix", self.block_dev, size_bytes)
        self._writer = PassthroughWriter(char_dev, nsid, lba_bytes)

    def _read_impl(self, offset, view, nbytes):
        return self._rw._read_impl(offset, view, nbytes)

    def _write_impl(self, offset, view, nbytes, placement):
        buf = (self._ctypes.c_char * nbytes).from_buffer(view)
        try:
            self._writer.write(buf, offset, placement)
        except OSError as exc:
            return IOFuture.failed(exc)
        return IOFuture.completed(nbytes)

    def _trim_impl(self, offset, length):
        return self._rw._trim_impl(offset, length)

    def _sync_impl(self):
        return self._rw._sync_impl()

    def _close_impl(self):
        self._writer.close()
        self._rw.close()


def _build_real_device(cfg: StoreConfig) -> WiredStore:
    """``mode="device"``: discovery via nvme-cli, placement via passthrough. Not verified on hardware."""
    from .fdp.nvme_cli import FdpDeviceStats, NvmeCli
    if cfg.path is None or not os.path.basename(cfg.path).startswith("ng"):
        raise ConfigError(f"mode='device' needs path=/dev/ngXnY (got {cfg.path!r})")
    ctrl = cfg.path.rsplit("n", 1)[0].replace("/ng", "/nvme")
    cli = NvmeCli()
    info = cli.discover(ctrl, cfg.path, cfg.endgid)
    if cfg.dataplacement == "fdp" and not info.fdp_enabled:
        raise ConfigError(f"{ctrl}: FDP not enabled (supported={info.fdp_supported}); "
                          "enable it with NvmeCli.enable_fdp_args or use dataplacement=none")
    ru = cfg.ru_size_bytes or (info.config.runs_bytes if info.config is not None else None)
    if ru is None:
        raise ConfigError("mode='device' without FDP needs ru_size_bytes (segment size)")
    if cfg.device_bytes is None:
        raise ConfigError("mode='device' needs device_bytes (namespace bytes to use)")
    dev = cfg.device_bytes // ru * ru
    tier = cfg.nvme_bytes if cfg.nvme_bytes is not None else int(cfg.utilization * dev) // ru * ru
    engine = PassthroughEngine(cfg.path, dev, cfg.nsid)
    if cfg.dataplacement == "fdp":
        policy = _placement(cfg, None, info.ruh_status, info.config.rgif)
    else:
        policy = PlacementPolicy.disabled()
    nvme = SegmentStorage(None, tier, cfg.layout.bytes_per_block, segment_size_bytes=ru, engine=engine)
    store = _make_kvstore(cfg, nvme, policy)
    geo = {"mode": "device", "dataplacement": cfg.dataplacement, "device_bytes": dev, "ru_size_bytes": ru,
           "segment_size_bytes": ru, "nvme_bytes": tier, "utilization": tier / dev,
           "description": f"{cfg.path} (real FDP namespace via passthrough; {NOT_VERIFIED_ON_HARDWARE})"}
    return WiredStore(store, nvme, None, None, policy, geo, None, FdpDeviceStats(ctrl, cfg.endgid, cli))
