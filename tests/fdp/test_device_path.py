"""The device path on CPU: management-command encoding, the PID table, fio's plids meaning,
the passthrough engine's checks and RUH Update decisions (against a fake writer), and the
bench/library/daemon refusing PIDs a device does not list. The same code runs against QEMU's
emulated FDP namespace in tests/fdp/test_vm.py."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct

import pytest

from tests.fdp import gen_fixtures as G
from tierstore.errors import ConfigError
from tierstore.fdp import device as dv
from tierstore.fdp import logpages as lp
from tierstore.fdp import passthrough as pt
from tierstore.fdp.lifetime import LifetimeClass as L
from tierstore.fdp.placement import PidTable, PlacementPolicy

QEMU_4X2 = os.path.join(G.DATA, "qemu_4x2", "ruh_status_l4096.bin")


def _status_4x2() -> lp.RuhStatus:
    with open(QEMU_4X2, "rb") as f:
        return lp.parse_ruh_status(f.read())


# ------------------------------------------------------------------ encoding
def test_ruh_status_command_encoding():
    c = pt.build_ruh_status_cmd(1, 0x1000, 272)
    b = c.pack()
    assert b[0] == 0x12  # I/O Management Receive
    assert struct.unpack_from("<I", b, 4)[0] == 1  # nsid
    assert struct.unpack_from("<I", b, 36)[0] == 272  # data_len
    assert struct.unpack_from("<II", b, 40) == (0x01, 272 // 4 - 1)  # CDW10 MO=1, CDW11 NUMD 0-based
    for bad in (0, 270, -4):
        with pytest.raises(ConfigError):
            pt.build_ruh_status_cmd(1, 0, bad)


def test_ruh_update_command_encoding():
    assert pt.encode_ruh_update_pids([0x4003, 1]) == b"\x03\x40\x01\x00"
    c = pt.build_ruh_update_cmd(1, 2, 0x2000)
    b = c.pack()
    assert b[0] == 0x1D  # I/O Management Send
    assert struct.unpack_from("<I", b, 36)[0] == 4  # 2 bytes per PID
    assert struct.unpack_from("<I", b, 40)[0] == 0x01 | (1 << 16)  # MO=1, MOS = #PIDs - 1
    assert pt.build_ruh_update_cmd(1, 1, 0).cdw10 == 0x1
    with pytest.raises(ConfigError):
        pt.encode_ruh_update_pids([])
    with pytest.raises(ConfigError):
        pt.encode_ruh_update_pids([0x10000])


def test_nvme_status_error():
    e = pt.NvmeStatusError(0x4002, "RUH Update")
    assert e.nvme_status == 0x4002 and e.errno == 5 and "SC 0x2" in str(e)


# ------------------------------------------------------------------ PID table and plids
def test_pid_table_is_ruh_status_order():
    t = PidTable.from_ruh_status(_status_4x2(), 2)
    assert t.pids == (0, 0x4000, 1, 0x4001, 2, 0x4002, 3, 0x4003)
    assert t.pid_at(3) == 0x4001 and t.pids_at([0, 7]) == [0, 0x4003]
    with pytest.raises(ConfigError, match="must be smaller than 8"):
        t.pid_at(8)
    assert t.check(0x4002) == 0x4002 and t.check(None) is None
    with pytest.raises(ConfigError, match="0x77"):
        t.check(0x77, "fdp.long_pid")
    assert t.split(0x4003) == (1, 3)


def test_plids_are_fio_indices_whole_pids_any_group():
    st = _status_4x2()
    p = PlacementPolicy.from_plids(st, 2, [3, 4])  # the example: was 0x0001/0x0002 in group 0
    assert (p.placement_for(L.LONG), p.placement_for(L.MEDIUM), p.placement_for(L.SHORT)) == (
        0x4001,
        2,
        0x4001,
    )
    p = PlacementPolicy.from_plids(st, 2, [3, 5, 7])
    assert [p.class_pid[c] for c in (L.LONG, L.MEDIUM, L.SHORT)] == [0x4001, 0x4002, 0x4003]
    assert p.default_pid == 0x4000  # handle 0 of the LONG class's group
    assert p.pid_table.pids == PidTable.from_ruh_status(st, 2).pids
    with pytest.raises(ConfigError, match="index 8"):
        PlacementPolicy.from_plids(st, 2, [1, 8])
    d = PlacementPolicy.from_plids(st, 2)  # no plids: the module table in group 0
    assert [d.class_pid[c] for c in (L.LONG, L.MEDIUM, L.SHORT)] == [1, 2, 3] and d.default_pid == 0


def test_device_without_group_zero_handles_is_usable():
    st = lp.RuhStatus(2, (lp.RuhStatusDesc(0x4000, 0, 0, 1), lp.RuhStatusDesc(0x4001, 1, 0, 1)))
    p = PlacementPolicy.from_plids(st, 2, [1])
    assert p.class_pid[L.SHORT] == 0x4001 and p.default_pid == 0x4000
    p = PlacementPolicy.from_plids(st, 2)
    assert p.default_pid == 0x4000 and p.class_pid[L.LONG] == 0x4000


def test_explicit_pids_are_checked_against_ruh_status():
    st = _status_4x2()
    p = dv.placement_policy(st, 2, explicit=(0x4001, 0x4002, 3, 0x4000))
    assert p.class_pid[L.LONG] == 0x4001 and p.default_pid == 0x4000
    with pytest.raises(ConfigError, match="fdp.medium_pid=0x9"):
        dv.placement_policy(st, 2, explicit=(1, 9, 3, None))
    with pytest.raises(ConfigError, match="not both"):
        dv.placement_policy(st, 2, plids=[1], explicit=(1, 2, 3, None))
    with pytest.raises(ConfigError, match="all of"):
        dv.placement_policy(st, 2, explicit=(1, None, 3, None))
    with pytest.raises(ConfigError, match="need a device"):
        PlacementPolicy.from_explicit(None, 0, 1, 2, 3)


def test_nvme_names():
    assert dv.nvme_names("/dev/ng3n2") == ("/dev/nvme3", "/dev/nvme3n2", "/dev/ng3n2")
    assert dv.nvme_names("/dev/nvme0n1") == ("/dev/nvme0", "/dev/nvme0n1", "/dev/ng0n1")
    with pytest.raises(ConfigError):
        dv.nvme_names("/dev/sda")


# ------------------------------------------------------------------ the engine, against a fake writer
class FakeWriter:
    """Stands in for PassthroughWriter: records commands, keeps RUAMW like a device (per PID)."""

    def __init__(self, char_dev, nsid, lba_bytes, entries=64, max_transfer_bytes=None):
        self.lba_bytes = lba_bytes
        self.log: list = []
        self.ru_blocks = (1 << 20) // lba_bytes
        self.ruamw = dict(FakeWriter.initial)

    initial: dict = {}

    def write(self, buf, offset, pid):
        n = ctypes.sizeof(buf) // self.lba_bytes
        self.log.append(("write", offset, pid))
        p = 0 if pid is None else pid
        self.ruamw[p] -= n
        if self.ruamw[p] <= 0:
            self.ruamw[p] += self.ru_blocks
        return 0

    def ruh_status_bytes(self, n):
        self.log.append(("status",))
        return lp.build_ruh_status([(p, p, 0, a) for p, a in self.ruamw.items()], pad_to_bytes=n)[
            : max(n, 16)
        ]

    def ruh_update(self, pids):
        self.log.append(("update", tuple(pids)))
        for p in pids:
            self.ruamw[p] = self.ru_blocks

    def close(self):
        pass


@pytest.fixture()
def engine(monkeypatch):
    from tierstore.io.factory import open_engine as real_open

    def make(initial=None, segment=1 << 20):
        FakeWriter.initial = initial or dict.fromkeys(range(4), (1 << 20) // 512)
        monkeypatch.setattr(pt, "PassthroughWriter", FakeWriter)
        monkeypatch.setattr(dv, "open_engine", lambda kind, path, size, **k: real_open("memory", None, size))
        tab = PidTable(tuple(sorted(FakeWriter.initial)), 0)
        return dv.PassthroughEngine(
            "/dev/ng0n1",
            8 << 20,
            1,
            512,
            pid_table=tab,
            ruh_update_segment_bytes=segment,
            ru_nominal_bytes=1 << 20,
        )

    return make


def _buf(n):
    from tierstore.io.engine import alloc_aligned

    return alloc_aligned(n)


def test_engine_refuses_unlisted_pid_before_any_command(engine):
    e = engine()
    keep, buf = _buf(4096)
    with pytest.raises(ConfigError, match="0x9"):
        e.write(1 << 20, buf, 9)
    assert [c for c in e._writer.log if c[0] != "status"] == []
    assert e.stats()["bytes_written"] == 0
    e.close()
    keep.close()


def test_engine_ruh_update_on_segment_open(engine):
    e = engine()
    seen = []

    class Obs:
        def on_write(self, off, n, pl):
            seen.append(("w", off, pl))

        def on_trim(self, off, n):
            pass

        def on_ruh_update(self, pl):
            seen.append(("u", pl))

    e.add_observer(Obs())
    keep, buf = _buf(64 << 10)
    e.write(0, buf, 1).get()  # first segment, fresh RU: no update
    e.write(64 << 10, buf, 1).get()
    e.write(1 << 20, buf, 1).get()  # next segment, RU partly written: update first
    e.write(2 << 20, buf, 2).get()  # PID 2 never written: no update
    log = [c for c in e._writer.log if c[0] != "status"]
    assert log == [
        ("write", 0, 1),
        ("write", 64 << 10, 1),
        ("update", (1,)),
        ("write", 1 << 20, 1),
        ("write", 2 << 20, 2),
    ]
    assert seen == [("w", 0, 1), ("w", 64 << 10, 1), ("u", 1), ("w", 1 << 20, 1), ("w", 2 << 20, 2)]
    st = e.stats()
    assert st["ruh_updates_sent"] == 1 and st["ruh_updates_skipped"] == 2
    assert st["ruh_update_unwritten_bytes"] == (1 << 20) - (128 << 10)  # the tail the device reported
    e.close()
    keep.close()


def test_engine_updates_before_a_segments_first_write_in_any_order(engine):
    """A write pipeline may send a segment's later extents before its first: the RUH Update
    comes before whichever write reaches the new segment first, so none of the new segment's
    bytes lands in the RU of the old one (on the emulated SSD 1.8 MB per class did)."""
    e = engine()
    keep, buf = _buf(64 << 10)
    e.write(0, buf, 1).get()
    e.write(64 << 10, buf, 1).get()
    e.write((1 << 20) + (128 << 10), buf, 1).get()  # segment 1's third extent first
    e.write(1 << 20, buf, 1).get()  # then its first: no second update
    e.write((1 << 20) + (64 << 10), buf, 1).get()
    log = [c for c in e._writer.log if c[0] != "status"]
    assert log == [
        ("write", 0, 1),
        ("write", 64 << 10, 1),
        ("update", (1,)),
        ("write", (1 << 20) + (128 << 10), 1),
        ("write", 1 << 20, 1),
        ("write", (1 << 20) + (64 << 10), 1),
    ]
    assert e.stats()["ruh_updates_sent"] == 1
    e.close()
    keep.close()


def test_shim_updates_on_a_placements_first_write_into_another_segment():
    calls = []

    class Target:
        def on_write(self, off, n, pl):
            calls.append(("w", off, pl))

        def on_trim(self, off, n):
            pass

        def ruh_update(self, pl):
            calls.append(("u", pl))

    shim = dv.RuhUpdateShim(Target(), 1 << 20)
    for off, pl in [(0, 1), (0 + (1 << 21), 2), (64 << 10, 1), ((1 << 20) + (64 << 10), 1), (1 << 20, 1)]:
        shim.on_write(off, 64 << 10, pl)
    assert calls == [
        ("u", 1),
        ("w", 0, 1),
        ("u", 2),
        ("w", 1 << 21, 2),
        ("w", 64 << 10, 1),
        ("u", 1),
        ("w", (1 << 20) + (64 << 10), 1),
        ("w", 1 << 20, 1),
    ]
    assert shim.ruh_updates == 3


def test_observers_hear_of_a_write_before_the_next_update_even_if_nobody_reaped_it(engine):
    """The write pipeline reaps futures later, in another thread: an FTL model fed by an
    observer must still see every write before the RUH Update that follows it on the device."""
    e = engine()
    seen = []

    class Obs:
        def on_write(self, off, n, pl):
            seen.append(("w", off))

        def on_trim(self, off, n):
            pass

        def on_ruh_update(self, pl):
            seen.append(("u", pl))

    e.add_observer(Obs())
    keep, buf = _buf(64 << 10)
    futs = [e.write(0, buf, 1), e.write(64 << 10, buf, 1), e.write(1 << 20, buf, 1)]  # none reaped yet
    assert seen == [("w", 0), ("w", 64 << 10), ("u", 1), ("w", 1 << 20)]
    assert [f.get() for f in futs] == [64 << 10] * 3
    e.close()
    keep.close()


def test_engine_skips_update_when_device_rolled_over(engine):
    e = engine()
    keep, buf = _buf(1 << 20)
    e.write(0, buf, 3).get()  # exactly one RU: the device moves on by itself
    e.write(1 << 20, buf, 3).get()
    assert not any(c[0] == "update" for c in e._writer.log)
    assert e.stats()["ruh_updates_skipped"] == 2
    e.close()
    keep.close()


def test_engine_switches_a_handle_an_earlier_run_left_partly_written(engine):
    e = engine(initial={0: 2048, 1: 1000, 2: 2048, 3: 2048})
    keep, buf = _buf(4096)
    e.write(0, buf, 1).get()
    log = [c for c in e._writer.log if c[0] != "status"]
    assert log == [("update", (1,)), ("write", 0, 1)]
    assert e.stats()["ruh_update_unwritten_bytes"] == 1000 * 512
    e.close()
    keep.close()


# ------------------------------------------------------------------ users of the table
def test_store_config_explicit_pids_checked_on_the_model(tmp_path):
    from tierstore import KVStore
    from tierstore.layout import get_layout

    lay = get_layout("tiny")
    nv = {
        "device": "sim",
        "engine": "memory",
        "capacity_bytes": "8MiB",
        "model": {"ru_size_bytes": "256KiB", "utilization": 0.5},
    }
    with pytest.raises(ConfigError, match="fdp.long_pid=0x9"):
        KVStore.from_config(
            {
                "tiers": {
                    "nvme": {**nv, "fdp": {"enabled": True, "long_pid": 9, "medium_pid": 2, "short_pid": 3}}
                }
            },
            lay,
        )
    s = KVStore.from_config(
        {"tiers": {"nvme": {**nv, "fdp": {"enabled": True, "long_pid": 5, "medium_pid": 6, "short_pid": 7}}}},
        lay,
    )
    try:
        assert s.placement.class_pid == {L.LONG: 5, L.MEDIUM: 6, L.SHORT: 7}
    finally:
        s.close()
    with pytest.raises(ConfigError, match="cannot place writes"):
        KVStore.from_config(
            {
                "tiers": {
                    "nvme": {
                        "device": "file",
                        "path": str(tmp_path / "f"),
                        "capacity_bytes": "8MiB",
                        "fdp": {"enabled": True},
                    }
                }
            },
            lay,
        )


def test_plain_job_plids_index_the_model_ruh_status(tmp_path, capsys):
    from tierstore.bench.cli import main

    out = tmp_path / "o.json"
    rc = main(
        [
            "--rw=write",
            "--device=sim",
            "--dataplacement=fdp",
            "--plids=0,7",
            "--bs=64k",
            "--size=1m",
            "--output-format=json",
            f"--output={out}",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    import json

    dev = json.loads(out.read_text())["jobs"][0]["device"]
    assert set(dev["ruh_host_bytes"]) == {"0", "7"}
    rc = main(
        [
            "--rw=write",
            "--device=sim",
            "--dataplacement=fdp",
            "--plids=0,9",
            "--bs=64k",
            "--size=1m",
            "--output-format=json",
            f"--output={tmp_path / 'p.json'}",
        ]
    )
    assert rc != 0 and "index 9 must be smaller than 8" in capsys.readouterr().err


def test_daemon_config_explicit_pid_checked_at_start(tmp_path):
    from tierstore.server.config import parse_config
    from tierstore.server.service import Service

    cfg = parse_config(
        {
            "state_dir": str(tmp_path / "s"),
            "layout": {"preset": "tiny"},
            "tiers": {
                "host": {"capacity_bytes": "1MiB"},
                "nvme": {
                    "device": "sim",
                    "engine": "memory",
                    "capacity_bytes": "8MiB",
                    "model": {"ru_size_bytes": "256KiB", "utilization": 0.5},
                    "fdp": {"enabled": True, "long_pid": 0x77, "medium_pid": 2, "short_pid": 3},
                },
            },
            "tenants": [{"name": "t", "tokens": ["0123456789abcdef0"]}],
        }
    )
    with pytest.raises(ConfigError, match="0x77"):
        Service(cfg)


# ------------------------------------------------------------------ tierstore fdp
class _FakeCli:
    """The nvme-cli driver as the QEMU 4x2 captures answer it."""

    def __init__(self):
        self.hbmw = 512

    def stats(self, dev, endgid):
        return lp.FdpStats(self.hbmw, self.hbmw + 4096, 0)

    def usage(self, dev, endgid):
        with open(os.path.join(G.DATA, "qemu_4x2", "usage.bin"), "rb") as f:
            return lp.parse_ruh_usage(f.read())


@pytest.fixture()
def fake_ns(monkeypatch):
    from tierstore.fdp import admin, discovery
    from tierstore.fdp.nvme_cli import FdpDeviceInfo

    with open(os.path.join(G.DATA, "qemu_4x2", "configs.bin"), "rb") as f:
        cfg = lp.parse_fdp_configs(f.read()).configs[0]
    with open(os.path.join(G.DATA, "qemu_4x2", "id_ns.bin"), "rb") as f:
        idns = lp.parse_id_ns(f.read())
    info = FdpDeviceInfo("/dev/nvme0", True, True, 0, cfg, _status_4x2())
    ns = discovery.FdpNamespace(
        "/dev/ng0n1", "/dev/nvme0n1", "/dev/nvme0", 1, 1, idns, 524288, "fdpvm0001", info
    )
    monkeypatch.setattr(discovery, "discover_namespace", lambda dev, endgid=1, cli=None: ns)
    return admin, _FakeCli()


def test_fdp_discover_report(fake_ns):
    admin, _ = fake_ns
    r = admin.discover_report("/dev/ng0n1", plids=[3, 5, 7])
    assert r["config"]["nrg"] == 2 and r["config"]["ruh_types"] == ["Initially Isolated"] * 4
    assert [s["pid"] for s in r["ruh_status"]] == [0, 0x4000, 1, 0x4001, 2, 0x4002, 3, 0x4003]
    assert {c["class"]: (c["pid"], c["plid"]) for c in r["placement"]["classes"]} == {
        "default": (0x4000, 1),
        "long": (0x4001, 3),
        "medium": (0x4002, 5),
        "short": (0x4003, 7),
    }


def test_fdp_discover_says_which_eviction_mode_and_why(fake_ns, monkeypatch, capsys):
    """Issue 26 item 4: discover names the eviction granularity the device gets by default, and the
    store's default is that mode (the config and discover cannot disagree)."""
    from tierstore.config import NvmeTierConfig
    from tierstore.fdp import discovery

    admin, _ = fake_ns
    r = admin.discover_report("/dev/ng0n1")
    assert (r["eviction_granularity"], r["eviction_why"]) == discovery.default_eviction(True)
    assert r["eviction_granularity"] == NvmeTierConfig.model_fields["eviction_granularity"].default
    assert "README_frontier.md" in r["eviction_why"] and "flat LRU" in r["eviction_why"]
    admin._print_discover(r)
    assert f"eviction on this device by default: {r['eviction_granularity']}" in capsys.readouterr().out
    ns = discovery.discover_namespace("/dev/ng0n1")  # the same namespace with FDP off: a conventional device
    off = dataclasses.replace(ns, info=dataclasses.replace(ns.info, fdp_enabled=False))
    monkeypatch.setattr(discovery, "discover_namespace", lambda dev, endgid=1, cli=None: off)
    r = admin.discover_report("/dev/ng0n1")
    assert (r["eviction_granularity"], r["eviction_why"]) == discovery.default_eviction(False)
    assert (
        r["eviction_granularity"] == NvmeTierConfig.model_fields["eviction_granularity"].default
        and "config" not in r
    )
    admin._print_discover(r)
    out = capsys.readouterr().out
    assert "NOT enabled" in out and "conventional device keeps region" in out


