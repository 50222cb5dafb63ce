"""Generate the FDP fixtures in tests/fdp/data, byte by byte from the spec layouts.

Run: ``python tests/fdp/gen_fixtures.py`` (idempotent; a test checks the
committed files equal what this script produces).

Binary layouts are written with explicit offsets (``put``), deliberately *not*
with :mod:`tierstore.fdp.logpages` builders, so the parsers are tested against
an independent encoding.  Offsets: NVMe TP4146 / Base Spec 2.1 log pages
20h-23h, RUH Status (I/O Management Receive), Identify Controller CTRATT
(bytes 99:96, bit 19 FDPS); cross-checked with libnvme ``src/nvme/types.h``.

Text/JSON fixtures follow nvme-cli 2.3's printers (``nvme-print-json.c``:
``json_nvme_fdp_stats`` prints 128-bit counters as strings via
``json_object_add_value_uint128``; ``json_nvme_fdp_configs`` omits ``ruhs`` and
``maxpids``; ``nvme-print.c`` normal output "Host Bytes with Metadata Written
(HBMW): N").
"""

from __future__ import annotations

import json
import os

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# Values the tests assert on.
HBMW = (1 << 64) + 123_456_789  # > 64 bits on purpose: the counters are 128-bit
MBMW = (1 << 64) + 234_567_890
MBE = 3 * (1 << 30)
RUNS_0 = 1 << 30  # config 0: 1 GiB reclaim units
RUNS_1 = 16 << 30  # config 1: 16 GiB reclaim units
STATUS = [  # (pid, ruhid, earutr_s, ruamw_blocks) for RGIF=2, rg 0..1, handles 0..3 ... 4 descs listed
    (0x0000, 0, 0, 262144),
    (0x0001, 1, 0, 131072),
    (0x0002, 2, 0, 65536),
    (0x0003, 3, 0, 4096),
    (0x4000, 0, 0, 262144),
    (0x4001, 1, 0, 1000),
    (0x4002, 2, 0, 2000),
    (0x4003, 3, 600, 3000),
]


def put(buf: bytearray, off: int, width: int, value: int) -> None:
    """Write ``value`` little-endian into ``buf[off:off+width]``."""
    buf[off : off + width] = int(value).to_bytes(width, "little")


def id_ctrl(fdp: bool) -> bytes:
    b = bytearray(4096)
    put(b, 0, 2, 0x144D)  # VID
    ctratt = (1 << 19 if fdp else 0) | (1 << 0) | (1 << 15)  # FDPS + HID128 + ELBAS
    put(b, 96, 4, ctratt)  # CTRATT bytes 99:96
    return bytes(b)


def config_desc(
    fdpa: int, nrg: int, ruhts: list[int], maxpids: int, nnss: int, runs: int, erutl: int, vendor: bytes
) -> bytes:
    dsze = 64 + 4 * len(ruhts) + len(vendor)
    b = bytearray(dsze)
    put(b, 0, 2, dsze)  # DSZE
    put(b, 2, 1, fdpa)  # FDPA
    put(b, 3, 1, len(vendor))  # VSS
    put(b, 4, 4, nrg)  # NRG
    put(b, 8, 2, len(ruhts))  # NRUH
    put(b, 10, 2, maxpids)  # MAXPIDS (0-based)
    put(b, 12, 4, nnss)  # NNSS
    put(b, 16, 8, runs)  # RUNS
    put(b, 24, 4, erutl)  # ERUTL
    for i, t in enumerate(ruhts):
        put(b, 64 + 4 * i, 1, t)  # RUHT
    b[64 + 4 * len(ruhts) :] = vendor
    return bytes(b)


def fdp_configs() -> bytes:
    d0 = config_desc(0x82, 2, [1, 1, 1, 1], 7, 1, RUNS_0, 0, b"")  # valid, RGIF=2
    d1 = config_desc(0x10, 1, [1, 2, 2, 1, 1, 1, 1, 2], 7, 4, RUNS_1, 3600, b"VNDR" * 4)  # not valid, FDPVWC
    size = 16 + len(d0) + len(d1)
    b = bytearray(16)
    put(b, 0, 2, 1)  # NUMFDPC, 0-based: two configs
    put(b, 2, 1, 0)  # version
    put(b, 4, 4, size)  # SZE
    return bytes(b) + d0 + d1


def ruh_usage() -> bytes:
    ruha = [1, 1, 2, 0]
    b = bytearray(8 + 8 * len(ruha))
    put(b, 0, 2, len(ruha))
    for i, a in enumerate(ruha):
        put(b, 8 + 8 * i, 1, a)
    return bytes(b)


def fdp_stats() -> bytes:
    b = bytearray(64)
    put(b, 0, 16, HBMW)
    put(b, 16, 16, MBMW)
    put(b, 32, 16, MBE)
    return bytes(b)


