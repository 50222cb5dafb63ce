"""Placement policy: lifetime class -> reclaim unit handle -> placement identifier (PID).

The I/O layer sees only ``placement: int | None`` (the PID to put in the
write's DSPEC field, or ``None`` for no placement).  Only this module knows the
handle -> PID table, and it takes it from the device's **RUH Status**
(I/O Management Receive, management operation 01h; see
:func:`tierstore.fdp.logpages.parse_ruh_status`) -- from a real device via
nvme-cli or from :class:`tierstore.fdp.simdevice.SimFdpDevice`, the same way.

PID format (TP4146 "Placement Identifier", as folded into NVMe Base Spec 2.1
"Flexible Data Placement"): the upper ``RGIF`` bits of the 16-bit PID name
the reclaim group, the rest the placement handle::

    PID = (reclaim_group << (16 - RGIF)) | placement_handle

``RGIF`` is FDPA bits 3:0 of the active FDP configuration descriptor.

Continued in ``docs/FDP.md`` (``tierstore/fdp/placement.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .lifetime import LifetimeClass, LifetimeClassifier, ReuseLifetimeClassifier
from .logpages import RuhStatus

__all__ = ["make_pid", "split_pid", "PidTable", "PlacementPolicy"]


def make_pid(reclaim_group: int, handle: int, rgif: int) -> int:
    """``(reclaim_group << (16 - rgif)) | handle`` (TP4146 Placement Identifier).

    Raises
    ------
    ConfigError
        If the group or handle does not fit the field widths.
    """
    if not 0 <= rgif <= 15:
        raise ConfigError(f"rgif={rgif}: must be 0..15")
    ph_bits = 16 - rgif
    if not 0 <= handle < (1 << ph_bits):
        raise ConfigError(f"placement handle {handle} does not fit {ph_bits} bits (rgif={rgif})")
    if not 0 <= reclaim_group < (1 << rgif) and not (rgif == 0 and reclaim_group == 0):
        raise ConfigError(f"reclaim group {reclaim_group} does not fit {rgif} bits")
    return (reclaim_group << ph_bits) | handle if rgif else handle


def split_pid(pid: int, rgif: int) -> tuple[int, int]:
    """Inverse of :func:`make_pid`: ``(reclaim_group, handle)``."""
    if not 0 <= pid <= 0xFFFF:
        raise ConfigError(f"pid {pid:#x}: must be a 16-bit value")
    ph_bits = 16 - rgif
    return (pid >> ph_bits if rgif else 0), pid & ((1 << ph_bits) - 1)


@dataclass(frozen=True)
class PidTable:
    """The placement identifiers a namespace accepts: its RUH Status list, in the device's order.

    Attributes
    ----------
    pids : tuple of int
        ``RuhStatus.descs[i].pid`` for every descriptor ``i`` (index ``i`` is fio's plid ``i``).
    rgif : int
        Reclaim Group Identifier Format of the active configuration (FDPA bits 3:0).
    """

    pids: tuple[int, ...]
    rgif: int = 0

    @classmethod
    def from_ruh_status(cls, status: RuhStatus, rgif: int) -> PidTable:
        """The table of a parsed RUH Status (I/O Management Receive, MO 01h).

        Raises
        ------
        ConfigError
            The status lists no descriptor (no PID could ever be sent).
        """
        if not status.descs:
            raise ConfigError(
                "RUH Status lists no placement identifier: FDP placement is not possible on this namespace"
            )
        return cls(tuple(int(d.pid) for d in status.descs), int(rgif))

    def __len__(self) -> int:
        return len(self.pids)

    def __contains__(self, pid: object) -> bool:
        return pid in self.pids

    def pid_at(self, plid: int) -> int:
        """PID of RUH Status entry ``plid`` (fio's ``plids=`` index).

        Raises
        ------
        ConfigError
            ``plid`` outside ``0..len - 1`` (fio: "PID index %d must be smaller than %d").
        """
        plid = int(plid)
        if not 0 <= plid < len(self.pids):
            raise ConfigError(
                f"plids: index {plid} must be smaller than {len(self.pids)}, the number of "
                f"entries in the device's RUH Status (PIDs {self.describe()})"
            )
        return self.pids[plid]

    def pids_at(self, plids: Sequence[int]) -> list[int]:
        """:meth:`pid_at` of each index, all checked before any is used."""
        return [self.pid_at(i) for i in plids]

    def check(self, pid: int | None, what: str = "pid") -> int | None:
        """Return ``pid`` if RUH Status lists it (``None`` passes: no placement directive).

        Raises
        ------
        ConfigError
            ``pid`` is not one of :attr:`pids`.
        """
        if pid is None:
            return None
        if int(pid) not in self.pids:
            raise ConfigError(
                f"{what}={int(pid):#x}: not a placement identifier of this namespace; its RUH Status "
                f"lists {self.describe()}"
            )
        return int(pid)

    def split(self, pid: int) -> tuple[int, int]:
        """``(reclaim_group, placement_handle)`` of ``pid`` under :attr:`rgif`."""
        return split_pid(pid, self.rgif)

    def describe(self) -> str:
        """``0x0, 0x1, ...`` for messages."""
        return ", ".join(f"{p:#x}" for p in self.pids)


@dataclass
class PlacementPolicy:
    """Maps a lifetime class (or no class) to the PID a write carries.

    Attributes
    ----------
    class_pid : dict[LifetimeClass, int]
        PID per class.
    default_pid : int
        PID of the default handle (placement handle 0), for untagged writes and metadata.
    rgif : int
        Reclaim Group Identifier Format of the active configuration.
    handle_pid : dict[tuple[int, int], int]
        ``(reclaim_group, handle) -> PID`` as listed by RUH Status.
    classifier : LifetimeClassifier
        Assigns classes when the caller has no class.
    """

    class_pid: dict[LifetimeClass, int]
    default_pid: int
    rgif: int
    handle_pid: dict[tuple[int, int], int] = field(default_factory=dict)
    classifier: LifetimeClassifier = field(default_factory=ReuseLifetimeClassifier)
    enabled: bool = True
    pid_table: PidTable | None = None

    @classmethod
    def from_ruh_status(
        cls,
        status: RuhStatus,
        rgif: int,
        reclaim_group: int = 0,
        classifier: LifetimeClassifier | None = None,
        class_handles: Mapping[LifetimeClass, int] | None = None,
    ) -> PlacementPolicy:
        """Build the policy from a device's RUH Status.

        Parameters
        ----------
        status : RuhStatus
            Parsed RUH Status (``nruhsd`` descriptors, each with its PID).
        rgif : int
            RGIF of the active FDP configuration (FDPA bits 3:0).
        reclaim_group : int
            Reclaim group to place into.
        class_handles : mapping, optional
            Override of the class -> placement-handle assignment (module table).
        """
        table: dict[tuple[int, int], int] = {}
        for d in status.descs:
            table.setdefault(split_pid(d.pid, rgif), d.pid)
        handles = sorted({h for (g, h) in table if g == reclaim_group})
        if not handles:
            raise ConfigError(f"RUH status lists no placement handle in reclaim group {reclaim_group}")
        default_h = 0 if 0 in handles else handles[0]
        others = [h for h in handles if h != default_h]
        if class_handles is None:
            if len(others) >= 3:
                pick = (others[0], others[1], others[2])
            elif len(others) == 2:
                pick = (others[0], others[1], others[1])
            elif len(others) == 1:
                pick = (default_h, others[0], others[0])
            else:
                pick = (default_h, default_h, default_h)
            class_handles = {
                LifetimeClass.LONG: pick[0],
                LifetimeClass.MEDIUM: pick[1],
                LifetimeClass.SHORT: pick[2],
            }
        class_pid = {}
        for c, h in class_handles.items():
            if (reclaim_group, h) not in table:
                raise ConfigError(
                    f"class {c.name}: handle {h} not in the device's RUH status {sorted(table)}"
                )
            class_pid[LifetimeClass(c)] = table[(reclaim_group, h)]
        return cls(
            class_pid=class_pid,
            default_pid=table[(reclaim_group, default_h)],
            rgif=rgif,
            handle_pid=table,
            classifier=classifier or ReuseLifetimeClassifier(),
            pid_table=PidTable.from_ruh_status(status, rgif),
        )

    @classmethod
    def from_plids(
        cls,
        status: RuhStatus,
        rgif: int,
        plids: Sequence[int] = (),
        classifier: LifetimeClassifier | None = None,
    ) -> PlacementPolicy:
        """The policy of a device, with fio's ``plids`` meaning.

        Parameters
        ----------
        status : RuhStatus
            The namespace's RUH Status.
        rgif : int
            RGIF of the active FDP configuration.
        plids : sequence of int
            Indices into the RUH Status list for LONG, MEDIUM, SHORT (cycled:
            ``plids=3,5`` gives LONG 3, MEDIUM 5, SHORT 3). The PIDs are taken
            whole, reclaim group included. Empty: the module table, in the
            reclaim group of the first RUH Status entry.

        Raises
        ------
        ConfigError
            An index outside the RUH Status list, or a status without PIDs.
        """
        tab = PidTable.from_ruh_status(status, rgif)
        if not plids:
            return cls.from_ruh_status(status, rgif, tab.split(tab.pids[0])[0], classifier)
        picks = tab.pids_at(plids)
        class_pid = {
            LifetimeClass.LONG: picks[0],
            LifetimeClass.MEDIUM: picks[1 % len(picks)],
            LifetimeClass.SHORT: picks[2 % len(picks)],
        }
        return cls._with_default(tab, class_pid, classifier)

    @classmethod
    def from_explicit(
        cls,
        status: RuhStatus | None,
        rgif: int,
        long_pid: int,
        medium_pid: int,
        short_pid: int,
        default_pid: int | None = None,
        classifier: LifetimeClassifier | None = None,
    ) -> PlacementPolicy:
        """The policy of explicit per-class PIDs (a configuration's ``fdp.*_pid``), each checked
        against the device's RUH Status.

        Raises
        ------
        ConfigError
            ``status`` is ``None`` (nothing to check the PIDs against), or a
            PID it does not list.
        """
        if status is None:
            raise ConfigError(
                "fdp.long_pid/medium_pid/short_pid need a device whose RUH Status can be read "
                "(device: fdp or device: sim); nothing else can check them"
            )
        tab = PidTable.from_ruh_status(status, rgif)
        class_pid = {
            LifetimeClass.LONG: tab.check(long_pid, "fdp.long_pid"),
            LifetimeClass.MEDIUM: tab.check(medium_pid, "fdp.medium_pid"),
            LifetimeClass.SHORT: tab.check(short_pid, "fdp.short_pid"),
        }
        pol = cls._with_default(tab, class_pid, classifier)
        if default_pid is not None:
            pol.default_pid = tab.check(default_pid, "fdp.default_pid")
        return pol

    @classmethod
    def _with_default(cls, tab: PidTable, class_pid: dict, classifier) -> PlacementPolicy:
        """Default PID: placement handle 0 in the reclaim group of the LONG class, else RUH Status entry 0."""
        handle_pid: dict[tuple[int, int], int] = {}
        for pid in tab.pids:
            handle_pid.setdefault(tab.split(pid), pid)
        rg = tab.split(class_pid[LifetimeClass.LONG])[0]
        default = handle_pid.get((rg, 0), tab.pids[0])
        return cls(
            class_pid=class_pid,
            default_pid=default,
            rgif=tab.rgif,
            handle_pid=handle_pid,
            classifier=classifier or ReuseLifetimeClassifier(),
            pid_table=tab,
        )

    def all_pids(self) -> list[int]:
        """Every PID this policy can send (classes and default), sorted."""
        return sorted(set(self.class_pid.values()) | {self.default_pid}) if self.enabled else []

    @classmethod
    def disabled(cls) -> PlacementPolicy:
        """A policy for devices without FDP: every write has ``placement=None``."""
        return cls(class_pid={}, default_pid=0, rgif=0, enabled=False)

    def placement_for(self, lifetime: LifetimeClass | None) -> int | None:
        """PID for a class; the default handle's PID for ``None``; ``None`` when FDP is off."""
        if not self.enabled:
            return None
        if lifetime is None:
            return self.default_pid
        return self.class_pid[LifetimeClass(lifetime)]

    def placement_for_metadata(self) -> int | None:
        """Metadata goes to the default handle."""
        return self.default_pid if self.enabled else None

    def placement_for_key(
        self, key: Hashable, hint: str | LifetimeClass | None = None, now_s: float | None = None
    ) -> int | None:
        """Classify ``key`` (hint first, then observed reuse) and return its PID."""
        if not self.enabled:
            return None
        return self.placement_for(self.classifier.classify(key, hint, now_s))
