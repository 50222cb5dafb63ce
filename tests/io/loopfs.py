"""Small loop-mounted ext4 file systems for tests, which never outlive the test process.

Each file system is an ext4 image mounted by a helper process in a mount
namespace of its own (``unshare --mount``); tests reach it through
``/proc/<helper pid>/root/...``, so the host's mount table never sees it. The
helper's stdin is a pipe from the test process and the helper waits on it: when
the test process ends in any way (a finished test, a failed one, SIGKILL, the
SIGILL of issue 12), the pipe closes, the helper exits, its namespace and the
mount go with it, and the loop device is released (``mount -o loop`` sets
``LO_FLAGS_AUTOCLEAR``, see losetup(8)).

What a dead process can leave is its image directory
``<tmp>/tierstore-test-mounts/<pid>-<token>/``; :func:`sweep_stale`, run at
session start (``tests/conftest.py``), removes those of dead pids, and
unmounts anything mounted under that directory in this namespace whose owner
pid is dead. Directories of live pids (another test session on the same
machine) are never touched.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator

#: where images live; ``TIERSTORE_TEST_MOUNTS_DIR`` moves it (a test of the sweep itself uses a private
#: one, so that the sweeps of other test sessions on the machine never race it)
BASE = pathlib.Path(
    os.environ.get("TIERSTORE_TEST_MOUNTS_DIR")
    or pathlib.Path(tempfile.gettempdir()) / "tierstore-test-mounts"
)


class MountUnavailable(RuntimeError):
    """The loop mount could not be made here (mount's message)."""


def unavailable_reason() -> str | None:
    """Why a loop mount cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root for a loop mount"
    for tool in ("mkfs.ext4", "unshare", "mount"):
        if not shutil.which(tool):
            return f"needs {tool} for a loop-mounted file system"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


@contextlib.contextmanager
def loop_ext4(size_bytes: int = 16 << 20) -> Iterator[pathlib.Path]:
    """Yield a writable directory on a fresh ext4 of ``size_bytes``, loop-mounted
    in a private mount namespace; it is unmounted and removed on exit, and cannot
    outlive this process. Raises :class:`MountUnavailable` with mount's message
    if the mount fails (callers skip on it)."""
    BASE.mkdir(exist_ok=True)
    d = BASE / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    helper = None
    try:
        img, mnt = d / "fs.img", d / "mnt"
        mnt.mkdir()
        with open(img, "wb") as f:
            f.truncate(size_bytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
        script = 'mount -o loop "$1" "$2" || exit 1; echo ready; exec cat >/dev/null'
        helper = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
                "sh",
                str(img),
                str(mnt),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if helper.stdout.readline().strip() != "ready":
            helper.wait(30)
            raise MountUnavailable(f"loop mount unavailable: {helper.stderr.read().strip()}")
        yield pathlib.Path(f"/proc/{helper.pid}/root") / mnt.relative_to("/")
    finally:
        if helper is not None:
            helper.stdin.close()  # the helper exits; its namespace and the mount go with it
            try:
                helper.wait(30)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait(30)
            for stream in (helper.stdout, helper.stderr):
                stream.close()
        shutil.rmtree(d, ignore_errors=True)


def sweep_stale(base: pathlib.Path | None = None) -> list[str]:
    """Remove what dead test processes left under ``base`` (default :data:`BASE`); return what was removed.

    Mount points under BASE in this namespace whose owner pid is dead are
    unmounted (``umount``, then ``umount -l`` if busy); directories of dead
    pids are deleted. Nothing of a live pid is touched.
    """
    base = BASE if base is None else base
    removed: list[str] = []
    if not base.is_dir():
        return removed
    prefix = str(base) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    for mp in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        owner = _owner_pid(mp[len(prefix) :])
        if owner is not None and not _pid_alive(owner):
            if subprocess.run(["umount", mp], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", mp], capture_output=True)
            removed.append(f"mount {mp}")
    for entry in base.iterdir():
        owner = _owner_pid(entry.name)
        if owner is not None and not _pid_alive(owner):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(f"dir {entry}")
    return removed
