"""Parsers for FDP log pages and data structures, byte-exact.

Every layout below is little-endian and was checked field by field against
libnvme ``src/nvme/types.h`` (structs ``nvme_fdp_config_log``,
``nvme_fdp_config_desc``, ``nvme_fdp_ruh_desc``, ``nvme_fdp_ruhu_log``,
``nvme_fdp_ruhu_desc``, ``nvme_fdp_stats_log``, ``nvme_fdp_events_log``,
``nvme_fdp_event``, ``nvme_fdp_ruh_status``, ``nvme_fdp_ruh_status_desc``)
and against how nvme-cli walks them (``nvme-print-stdout.c`` /
``nvme-print-json.c``: configuration descriptors are stepped by their
``size`` field, RUH descriptors start right after the 64-byte descriptor
header).  The normative source is NVMe TP4146 "Flexible Data Placement" as
folded into the NVMe Base Specification 2.1: the Get Log Page command, log
page identifiers 20h..23h ("FDP Configurations", "Reclaim Unit Handle Usage",
"FDP Statistics", "FDP Events"), the Identify Controller data structure
(CTRATT bit 19 = FDPS), and the I/O Management Receive command (opcode 12h,
management operation 01h "Reclaim Unit Handle Status").  Sections are cited
by name, not number: the numbered 2.1 text was not available to check.  The
field offsets are what counts, and they are tested byte by byte.

All parsers take ``bytes``/``bytearray``/``memoryview`` and raise
:class:`tierstore.errors.CorruptData` on a buffer that is too short or whose
sizes do not add up.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..errors import CorruptData

__all__ = [
    "LID_FDP_CONFIGS",
    "LID_RUH_USAGE",
    "LID_FDP_STATS",
    "LID_FDP_EVENTS",
    "CTRATT_OFFSET",
    "CTRATT_FDPS_BIT",
    "RUHT_INITIALLY_ISOLATED",
    "RUHT_PERSISTENTLY_ISOLATED",
    "RuhDesc",
    "FdpConfig",
    "FdpConfigLog",
    "RuhUsageLog",
    "FdpStats",
    "FdpEvent",
    "FdpEventsLog",
    "RuhStatusDesc",
    "RuhStatus",
    "parse_fdp_configs",
    "parse_ruh_usage",
    "parse_fdp_stats",
    "parse_fdp_events",
    "parse_ruh_status",
    "ctratt_from_id_ctrl",
    "fdp_supported",
    "IdNamespace",
    "parse_id_ns",
    "serial_from_id_ctrl",
    "ruh_status_bytes_for",
]

#: Log page identifiers (Base Spec 2.1, Get Log Page, figure "Log Page Identifiers").
LID_FDP_CONFIGS = 0x20
LID_RUH_USAGE = 0x21
LID_FDP_STATS = 0x22
LID_FDP_EVENTS = 0x23

#: Identify Controller: CTRATT is bytes 99:96; bit 19 is FDPS (FDP supported).
#: Source: Base Spec 2.1 Identify Controller data structure; linux
#: ``include/linux/nvme.h`` ``NVME_CTRL_ATTR_FDPS = (1 << 19)``.
CTRATT_OFFSET = 96
CTRATT_FDPS_BIT = 19
ID_CTRL_BYTES = 4096

#: Reclaim Unit Handle Type (RUHT) values (FDP config descriptor RUH descriptor byte 0).
RUHT_INITIALLY_ISOLATED = 0x1
RUHT_PERSISTENTLY_ISOLATED = 0x2
RUHT_NAMES = {
    RUHT_INITIALLY_ISOLATED: "Initially Isolated",
    RUHT_PERSISTENTLY_ISOLATED: "Persistently Isolated",
}

_CONFIG_LOG_HDR = struct.Struct("<HBBI8x")  # n(0-based), version, rsvd3, size; 16 bytes
_CONFIG_DESC_HDR = struct.Struct(
    "<HBBIHHIQI36x"
)  # size, fdpa, vss, nrg, nruh, maxpids, nnss, runs, erutl; 64 bytes
_RUH_DESC = struct.Struct("<B3x")  # ruht; 4 bytes
_RUHU_HDR = struct.Struct("<H6x")  # nruh; 8 bytes
_RUHU_DESC = struct.Struct("<B7x")  # ruha; 8 bytes
_STATS_BYTES = 64  # hbmw[16] mbmw[16] mbe[16] rsvd48[16]
_EVENTS_HDR = struct.Struct("<I60x")  # n; 64 bytes
_EVENT = struct.Struct("<BBH6sBBI16sHB5x24s")  # 64 bytes, see FdpEvent
_RUHS_HDR = struct.Struct("<14xH")  # rsvd0[14], nruhsd; 16 bytes
_RUHS_DESC = struct.Struct("<HHIQ16x")  # pid, ruhid, earutr, ruamw; 32 bytes

if (
    _CONFIG_LOG_HDR.size,
    _CONFIG_DESC_HDR.size,
    _RUH_DESC.size,
    _RUHU_HDR.size,
    _RUHU_DESC.size,
    _EVENTS_HDR.size,
    _EVENT.size,
    _RUHS_HDR.size,
    _RUHS_DESC.size,
) != (16, 64, 4, 8, 8, 64, 64, 16, 32):
    raise ImportError("FDP struct layouts do not match libnvme types.h sizes")


def _need(buf: bytes | memoryview, n: int, what: str) -> None:
    if len(buf) < n:
        raise CorruptData(f"{what}: need {n} bytes, buffer has {len(buf)}")


def _counted_page(
    buf: bytes | memoryview,
    hdr: struct.Struct,
    hdr_bytes: int,
    entry_bytes: int,
    what: str,
    entries: str,
    max_n: int | None = None,
) -> tuple[bytes, int]:
    """``(bytes(buf), n)`` for a log page of a ``hdr_bytes`` header, whose ``hdr`` (read at byte 0)
    has the one field ``n``, followed by ``n`` entries of ``entry_bytes``.

    Raises
    ------
    CorruptData
        When the buffer is shorter than the header or its ``n`` entries, or ``n > max_n``.
    """
    buf = bytes(buf)
    _need(buf, hdr_bytes, f"{what} header")
    (n,) = hdr.unpack_from(buf, 0)
    if max_n is not None and n > max_n:
        raise CorruptData(f"{what}: n={n} exceeds the {max_n} {entries} the log holds")
    _need(buf, hdr_bytes + entry_bytes * n, f"{what} with {n} {entries}")
    return buf, n


def le128(b: bytes | memoryview) -> int:
    """Unsigned little-endian 128-bit integer (16 bytes), as the FDP Statistics counters."""
    if len(b) != 16:
        raise CorruptData(f"le128: need 16 bytes, got {len(b)}")
    return int.from_bytes(bytes(b), "little", signed=False)


# --------------------------------------------------------------- configs 20h
@dataclass(frozen=True)
class RuhDesc:
    """RUH descriptor of an FDP configuration: ``ruht`` (1 = Initially, 2 = Persistently Isolated)."""

    ruht: int

    @property
    def persistent(self) -> bool:
        """True for Persistently Isolated (RUHT 2h)."""
        return self.ruht == RUHT_PERSISTENTLY_ISOLATED


@dataclass(frozen=True)
class FdpConfig:
    """One FDP Configuration Descriptor (log 20h).

    Attributes
    ----------
    size_bytes : int     DSZE, descriptor size incl. RUH descriptors (offset 0, le16).
    fdpa : int           FDP Attributes (offset 2): bits 3:0 RGIF, bit 4 FDPVWC, bit 7 valid.
    vss_bytes : int      Vendor Specific Size (offset 3).
    nrg : int            Number of Reclaim Groups (offset 4, le32).
    nruh : int           Number of Reclaim Unit Handles (offset 8, le16).
    maxpids : int        Max Placement Identifiers, 0-based (offset 10, le16).
    nnss : int           Number of Namespaces Supported (offset 12, le32).
    runs_bytes : int     Reclaim Unit Nominal Size, bytes (offset 16, le64).
    erutl_s : int        Estimated Reclaim Unit Time Limit, seconds, 0 = not reported (offset 24, le32).
    ruhs : tuple[RuhDesc, ...]  nruh 4-byte RUH descriptors from offset 64.
    """

    size_bytes: int
    fdpa: int
    vss_bytes: int
    nrg: int
    nruh: int
    maxpids: int
    nnss: int
    runs_bytes: int
    erutl_s: int
    ruhs: tuple[RuhDesc, ...] = field(default_factory=tuple)

    @property
    def rgif(self) -> int:
        """Reclaim Group Identifier Format: PID bits used for the reclaim group (FDPA 3:0)."""
        return self.fdpa & 0xF

    @property
    def volatile_write_cache(self) -> bool:
        """FDPVWC (FDPA bit 4)."""
        return bool(self.fdpa >> 4 & 1)

    @property
    def valid(self) -> bool:
        """FDP Configuration Valid (FDPA bit 7)."""
        return bool(self.fdpa >> 7 & 1)


@dataclass(frozen=True)
class FdpConfigLog:
    """FDP Configurations log page (20h): ``numfdpc`` is the real count (1-based)."""

    numfdpc: int
    version: int
    size_bytes: int
    configs: tuple[FdpConfig, ...]


def parse_fdp_configs(buf: bytes | memoryview) -> FdpConfigLog:
    """Parse the FDP Configurations log page (LID 20h).

    Layout: 16-byte header (``n`` 0-based count le16 @0, version @2, size le32 @4),
    then ``n + 1`` descriptors, each stepped by its own ``size`` (DSZE) field.
    """
    buf = memoryview(bytes(buf))
    _need(buf, 16, "FDP configs header")
    n0, version, _rsvd, size = _CONFIG_LOG_HDR.unpack_from(buf, 0)
    if size < 16 or size > len(buf):
        raise CorruptData(f"FDP configs: log size field {size} vs buffer {len(buf)} bytes")
    off = 16
    configs = []
    for i in range(n0 + 1):
        _need(buf[:size], off + 64, f"FDP config descriptor {i}")
        dsze, fdpa, vss, nrg, nruh, maxpids, nnss, runs, erutl = _CONFIG_DESC_HDR.unpack_from(buf, off)
        if dsze < 64 + 4 * nruh or off + dsze > size:
            raise CorruptData(
                f"FDP config descriptor {i}: size {dsze} too small for {nruh} RUHs "
                f"or past the log end ({off}+{dsze} > {size})"
            )
        ruhs = tuple(RuhDesc(_RUH_DESC.unpack_from(buf, off + 64 + 4 * j)[0]) for j in range(nruh))
        configs.append(FdpConfig(dsze, fdpa, vss, nrg, nruh, maxpids, nnss, runs, erutl, ruhs))
        off += dsze
    return FdpConfigLog(n0 + 1, version, size, tuple(configs))


# ----------------------------------------------------------------- usage 21h
@dataclass(frozen=True)
class RuhUsageLog:
    """Reclaim Unit Handle Usage log (21h): ``ruha[i]`` per RUH (0 unused, 1 host, 2 controller specified)."""

    nruh: int
    ruha: tuple[int, ...]


def parse_ruh_usage(buf: bytes | memoryview) -> RuhUsageLog:
    """Parse the RUH Usage log page (LID 21h): 8-byte header (nruh le16 @0), 8-byte descriptors."""
    buf, nruh = _counted_page(buf, _RUHU_HDR, 8, 8, "RUH usage", "descriptors")
    return RuhUsageLog(nruh, tuple(_RUHU_DESC.unpack_from(buf, 8 + 8 * i)[0] for i in range(nruh)))


# ----------------------------------------------------------------- stats 22h
@dataclass(frozen=True)
class FdpStats:
    """FDP Statistics log (22h): three little-endian 128-bit byte counters.

    ``hbmw_bytes`` bytes 15:0, ``mbmw_bytes`` bytes 31:16, ``mbe_bytes`` bytes 47:32;
    bytes 63:48 reserved.
    """

    hbmw_bytes: int
    mbmw_bytes: int
    mbe_bytes: int

    def as_dict(self) -> dict[str, int]:
        """The stats interface shared with the FTL model."""
        return {"hbmw_bytes": self.hbmw_bytes, "mbmw_bytes": self.mbmw_bytes, "mbe_bytes": self.mbe_bytes}


def parse_fdp_stats(buf: bytes | memoryview) -> FdpStats:
    """Parse the FDP Statistics log page (LID 22h, 64 bytes)."""
    buf = bytes(buf)
    _need(buf, 48, "FDP statistics")
    return FdpStats(le128(buf[0:16]), le128(buf[16:32]), le128(buf[32:48]))


# ---------------------------------------------------------------- events 23h
EVENT_NAMES = {
    0x00: "Reclaim Unit Not Fully Written",
    0x01: "Reclaim Unit Time Limit Exceeded",
    0x02: "Controller Level Reset Modified Reclaim Unit Handles",
    0x03: "Invalid Placement Identifier",
    0x80: "Media Reallocated",
    0x81: "Implicitly Modified Reclaim Unit Handle",
}


@dataclass(frozen=True)
class FdpEvent:
    """One 64-byte FDP event (``struct nvme_fdp_event``).

    Offsets: type @0, flags @1 (bit0 PIV, bit1 NSIDV, bit2 LV), pid le16 @2,
    timestamp @4 (6-byte ms + attr + rsvd, ``struct nvme_timestamp``), nsid le32 @12,
    type-specific 16 bytes @16 (Media Reallocated: flags @16, nlbam le16 @18, lba le64 @20),
    rgid le16 @32, ruhid @34, rsvd 35..39, vendor specific 24 bytes @40.
    """

    type: int
    flags: int
    pid: int
    timestamp_ms: int
    nsid: int
    rgid: int
    ruhid: int
    nlbam: int | None = None
    lba: int | None = None

    @property
    def name(self) -> str:
        """Event type name (libnvme ``enum nvme_fdp_event_type``)."""
        return EVENT_NAMES.get(self.type, f"unknown({self.type:#x})")


@dataclass(frozen=True)
class FdpEventsLog:
    """FDP Events log (23h): ``n`` events (at most 63)."""

    n: int
    events: tuple[FdpEvent, ...]


def parse_fdp_events(buf: bytes | memoryview) -> FdpEventsLog:
    """Parse the FDP Events log page (LID 23h): 64-byte header (n le32 @0) + n 64-byte events."""
    buf, n = _counted_page(buf, _EVENTS_HDR, 64, 64, "FDP events", "entries", max_n=63)
    events = []
    for i in range(n):
        typ, flags, pid, ts, _attr, _r, nsid, spec, rgid, ruhid, _vs = _EVENT.unpack_from(buf, 64 + 64 * i)
        nlbam = lba = None
        if typ == 0x80:
            rflags, nlbam, lba_v = struct.unpack_from("<BxHQ", spec, 0)
            lba = lba_v if rflags & 1 else None
        events.append(FdpEvent(typ, flags, pid, int.from_bytes(ts, "little"), nsid, rgid, ruhid, nlbam, lba))
    return FdpEventsLog(n, tuple(events))


# ------------------------------------------------------------- RUH status
@dataclass(frozen=True)
class RuhStatusDesc:
    """RUH Status descriptor (32 bytes): pid le16 @0, ruhid le16 @2, earutr le32 @4 (s), ruamw le64 @8
    (logical blocks)."""

    pid: int
    ruhid: int
    earutr_s: int
    ruamw_blocks: int


@dataclass(frozen=True)
class RuhStatus:
    """Reclaim Unit Handle Status (I/O Management Receive, MO 01h): ``nruhsd`` descriptors."""

    nruhsd: int
    descs: tuple[RuhStatusDesc, ...]


def parse_ruh_status(buf: bytes | memoryview) -> RuhStatus:
    """Parse RUH Status: 16-byte header (nruhsd le16 @14) and 32-byte descriptors.

    Stops at ``nruhsd`` descriptors even when the buffer is longer (the host
    usually over-allocates the transfer).
    """
    buf, nruhsd = _counted_page(buf, _RUHS_HDR, 16, 32, "RUH status", "descriptors")
    return RuhStatus(
        nruhsd, tuple(RuhStatusDesc(*_RUHS_DESC.unpack_from(buf, 16 + 32 * i)) for i in range(nruhsd))
    )


# ------------------------------------------------------------ id-ctrl
def ctratt_from_id_ctrl(buf: bytes | memoryview) -> int:
    """CTRATT (le32, Identify Controller bytes 99:96)."""
    buf = bytes(buf)
    _need(buf, CTRATT_OFFSET + 4, "Identify Controller")
    return struct.unpack_from("<I", buf, CTRATT_OFFSET)[0]


def fdp_supported(ctratt: int) -> bool:
    """FDPS: CTRATT bit 19."""
    return bool(ctratt >> CTRATT_FDPS_BIT & 1)


def serial_from_id_ctrl(buf: bytes | memoryview) -> str:
    """Serial Number (SN, Identify Controller bytes 23:04, ASCII, space padded)."""
    buf = bytes(buf)
    _need(buf, 24, "Identify Controller")
    return buf[4:24].decode("ascii", "replace").strip()


@dataclass(frozen=True)
class IdNamespace:
    """What the device path needs from Identify Namespace (CNS 00h, NVM Command Set).

    Attributes
    ----------
    nsze_blocks : int    Namespace Size (NSZE, bytes 7:0), logical blocks.
    lba_bytes : int      ``2 ** LBADS`` of the format FLBAS selects.
    metadata_bytes : int MS of that format (metadata bytes per block; 0 = none).
    """

    nsze_blocks: int
    lba_bytes: int
    metadata_bytes: int

    @property
    def size_bytes(self) -> int:
        """NSZE x logical block size."""
        return self.nsze_blocks * self.lba_bytes


def parse_id_ns(buf: bytes | memoryview) -> IdNamespace:
    """Identify Namespace: NSZE (le64 @0), NLBAF (@25), FLBAS (@26: bits 3:0 the format
    index, bits 6:5 its upper bits), LBAF[i] (le32 @128 + 4i: MS bits 15:0, LBADS bits 23:16).

    Source: NVM Command Set Specification 1.0, Identify Namespace data structure;
    linux ``include/linux/nvme.h`` ``struct nvme_id_ns``.

    Raises
    ------
    CorruptData
        A short buffer, a format index beyond NLBAF, or LBADS < 9 (the spec's minimum 512 bytes).
    """
    buf = bytes(buf)
    _need(buf, 384, "Identify Namespace")
    nsze = struct.unpack_from("<Q", buf, 0)[0]
    nlbaf, flbas = buf[25], buf[26]
    idx = (flbas & 0xF) | ((flbas >> 5 & 0x3) << 4)
    if idx > nlbaf:
        raise CorruptData(f"Identify Namespace: FLBAS selects format {idx} but NLBAF is {nlbaf} (0-based)")
    lbaf = struct.unpack_from("<I", buf, 128 + 4 * idx)[0]
    lbads = lbaf >> 16 & 0xFF
    if lbads < 9:
        raise CorruptData(
            f"Identify Namespace: LBADS {lbads} of format {idx} (logical blocks are >= 512 bytes)"
        )
    return IdNamespace(nsze, 1 << lbads, lbaf & 0xFFFF)


def ruh_status_bytes_for(nruhsd: int) -> int:
    """Bytes of a RUH Status holding ``nruhsd`` descriptors: 16 + 32 each."""
    return _RUHS_HDR.size + _RUHS_DESC.size * int(nruhsd)


# ------------------------------------------------------------ builders
def build_ruh_status(descs: list[tuple[int, int, int, int]], pad_to_bytes: int = 0) -> bytes:
    """Build a RUH Status buffer from ``(pid, ruhid, earutr_s, ruamw_blocks)`` tuples.

    Used by the simulated device and the fixture generator; ``pad_to_bytes``
    appends zeros (a device answers into the whole host buffer).
    """
    out = bytearray(_RUHS_HDR.pack(len(descs)))
    for d in descs:
        out += _RUHS_DESC.pack(*d)
    if len(out) < pad_to_bytes:
        out += bytes(pad_to_bytes - len(out))
    return bytes(out)


def build_fdp_stats(hbmw_bytes: int, mbmw_bytes: int, mbe_bytes: int) -> bytes:
    """Build a 64-byte FDP Statistics log page."""
    return (
        hbmw_bytes.to_bytes(16, "little")
        + mbmw_bytes.to_bytes(16, "little")
        + mbe_bytes.to_bytes(16, "little")
        + bytes(16)
    )


def build_fdp_config_desc(
    fdpa: int,
    nrg: int,
    ruhts: list[int],
    maxpids: int,
    nnss: int,
    runs_bytes: int,
    erutl_s: int = 0,
    vss: bytes = b"",
) -> bytes:
    """Build one FDP configuration descriptor: 64-byte header, RUH descriptors, vendor bytes."""
    dsze = 64 + 4 * len(ruhts) + len(vss)
    out = bytearray(
        _CONFIG_DESC_HDR.pack(dsze, fdpa, len(vss), nrg, len(ruhts), maxpids, nnss, runs_bytes, erutl_s)
    )
    for t in ruhts:
        out += _RUH_DESC.pack(t)
    out += vss
    return bytes(out)


def build_fdp_configs(descs: list[bytes], version: int = 0) -> bytes:
    """Build the FDP Configurations log page from descriptors made by :func:`build_fdp_config_desc`."""
    body = b"".join(descs)
    return _CONFIG_LOG_HDR.pack(len(descs) - 1, version, 0, 16 + len(body)) + body


def build_ruh_usage(ruha: list[int]) -> bytes:
    """Build a RUH Usage log page."""
    return _RUHU_HDR.pack(len(ruha)) + b"".join(_RUHU_DESC.pack(a) for a in ruha)


def build_fdp_events(events: list[FdpEvent]) -> bytes:
    """Build an FDP Events log page (header + 64-byte events, padded to the 63-event size)."""
    out = bytearray(_EVENTS_HDR.pack(len(events)))
    for e in events:
        spec = bytes(16)
        if e.type == 0x80:
            spec = struct.pack("<BxHQ4x", 1 if e.lba is not None else 0, e.nlbam or 0, e.lba or 0)
        out += _EVENT.pack(
            e.type,
            e.flags,
            e.pid,
            e.timestamp_ms.to_bytes(6, "little"),
            0,
            0,
            e.nsid,
            spec,
            e.rgid,
            e.ruhid,
            bytes(24),
        )
    out += bytes(64 + 64 * 63 - len(out))
    return bytes(out)
