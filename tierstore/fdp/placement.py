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

Handle assignment (placement handle 0 is the default handle, used by writes
without a placement directive; it is kept for untagged writes and metadata):

=========================  =========================================
non-default handles         LONG / MEDIUM / SHORT
=========================  =========================================
>= 3                        h1 / h2 / h3
2                           h1 / h2 / h2   (medium and short die soon)
1                           h0 / h1 / h1   (long shares the default)
0                           h0 / h0 / h0   (no separation possible)
=========================  =========================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

from ..errors import ConfigError
from .lifetime import LifetimeClass, LifetimeClassifier, ReuseLifetimeClassifier
from .logpages import RuhStatus

__all__ = ["make_pid", "split_pid", "PlacementPolicy"]


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

    @classmethod
    def from_ruh_status(cls, status: RuhStatus, rgif: int, reclaim_group: int = 0,
                        classifier: LifetimeClassifier | None = None,
                        class_handles: Mapping[LifetimeClass, int] | None = None) -> "PlacementPolicy":
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
            class_handles = {LifetimeClass.LONG: pick[0], LifetimeClass.MEDIUM: pick[1], LifetimeClass.SHORT: pick[2]}
        class_pid = {}
        for c, h in class_handles.items():
            if (reclaim_group, h) not in table:
                raise ConfigError(f"class {c.name}: handle {h} not in the device's RUH status {sorted(table)}")
            class_pid[LifetimeClass(c)] = table[(reclaim_group, h)]
        return cls(class_pid=class_pid, default_pid=table[(reclaim_group, default_h)], rgif=rgif,
                   handle_pid=table, classifier=classifier or ReuseLifetimeClassifier())

    @classmethod
    def disabled(cls) -> "PlacementPolicy":
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

    def placement_for_key(self, key: Hashable, hint: str | LifetimeClass | None = None,
                          now_s: float | None = None) -> int | None:
        """Classify ``key`` (hint first, then observed reuse) and return its PID."""
        if not self.enabled:
            return None
        return self.placement_for(self.classifier.classify(key, hint, now_s))
