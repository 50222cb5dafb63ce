"""The FDP device path, end to end, on QEMU's emulated FDP SSD (``../shared/tools/fdp-vm/run``).

One guest boot per emulator configuration per session (the ``vm`` fixture); the guest runs
``tests/fdp/vm_checks.py`` once, which records what the *device* reported (log pages and RUH Status
read through nvme-cli) next to what tierstore did, and the tests below assert on that record.

Run with ``python -m pytest -q -m fdp tests/fdp`` (or ``nox -s fdp``). Skipped where the tool is
absent (no ``../shared``), and unless selected with ``-m fdp`` or ``TIERSTORE_FDP_VM=1``: a boot
costs ~40 s and Python under TCG is slow, so the plain test run does not pay for it.

This is QEMU's emulation (``hw/nvme``), not an SSD: it models no garbage collection, so MBMW
exceeds HBMW only by the unwritten tails of RUs switched by RUH Update, and MBE stays 0.
"""

from __future__ import annotations

import os
import warnings

import pytest

from tests.fdp import vm_checks, vmenv

#: A boot that hangs is booted again (vmenv.boot): the first test waits for up to two boots.
pytestmark = [pytest.mark.fdp, pytest.mark.timeout(1500)]

LBA = 512  # the emulated namespace's logical block size (Identify Namespace, checked below)
RUNS = 8 << 20  # --ru-size 8M
SIZE = 1 << 30  # --size 1G

#: The two emulator configurations and what each boot runs (the 4x2 boot skips the phases whose
#: subject does not depend on the geometry, to keep the group inside its CI budget).
CONFIGS = {
    "8ruh-1rg": {"nruh": 8, "nrg": 1, "driver": ["--fio-plids", "1,3,6"]},
    "4ruh-2rg": {
        "nruh": 4,
        "nrg": 2,
        "driver": [
            "--fio-plids",
            "1,3,6",
            "--kv-plids",
            "3,5,7",
            "--phases",
            "discovery,imports,kvtrace,plids_vs_fio",
        ],
    },
}


def _selected(config) -> bool:
    return "fdp" in (config.getoption("-m") or "") or bool(os.environ.get("TIERSTORE_FDP_VM"))


#: One boot per configuration, all started together on first use (each guest is mostly one
#: single-threaded Python under TCG, so two boots side by side take about the wall time of one
#: on a 2-core host: the group's CI budget is 5 minutes).
_BOOTS: dict = {}


def _boot_all() -> dict:
    if not _BOOTS:
        from concurrent.futures import ThreadPoolExecutor

        fio, why = vmenv.fio_with_fdp()
        vmenv.python_image()  # built (or found) once, before the boots share it
        pool = ThreadPoolExecutor(max_workers=len(CONFIGS), thread_name_prefix="fdp-vm")
        for name, c in CONFIGS.items():
            args = list(c["driver"]) + (["--fio", fio] if fio else [])
            _BOOTS[name] = (pool.submit(vmenv.run_config, name, c["nruh"], c["nrg"], "8M", "1G", args), why)
        pool.shutdown(wait=False)
    return _BOOTS


def _phases_of(name: str) -> tuple[str, ...]:
    driver = CONFIGS[name]["driver"]
    return (
        tuple(driver[driver.index("--phases") + 1].split(",")) if "--phases" in driver else vm_checks.PHASES
    )


