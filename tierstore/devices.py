"""The NVMe device under the tier: opened by :func:`open_device`, reported by :func:`device_report`.

``tiers.nvme.device`` names what is underneath, explicitly:

* ``file``: a file or block device through the ``posix``/``uring`` engine,
  optionally watched by an FTL model (``model:``), so a run reports the WAF of
  a *model*, not of the disk below;
* ``sim``: the simulated FDP SSD (:class:`~tierstore.fdp.simdevice.SimFdpDevice`
  over an :class:`~tierstore.fdp.ftl.FTLModel`), data in memory, in a file, or
  nowhere (``engine: null``);
* ``fdp``: a real FDP namespace ``/dev/ngXnY`` (passthrough writes, nvme-cli
  discovery). **Not verified on hardware.**

The segment size is the device's reclaim-unit size where there is one, else
chosen from the capacity, or, for a tier that exists, the one its label records
(:func:`file_tier_geometry`). A path passes
:func:`tierstore.io.label.check_target` before anything is opened for writing.

What was opened is an :class:`OpenedDevice`; the facts about it that the store
reports are one frozen :class:`NvmeGeometry` (``KVStore.device_stats()``).
:mod:`tierstore.build` wires the opened device into a store; the daemon's
``--check`` (:mod:`tierstore.server.check`) runs :func:`file_tier_geometry`
without opening anything.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

from .config import NvmeTierConfig, SimDeviceConfig
from .errors import ConfigError, TierStoreError
from .fdp.device import NOT_VERIFIED_ON_HARDWARE, PassthroughEngine
from .fdp.ftl import FTLModel
from .fdp.simdevice import SimFdpDevice
from .io.engine import IOEngine
from .io.factory import open_engine
from .io.label import Target, check_target, resolve_nvme_path
from .io.null import NullEngine
from .io.segments import MIN_SEGMENTS, choose_segment_size
from .units import format_bytes

if TYPE_CHECKING:
    from .build import StoreParts
    from .fdp.discovery import FdpNamespace

__all__ = [
    "DeviceStatsSource",
    "NvmeGeometry",
    "OpenedDevice",
    "device_report",
    "file_tier_geometry",
    "open_device",
]

#: ``NvmeGeometry`` fields ``device_stats()`` reports, in its order (``lba_bytes`` is kept, not reported).
_REPORTED = (
    "device_bytes",
    "nvme_bytes",
    "ru_size_bytes",
    "segment_size_bytes",
    "utilization",
    "op_fraction",
    "num_ruh",
    "isolation",
    "gc",
    "page_bytes",
    "warning",
)
#: Keys of a device's own counters that ``device_stats()`` copies as they are.
_DEVICE_KEYS = (
    "hbmw_bytes",
    "mbmw_bytes",
    "mbe_bytes",
    "waf",
    "gc_runs",
    "trimmed_bytes",
    "invalid_pid_writes",
    "valid_bytes",
)


@dataclasses.dataclass(frozen=True)
class NvmeGeometry:
    """What the store reports about the device under its NVMe tier.

    ``None`` is "not known for this device" (a plain file has no OP or RUHs);
    byte sizes are in bytes, ``utilization`` = tier bytes / device bytes.
    """

    description: str
    device_bytes: int | None = None
    nvme_bytes: int | None = None
    ru_size_bytes: int | None = None
    segment_size_bytes: int | None = None
    utilization: float | None = None
    op_fraction: float | None = None
    num_ruh: int | None = None
    isolation: str | None = None
    gc: str | None = None
    page_bytes: int | None = None
    lba_bytes: int | None = None
    warning: str | None = None

    def as_dict(self) -> dict:
        """The fields that are set (not ``None``), in field order."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


class DeviceStatsSource(Protocol):
    """A device's own counters (:class:`~tierstore.fdp.simdevice.SimFdpDevice`,
    :class:`~tierstore.fdp.nvme_cli.FdpDeviceStats`)."""

    def stats(self) -> dict: ...


@dataclasses.dataclass
class OpenedDevice:
    """What :func:`open_device` opened: the engine (owned by the caller from here on),
    the tier's and a segment's size in bytes, the path the tier's label goes to
    (``None`` for a simulated device in memory), the FTL model, the simulated
    device (``device: sim`` or a file with ``model:``; it observes the tier's
    writes once the label is written), the source of the device's counters, the
    geometry, and the FDP namespace found by discovery (``device: fdp``)."""

    engine: IOEngine
    tier_bytes: int
    segment_bytes: int
    path: str | None
    geometry: NvmeGeometry
    ftl: FTLModel | None = None
    device: SimFdpDevice | None = None
    stats_source: DeviceStatsSource | None = None
    discovery: FdpNamespace | None = None