def fdp_events() -> bytes:
    b = bytearray(64 + 64 * 63)
    put(b, 0, 4, 2)  # n
    e = 64
    put(b, e + 0, 1, 0x03)  # Invalid Placement Identifier
    put(b, e + 1, 1, 0x1 | 0x2)  # PIV | NSIDV
    put(b, e + 2, 2, 0x4007)  # PID
    put(b, e + 4, 6, 1_700_000_000_000)  # timestamp, ms
    put(b, e + 12, 4, 1)  # NSID
    e = 128
    put(b, e + 0, 1, 0x80)  # Media Reallocated
    put(b, e + 1, 1, 0x1 | 0x4)  # PIV | LV
    put(b, e + 2, 2, 0x0001)
    put(b, e + 4, 6, 1_700_000_000_500)
    put(b, e + 16, 1, 0x1)  # LBAV
    put(b, e + 18, 2, 16)  # NLBAM
    put(b, e + 20, 8, 0x1234_5678)  # LBA
    put(b, e + 32, 2, 1)  # RGID
    put(b, e + 34, 1, 1)  # RUHID
    return bytes(b)


def ruh_status() -> bytes:
    n = 4
    b = bytearray(16 + 32 * len(STATUS))
    put(b, 14, 2, n)  # NRUHSD = 4 ...
    for i, (pid, ruhid, earutr, ruamw) in enumerate(STATUS):
        o = 16 + 32 * i
        put(b, o, 2, pid)
        put(b, o + 2, 2, ruhid)
        put(b, o + 4, 4, earutr)
        put(b, o + 8, 8, ruamw)
    b += b"\xff" * 64  # ... and garbage after: parsers must stop at NRUHSD
    return bytes(b)


def ruh_status_rgif2() -> bytes:
    b = bytearray(16 + 32 * len(STATUS))
    put(b, 14, 2, len(STATUS))
    for i, (pid, ruhid, earutr, ruamw) in enumerate(STATUS):
        o = 16 + 32 * i
        put(b, o, 2, pid)
        put(b, o + 2, 2, ruhid)
        put(b, o + 4, 4, earutr)
        put(b, o + 8, 8, ruamw)
    return bytes(b)


def text_fixtures() -> dict[str, str]:
    stats_json = '{\n  "hbmw":"%d",\n  "mbmw":"%d",\n  "mbe":"%d"\n}\n' % (HBMW, MBMW, MBE)
    stats_json_num = json.dumps({"hbmw": 1000, "mbmw": 1500, "mbe": 0}, indent=2) + "\n"
    status_json = (
        json.dumps(
            {
                "nruhsd": 4,
                "ruhss": [{"pid": p, "ruhid": r, "earutr": e, "ruamw": a} for (p, r, e, a) in STATUS[:4]],
            },
            indent=2,
        )
        + "\n"
    )
    configs_json = (
        json.dumps(
            {
                "n": 0,
                "configs": [
                    {"fdpa": 130, "vss": 0, "nrg": 2, "nruh": 4, "nnss": 1, "runs": RUNS_0, "erutl": 0}
                ],
            },
            indent=2,
        )
        + "\n"
    )
    usage_json = json.dumps({"nruh": 4, "ruhus": [{"ruha": a} for a in (1, 1, 2, 0)]}, indent=2) + "\n"
    events_json = (
        json.dumps(
            {
                "n": 1,
                "events": [
                    {
                        "type": 128,
                        "fdpef": 5,
                        "pid": 1,
                        "timestamp": 1_700_000_000_500,
                        "nsid": 0,
                        "nlbam": 16,
                        "lba": 0x12345678,
                    }
                ],
            },
            indent=2,
        )
        + "\n"
    )
    stats_txt = (
        "Host Bytes with Metadata Written (HBMW): 18,446,744,073,833,008,405\n"
        "Media Bytes with Metadata Written (MBMW): 18,446,744,073,944,119,506\n"
        "Media Bytes Erased (MBE): 3,221,225,472\n"
    )
    feature_txt = "get-feature:0x1d (Flexible Direct Placement), Current value:0x000001\n"
    feature_off_txt = "get-feature:0x1d (Flexible Direct Placement), Current value:0x000100\n"
    return {
        "fdp_stats.json": stats_json,
        "fdp_stats_numbers.json": stats_json_num,
        "fdp_status.json": status_json,
        "fdp_configs.json": configs_json,
        "fdp_usage.json": usage_json,
        "fdp_events.json": events_json,
        "fdp_stats.txt": stats_txt,
        "get_feature_fdp_on.txt": feature_txt,
        "get_feature_fdp_off.txt": feature_off_txt,
    }


def all_fixtures() -> dict[str, bytes]:
    out = {
        "id_ctrl_fdp.bin": id_ctrl(True),
        "id_ctrl_nofdp.bin": id_ctrl(False),
        "fdp_configs.bin": fdp_configs(),
        "ruh_usage.bin": ruh_usage(),
        "fdp_stats.bin": fdp_stats(),
        "fdp_events.bin": fdp_events(),
        "ruh_status.bin": ruh_status(),
        "ruh_status_rgif2.bin": ruh_status_rgif2(),
    }
    out.update({k: v.encode() for k, v in text_fixtures().items()})
    return out


def main() -> None:
    os.makedirs(DATA, exist_ok=True)
    for name, data in all_fixtures().items():
        with open(os.path.join(DATA, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(all_fixtures())} fixtures to {DATA}")


if __name__ == "__main__":
    main()
