"""nvme-cli driving through `sh`, with a fake `nvme` executable that prints fixture bytes."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from tests.fdp import gen_fixtures as G
from tierstore.errors import ConfigError, CorruptData
from tierstore.fdp import nvme_cli as nc
from tierstore.fdp.waf import WafWindow

FAKE = r"""#!{python}
import os, sys
data = {data!r}
args = sys.argv[1:]
with open(os.path.join({log!r}), "a") as f:
    f.write(" ".join(args) + "\n")
def out(name):
    sys.stdout.buffer.write(open(os.path.join(data, name), "rb").read()); sys.exit(0)
if args[:1] == ["id-ctrl"]:
    out("id_ctrl_fdp.bin" if "nvme0" in args[1] else "id_ctrl_nofdp.bin")
if args[:1] == ["get-feature"]:
    out("get_feature_fdp_on.txt")
if args[:1] == ["id-ns"]:
    out("qemu_4x2/id_ns.bin")
if args[:1] == ["io-mgmt-recv"]:
    # nvme-cli 2.3: "Success" line, then d()'s hex dump of exactly -l bytes
    n = int(args[args.index("-l") + 1])
    raw = open(os.path.join(data, os.environ.get("FAKE_RUHS", "ruh_status.bin")), "rb").read()
    raw = (raw + bytes(n))[:n]
    if os.environ.get("FAKE_SHORT_DUMP"):
        raw = raw[:int(os.environ["FAKE_SHORT_DUMP"])]
    print("io-mgmt-recv: Success, mos:0 mo:1 nsid:1")
    print("       " + "  ".join("%x" % i for i in range(16)))
    for i in range(0, len(raw), 16):
        row = raw[i:i + 16]
        print("%04x: %s \"%s\"" % (i, " ".join("%02x" % b for b in row),
                                  "".join(chr(b) if 32 <= b < 127 else "." for b in row)))
    sys.exit(0)
if args[:1] == ["fdp"]:
    sub = args[1]
    if sub != "status" and ("-e" not in args or args[args.index("-e") + 1] == "0"):
        sys.stderr.write("endurance group identifier required\n"); sys.exit(22)
    if "-b" not in args:
        sys.stderr.write("fake nvme: only -b\n"); sys.exit(1)
    out({{"configs": "fdp_configs.bin", "usage": "ruh_usage.bin", "stats": "fdp_stats.bin",
          "events": "fdp_events.bin", "status": "ruh_status.bin"}}[sub])