def pytest_generate_tests(metafunc):
    """Each test runs on the configurations whose guest runs its phase (``@pytest.mark.phase``):
    a phase a configuration does not plan is no test there, rather than a skip."""
    if "vm" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("phase")
    if mark is None:
        raise pytest.UsageError(f"{metafunc.function.__name__} uses vm: mark it @pytest.mark.phase(NAME)")
    names = [n for n in CONFIGS if mark.args[0] in _phases_of(n)]
    metafunc.parametrize("vm", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def vm(request):
    if vmenv.tool_path() is None:
        pytest.skip(
            f"the FDP VM tool is absent ({vmenv.TOOL} not found: ../shared is not next to this checkout)"
        )
    if not _selected(request.config):
        pytest.skip(
            "boots an emulated FDP SSD (QEMU, minutes under TCG): run with `-m fdp` or TIERSTORE_FDP_VM=1"
        )
    fut, _why = _boot_all()[request.param]
    res = fut.result()
    res["_name"] = request.param
    res["_fio_why"] = _why
    if not res.get("config"):
        pytest.fail(
            f"the guest produced no results (rc {res['_vm']['rc']}):\n{res['_vm']['tool_output']}\n"
            f"{res['_vm']['driver_log']}"
        )
    return res


def _phase(vm, name):
    if name in vm["errors"]:
        pytest.fail(f"{vm['_name']}: phase {name} raised in the guest:\n{vm['errors'][name]}")
    if name not in vm:
        planned = vm.get("config", {}).get("phases", "").split(",")
        if name in planned:  # the guest meant to run it and stopped first: never a silent skip
            pytest.fail(
                f"{vm['_name']}: the guest stopped before phase {name} (rc {vm['_vm']['rc']}, "
                f"{vm['_vm']['wall_s']} s):\n{vm['_vm']['tool_output'][-2000:]}\n"
                f"driver.log:\n{vm['_vm']['driver_log'][-3000:]}"
            )
        pytest.fail(f"{vm['_name']}: phase {name} is not planned here: mark the test @pytest.mark.phase")
    return vm[name]


def _pid(rg: int, ph: int, rgif: int) -> int:
    return (rg << (16 - rgif)) | ph if rgif else ph


# ------------------------------------------------------------------ discovery
@pytest.mark.phase("discovery")
def test_discovery_matches_the_emulator_configuration(vm):
    d = _phase(vm, "discovery")
    cfg = vm["config"]
    rep = d["report"]
    assert rep["fdp_supported"] and rep["fdp_enabled"] and rep["config_index"] == 0
    assert (rep["lba_bytes"], rep["size_bytes"], rep["nsid"]) == (LBA, SIZE, 1)
    c = rep["config"]
    assert (c["nrg"], c["nruh"], c["runs_bytes"]) == (cfg["nrg"], cfg["nruh"], RUNS)
    assert c["ruh_types"] == ["Initially Isolated"] * cfg["nruh"]
    rgif = c["rgif"]
    assert (1 << rgif) >= cfg["nrg"]
    # RUH Status: one entry per (placement handle, reclaim group), every RU fresh at boot
    st = rep["ruh_status"]
    assert len(st) == cfg["nruh"] * cfg["nrg"]
    assert sorted(s["pid"] for s in st) == sorted(
        _pid(g, h, rgif) for g in range(cfg["nrg"]) for h in range(cfg["nruh"])
    )
    for s in st:
        assert (s["reclaim_group"], s["placement_handle"]) == (
            (s["pid"] >> (16 - rgif)) if rgif else 0,
            s["pid"] & ((1 << (16 - rgif)) - 1),
        )
        assert s["ruamw_bytes"] == RUNS and s["ruhid"] == s["placement_handle"]
    assert [s["plid"] for s in st] == list(range(len(st)))
    # the four log pages read independently (nvme get-log) say the same
    raw = d["raw"]
    assert (raw["nrg"], raw["nruh"], raw["runs_bytes"], raw["rgif"], raw["valid"]) == (
        cfg["nrg"],
        cfg["nruh"],
        RUNS,
        rgif,
        True,
    )
    assert raw["ruht"] == [1] * cfg["nruh"] and raw["numfdpc"] == 1
    assert raw["ruha"] == [1] * cfg["nruh"]  # log 21h: host specified
    assert raw["stats"] == {"hbmw_bytes": 0, "mbmw_bytes": 0, "mbe_bytes": 0}  # log 22h at boot
    assert raw["host_events"] == 0  # log 23h
    # tierstore's PIDs per class: handles 1, 2, 3 of the first entry's reclaim group, default handle 0
    classes = {r["class"]: r["pid"] for r in rep["placement"]["classes"]}
    assert classes == {"default": 0, "long": 1, "medium": 2, "short": 3}
    assert d["discover_json_rc"] == 0, d["discover_err"]
    assert "Reclaim Unit Nominal Size: 8388608 bytes" in d["discover_text"]


@pytest.mark.phase("discovery")
def test_nvme_cli_23_fdp_status_is_short_so_we_do_not_use_it(vm):
    d = _phase(vm, "discovery")
    n = vm["config"]["nruh"] * vm["config"]["nrg"]
    assert d["fdp_status_cli_bytes"] == 32 * n  # 16 bytes short of 16 + 32 n: nvme-cli 2.3's bug
    assert len(d["report"]["ruh_status"]) == n  # io-mgmt-recv with an explicit length has them all


# ------------------------------------------------------------------ kvtrace
@pytest.mark.phase("kvtrace")
def test_kvtrace_puts_each_class_into_its_own_handle(vm):
    k = _phase(vm, "kvtrace")
    assert k["rc"] == 0, k["stderr"]
    placement = {r["class"]: r["pid"] for r in k["placement"]["classes"]}
    before, after = k["before"], k["after"]
    cls_pids = {placement[c] for c in ("long", "medium", "short")}
    # the device's own view: the RU each class PID's handle has open took RUNS - RUAMW x LBA bytes.
    # That is all the class wrote: each class wrote less than one RU (8 MiB), and its first segment
    # started a fresh RU (a RUH Update where an earlier phase had left the RU partly written).
    dev = {pid: RUNS - after["ruamw"][str(pid)] * LBA for pid in cls_pids}
    ours = {int(p): b for p, b in k["device"]["bytes_by_pid"].items() if p != "none"}
    assert "none" not in k["device"]["bytes_by_pid"]  # every write carried a PID
    for cls in ("long", "medium", "short"):
        pid = placement[cls]
        assert ours.get(pid, 0) > 0, f"no {cls} bytes in this trace: {ours}"
        assert dev[pid] == ours[pid], f"{cls} (PID {pid:#x}): device {dev[pid]} vs sent {ours[pid]}"
    # nothing else moved: no other handle took a byte but the default one, which takes the tier's
    # metadata (the label, a format's zeroed chain starts: PlacementPolicy.placement_for_metadata);
    # a block sent with a wrong PID would be missing from its class's RU above
    meta = placement["default"]
    assert {int(p) for p in after["ruamw"] if after["ruamw"][p] != before["ruamw"][p]} <= cls_pids | {meta}
    assert cls_pids <= set(ours) <= cls_pids | {meta}
    if meta not in cls_pids:
        assert ours.get(meta, 0) >= 4096 and ours[meta] % 4096 == 0  # at least the label (io/label.py)
    dh = after["stats"]["hbmw_bytes"] - before["stats"]["hbmw_bytes"]
    assert dh == sum(ours.values()) == k["device"]["engine_write_bytes"]
    if vm["config"]["nrg"] > 1:  # plids=3,5,7 on 4 RUHs x 2 groups: group 1's PIDs
        rgif = _phase(vm, "discovery")["report"]["config"]["rgif"]
        assert [placement[c] for c in ("long", "medium", "short")] == [
            _pid(1, 1, rgif),
            _pid(1, 2, rgif),
            _pid(1, 3, rgif),
        ]


@pytest.mark.phase("kvtrace")
def test_hbmw_equals_the_bytes_we_wrote_metadata_included(vm):
    k = _phase(vm, "kvtrace")
    d = k["device"]
    dh = k["after"]["stats"]["hbmw_bytes"] - k["before"]["stats"]["hbmw_bytes"]
    # engine bytes = extent headers + blocks + padding: more than the blocks alone
    assert dh == d["engine_write_bytes"] > d["tier_write_bytes"]
    if "ruh_update" in vm:
        r = _phase(vm, "ruh_update")
        assert (
            r["after"]["stats"]["hbmw_bytes"] - r["before"]["stats"]["hbmw_bytes"]
            == r["engine"]["bytes_written"]
        ), (r["engine"], _not_ok(r), vm["_vm"]["dmesg"])


# ------------------------------------------------------------------ RUH Update
def _not_ok(r: dict) -> dict:
    return {k: [s for s in st if s != "ok"] for k, st in r["statuses"].items() if set(st) != {"ok"}}


@pytest.mark.phase("ruh_update")
def test_a_rerun_ruh_update_phase_had_only_host_side_write_errors(vm):
    """The guest reruns the phase once when writes failed host-side (vm_checks.ruh_update): only
    then, and the failed run's blocks were io_error (a miss, never a wrong 'ok') with the engine
    counting the failed writes; its kernel log and warnings are shown, and the rerun is checked in
    full by the tests below."""
    r = _phase(vm, "ruh_update")
    for a in r.get("failed_attempts", []):
        bad = {s for st in _not_ok(a).values() for s in st}
        assert bad == {"io_error"} and a["engine"]["write_errors"] > 0, (bad, a["engine"])
        warnings.warn(
            f"{vm['_name']}: ruh_update ran twice: the first run's writes failed host-side "
            f"({a['engine']['write_errors']} write errors; {_not_ok(a)})\nwarnings: {a['warnings']}\n"
            f"guest kernel log:\n{a['dmesg']}",
            stacklevel=1,
        )


@pytest.mark.phase("ruh_update")
def test_ruh_update_on_segment_open_shows_in_mbmw_and_the_model_predicts_it(vm):
    r = _phase(vm, "ruh_update")
    assert not _not_ok(r), (_not_ok(r), r["engine"], vm["_vm"]["driver_log"][-2000:])
    e, m = r["engine"], r["model"]
    assert e["ruh_updates_sent"] >= 3  # one per class at least: each filled a segment
    b, a = r["before"]["stats"], r["after"]["stats"]
    dev_extra = (a["mbmw_bytes"] - b["mbmw_bytes"]) - (a["hbmw_bytes"] - b["hbmw_bytes"])
    assert dev_extra > 0
    # the device's tails (RUAMW x LBA just before each update) add up to its MBMW - HBMW ...
    assert dev_extra == e["ruh_update_unwritten_bytes"]
    assert m["ruh_updates"] == e["ruh_updates_sent"]
    assert m["hbmw_bytes"] == e["bytes_written"] == a["hbmw_bytes"] - b["hbmw_bytes"]


@pytest.mark.phase("ruh_update")
def test_the_ftl_model_predicts_the_devices_ruh_update_tails_within_1_percent(vm):
    """Fed the same writes and updates, in device order (PassthroughEngine resolves each write's
    future before returning, so an observer hears of it before the next RUH Update; reaped later,
    the model once put 1.8 MB of each RU after its update: tail 2,093,056 vs 253,952 bytes)."""
    r = _phase(vm, "ruh_update")
    b, a = r["before"]["stats"], r["after"]["stats"]
    dev_extra = (a["mbmw_bytes"] - b["mbmw_bytes"]) - (a["hbmw_bytes"] - b["hbmw_bytes"])
    m = r["model"]
    assert abs(m["ruh_update_unwritten_bytes"] - dev_extra) <= 0.01 * dev_extra, (m, dev_extra)


# ------------------------------------------------------------------ PID validation
@pytest.mark.phase("invalid_pid")
def test_an_invalid_pid_from_configuration_is_refused_before_any_write(vm):
    v = _phase(vm, "invalid_pid")
    assert v["store"].startswith("ConfigError") and "0x77" in v["store"]
    assert v["engine"].startswith("ConfigError") and "0x77" in v["engine"]
    assert v["bench_rc"] != 0 and "must be smaller than" in v["bench_err"]
    assert v["daemon_exit"]["exit"] not in (0, None), v["daemon_log"]
    assert "0x77" in v["daemon_log"]
    assert v["after"] == v["before"]  # not a byte reached the device, RUH state unchanged


@pytest.mark.phase("discovery")
def test_every_pid_we_send_is_listed_by_ruh_status(vm):
    listed = {s["pid"] for s in _phase(vm, "discovery")["report"]["ruh_status"]}
    k = _phase(vm, "kvtrace")
    assert {int(p) for p in k["device"]["bytes_by_pid"]} <= listed
    if "ruh_update" in vm:
        assert {int(p) for p in _phase(vm, "ruh_update")["bytes_by_placement"]} <= listed


# ------------------------------------------------------------------ daemon
@pytest.mark.phase("daemon")
def test_daemon_places_puts_by_class_and_recovers_them_after_kill9(vm):
    d = _phase(vm, "daemon")
    assert d["acked_puts"] == 9 and d["loaded_bad"] == 0 and d["loaded_ok"] == d["acked_blocks"]
    assert d["killed"]["signal"] == 9 and d["stopped"]["exit"] == 0
    assert d["recovered"] and d["recovered"][-1]["blocks"] >= d["acked_blocks"]
    b, m = d["before"], d["after_puts"]
    # PIDs from the device's RUH Status per class (1, 2, 3), each put one extent of the on-disk format;
    # the device's view: the RU each class handle has open (fresh at the daemon's first segment) took
    # RUNS - RUAMW x LBA bytes, and no other handle moved
    exp = d["expected_extent_bytes"]
    assert {pid: RUNS - m["ruamw"][str(pid)] * LBA for pid in (1, 2, 3)} == {
        1: exp["system"],
        2: exp["conversation"],
        3: exp["query"],
    }
    assert {int(p) for p in m["ruamw"] if m["ruamw"][p] != b["ruamw"][p]} <= {1, 2, 3}
    # the puts' extents, and the tier's label that the daemon's first start writes (on the default
    # handle, io/label.py; the namespace was zeroed before, so formatting zeroes no chain start)
    from tierstore.io.label import LABEL_BYTES

    assert m["stats"]["hbmw_bytes"] - b["stats"]["hbmw_bytes"] == sum(exp.values()) + LABEL_BYTES


# ------------------------------------------------------------------ plain jobs vs fio
@pytest.mark.phase("plids_vs_fio")
def test_plain_job_plids_write_the_pids_fio_writes(vm):
    f = _phase(vm, "plids_vs_fio")
    assert f["ours"]["rc"] == 0, f["ours"]["stderr"]
    if "skipped" in f["fio"]:
        pytest.skip(vm["_fio_why"] or f["fio"]["skipped"])
    assert f["fio"]["rc"] == 0, f["fio"]["stderr"]
    # the device's RUH Status: the same PIDs took the same bytes (24 KiB round robin over 3 plids)
    assert f["ours"]["pid_bytes"] == f["fio"]["pid_bytes"]
    assert sorted(f["fio"]["pid_bytes"].values()) == [8192] * 3
    listed = [s["pid"] for s in _phase(vm, "discovery")["report"]["ruh_status"]]
    assert sorted(int(p) for p in f["fio"]["pid_bytes"]) == sorted(listed[i] for i in (1, 3, 6))


# ------------------------------------------------------------------ tierstore fdp stats
@pytest.mark.phase("stats_cli")
def test_fdp_stats_reports_waf_since_the_saved_baseline(vm):
    s = _phase(vm, "stats_cli")
    assert s["save_rc"] == 0 and s["rc"] == 0 and s["json_rc"] == 0, s["err"]
    j = s["json"]
    since = j["since_baseline"]
    assert since["hbmw_bytes"] == since["mbmw_bytes"] == 1 << 20 and since["waf"] == 1.0
    assert since["mbe_bytes"] == 0
    row = next(u for u in j["ruh_usage"] if u["pid"] == 1)
    assert row["class"] == "long" and row["ruha"] == "host specified"
    assert "Host Bytes with Metadata Written (HBMW)" in s["text"]
