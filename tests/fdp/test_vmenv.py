"""tests/fdp/vmenv.py: the guest image holds every package the guest's phases import."""

from __future__ import annotations

import shutil
import time

from tests.fdp import vmenv


def test_the_guest_image_packs_the_extras_the_guest_phases_import():
    """The daemon phase imports prometheus_client and aiohttp ([server]); once they moved from
    the core requirements to the extra, the guest's daemon died at start-up (CI's fdp session)."""
    tops = vmenv._dependency_tops()
    assert {"aiohttp", "prometheus_client", "rich", "torch", "numpy", "pydantic"} <= tops


def _fake_tool(tmp_path, body: str) -> list[str]:
    """A stand-in for the fdp-vm tool: a shell script whose "QEMU" is ``sleep`` under a
    ``qemu-system-*`` name (the kernel names a process after the file it executed)."""
    qemu = tmp_path / "qemu-system-fake"
    qemu.symlink_to(shutil.which("sleep"))
    script = tmp_path / "tool.sh"
    script.write_text(f"QEMU={qemu}\nOUT={tmp_path / 'out'}\n{body}\n")
    (tmp_path / "out").mkdir()
    return ["bash", str(script)]


def test_a_guest_that_hangs_before_its_script_starts_is_booted_again(tmp_path):
    """A boot that stalls (QEMU idle, no driver.log) is killed after ``hang_s`` and run again; the
    second boot's result is the one returned. Without the watchdog this waited for the
    suite's 25-minute timeout."""
    cmd = _fake_tool(
        tmp_path,
        'if [ ! -e "$OUT/.first" ]; then touch "$OUT/.first"; echo booting; exec "$QEMU" 60; fi\n'
        'echo started > "$OUT/driver.log"; "$QEMU" 1; exit 3',
    )
    t = time.monotonic()
    rc, text, boots = vmenv.boot(cmd, str(tmp_path / "out"), timeout_s=60, hang_s=2)
    assert time.monotonic() - t < 30
    assert [b["outcome"] for b in boots] == ["hung", "exited"]
    assert rc == 3
    assert (tmp_path / "out" / "tool-1.log").read_text().startswith("booting")


def test_a_guest_that_hangs_twice_fails_with_both_attempts_said(tmp_path):
    cmd = _fake_tool(tmp_path, 'exec "$QEMU" 60')
    rc, text, boots = vmenv.boot(cmd, str(tmp_path / "out"), timeout_s=60, hang_s=2)
    assert rc == -1 and [b["outcome"] for b in boots] == ["hung", "hung"]
    assert "attempt 2: hung" in text


def test_set_up_before_qemu_starts_is_not_a_hang_but_the_timeout_still_holds(tmp_path):
    """The tool's first-run set-up (apt, virtme-ng) runs before QEMU: only the overall
    timeout bounds it."""
    cmd = _fake_tool(tmp_path, 'sleep 4; echo x > "$OUT/driver.log"; exit 0')
    rc, _, boots = vmenv.boot(cmd, str(tmp_path / "out"), timeout_s=60, hang_s=1)
    assert rc == 0 and [b["outcome"] for b in boots] == ["exited"]
    cmd = ["bash", "-c", "sleep 30"]
    rc, _, boots = vmenv.boot(cmd, str(tmp_path / "out"), timeout_s=2, hang_s=1)
    assert rc == -1 and [b["outcome"] for b in boots] == ["timed out"]


def _ruh_attempt(statuses: list[str], write_errors: int) -> dict:
    return {"statuses": {"query/0": statuses}, "engine": {"write_errors": write_errors}}


def test_the_ruh_update_phase_reruns_only_after_host_side_write_errors(tmp_path, monkeypatch):
    """vm_checks.ruh_update runs its body again once when the only fault was writes the host saw
    fail (CI, stop 37: HBMW exceeded the engine's count after such a write); any other non-ok
    block (a wrong status, a refusal) is returned as it is, for the tests to fail on."""
    import argparse

    from tests.fdp import vm_checks

    monkeypatch.setattr(vm_checks, "ARGS", argparse.Namespace(out=str(tmp_path)), raising=False)
    monkeypatch.setattr(vm_checks, "R", {"timings_s": {}, "errors": {}})
    runs = iter([_ruh_attempt(["ok", "io_error"], 1), _ruh_attempt(["ok", "ok"], 0)])
    monkeypatch.setattr(vm_checks, "_ruh_update_once", lambda: next(runs))
    vm_checks.ruh_update()
    out = vm_checks.R["ruh_update"]
    assert out["statuses"] == {"query/0": ["ok", "ok"]}
    assert [a["statuses"] for a in out["failed_attempts"]] == [{"query/0": ["ok", "io_error"]}]
    assert "dmesg" in out["failed_attempts"][0] and "warnings" in out["failed_attempts"][0]
    for first in (_ruh_attempt(["rejected"], 0), _ruh_attempt(["io_error", "no_space"], 2)):
        runs = iter([first, _ruh_attempt(["ok"], 0)])
        monkeypatch.setattr(vm_checks, "_ruh_update_once", lambda runs=runs: next(runs))
        vm_checks.ruh_update()
        assert vm_checks.R["ruh_update"]["statuses"] == first["statuses"]
        assert "failed_attempts" not in vm_checks.R["ruh_update"]