sys.stderr.write("fake nvme: unsupported " + " ".join(args) + "\n"); sys.exit(1)
"""


@pytest.fixture()
def fake_nvme(tmp_path, monkeypatch):
    log = tmp_path / "argv.log"
    exe = tmp_path / "bin" / "nvme"
    exe.parent.mkdir()
    exe.write_text(FAKE.format(python=sys.executable, data=G.DATA, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    return nc.NvmeCli("nvme"), log


def test_discovery_via_sh(fake_nvme):
    cli, log = fake_nvme
    info = cli.discover("/dev/nvme0", "/dev/nvme0n1", endgid=1)
    assert info.fdp_supported and info.fdp_enabled and info.config_index == 0
    assert info.config.rgif == 2 and info.ruh_status.nruhsd == 4
    lines = log.read_text().splitlines()
    assert lines[0] == "id-ctrl /dev/nvme0 -b"
    assert lines[1] == "get-feature /dev/nvme0 -f 0x1d -c 1"
    assert lines[2] == "fdp configs /dev/nvme0 -e 1 -b"
    # RUH Status with an explicit length: room for nrg x nruh descriptors of the active config
    cfg = info.config
    assert lines[3] == f"io-mgmt-recv /dev/nvme0n1 -n 1 -m 1 -l {16 + 32 * cfg.nrg * cfg.nruh}"
    assert not any(line.startswith("fdp status") for line in lines)
    assert not cli.fdp_supported("/dev/nvme1")


def test_logs_via_sh(fake_nvme):
    cli, _ = fake_nvme
    assert cli.usage("/dev/nvme0", 1).ruha == (1, 1, 2, 0)
    assert cli.events("/dev/nvme0", 1, host_events=True).n == 2
    st = cli.stats("/dev/nvme0", 1)
    assert st.hbmw_bytes == G.HBMW
    w = WafWindow(nc.FdpDeviceStats("/dev/nvme0", 1, cli))
    w.start()
    w.stop()
    assert w.host_bytes == 0


def test_endgid_zero_is_config_error(fake_nvme):
    cli, _ = fake_nvme
    for f in (cli.configs, cli.usage, cli.stats, cli.events):
        with pytest.raises(ConfigError):
            f("/dev/nvme0", 0)
    with pytest.raises(ConfigError):
        nc.FdpDeviceStats("/dev/nvme0", 0)


def test_failure_is_nvmecli_error(fake_nvme):
    cli, _ = fake_nvme
    with pytest.raises(nc.NvmeCliError, match="unsupported"):
        cli.run(["smart-log", "/dev/nvme0"])
    with pytest.raises(nc.NvmeCliError):
        nc.NvmeCli("/nonexistent/nvme").run(["version"])


def test_enable_args():
    assert nc.NvmeCli.enable_fdp_args("/dev/nvme0", 1, 2) == [
        "set-feature",
        "/dev/nvme0",
        "-f",
        "0x1d",
        "-v",
        "1",
        "-c",
        "0x201",
        "-s",
    ]
    with pytest.raises(ConfigError):
        nc.NvmeCli.enable_fdp_args("/dev/nvme0", 0)


def _t(name: str) -> str:
    with open(os.path.join(G.DATA, name)) as f:
        return f.read()


def test_json_and_text_variants():
    assert nc.parse_stats_json(_t("fdp_stats.json")).mbmw_bytes == G.MBMW  # uint128 as string
    assert nc.parse_stats_json(_t("fdp_stats_numbers.json")).mbmw_bytes == 1500  # plain numbers
    assert nc.parse_stats_text(_t("fdp_stats.txt")).hbmw_bytes == G.HBMW  # l10n separators
    st = nc.parse_ruh_status_json(_t("fdp_status.json"))
    assert [d.pid for d in st.descs] == [0, 1, 2, 3]
    cfg = nc.parse_configs_json(_t("fdp_configs.json")).configs[0]
    assert cfg.rgif == 2 and cfg.ruhs == () and cfg.maxpids == 3  # 2.x omits ruhs/maxpids
    assert nc.parse_usage_json(_t("fdp_usage.json")).ruha == (1, 1, 2, 0)
    ev = nc.parse_events_json(_t("fdp_events.json")).events[0]
    assert (ev.type, ev.nlbam, ev.lba) == (0x80, 16, 0x12345678)
    assert nc.parse_feature_value(_t("get_feature_fdp_off.txt")) == 0x100
    with pytest.raises(CorruptData):
        nc.parse_stats_json('{"hbmw": "12x", "mbmw": 1, "mbe": 1}')
    with pytest.raises(CorruptData):
        nc.parse_stats_text("nothing here")


QEMU = os.path.join(G.DATA, "qemu_4x2")


def _b(name: str) -> bytes:
    with open(os.path.join(QEMU, name), "rb") as f:
        return f.read()


def test_qemu_captures_parse():
    """Bytes captured from QEMU's emulated FDP namespace (4 RUHs x 2 reclaim groups, 8 MiB RUs)."""
    from tierstore.fdp import logpages as lp

    cfg = lp.parse_fdp_configs(_b("configs.bin")).configs[0]
    assert (cfg.nrg, cfg.nruh, cfg.runs_bytes, cfg.rgif, cfg.valid) == (2, 4, 8 << 20, 2, True)
    assert [r.ruht for r in cfg.ruhs] == [lp.RUHT_INITIALLY_ISOLATED] * 4
    ns = lp.parse_id_ns(_b("id_ns.bin"))
    assert (ns.lba_bytes, ns.size_bytes) == (512, 1 << 30)
    assert lp.serial_from_id_ctrl(_b("id_ctrl.bin")) == "fdpvm0001"
    assert lp.fdp_supported(lp.ctratt_from_id_ctrl(_b("id_ctrl.bin")))
    assert lp.parse_ruh_usage(_b("usage.bin")).ruha == (1, 1, 1, 1)
    assert lp.parse_fdp_stats(_b("stats_after_512.bin")).as_dict() == {
        "hbmw_bytes": 512,
        "mbmw_bytes": 512,
        "mbe_bytes": 0,
    }
    st = lp.parse_ruh_status(_b("ruh_status_l4096.bin"))
    assert [d.pid for d in st.descs] == [0, 0x4000, 1, 0x4001, 2, 0x4002, 3, 0x4003]
    assert {d.ruamw_blocks for d in st.descs} == {(8 << 20) // 512}


def test_nvme_cli_23_fdp_status_is_short_and_refused():
    """`nvme fdp status -b` of nvme-cli 2.3 returns 16 bytes less than its descriptor count needs."""
    from tierstore.fdp import logpages as lp

    raw = _b("fdp_status_nvme_cli_2.3.bin")
    assert len(raw) == 256 and int.from_bytes(raw[14:16], "little") == 8
    with pytest.raises(CorruptData, match="need 272 bytes, buffer has 256"):
        lp.parse_ruh_status(raw)
    with pytest.raises(CorruptData, match="need 272 bytes, buffer has 100"):
        lp.parse_ruh_status(_b("ruh_status_l100.bin"))


def test_hex_dump_of_nvme_cli_23():
    with open(os.path.join(QEMU, "io_mgmt_recv_l4096.txt")) as f:
        text = f.read()
    assert nc.parse_hex_dump(text, 4096) == _b("ruh_status_l4096.bin")
    with pytest.raises(CorruptData, match="expected 4000"):
        nc.parse_hex_dump(text, 4000)
    with pytest.raises(CorruptData):
        nc.parse_hex_dump("io-mgmt-recv: Success, mos:0 mo:1 nsid:1\n")


def test_ruh_status_reads_explicit_length(fake_nvme, monkeypatch):
    cli, log = fake_nvme
    monkeypatch.setenv("FAKE_RUHS", "qemu_4x2/ruh_status_l4096.bin")
    st = cli.ruh_status("/dev/ng0n1", 1, max_descs=8)
    assert st.nruhsd == 8 and st.descs[7].pid == 0x4003
    assert log.read_text().splitlines()[-1] == "io-mgmt-recv /dev/ng0n1 -n 1 -m 1 -l 272"
    # a first guess too small for the header's count: read again with exactly that length
    st = cli.ruh_status("/dev/ng0n1", 1, max_descs=2)
    assert st.nruhsd == 8
    assert log.read_text().splitlines()[-2:] == [
        "io-mgmt-recv /dev/ng0n1 -n 1 -m 1 -l 80",
        "io-mgmt-recv /dev/ng0n1 -n 1 -m 1 -l 272",
    ]


def test_ruh_status_truly_short_transfer_refused(fake_nvme, monkeypatch):
    cli, _ = fake_nvme
    monkeypatch.setenv("FAKE_RUHS", "qemu_4x2/ruh_status_l4096.bin")
    monkeypatch.setenv("FAKE_SHORT_DUMP", "100")
    with pytest.raises(CorruptData, match="hex dump has 100 bytes, expected 272"):
        cli.ruh_status("/dev/ng0n1", 1, max_descs=8)


def test_id_ns_via_sh(fake_nvme):
    cli, log = fake_nvme
    assert cli.id_ns("/dev/ng0n1", 1).lba_bytes == 512
    assert log.read_text().splitlines()[-1] == "id-ns /dev/ng0n1 -n 1 -b"
