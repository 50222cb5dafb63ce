"""A simulated FDP device: answers like a real one, backed by :class:`FTLModel`.

:class:`SimFdpDevice` exposes what the placement policy and a WAF bench read
from a real device -- the FDP configuration, RUH Status (the handle -> PID
table) and the FDP Statistics counters -- and returns them *as the same binary
structures* a device returns (built with the layouts of
:mod:`tierstore.fdp.logpages`, then parsed back), so the policy is built by the
same code on both.  It is also an I/O observer (``on_write``/``on_trim``).
"""

from __future__ import annotations

from typing import Any

from . import logpages as lp
from .ftl import ISOLATION_PERSISTENT, FTLModel
from .placement import PidTable, PlacementPolicy, make_pid

__all__ = ["SimFdpDevice", "FakeFdpDevice"]


class SimFdpDevice:
    """An FDP "device" = FTL model + FDP configuration + RUH Status.

    Parameters
    ----------
    ftl : FTLModel
        The model (its ``num_rg``, ``num_ruh``, ``rgif``, ``ru_size_bytes`` and
        ``isolation`` become the FDP configuration).
    lba_bytes : int
        Logical block size, bytes (RUAMW is reported in logical blocks).
    """

    def __init__(self, ftl: FTLModel, lba_bytes: int = 4096) -> None:
        self.ftl = ftl
        self.lba_bytes = int(lba_bytes)

    # what a device answers ------------------------------------------------
    def fdp_configs_bytes(self) -> bytes:
        """FDP Configurations log (20h) with one valid configuration matching the model."""
        ruht = (
            lp.RUHT_PERSISTENTLY_ISOLATED
            if self.ftl.isolation == ISOLATION_PERSISTENT
            else lp.RUHT_INITIALLY_ISOLATED
        )
        fdpa = 0x80 | (self.ftl.rgif & 0xF)
        desc = lp.build_fdp_config_desc(
            fdpa,
            self.ftl.num_rg,
            [ruht] * self.ftl.num_ruh,
            maxpids=self.ftl.num_ruh * self.ftl.num_rg - 1,
            nnss=1,
            runs_bytes=self.ftl.ru_size_bytes,
        )
        return lp.build_fdp_configs([desc])

    def ruh_status_bytes(self) -> bytes:
        """RUH Status: one descriptor per (reclaim group, placement handle); RUAMW = room left in the open
        RU."""
        descs = []
        for g in range(self.ftl.num_rg):
            for h in range(self.ftl.num_ruh):
                st = self.ftl._host[g][h]
                left_pages = self.ftl.ru_pages - st.wp if st.ru >= 0 else self.ftl.ru_pages
                descs.append(
                    (make_pid(g, h, self.ftl.rgif), h, 0, left_pages * self.ftl.page_bytes // self.lba_bytes)
                )
        return lp.build_ruh_status(descs, pad_to_bytes=16 + 32 * len(descs) + 64)

    def fdp_stats_bytes(self) -> bytes:
        """FDP Statistics log (22h) from the model's counters."""
        s = self.ftl.stats()
        return lp.build_fdp_stats(s["hbmw_bytes"], s["mbmw_bytes"], s["mbe_bytes"])

    # parsed views (same parsers as for a device) ---------------------------
    def configs(self) -> lp.FdpConfigLog:
        """Parsed :meth:`fdp_configs_bytes`."""
        return lp.parse_fdp_configs(self.fdp_configs_bytes())

    def ruh_status(self) -> lp.RuhStatus:
        """Parsed :meth:`ruh_status_bytes`."""
        return lp.parse_ruh_status(self.ruh_status_bytes())

    def stats(self) -> dict[str, Any]:
        """Stats interface shared with real devices (plus the model's extra keys)."""
        parsed = lp.parse_fdp_stats(self.fdp_stats_bytes()).as_dict()
        return {**self.ftl.stats(), **parsed}

    def placement_policy(self, reclaim_group: int = 0) -> PlacementPolicy:
        """Build the placement policy exactly as for a real device: config RGIF + RUH Status."""
        cfg = self.configs().configs[0]
        return PlacementPolicy.from_ruh_status(self.ruh_status(), cfg.rgif, reclaim_group)

    def pid_table(self) -> PidTable:
        """The model's PIDs in RUH Status order (what fio-style ``plids`` index)."""
        return PidTable.from_ruh_status(self.ruh_status(), self.configs().configs[0].rgif)

    def ruh_update(self, placement: int | None) -> None:
        """Reclaim Unit Handle Update for the handle named by PID ``placement``."""
        self.ftl.ruh_update(placement)

    def on_ruh_update(self, placement: int) -> None:
        """I/O observer hook: a real device was sent a RUH Update of ``placement``
        (:class:`tierstore.fdp.device.PassthroughEngine`); the model switches the same handle."""
        self.ftl.ruh_update(placement)

    # I/O observer -------------------------------------------------------------
    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        """Forward a completed write to the model."""
        self.ftl.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        """Forward a completed deallocate to the model."""
        self.ftl.on_trim(offset_bytes, nbytes)


#: Alias named in the issue.
FakeFdpDevice = SimFdpDevice
