"""``tierstore serve --check``: find what start-up would refuse, without starting or changing anything.

A config that validates (:mod:`tierstore.server.config`) can still fail to start on this machine.
:func:`preflight` checks, read-only: memory (the memory tiers against ``MemAvailable``), the NVMe
geometry, the NVMe path (:func:`tierstore.io.label.resolve_nvme_path`), what the path holds
(:func:`tierstore.io.label.inspect_target`), a process holding the tier's lock, ``state_dir``, and
the node socket's path, and the listen and metrics ports.

Errors make ``--check`` exit 2 with one line each; notes are printed and do not fail. Start-up
runs the same checks except the port test (the real bind does that) and refuses on an error.

Continued in ``docs/SERVER.md`` (``tierstore/server/check.py``): each check in detail.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import stat

from ..config import NvmeTierConfig
from ..devices import file_tier_geometry
from ..errors import ConfigError, CorruptData
from ..extras import require
from ..io import format as fmt
from ..io._fileops import lock_holder_pid, process_alive
from ..io.block_eviction import live_budget
from ..io.journal import MAGIC as JOURNAL_MAGIC
from ..io.journal import check_owner, read_records
from ..io.label import LABEL_BYTES, Target, inspect_target, refusal, resolve_nvme_path
from ..io.segments import RESERVE_SEGMENTS, choose_segment_size
from ..layout import KVLayout
from ..units import format_bytes
from .config import DaemonConfig
from .statefiles import SCOPE_FIELDS, TOMB_FIELDS, foreign_state_file, read_state_records, skipped_lines_said

__all__ = ["Preflight", "preflight", "nvme_file_path", "segment_size_bytes"]

_DEFAULT_STATE_FILE = "scopes.jsonl"
_TOMB_FILE = "invalidations.jsonl"


@dataclasses.dataclass
class Preflight:
    """Outcome of :func:`preflight`: ``errors`` (start-up would refuse) and ``notes``."""

    errors: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _gib(n: int) -> str:
    """``n`` bytes in the unit that shows it (``16.00MiB``, ``64.00GiB``; 0.0 GiB hid a 16 MiB tier)."""
    return format_bytes(n)


def nvme_file_path(path: str) -> str:
    """The file the daemon opens for ``tiers.nvme.path``: the one path rule of
    :func:`tierstore.io.label.resolve_nvme_path` (a path that ends in ``/`` or
    names an existing directory gets ``tierstore.nvme`` inside).

    Raises
    ------
    ConfigError
        The directory does not exist.
    """
    return resolve_nvme_path(path)


def segment_size_bytes(capacity_bytes: int, configured: int | None, block_bytes: int) -> int:
    """The segment size the daemon uses (:func:`tierstore.io.segments.choose_segment_size`).

    Raises
    ------
    ConfigError
        A tier too small for region eviction.
    """
    return choose_segment_size(capacity_bytes, block_bytes, configured)


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes (Linux 3.14+), or ``None`` when unknown."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _nearest_existing(path: str) -> str:
    """``path`` (absolute) or its nearest ancestor that exists (a directory or not)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _existing_dir(path: str) -> str:
    """The nearest existing ancestor directory of ``path``."""
    p = _nearest_existing(path)
    return p if os.path.isdir(p) else os.path.dirname(p)


def _check_memory(cfg: DaemonConfig, out: Preflight, meminfo: str) -> None:
    from ..tiers.memory import cuda_available

    host = cfg.tiers.host.capacity_bytes
    hbm = cfg.tiers.hbm.capacity_bytes
    on_cpu = hbm if hbm and not cuda_available() else 0
    need = host + on_cpu
    avail = mem_available_bytes(meminfo)
    if avail is None:
        out.notes.append("memory: MemAvailable unknown (no /proc/meminfo); not checked")
        return
    what = f"tiers.host.capacity_bytes={host} ({_gib(host)})"
    if on_cpu:
        what += f" + tiers.hbm.capacity_bytes={on_cpu} ({_gib(on_cpu)}, host memory: no CUDA here)"
    if need > avail:
        out.errors.append(
            f"memory: {what} exceed MemAvailable={avail} ({_gib(avail)}) of this machine; "
            "lower the capacity (the pool is allocated whole at start)"
        )
    else:
        out.notes.append(f"memory: {_gib(need)} of memory tiers, {_gib(avail)} available")


def _check_writable_dir(what: str, path: str, out: Preflight) -> bool:
    if os.path.isfile(path) and not os.access(path, os.R_OK | os.W_OK):
        # the tier file itself, not only its directory: start-up opens it read-write
        out.errors.append(f"{what}: {path} is not readable and writable by this user (uid {os.getuid()})")
        return False
    base = _existing_dir(path)
    if not os.access(base, os.W_OK | os.X_OK):
        if _read_only_fs(base):  # access(2) refuses everyone there (EROFS), whatever the user
            out.errors.append(f"{what}: {path}: {base} is on a read-only file system")
        else:
            out.errors.append(f"{what}: {path}: {base} is not writable by this user (uid {os.getuid()})")
        return False
    return True