def _default_ru(device_bytes: int, page_bytes: int) -> int:
    """``device / 60`` (a 16 GiB RU on a ~960 GiB SSD), whole MiB (or pages below 4 MiB)."""
    ru = device_bytes // 60
    unit = 1 << 20 if ru >= 4 << 20 else page_bytes
    return max(page_bytes, ru // unit * unit)


def _open_file_engine(kind: str, path: str, size_bytes: int, iodepth: int, what: str) -> IOEngine:
    """``open_engine`` on a file or block device; an ``OSError`` becomes a
    :class:`ConfigError` naming the path and what to do."""
    try:
        return open_engine(kind, path, size_bytes, iodepth=iodepth)
    except OSError as e:
        if isinstance(e, TierStoreError):
            raise
        hint = {
            errno.EFBIG: f": {size_bytes} bytes is larger than a file may be on this file system; lower "
            "capacity_bytes",
            errno.EINVAL: ": the file system refuses O_DIRECT (e.g. tmpfs); use a directory on a disk",
            errno.ENOSPC: f": smaller than the {size_bytes} bytes asked for",
            errno.ENOENT: " (no file can be created there)",
            errno.EROFS: " (a read-only file system)",
            errno.EACCES: " (not writable by this user)",
            errno.EPERM: " (not writable by this user)",
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
        raise ConfigError(
            f"{path}: holds blocks of {old.block_bytes} bytes, but was opened for {block_bytes}-byte "
            "blocks (another KV layout?); open it with the layout it was written with, or use "
            "another path. Nothing was changed."
        )
    if nv.segment_size_bytes is not None and nv.segment_size_bytes != seg:
        raise ConfigError(
            f"tiers.nvme.segment_size_bytes={nv.segment_size_bytes}: {path} was formatted with "
            f"{seg}-byte segments, and a tier keeps its segment size; remove the key or set it to "
            f"{seg}, or use another path. Nothing was changed."
        )
    if cap // seg < MIN_SEGMENTS:
        raise ConfigError(
            f"tiers.nvme.capacity_bytes={cap} ({format_bytes(cap)}): {path} was formatted with "
            f"{seg}-byte segments (as a {format_bytes(old.n_segments * seg)} tier); {cap} bytes hold "
            f"{cap // seg} of them, fewer than the {MIN_SEGMENTS} region eviction needs: give at least "
            f"{MIN_SEGMENTS * seg} bytes, or another path. Nothing was changed."
        )
    return seg, max(cap // seg * seg, old.n_segments * seg)


def open_device(nv: NvmeTierConfig, block_bytes: int) -> OpenedDevice:
    """Open the device ``nv.device`` names (module doc) for a tier of ``block_bytes``-byte blocks.

    Raises
    ------
    ConfigError
        Sizes that do not fit the device, a path tierstore may not write to
        (:func:`tierstore.io.label.check_target`), a label of another geometry,
        or a path that cannot be opened.
    """
    if nv.device == "fdp":
        return _open_fdp(nv)
    if nv.device == "sim":
        return _open_sim(nv)
    return _open_file(nv, block_bytes)


def _open_sim(nv: NvmeTierConfig) -> OpenedDevice:
    """``device: sim``: an FTL model of the whole device, its data in memory, a file, or nowhere."""
    m = nv.model or SimDeviceConfig()
    pb = m.page_bytes
    dev = m.device_bytes
    if dev is None:
        dev = int(nv.capacity_bytes / m.utilization)
    ru = m.ru_size_bytes or nv.segment_size_bytes or _default_ru(dev, pb)
    if ru % pb or ru % 4096:
        raise ConfigError(f"ru_size_bytes={ru}: must be a multiple of page_bytes={pb} and 4096")
    dev = dev // ru * ru
    n_ru = (
        (nv.capacity_bytes // ru) if nv.capacity_bytes is not None else int(m.utilization * dev + 1e-6) // ru
    )
    tier = n_ru * ru
    if tier > dev or n_ru < 2:
        raise ConfigError(
            f"NVMe tier of {n_ru} RUs of {ru} bytes does not fit a {dev}-byte device "
            "(need >= 2 RUs: one open segment and the GC reserve); use smaller RUs"
        )
    kind = "memory" if nv.engine == "auto" else nv.engine
    path = None
    if kind not in ("memory", "null"):  # the simulated device's data in a file
        if nv.path is None:
            raise ConfigError(f"device: sim with engine: {kind} needs a path")
        path = resolve_nvme_path(nv.path)
        check_target(path, format=nv.format)
    ftl = _ftl_model(m, dev, ru, num_ruh=m.num_ruh)
    device = SimFdpDevice(ftl)
    if kind == "null":
        engine: IOEngine = NullEngine(dev)
    elif kind == "memory":
        engine = open_engine(kind, None, dev, iodepth=nv.iodepth)
    else:
        engine = _open_file_engine(kind, path, dev, nv.iodepth, f"tiers.nvme.path={nv.path!r}")
    geometry = NvmeGeometry(
        description=f"sim (FTL model, {kind} engine): {dev} B user capacity, RU {ru} B, OP {m.op_fraction}, "
        f"{m.num_ruh} RUHs, {m.isolation} isolation, {m.gc} GC; a simulation, not an SSD",
        device_bytes=dev,
        nvme_bytes=tier,
        ru_size_bytes=ru,
        segment_size_bytes=ru,
        utilization=tier / dev,
        op_fraction=m.op_fraction,
        num_ruh=m.num_ruh,
        isolation=m.isolation,
        gc=m.gc,
        page_bytes=pb,
    )
    return OpenedDevice(engine, tier, ru, path, geometry, ftl=ftl, device=device, stats_source=device)


def _open_file(nv: NvmeTierConfig, block_bytes: int) -> OpenedDevice:
    """``device: file``: a file or block device, optionally observed by an FTL model (``model:``)."""
    kind = nv.engine  # "auto": io_uring where this process can use it, else posix (io.factory)
    path = resolve_nvme_path(nv.path)
    target = check_target(path, format=nv.format)  # before anything is written
    seg, size = file_tier_geometry(target, nv, block_bytes)
    tier = nv.capacity_bytes // seg * seg
    engine = _open_file_engine(kind, path, size, nv.iodepth, f"tiers.nvme.path={nv.path!r}")
    geometry = NvmeGeometry(
        description=f"file ({kind} engine) {path}",
        device_bytes=tier,
        nvme_bytes=tier,
        ru_size_bytes=seg,
        segment_size_bytes=seg,
        utilization=1.0,
        warning=_sparse_overcommit_warning(path, tier),
    )
    opened = OpenedDevice(engine, tier, seg, path, geometry)
    if nv.model is None:
        return opened
    m = nv.model
    try:
        ftl = _ftl_model(m, tier, seg, num_ruh=m.num_ruh)
    except ConfigError as exc:
        opened.geometry = dataclasses.replace(
            geometry, description=f"{geometry.description}; no FTL model ({exc})"
        )
        return opened
    opened.ftl = ftl
    opened.device = opened.stats_source = SimFdpDevice(ftl)
    opened.geometry = dataclasses.replace(
        geometry,
        op_fraction=m.op_fraction,
        num_ruh=m.num_ruh,
        isolation=m.isolation,
        gc=m.gc,
        page_bytes=m.page_bytes,
        description=f"{geometry.description}; WAF from an FTL model observing the engine "
        f"(a model, not this file system's device): RU = segment = {seg} B, OP {m.op_fraction}",
    )
    return opened


def _ftl_model(m: SimDeviceConfig, capacity_bytes: int, ru_size_bytes: int, **fdp_geometry: int) -> FTLModel:
    """An FTL model with the ``model`` section's settings (OP, isolation, GC, page size) over
    ``fdp_geometry`` (``num_ruh``, and ``num_rg``/``rgif`` of a real namespace).

    Raises
    ------
    ConfigError
        A geometry the model refuses.
    """
    return FTLModel(
        capacity_bytes,
        ru_size_bytes,
        m.op_fraction,
        isolation=m.isolation,
        gc=m.gc,
        page_bytes=m.page_bytes,
        **fdp_geometry,
    )


def _sparse_overcommit_warning(path: str, tier_bytes: int) -> str | None:
    """A sparse file accepts any size: the warning (also logged) when the tier exceeds
    the free space plus what the tier's file already holds in allocated blocks."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize + (os.stat(path).st_blocks * 512 if os.path.exists(path) else 0)
    except OSError:
        return None
    if tier_bytes <= free:
        return None
    msg = (
        f"NVMe tier of {tier_bytes} bytes is larger than the {free} bytes free on the file system of "
        f"{path}: writes will fail with no space once it fills"
    )
    logging.getLogger("tierstore").warning(msg)
    return msg


def _namespace_model(
    nv: NvmeTierConfig, ns: Any, tier: int, runs: int, engine: PassthroughEngine
) -> tuple[FTLModel | None, str]:
    """``(model, what to add to the description)``: an FTL model of the FDP namespace ``ns``'s
    geometry (``nv.model``'s settings) observing ``engine``'s writes and RUH Updates, or ``None``
    when the geometry is one the model refuses (the reason said)."""
    m, cfg = nv.model, ns.info.config
    try:
        ftl = _ftl_model(m, tier, runs, num_ruh=cfg.nruh, num_rg=max(1, cfg.nrg), rgif=cfg.rgif)
    except ConfigError as exc:
        return None, f"; no FTL model ({exc})"
    engine.add_observer(SimFdpDevice(ftl))
    return ftl, "; an FTL model observes its writes and RUH Updates (KVStore.ftl)"


def _open_fdp(nv: NvmeTierConfig) -> OpenedDevice:
    """``device: fdp``: the FDP namespace ``/dev/ngXnY``, found by
    :func:`tierstore.fdp.device.discover_namespace` (the one discovery the bench
    and the daemon share); placed writes by passthrough, RUH Update on segment
    open, every PID checked against RUH Status. With ``model:``, an FTL model of
    the namespace's geometry observes the writes and RUH Updates (``KVStore.ftl``),
    for comparison with the device's own counters."""
    from .fdp.device import discover_namespace
    from .fdp.nvme_cli import FdpDeviceStats

    path = nv.path
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
        raise ConfigError(
            f"capacity_bytes={nv.capacity_bytes}: the namespace {path} has {ns.size_bytes} bytes"
        )
    ruh_update = nv.fdp.ruh_update_on_segment_open
    if ruh_update is None:
        ruh_update = nv.fdp.enabled
    engine = PassthroughEngine(
        ns.char_dev,
        tier,
        ns.nsid,
        ns.lba_bytes,
        pid_table=ns.pid_table if fdp_on else None,
        max_transfer_bytes=ns.max_transfer_bytes,
        ruh_update_segment_bytes=ru if (ruh_update and fdp_on) else None,
        ru_nominal_bytes=runs,
    )
    description = (
        f"{path} (FDP namespace {ns.nsid} of {ns.ctrl_dev} via NVMe passthrough; {NOT_VERIFIED_ON_HARDWARE})"
    )
    ftl = None
    if nv.model is not None and fdp_on:
        ftl, said = _namespace_model(nv, ns, tier, runs, engine)
        description += said
    geometry = NvmeGeometry(
        description=description,
        device_bytes=ns.size_bytes,
        nvme_bytes=tier,
        ru_size_bytes=runs or ru,
        segment_size_bytes=ru,
        utilization=tier / ns.size_bytes,
        lba_bytes=ns.lba_bytes,
    )
    return OpenedDevice(
        engine,
        tier,
        ru,
        path,
        geometry,
        ftl=ftl,
        stats_source=FdpDeviceStats(ns.ctrl_dev, ns.endgid),
        discovery=ns,
    )


def device_report(parts: StoreParts, tier_write_bytes: int) -> dict:
    """The body of :meth:`tierstore.api.KVStore.device_stats`: the geometry's
    reported fields, the placement, the tier's and the engine's write counters,
    and the device's own counters (HBMW/MBMW/MBE/WAF, per-RUH bytes).

    ``e2e_wa`` = media bytes written / ``tier_write_bytes`` (the bytes the index
    wrote to the NVMe tier; NaN before any): it counts segment headers,
    padding, host copy-forward and the device's GC.
    """
    g = parts.geometry.as_dict()
    out: dict = {"device": parts.geometry.description}
    out.update((k, g[k]) for k in _REPORTED if k in g)
    out["dataplacement"] = "fdp" if parts.placement.enabled else "none"
    out["tier_write_bytes"] = tier_write_bytes
    if parts.nvme is not None:
        st = parts.nvme.stats()
        out["host_user_bytes"] = int(st.get("user_bytes_written", 0))
        out["host_gc_bytes"] = int(st.get("gc_bytes_written", 0))
        out["host_write_amplification"] = float(st.get("host_write_amplification", 1.0))
        eng = st.get("engine", {})
        out["engine_write_bytes"] = int(eng.get("bytes_written", 0))
        out["engine_trim_bytes"] = int(eng.get("bytes_trimmed", 0))
    if parts.stats_source is not None:
        s = parts.stats_source.stats()
        out.update((k, s[k]) for k in _DEVICE_KEYS if k in s)
        if "ruh_host_bytes" in s:
            out["ruh_bytes"] = {str(i): int(v) for i, v in enumerate(s["ruh_host_bytes"]) if v}
            out["ruh_gc_bytes"] = {str(i): int(v) for i, v in enumerate(s["ruh_gc_bytes"]) if v}
        if "mbmw_bytes" in s:
            out["e2e_wa"] = s["mbmw_bytes"] / tier_write_bytes if tier_write_bytes else float("nan")
    if parts.shim is not None:
        out["ruh_updates"] = parts.shim.ruh_updates
    return out