def test_fdp_stats_baseline(fake_ns, tmp_path, capsys):
    admin, cli = fake_ns
    base = str(tmp_path / "b.json")
    r = admin.stats_report("/dev/ng0n1", baseline=base, cli=cli)
    assert r["since_baseline"] is None and r["waf"] == (512 + 4096) / 512
    admin.stats_report("/dev/ng0n1", baseline=base, save_baseline=True, cli=cli)
    cli.hbmw += 1 << 20
    r = admin.stats_report("/dev/ng0n1", baseline=base, cli=cli)
    assert r["since_baseline"] == {"hbmw_bytes": 1 << 20, "mbmw_bytes": 1 << 20, "mbe_bytes": 0, "waf": 1.0}
    row = next(u for u in r["ruh_usage"] if u["pid"] == 1)
    assert (row["class"], row["ruha"], row["ru_written_bytes"]) == ("long", "host specified", 0)
    cli.hbmw = 0  # counters below the baseline: another device, or reset
    r = admin.stats_report("/dev/ng0n1", baseline=base, cli=cli)
    assert r["since_baseline"] is None and "below the baseline" in r["baseline_error"]
    admin._print_stats(admin.stats_report("/dev/ng0n1", baseline=base, cli=_FakeCli()))
    out = capsys.readouterr().out
    assert "Host Bytes with Metadata Written (HBMW)" in out and "0x4003" in out


def test_fdp_cli_usage_errors(capsys, tmp_path):
    from tierstore.cli import main

    assert main(["fdp", "discover", "/dev/null"]) == 1
    assert "expected an NVMe namespace device" in capsys.readouterr().err
    # a missing path and a regular file said the same (trial 4a): each is named now
    assert main(["fdp", "discover", str(tmp_path / "missing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "tier").write_bytes(b"x")
    assert main(["fdp", "discover", str(tmp_path / "tier")]) == 1
    assert "not a device" in capsys.readouterr().err
    assert main(["fdp", "discover", "/dev/ng9n1", "--plids=a"]) == 2


def test_a_link_to_another_device_names_what_it_was_given(tmp_path):
    """`fdp discover ./ng9n1` (a link to /dev/null) said `./nvme9: no such device`, a path the user
    never gave (trial 5a): the message names the given path and the one that is missing."""
    from tierstore.fdp import discovery

    link = tmp_path / "ng9n1"
    link.symlink_to("/dev/null")
    with pytest.raises(ConfigError) as e:
        discovery.discover_namespace(str(link))
    said = str(e.value)
    assert said.startswith(f"{link}:") and "does not exist" in said and "nvme9" in said
