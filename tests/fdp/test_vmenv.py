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
