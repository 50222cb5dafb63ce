"""Parsers against byte-by-byte fixtures (tests/fdp/gen_fixtures.py)."""

from __future__ import annotations

import os

import pytest

from tests.fdp import gen_fixtures as G
from tierstore.errors import CorruptData
from tierstore.fdp import logpages as lp

DATA = G.DATA


def _read(name: str) -> bytes:
    with open(os.path.join(DATA, name), "rb") as f:
        return f.read()


def test_fixtures_are_up_to_date():
    for name, data in G.all_fixtures().items():
        assert _read(name) == data, f"{name} differs; run python tests/fdp/gen_fixtures.py"


def test_configs_stepped_by_descriptor_size():
    log = lp.parse_fdp_configs(_read("fdp_configs.bin"))
    assert log.numfdpc == 2 and len(log.configs) == 2
    c0, c1 = log.configs
    assert (c0.rgif, c0.valid, c0.nrg, c0.nruh, c0.maxpids, c0.runs_bytes) == (2, True, 2, 4, 7, G.RUNS_0)
    assert [r.ruht for r in c0.ruhs] == [1, 1, 1, 1]
    # second descriptor has 16 vendor bytes after 8 RUH descriptors: only reachable via DSZE stepping
    assert c1.size_bytes == 64 + 32 + 16 and c1.vss_bytes == 16
    assert (c1.valid, c1.volatile_write_cache, c1.nnss, c1.runs_bytes, c1.erutl_s) == (
        False,
        True,
        4,
        G.RUNS_1,
        3600,
    )
    assert [r.persistent for r in c1.ruhs] == [False, True, True, False, False, False, False, True]


def test_configs_corrupt_size_raises():
    b = bytearray(_read("fdp_configs.bin"))
    b[16:18] = (4000).to_bytes(2, "little")  # DSZE past the end
    with pytest.raises(CorruptData):
        lp.parse_fdp_configs(bytes(b))
    with pytest.raises(CorruptData):
        lp.parse_fdp_configs(_read("fdp_configs.bin")[:40])


def test_usage_stats_events():
    u = lp.parse_ruh_usage(_read("ruh_usage.bin"))
    assert u.nruh == 4 and u.ruha == (1, 1, 2, 0)
    s = lp.parse_fdp_stats(_read("fdp_stats.bin"))
    assert (s.hbmw_bytes, s.mbmw_bytes, s.mbe_bytes) == (G.HBMW, G.MBMW, G.MBE)
    assert s.hbmw_bytes > 2**64  # 128-bit counter, not truncated
    e = lp.parse_fdp_events(_read("fdp_events.bin"))
    assert e.n == 2
    a, b = e.events
    assert (a.type, a.pid, a.nsid, a.timestamp_ms, a.name) == (
        3,
        0x4007,
        1,
        1_700_000_000_000,
        "Invalid Placement Identifier",
    )
    assert (b.type, b.nlbam, b.lba, b.rgid, b.ruhid) == (0x80, 16, 0x12345678, 1, 1)


def test_ruh_status_stops_at_nruhsd():
    buf = _read("ruh_status.bin")
    st = lp.parse_ruh_status(buf)
    assert st.nruhsd == 4 and len(st.descs) == 4
    assert [d.pid for d in st.descs] == [0, 1, 2, 3]
    assert st.descs[3].ruamw_blocks == 4096
    with pytest.raises(CorruptData):
        lp.parse_ruh_status(buf[: 16 + 32 * 3])


def test_id_ctrl_fdps_bit19():
    assert lp.fdp_supported(lp.ctratt_from_id_ctrl(_read("id_ctrl_fdp.bin")))
    assert not lp.fdp_supported(lp.ctratt_from_id_ctrl(_read("id_ctrl_nofdp.bin")))


def test_builders_roundtrip_against_independent_fixtures():
    assert lp.build_fdp_stats(G.HBMW, G.MBMW, G.MBE) == _read("fdp_stats.bin")
    assert lp.build_ruh_usage([1, 1, 2, 0]) == _read("ruh_usage.bin")
    assert lp.build_ruh_status(G.STATUS) == _read("ruh_status_rgif2.bin")
    d0 = lp.build_fdp_config_desc(0x82, 2, [1] * 4, 7, 1, G.RUNS_0)
    d1 = lp.build_fdp_config_desc(0x10, 1, [1, 2, 2, 1, 1, 1, 1, 2], 7, 4, G.RUNS_1, 3600, b"VNDR" * 4)
    assert lp.build_fdp_configs([d0, d1]) == _read("fdp_configs.bin")
