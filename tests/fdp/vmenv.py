"""Host side of the FDP VM tests: find the tool, build the guest's Python image, boot, collect.

``../shared/tools/fdp-vm/run`` (next to the checkout; see its README) boots a TCG guest with an
emulated FDP namespace and runs one command in it. Python in that guest is slow: every 9p file
operation costs tens of milliseconds, so the venv's ``python -c pass`` alone takes ~40 s and
``import torch`` several minutes. :func:`python_image` therefore packs the interpreter's standard
library and the venv packages the product imports into one squashfs file
(``mksquashfs``, Debian package ``squashfs-tools``), cached by content under
``$XDG_CACHE_HOME/tierstore/fdp-vm``; the guest loop-mounts it (``vm_guest.sh``), and the
checkout itself is imported from its own path. Without ``mksquashfs`` the venv is used over 9p
(slower, same results).

:func:`fio_with_fdp` finds a fio that knows ``dataplacement=fdp`` (fio >= 3.34; Debian 12's fio
3.33 predates FDP): ``$TIERSTORE_FDP_FIO``, ``$XDG_CACHE_HOME/tierstore/fio-*/fio``, or ``fio`` on
``PATH``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(os.path.dirname(REPO), "shared", "tools", "fdp-vm", "run")
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tierstore")

#: Packages of the venv the guest needs (what the bench, the library, the daemon and the client import,
#: found with ``python -X importtime``), plus torch's lazily imported dependencies.
PACKAGES = (
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated_types",
    "attr",
    "crc32c",
    "frozenlist",
    "hdrh",
    "idna",
    "multidict",
    "numpy",
    "numpy.libs",
    "propcache",
    "pydantic",
    "pydantic_core",
    "typing_extensions.py",
    "typing_inspection",
    "yaml",
    "_yaml",
    "yarl",
    "tqdm",
    "sh",
    "sh.py",
    "torch",
    "torchgen",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "filelock",
    "rich",
    "markdown_it",
    "mdurl",
    "pygments",
)


#: ``root``'s extras the guest's phases use: the daemon ([server]: aiohttp, prometheus-client),
#: nvme-cli through ``sh`` ([fdp]) and the bench CLI ([bench])
GUEST_EXTRAS = ("server", "fdp", "bench")


def _dependency_tops(root: str = "tierstore", extras: tuple[str, ...] = GUEST_EXTRAS) -> set[str]:
    """Top-level names in site-packages of ``root``'s runtime dependencies, recursively
    (``importlib.metadata``: each distribution's ``Requires-Dist`` without extras, except
    ``root``'s own ``extras``, and the first path part of each of its files), so a new
    dependency reaches the guest without an edit here. ``root`` itself is mounted, not packed."""
    from importlib import metadata

    tops: set[str] = set()
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if key != root:
            for f in dist.files or ():
                top = f.parts[0] if f.parts else ""
                if (
                    top
                    and not top.startswith(("..", "__editable__", "__pycache__"))
                    and not top.endswith((".pth", ".dist-info"))
                ):
                    tops.add(top)
        for req in dist.requires or ():
            marker = req.split(";", 1)[1] if ";" in req else ""
            wanted = key == root and any(re.search(rf"extra\s*==\s*['\"]{e}['\"]", marker) for e in extras)
            if "extra" in marker and not wanted:
                continue
            todo.append(re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0])
    return tops


_STDLIB_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}


def tool_path() -> str | None:
    """The fdp-vm tool, or ``None`` where ``../shared`` is absent."""
    return TOOL if os.access(TOOL, os.X_OK) else None


def guest_python() -> str:
    """The interpreter binary behind the venv (the guest sees the host's root at the same paths)."""
    return os.path.realpath(
        os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    )


def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _entries() -> list[tuple[str, str]]:
    """``(source, destination relative to the image root)`` of everything in the image."""
    std = sysconfig.get_paths()["stdlib"]
    ver = os.path.basename(std)
    out = [
        (os.path.join(std, n), f"lib/{ver}/{n}")
        for n in sorted(os.listdir(std))
        if n not in _STDLIB_SKIP and not n.startswith("config-")
    ]
    sp = _site_packages()
    for name in sorted(set(PACKAGES) | _dependency_tops()):
        p = os.path.join(sp, name)
        if os.path.exists(p):
            out.append((p, f"lib/{ver}/site-packages/{name}"))
    for p in sorted(glob.glob(os.path.join(sp, "*.dist-info"))) + sorted(glob.glob(os.path.join(sp, "*.so"))):
        out.append((p, f"lib/{ver}/site-packages/{os.path.basename(p)}"))
    return list({dst: (src, dst) for src, dst in out}.values())  # each destination once


def _fingerprint(entries: list[tuple[str, str]]) -> str:
    h = hashlib.sha256(sys.version.encode())
    for src, dst in entries:
        st = os.stat(src)
        h.update(f"{dst}:{st.st_mtime_ns}:{st.st_size}".encode())
    return h.hexdigest()[:16]


def python_image() -> str | None:
    """The squashfs image of the guest's Python (built once per content), or ``None`` without mksquashfs."""
    mk = shutil.which("mksquashfs")
    if mk is None:
        return None
    entries = _entries()
    img = os.path.join(CACHE, "fdp-vm", f"python-{_fingerprint(entries)}.sqfs")
    if os.path.exists(img):
        return img
    os.makedirs(os.path.dirname(img), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fdp-vm-py-", dir=os.path.dirname(img)) as stage:
        for src, dst in entries:  # hard links where possible: nothing is copied on one file system
            target = os.path.join(stage, dst)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(src):
                subprocess.run(["cp", "-al", src, target], check=False, capture_output=True)
                if not os.path.exists(target):
                    shutil.copytree(src, target, symlinks=True)
            else:
                try:
                    os.link(src, target)
                except OSError:
                    shutil.copy2(src, target)
        shutil.rmtree(
            os.path.join(
                stage,
                "lib",
                os.path.basename(sysconfig.get_paths()["stdlib"]),
                "site-packages",
                "torch",
                "include",
            ),
            ignore_errors=True,
        )
        tmp = img + ".tmp"
        subprocess.run(
            [mk, stage, tmp, "-comp", "lz4", "-noappend", "-all-root", "-no-xattrs", "-quiet"],
            check=True,
            capture_output=True,
        )
        os.replace(tmp, img)
    for old in glob.glob(os.path.join(CACHE, "fdp-vm", "python-*.sqfs")):
        if old != img:
            os.unlink(old)
    return img


def _has_fdp(fio: str) -> bool:
    try:
        p = subprocess.run([fio, "--cmdhelp=plids"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and b"Data Placement" in p.stdout


def fio_with_fdp() -> tuple[str | None, str]:
    """``(path, why)``: a fio that knows ``dataplacement=fdp``, or ``None`` and the reason."""
    cands = (
        [os.environ.get("TIERSTORE_FDP_FIO", "")]
        + sorted(glob.glob(os.path.join(CACHE, "fio-*", "fio")), reverse=True)
        + [shutil.which("fio") or ""]
    )
    for c in cands:
        if c and _has_fdp(c):
            return c, ""
    which = shutil.which("fio")
    ver = (
        subprocess.run([which, "--version"], capture_output=True).stdout.decode().strip() if which else "none"
    )
    return None, (
        f"no fio with FDP support (dataplacement=fdp, fio >= 3.34) was found; fio on PATH: {ver} "
        "(Debian 12 ships 3.33, which predates FDP). Build one with tests/fdp/build_fio.sh or set "
        "TIERSTORE_FDP_FIO"
    )


def compile_for_guest(*dirs: str) -> None:
    """Compile the checkout's modules (``tierstore/``, ``tests/fdp/`` and ``dirs``) here: the
    guest reads the host root's ``.pyc`` files and writes none."""
    paths = [os.path.join(REPO, "tierstore"), *dirs, os.path.join(REPO, "tests", "fdp")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *paths], capture_output=True)


#: Seconds from QEMU's start to the guest script's first output (``driver.log``) after which a boot
#: counts as hung. A boot takes 30-45 s under TCG (the tool's README) and the squashfs mount a few
#: more; a guest that stalled in boot (seen once on a fresh machine: QEMU idle, no guest output for
#: 25 minutes) is killed and booted again, once, instead of holding the suite until its timeout.
BOOT_HANG_S = 240.0


def _qemu_in_session(sid: int) -> bool:
    """Whether a ``qemu-system-*`` process runs in session ``sid`` (``/proc/PID/stat``: the
    command name in parentheses, then state, ppid, pgrp, session; proc(5))."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if comm.startswith("qemu-system") and int(fields[3]) == sid:
            return True
    return False


def boot(
    cmd: list[str], out: str, timeout_s: float, hang_s: float = BOOT_HANG_S, tries: int = 2
) -> tuple[int, str, list[dict]]:
    """Run the fdp-vm tool's ``cmd`` (its guest command writes ``OUT/driver.log`` first), booting
    again when the guest hangs before that.

    The tool runs in its own session, its output in ``OUT/tool-N.log`` (readable while it runs).
    A boot is hung when QEMU has run ``hang_s`` seconds and ``driver.log`` does not exist; the
    tool's first-run set-up (apt, virtme-ng) happens before QEMU starts and does not count.
    A hung or timed-out attempt's process group is killed (SIGKILL).

    Returns
    -------
    (rc, output, boots)
        The last attempt's exit status (-1: timed out or hung), its output, and one dict per
        attempt (``wall_s``, ``outcome``: ``exited``, ``hung`` or ``timed out``).
    """
    boots: list[dict] = []
    rc, text = -1, ""
    for n in range(1, tries + 1):
        log_path = os.path.join(out, f"tool-{n}.log")
        t0 = time.monotonic()
        qemu_t: float | None = None
        outcome = "exited"
        with open(log_path, "wb") as log:
            p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            while p.poll() is None:
                time.sleep(0.5)
                now = time.monotonic()
                if qemu_t is None and _qemu_in_session(p.pid):
                    qemu_t = now
                hung = (
                    qemu_t is not None
                    and now - qemu_t > hang_s
                    and not os.path.exists(os.path.join(out, "driver.log"))
                )
                if hung or now - t0 > timeout_s:
                    outcome = "hung" if hung else "timed out"
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    break
        with open(log_path, errors="replace") as f:
            text = f.read()
        rc = p.returncode if outcome == "exited" else -1
        if outcome != "exited":
            text += f"\n[vmenv] attempt {n}: {outcome} after {time.monotonic() - t0:.0f} s"
        boots.append({"wall_s": round(time.monotonic() - t0, 1), "outcome": outcome})
        if outcome != "hung":
            break
    return rc, text, boots


def run_config(
    name: str, nruh: int, nrg: int, runs: str, size: str, driver_args: list[str], timeout_s: float = 900
) -> dict:
    """Boot the guest once with this FDP configuration, run ``vm_checks.py``, return its results.

    The returned dict is ``results.json`` plus ``_vm`` (exit status, wall time, the tool's and the
    driver's output tails, the output directory).
    """

    def size_bytes(s: str) -> int:
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)

    compile_for_guest()
    img = python_image()
    out = tempfile.mkdtemp(prefix=f"tierstore-fdp-vm-{name}-")
    os.chmod(out, 0o777)
    py = guest_python() if img else os.path.join(REPO, ".venv", "bin", "python")
    cmd = [
        TOOL,
        "--nruh",
        str(nruh),
        "--nrg",
        str(nrg),
        "--ru-size",
        runs,
        "--size",
        size,
        "--memory",
        "3G",
        "--rwdir",
        out,
        "--",
        "bash",
        os.path.join(REPO, "tests", "fdp", "vm_guest.sh"),
        py,
        img or "-",
        REPO,
        out,
        "--nruh",
        str(nruh),
        "--nrg",
        str(nrg),
        "--runs-bytes",
        str(size_bytes(runs)),
        "--size-bytes",
        str(size_bytes(size)),
        *driver_args,
    ]
    t = time.monotonic()
    rc, tool_out, boots = boot(cmd, out, timeout_s)
    wall = time.monotonic() - t
    res_path = os.path.join(out, "results.json")
    res: dict = {}
    if os.path.exists(res_path):
        with open(res_path) as f:
            res = json.load(f)
    drv = ""
    if os.path.exists(os.path.join(out, "driver.log")):
        with open(os.path.join(out, "driver.log"), errors="replace") as f:
            drv = f.read()[-6000:]
    kern = ""
    if os.path.exists(os.path.join(out, "dmesg.log")):  # vm_guest.sh saves it after the checks
        with open(os.path.join(out, "dmesg.log"), errors="replace") as f:
            kern = "\n".join(f.read().splitlines()[-40:])
    res["_vm"] = {
        "rc": rc,
        "dmesg": kern,
        "wall_s": round(wall, 1),
        "boots": boots,
        "tool_output": "\n".join(ln for ln in tool_out.splitlines() if "WARNING: Location" not in ln)[-4000:],
        "driver_log": drv,
        "out_dir": out,
        "image": img,
        "command": cmd,
    }
    return res