def _read_only_fs(path: str) -> bool:
    """Whether ``path`` is on a file system mounted read-only (statvfs(3) ``ST_RDONLY``; False when
    unknown)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_o_direct(path: str, out: Preflight) -> None:
    """The NVMe tier is opened with O_DIRECT and never falls back (tmpfs refuses it with EINVAL).

    An existing file is opened read-only; otherwise a probe file is created in the
    nearest existing directory and removed at once.
    """
    if os.path.exists(path):
        target, flags = path, os.O_RDONLY
    else:
        target = os.path.join(_existing_dir(path), f".tierstore-check-{os.getpid()}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(target, flags | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        hint = {
            errno.EINVAL: " (the file system refuses O_DIRECT, e.g. tmpfs)",
            errno.EROFS: " (a read-only file system)",
        }.get(e.errno, "")
        out.errors.append(f"tiers.nvme.path={path}: cannot open with O_DIRECT: {e.strerror}{hint}")
        return
    os.close(fd)
    if target != path:
        os.unlink(target)


def _check_nvme(cfg: DaemonConfig, layout: KVLayout, out: Preflight) -> None:
    n = cfg.tiers.nvme
    if n is None:
        return
    bb = layout.bytes_per_block
    seg = _check_segments(n, bb, out)
    if seg is None:
        return
    try:
        path = nvme_file_path(n.path)
        target = inspect_target(path)
    except ConfigError as e:
        out.errors.append(str(e))
        return
    if target.kind in ("foreign", "legacy") and not n.format:
        out.errors.append(refusal(target))
        return
    if target.label is not None:
        seg = _check_label(n, bb, path, target, out)
        if seg is None:
            return
    elif target.kind in ("foreign", "legacy"):
        out.notes.append(f"nvme: {path}: format: true: what it holds is overwritten at start")
    if target.kind not in ("absent",):
        _check_lock(path, out)
    if n.eviction_granularity == "block":
        _check_journal(n, path, target, out)
        _check_live_budget(n, bb, seg, out)
    tier = n.capacity_bytes // seg * seg
    if path.startswith("/dev/"):
        _check_device_node(n, path, target, tier, out)
    else:
        _check_file_room(n, path, target, tier, out)


def _check_journal(n: NvmeTierConfig, path: str, target: Target, out: Preflight) -> None:
    """Block mode's journal (:mod:`tierstore.io.journal`), as opening the tier checks it: a file of its
    own in an existing directory, a tierstore journal of this tier if it exists, no foreign
    ``<journal>.tmp`` beside it."""
    jp = n.journal_path
    if jp is None:
        if path.startswith("/dev/"):
            out.errors.append(
                f"tiers.nvme.journal_path: eviction_granularity: block on the device {path} needs "
                "one (a file on a durable file system)"
            )
            return
        jp = path + ".journal"
    what = f"tiers.nvme.journal_path={jp!r}"
    if not jp or os.path.isdir(jp) or os.path.abspath(jp) == os.path.abspath(path):
        out.errors.append(f"{what}: give a file of its own (not empty, not a directory, not the tier's path)")
        return
    if not os.path.isdir(os.path.dirname(os.path.abspath(jp))):
        out.errors.append(f"{what}: its directory does not exist")
        return
    if os.path.exists(jp):
        try:
            res = read_records(jp)
            if target.label is not None:
                check_owner(res, jp, target.label.store_id)
        except (CorruptData, ConfigError, OSError) as e:
            out.errors.append(f"{what}: {e}")
            return
    tmp = jp + ".tmp"
    if os.path.lexists(tmp):
        try:
            with open(tmp, "rb") as f:
                ours = f.read(len(JOURNAL_MAGIC)) in (b"", JOURNAL_MAGIC)
        except OSError:
            ours = False
        if not ours:
            out.errors.append(f"{what}: {tmp} exists and is not a journal tierstore was writing: move it")


def _check_live_budget(n: NvmeTierConfig, bb: int, seg: int, out: Preflight) -> None:
    """Block mode's live budget, computed as start-up computes it (:func:`tierstore.io.block_eviction.
    live_budget`, the store's one reserved segment): below one block start-up refuses."""
    _, bpe = fmt.blocks_per_extent_for(n.extent_size_bytes, seg, bb)
    try:
        budget = live_budget(n.capacity_bytes // seg, RESERVE_SEGMENTS, seg, bb, bpe, n.live_fraction)
    except ConfigError as e:
        out.errors.append(f"tiers.nvme: {e}")
        return
    out.notes.append(f"nvme: block mode keeps at most {budget} blocks live (live_fraction={n.live_fraction})")


def _check_segments(n: NvmeTierConfig, bb: int, out: Preflight) -> int | None:
    """The segment size start-up would choose, or ``None`` after an error: a segment
    holds one block extent and the label, the tier at least two segments."""
    cap = n.capacity_bytes
    one = fmt.extent_bytes_for(1, bb) + LABEL_BYTES  # segment 0 holds the tier's label and one block
    if n.segment_size_bytes is not None and (
        n.segment_size_bytes % fmt.ALIGN_BYTES or n.segment_size_bytes < one
    ):
        out.errors.append(
            f"tiers.nvme.segment_size_bytes={n.segment_size_bytes}: must be a multiple of 4096 "
            f"holding one block extent and the tier's label, {one} bytes (blocks of {bb} bytes)"
        )
        return None
    try:
        seg = segment_size_bytes(cap, n.segment_size_bytes, bb)
    except ConfigError as e:
        out.errors.append(f"tiers.nvme.capacity_bytes={cap}: {e}")
        return None
    if seg % fmt.ALIGN_BYTES or seg < one:
        out.errors.append(
            f"tiers.nvme.segment_size_bytes={seg}: must be a multiple of 4096 holding one block "
            f"extent and the tier's label, {one} bytes (blocks of {bb} bytes)"
        )
        return None
    n_seg = cap // seg
    if n_seg < 2:
        out.errors.append(
            f"tiers.nvme.capacity_bytes={cap}: holds {n_seg} segments of {seg} bytes; the segment "
            "store needs at least 2 (one reserved)"
        )
        return None
    return seg


def _check_label(n: NvmeTierConfig, bb: int, path: str, target: Target, out: Preflight) -> int | None:
    """A tier that exists: its label's segment size (start-up's own check,
    :func:`tierstore.devices.file_tier_geometry`), or ``None`` after an error."""
    try:
        seg, _ = file_tier_geometry(target, n, bb)
    except ConfigError as e:
        out.errors.append(f"layout: {e}" if "bytes, but was opened for" in str(e) else str(e))
        return None
    n_seg = n.capacity_bytes // seg
    out.notes.append(
        f"nvme: {path}: a tier of {target.label.n_segments} segments of {seg} bytes holding "
        f"{bb}-byte blocks; its blocks are recovered at start"
        + (
            f" (now {n_seg} segments: the blocks past them are dropped)"
            if n_seg < target.label.n_segments
            else ""
        )
    )
    return seg


def _check_device_node(n: NvmeTierConfig, path: str, target: Target, tier_bytes: int, out: Preflight) -> None:
    """A path under ``/dev``: exists, is a block or character device, and a block device is large enough."""
    try:
        st = os.stat(path)
    except OSError as e:
        out.errors.append(f"tiers.nvme.path={path}: {e.strerror} (no such device on this machine)")
        return
    if not (stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        out.errors.append(f"tiers.nvme.path={path}: not a block or character device")
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # A block device's size is where SEEK_END lands; a character device
            # (an NVMe generic node /dev/ngXnY) cannot seek (ESPIPE): its
            # namespace size comes from Identify Namespace when the store opens
            # (tierstore.devices checks capacity_bytes against it there).
            dev_bytes = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else None
        finally:
            os.close(fd)
    except OSError as e:
        out.errors.append(f"tiers.nvme.path={path}: cannot open: {e.strerror}")
        return
    if dev_bytes is not None and dev_bytes < tier_bytes:
        out.errors.append(
            f"tiers.nvme.capacity_bytes={n.capacity_bytes}: the device {path} has {dev_bytes} bytes"
        )
    if target.kind == "unreadable" and not n.format:
        out.notes.append(
            f"nvme: {path}: a character device; its label is read when the tier opens, which "
            "refuses it unless it carries tierstore's label (or format: true)"
        )


def _check_file_room(n: NvmeTierConfig, path: str, target: Target, tier_bytes: int, out: Preflight) -> None:
    """A file: its directory writable, O_DIRECT accepted, and room for the (sparse) tier."""
    cap = n.capacity_bytes
    if _check_writable_dir("tiers.nvme.path", path, out):
        _check_o_direct(path, out)
    held = os.stat(path).st_blocks * 512 if target.kind != "absent" else 0
    try:
        vfs = os.statvfs(_existing_dir(path))
    except OSError as e:
        out.errors.append(f"tiers.nvme.path={path}: statvfs: {e.strerror}")
        return
    free = vfs.f_bavail * vfs.f_frsize
    if tier_bytes > free + held:
        out.errors.append(
            f"disk: tiers.nvme.capacity_bytes={cap} ({_gib(cap)}) is larger than the "
            f"{free + held} bytes ({_gib(free + held)}) free on the file system of "
            f"{_existing_dir(path)}"
            + (f" (counting the {held} bytes the tier file already holds)" if held else "")
            + "; the file is sparse, so blocks would be refused once the disk is full"
        )


def _check_lock(path: str, out: Preflight) -> None:
    """A live process holding the tier's flock (start-up would be refused) is an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        pid = lock_holder_pid(fd)
    finally:
        os.close(fd)
    if pid is not None and process_alive(pid):
        out.errors.append(
            f"tiers.nvme.path={path}: in use by process {pid} (another tierstore store or daemon "
            "holds its lock); stop it, or give this daemon another NVMe path"
        )


def _check_node(cfg: DaemonConfig, out: Preflight) -> None:
    """The node socket: its extra is installed, its directory exists, and the path is free or a
    stale socket (nothing listens)."""
    if cfg.node is None:
        return
    try:
        require("msgspec", "node: the node socket")
    except ConfigError as e:
        out.errors.append(str(e))
    path = cfg.node.socket
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        out.errors.append(f"node.socket={path}: the directory {parent} does not exist")
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        out.errors.append(f"node.socket={path}: exists and is not a socket (tierstore never replaces it)")
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            out.notes.append(f"node.socket={path}: a stale socket (nothing listens); start-up replaces it")
            return
    out.errors.append(f"node.socket={path}: another service listens there")


def _check_state_layout(cfg: DaemonConfig, layout: KVLayout, out: Preflight) -> None:
    near = _nearest_existing(cfg.state_dir)
    if not os.path.isdir(near):  # start-up could not create it (tenancy.make_state_dir)
        what = "exists" if near == os.path.abspath(cfg.state_dir) else f"is under {near}, which exists"
        out.errors.append(f"state_dir: {cfg.state_dir} {what} and is not a directory")
        return
    _check_writable_dir("state_dir", cfg.state_dir, out)
    reg = os.path.join(cfg.state_dir, _DEFAULT_STATE_FILE)
    fp = layout.fingerprint().hex()
    for path, fields in ((reg, SCOPE_FIELDS), (os.path.join(cfg.state_dir, _TOMB_FILE), TOMB_FIELDS)):
        try:
            records, skipped = read_state_records(path, fields)
        except OSError as e:
            out.errors.append(f"state_dir: {path}: cannot read: {e.strerror}")
            return
        refusal = foreign_state_file(path, records, skipped)
        if refusal:
            out.errors.append(f"state_dir: {refusal}")
            continue
        if skipped:
            out.notes.append(skipped_lines_said(path, skipped))
        other = sum(1 for rec in records if rec.get("layout") != fp) if path == reg else 0
        if other:
            out.notes.append(
                f"layout: {other} scopes in {reg} were written under another layout; start-up drops "
                "their blocks (they can never be addressed again)"
            )


def _bind_test(what: str, host: str, port: int, out: Preflight) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        out.errors.append(f"{what}: host {host!r}: {e.strerror}")
        return
    for family, socktype, proto, _, addr in infos[:1]:
        s = socket.socket(family, socktype, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        except OSError as e:
            hint = (
                " (another process listens there; a daemon already running?)"
                if e.errno == errno.EADDRINUSE
                else ""
            )
            out.errors.append(f"{what}: cannot bind {host}:{port}: {e.strerror}{hint}")
        finally:
            s.close()


def preflight(cfg: DaemonConfig, *, ports: bool = True, meminfo: str = "/proc/meminfo") -> Preflight:
    """Check what start-up would refuse on this machine (see the module doc); changes nothing.

    Parameters
    ----------
    cfg : DaemonConfig
        A validated config.
    ports : bool
        Also bind-test ``listen`` and ``metrics`` (``--check``); start-up skips it.
    meminfo : str
        Path of ``/proc/meminfo`` (tests point it at a fixture).

    Returns
    -------
    Preflight
    """
    out = Preflight()
    layout = cfg.layout.build()
    _check_memory(cfg, out, meminfo)
    _check_nvme(cfg, layout, out)
    _check_state_layout(cfg, layout, out)
    _check_node(cfg, out)
    if ports:
        _bind_test("listen", cfg.listen.host, cfg.listen.port, out)
        if cfg.metrics.port is not None:
            if (
                cfg.metrics.port
                and cfg.metrics.port == cfg.listen.port
                and cfg.metrics.host == cfg.listen.host
            ):
                out.errors.append(
                    f"metrics.port={cfg.metrics.port}: same address as listen; use null to serve "
                    "/metrics on the API port only"
                )
            else:
                _bind_test("metrics", cfg.metrics.host, cfg.metrics.port, out)
    return out
