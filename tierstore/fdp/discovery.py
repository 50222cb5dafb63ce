"""Discovery of an FDP namespace and its placement table, without torch (``tierstore fdp`` is quick).

* :func:`discover_namespace` -- the one discovery of a real FDP namespace
  (``/dev/ngXnY`` or ``/dev/nvmeXnY``): controller and block device names,
  namespace id (``NVME_IOCTL_ID``), logical block size and size (Identify
  Namespace), the largest transfer (MDTS as the driver applies it), FDP
  support and enablement, the active configuration and the RUH Status, all
  through nvme-cli (:mod:`tierstore.fdp.nvme_cli`). The library (``device:
  fdp``), ``tierstore bench``, the daemon and ``tierstore fdp`` all start here.
* :func:`default_eviction` -- the NVMe tier's eviction granularity a device gets
  by default (FDP or conventional), and why (issue 26 item 4: the measurement decides).
* :func:`placement_policy` -- the lifetime class -> PID table from a device's
  RUH Status (real, or the simulated device's): fio-style ``plids`` (indices
  into the RUH Status list) or explicit PIDs, every one validated against RUH
  Status (:class:`tierstore.fdp.placement.PidTable`).

The write path that uses them is :mod:`tierstore.fdp.device`.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import logpages as lp
from .placement import PidTable, PlacementPolicy

__all__ = [
    "default_eviction",
    "placement_policy",
    "FdpNamespace",
    "discover_namespace",
    "nvme_names",
    "max_transfer_bytes",
    "NVME_IOCTL_ID",
]


#: ``NVME_IOCTL_ID = _IO('N', 0x40)`` (linux ``include/uapi/linux/nvme_ioctl.h``): the namespace id of a
#: namespace's block or generic character device.
NVME_IOCTL_ID = (ord("N") << 8) | 0x40


#: ``fdp_enabled -> (eviction_granularity, why)``: the NVMe tier's default per device kind. Issue 26
#: item 4: an FDP device gets per-block eviction with placement only if that configuration saves at
#: least a flat LRU's prefill at e2e WA <= 1.10 on conversation 10 %, conversation 40 % and agent
#: 10 % (FTL model). Measured through the real store (``bench/frontier_store.py``, table in
#: ``bench/README_frontier.md``, 2026-12-03): it does not, so both kinds keep ``region``.
EVICTION_DEFAULTS: dict[bool, tuple[str, str]] = {
    True: (
        "region",
        "per-block eviction with FDP placement saved less prefill than a flat LRU of the same "
        "bytes on every measured point (FTL model; bench/README_frontier.md, 2026-12-03), so an FDP "
        "device keeps region eviction; set tiers.nvme.eviction_granularity: block to choose it",
    ),
    False: (
        "region",
        "a conventional device keeps region eviction, the best configuration measured there at "
        "e2e WA <= 1.10 (FTL model; bench/README_frontier.md, 2026-12-03)",
    ),
}


def default_eviction(fdp_enabled: bool) -> tuple[str, str]:
    """The NVMe tier's default ``eviction_granularity`` on a device, and why.

    Parameters
    ----------
    fdp_enabled : bool
        Whether the namespace has FDP enabled (the tier places writes by handle).

    Returns
    -------
    (str, str)
        ``"region"`` or ``"block"`` (:class:`tierstore.config.NvmeTierConfig` values), and the
        reason: the measurement it follows (:data:`EVICTION_DEFAULTS`).
    """
    return EVICTION_DEFAULTS[bool(fdp_enabled)]


def max_transfer_bytes(block_dev: str, sys_root: str = "/sys") -> int | None:
    """Largest transfer of one passthrough command: ``/sys/block/<dev>/queue/max_hw_sectors_kb``
    (the controller's MDTS as the nvme driver applies it); ``None`` when absent."""
    path = os.path.join(sys_root, "block", os.path.basename(block_dev), "queue", "max_hw_sectors_kb")
    try:
        with open(path, encoding="ascii") as f:
            kb = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return None
    return kb * 1024 if kb > 0 else None


def placement_policy(
    ruh_status: lp.RuhStatus,
    rgif: int,
    plids: Sequence[int] = (),
    explicit: Sequence[int | None] | None = None,
) -> PlacementPolicy:
    """The class -> PID table for a device, every PID one its RUH Status lists.

    Parameters
    ----------
    ruh_status : RuhStatus
        The device's RUH Status (I/O Management Receive, TP4146).
    rgif : int
        Reclaim Group Identifier Format of the active configuration.
    plids : sequence of int
        Indices into the RUH Status list for LONG, MEDIUM, SHORT (cycled), as
        fio's ``plids=``; the PIDs are taken whole (reclaim group included).
        Empty: the table of :mod:`tierstore.fdp.placement`.
    explicit : (long, medium, short, default), optional
        Explicit PIDs (``fdp.*_pid``); each must be listed by RUH Status.

    Raises
    ------
    ConfigError
        An index outside the RUH Status list, or an explicit PID it does not list.
    """
    if explicit is not None and any(p is not None for p in explicit[:3]):
        if plids:
            raise ConfigError("fdp: give plids or long_pid/medium_pid/short_pid, not both")
        if any(p is None for p in explicit[:3]):
            raise ConfigError(
                "fdp: give all of long_pid, medium_pid, short_pid, or none (then the device's "
                "RUH Status decides)"
            )
        long_pid, medium_pid, short_pid = explicit[:3]
        default = explicit[3] if len(explicit) > 3 else None
        return PlacementPolicy.from_explicit(ruh_status, rgif, long_pid, medium_pid, short_pid, default)
    return PlacementPolicy.from_plids(ruh_status, rgif, plids)


def nvme_names(dev: str) -> tuple[str, str, str]:
    """``(controller, block device, generic char device)`` for ``/dev/ngXnY`` or ``/dev/nvmeXnY``.

    Raises
    ------
    ConfigError
        ``dev`` is not a namespace device name.
    """
    m = re.search(r"/(?:ng|nvme)(\d+)n(\d+)$", dev)
    if m is None:
        raise ConfigError(f"device={dev!r}: expected an NVMe namespace device, /dev/ngXnY or /dev/nvmeXnY")
    d = os.path.dirname(dev)
    c, n = m.group(1), m.group(2)
    return os.path.join(d, f"nvme{c}"), os.path.join(d, f"nvme{c}n{n}"), os.path.join(d, f"ng{c}n{n}")


def _namespace_id(dev: str) -> int:
    """NVME_IOCTL_ID on the namespace device (the ``Y`` of the name need not be the nsid)."""
    fd = os.open(dev, os.O_RDONLY)
    try:
        nsid = fcntl.ioctl(fd, NVME_IOCTL_ID)
    finally:
        os.close(fd)
    if nsid <= 0:
        raise ConfigError(f"{dev}: NVME_IOCTL_ID returned {nsid}")
    return int(nsid)


@dataclass(frozen=True)
class FdpNamespace:
    """A discovered FDP namespace (see :func:`discover_namespace`).

    Attributes
    ----------
    char_dev, block_dev, ctrl_dev : str
        ``/dev/ngXnY``, ``/dev/nvmeXnY``, ``/dev/nvmeX``.
    nsid : int
        Namespace id (``NVME_IOCTL_ID``).
    endgid : int
        Endurance group of the FDP configuration.
    id_ns : IdNamespace
        Size and logical block size.
    max_transfer_bytes : int or None
        Largest transfer of one command (``max_hw_sectors_kb``).
    serial : str
        The controller's serial number (names the stats baseline).
    info : FdpDeviceInfo
        FDP support, enablement, the active configuration and RUH Status.
    """

    char_dev: str
    block_dev: str
    ctrl_dev: str
    nsid: int
    endgid: int
    id_ns: lp.IdNamespace
    max_transfer_bytes: int | None
    serial: str
    info: Any

    @property
    def lba_bytes(self) -> int:
        """Logical block size, bytes."""
        return self.id_ns.lba_bytes

    @property
    def size_bytes(self) -> int:
        """Namespace size, bytes."""
        return self.id_ns.size_bytes

    @property
    def config(self) -> lp.FdpConfig:
        """The active FDP configuration (raises :class:`ConfigError` when FDP is off)."""
        self.require_fdp()
        return self.info.config

    @property
    def ruh_status(self) -> lp.RuhStatus:
        """RUH Status at discovery."""
        self.require_fdp()
        return self.info.ruh_status

    @property
    def pid_table(self) -> PidTable:
        """Every PID this namespace accepts, in RUH Status order."""
        return PidTable.from_ruh_status(self.ruh_status, self.config.rgif)

    def require_fdp(self) -> None:
        """Raise :class:`ConfigError` unless FDP is supported and enabled."""
        if not self.info.fdp_supported:
            raise ConfigError(
                f"{self.ctrl_dev}: the controller does not support FDP (Identify Controller "
                "CTRATT bit 19 is 0)"
            )
        if not self.info.fdp_enabled:
            raise ConfigError(
                f"{self.ctrl_dev}: FDP is supported but not enabled on endurance group "
                f"{self.endgid} (Get Features 1Dh); enable it (NvmeCli.enable_fdp_args; the "
                "endurance group must have no namespaces) or set fdp.enabled: false"
            )

    def placement(
        self, plids: Sequence[int] = (), explicit: Sequence[int | None] | None = None
    ) -> PlacementPolicy:
        """:func:`placement_policy` from this namespace's RUH Status."""
        return placement_policy(self.ruh_status, self.config.rgif, plids, explicit)


def discover_namespace(dev: str, endgid: int = 1, cli: Any = None, sys_root: str = "/sys") -> FdpNamespace:
    """Discover the FDP namespace ``dev`` (``/dev/ngXnY`` or ``/dev/nvmeXnY``).

    Raises
    ------
    ConfigError
        A bad device name, or a device that is not there.
    NvmeCliError
        nvme-cli is missing or a command failed.
    CorruptData
        The device answered with a structure that does not parse.
    """
    from .nvme_cli import NvmeCli

    try:
        mode = os.stat(dev).st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"{dev}: no such file or directory (an FDP namespace is /dev/ngXnY or /dev/nvmeXnY)"
        ) from None
    if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
        raise ConfigError(
            f"{dev}: not a device (an FDP namespace is /dev/ngXnY or /dev/nvmeXnY); a file tier has no "
            "FDP configuration or log pages: its placement and WAF are the FTL model's (tiers.nvme.device: "
            "file; store.stats()['nvme_backend'])"
        )
    ctrl, blk, chr_ = nvme_names(dev)
    for p in (ctrl, chr_):
        if not os.path.exists(p):
            raise ConfigError(
                f"{dev}: an FDP namespace needs its controller and character device too, named from "
                f"{os.path.basename(dev)!r}: {p} does not exist (give /dev/ngXnY or /dev/nvmeXnY itself, "
                "not a link of another name)"
            )
    cli = cli or NvmeCli()
    nsid = _namespace_id(chr_)
    idns = cli.id_ns(chr_, nsid)
    info = cli.discover(ctrl, chr_, endgid, nsid)
    return FdpNamespace(
        chr_, blk, ctrl, nsid, endgid, idns, max_transfer_bytes(blk, sys_root), cli.serial(ctrl), info
    )
