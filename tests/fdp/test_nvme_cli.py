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

FAKE = r'''#!{python}
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
if args[:1] == ["fdp"]:
    sub = args[1]
    if sub != "status" and ("-e" not in args or args[args.index("-e") + 1] == "0"):
        sys.stderr.write("endurance group identifier required\n"); sys.exit(22)
    if "-b" not in args:
        sys.stderr.write("fake nvme: only -b\n"); sys.exit(1)
    out({{"configs": "fdp_configs.bin", "usage": "ruh_usage.bin", "stats": "fdp_stats.bin",
          "events": "fdp_events.bin", "status": "ruh_status.bin"}}[sub])
sys.stderr.write("fake nvme: unsupported " + " ".join(args) + "\n"); sys.exit(1)
'''


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
    assert lines[3] == "fdp status /dev/nvme0n1 -b"
    assert not cli.fdp_supported("/dev/nvme1")


def test_logs_via_sh(fake_nvme):
    cli, _ = fake_nvme
    assert cli.usage("/dev/nvme0", 1).ruha == (1, 1, 2, 0)
    assert cli.events("/dev/nvme0", 1, host_events=True).n == 2
    st = cli.stats("/dev/nvme0", 1)
    assert st.hbmw_bytes == G.HBMW
    w = WafWindow(nc.FdpDeviceStats("/dev/nvme0", 1, cli))
    w.start(); w.stop()
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
    assert nc.NvmeCli.enable_fdp_args("/dev/nvme0", 1, 2) == \
        ["set-feature", "/dev/nvme0", "-f", "0x1d", "-v", "1", "-c", "0x201", "-s"]
    with pytest.raises(ConfigError):
        nc.NvmeCli.enable_fdp_args("/dev/nvme0", 0)


def _t(name: str) -> str:
    with open(os.path.join(G.DATA, name)) as f:
        return f.read()


def test_json_and_text_variants():
    assert nc.parse_stats_json(_t("fdp_stats.json")).mbmw_bytes == G.MBMW        # uint128 as string
    assert nc.parse_stats_json(_t("fdp_stats_numbers.json")).mbmw_bytes == 1500  # plain numbers
    assert nc.parse_stats_text(_t("fdp_stats.txt")).hbmw_bytes == G.HBMW          # l10n separators
    st = nc.parse_ruh_status_json(_t("fdp_status.json"))
    assert [d.pid for d in st.descs] == [0, 1, 2, 3]
    cfg = nc.parse_configs_json(_t("fdp_configs.json")).configs[0]
    assert cfg.rgif == 2 and cfg.ruhs == () and cfg.maxpids == 3                   # 2.x omits ruhs/maxpids
    assert nc.parse_usage_json(_t("fdp_usage.json")).ruha == (1, 1, 2, 0)
    ev = nc.parse_events_json(_t("fdp_events.json")).events[0]
    assert (ev.type, ev.nlbam, ev.lba) == (0x80, 16, 0x12345678)
    assert nc.parse_feature_value(_t("get_feature_fdp_off.txt")) == 0x100
    with pytest.raises(CorruptData):
        nc.parse_stats_json('{"hbmw": "12x", "mbmw": 1, "mbe": 1}')
    with pytest.raises(CorruptData):
        nc.parse_stats_text("nothing here")
