"""The loop-mount helper of the ENOSPC tests leaves nothing behind, even when
the test process is killed (issue 12: a crashed ENOSPC test left its mount)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from . import loopfs

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    loopfs.unavailable_reason() is not None, reason=str(loopfs.unavailable_reason())
)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split()[4] for line in f]


def _wait_until(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_mount_is_private_and_gone_after_exit():
    with loopfs.loop_ext4(16 << 20) as mnt:
        (mnt / "f").write_bytes(b"x" * 4096)
        assert (mnt / "f").stat().st_size == 4096
        assert not any(p.startswith(str(loopfs.BASE)) for p in _mount_points())  # not in our namespace
        d = loopfs.BASE / str(mnt).split(str(loopfs.BASE) + "/", 1)[1].split("/", 1)[0]
        img = d / "fs.img"
        assert subprocess.run(["losetup", "-j", str(img)], capture_output=True, text=True).stdout.strip()
    assert not d.exists()


def test_killed_process_leaves_no_mount_and_sweep_removes_its_image(tmp_path):
    base = tmp_path / "mounts"  # private: another test session's start-up sweep must not remove it first
    code = (
        "import os, signal, sys\n"
        "from tests.io.loopfs import loop_ext4\n"
        "with loop_ext4(16 << 20) as mnt:\n"
        "    (mnt / 'f').write_bytes(b'x' * 4096)\n"
        "    print(mnt, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TIERSTORE_TEST_MOUNTS_DIR=str(base)),
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    mnt = r.stdout.strip()
    helper_pid = int(mnt.split("/")[2])
    rel = mnt.split("/root", 1)[1]
    d = pathlib.Path(rel).parent
    img = d / "fs.img"
    assert d.parent == base and img.exists()  # the dead process's image is still there ...
    assert _wait_until(lambda: not os.path.exists(f"/proc/{helper_pid}"))  # ... its helper is gone,
    assert _wait_until(
        lambda: not subprocess.run(["losetup", "-j", str(img)], capture_output=True, text=True).stdout.strip()
    )  # so is the loop device,
    assert not any(p.startswith(str(base)) for p in _mount_points())  # and no mount is left
    removed = loopfs.sweep_stale(base)
    assert f"dir {d}" in removed and not d.exists()


def test_sweep_unmounts_dead_owners_only(tmp_path):
    base = tmp_path / "mounts"  # private: another test session's sweep must not take the dead one first
    dead = base / f"{_dead_pid()}-sweeptest"
    live = base / f"{os.getpid()}-sweeptest"
    try:
        for d in (dead, live):
            (d / "mnt").mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(dead / "mnt")], check=True)
        removed = loopfs.sweep_stale(base)
        assert f"mount {dead / 'mnt'}" in removed and f"dir {dead}" in removed
        assert str(dead / "mnt") not in _mount_points() and not dead.exists()
        assert live.exists() and not any(str(live) in x for x in removed)
    finally:
        if str(dead / "mnt") in _mount_points():
            subprocess.run(["umount", "-l", str(dead / "mnt")])
        for d in (dead, live):
            subprocess.run(["rm", "-rf", str(d)])
