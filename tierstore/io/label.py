"""The NVMe tier's label, and what tierstore may write to.

A user's data is not tierstore's: like ``mkfs`` stopping at a device that
already holds a file system, the NVMe tier writes only to a file or device that
is empty or carries its own label, unless told to format it (``format: true``
in ``tiers.nvme``, ``--format`` on the command line). Every way of opening a
tier -- ``KVStore(...)``, ``build.assemble``, the daemon and ``serve --check``,
the benchmark CLI, the engine connectors -- goes through
:func:`check_target` before anything is written, and
:class:`~tierstore.io.segments.SegmentStorage` checks the label again through
its engine (the only way to read an NVMe generic character device).

Continued in ``docs/FORMAT.md`` (``tierstore/io/label.py``): label; what a target may be
(:func:`inspect_target`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import struct
import uuid

import crc32c

from ..errors import ConfigError, CorruptData, ForeignDataError
from ..units import format_bytes
from . import format as fmt

MAGIC = b"TSKVLBL1"
LABEL_VERSION = 1
#: Bytes the label occupies at the start of the device (one O_DIRECT page).
LABEL_BYTES = fmt.ALIGN_BYTES
LABEL_FMT = "<8sIIQQQ16s4sI"
_LABEL_USED = struct.calcsize(LABEL_FMT)  # 64
_CRC_OFFSET = 60
#: The tier's file in a directory given as ``tiers.nvme.path``.
DEFAULT_FILE_NAME = "tierstore.nvme"


@dataclasses.dataclass(frozen=True)
class StoreLabel:
    """A decoded label (see the module table)."""

    segment_size_bytes: int
    block_bytes: int
    n_segments: int
    store_id: bytes = b""
    format_version: int = fmt.FORMAT_VERSION

    def encode(self) -> bytes:
        """The label page (:data:`LABEL_BYTES` bytes)."""
        sid = self.store_id or uuid.uuid4().bytes
        head = struct.pack(
            LABEL_FMT,
            MAGIC,
            LABEL_VERSION,
            self.format_version,
            self.segment_size_bytes,
            self.block_bytes,
            self.n_segments,
            sid,
            bytes(4),
            0,
        )
        crc = crc32c.crc32c(head[:_CRC_OFFSET])
        return head[:_CRC_OFFSET] + struct.pack("<I", crc) + bytes(LABEL_BYTES - _LABEL_USED)


def decode_label(page) -> StoreLabel | None:
    """The label in ``page`` (at least 64 bytes), or ``None`` when it carries none.

    Raises
    ------
    CorruptData
        The magic is there but the CRC, the version or a size is wrong.
    """
    page = bytes(page[:_LABEL_USED])
    if len(page) < _LABEL_USED or page[:8] != MAGIC:
        return None
    magic, ver, fver, seg, bb, n, sid, _, crc = struct.unpack(LABEL_FMT, page)
    if crc32c.crc32c(page[:_CRC_OFFSET]) != crc:
        raise CorruptData("tierstore label: CRC mismatch")
    if ver != LABEL_VERSION:
        raise CorruptData(f"tierstore label: version {ver}, this tierstore reads {LABEL_VERSION}")
    if fver != fmt.FORMAT_VERSION:
        raise CorruptData(f"tierstore label: extent format {fver}, this tierstore reads {fmt.FORMAT_VERSION}")
    if seg <= 0 or seg % fmt.ALIGN_BYTES or bb <= 0 or n <= 0:
        raise CorruptData(
            f"tierstore label: impossible geometry (segment {seg} B, block {bb} B, {n} segments)"
        )
    return StoreLabel(seg, bb, n, sid, fver)


def resolve_nvme_path(path: str, file_name: str = DEFAULT_FILE_NAME, what: str = "tiers.nvme.path") -> str:
    """The file (or device) of an NVMe tier given as ``path`` (the one path rule).

    A path that ends in ``/`` or names an existing directory is a directory:
    the tier is ``file_name`` in it. Any other path is the tier's own file or
    device. The directory holding the file must exist.

    Raises
    ------
    ConfigError
        The directory does not exist, or a parent is not a directory.
    """
    p = os.fspath(path)
    if not p:
        raise ConfigError(f"{what}={path!r}: empty path")
    if p.endswith("/") or os.path.isdir(p):
        if not os.path.isdir(p):
            raise ConfigError(
                f"{what}={path!r}: the directory {p.rstrip('/') or '/'} does not exist "
                "(a path ending in '/' names a directory: create it first)"
            )
        return os.path.join(p, file_name)
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(parent):
        what_is = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(
            f"{what}={path!r}: the directory {parent} {what_is} (create it, or give an "
            "existing directory or file path)"
        )
    return p


@dataclasses.dataclass(frozen=True)
class Target:
    """What :func:`inspect_target` found at a path (read-only).

    ``kind``: ``"absent"``, ``"empty"`` (no byte, or tierstore's file before its label:
    :data:`.format.UNLABELLED_PAGE`), ``"tierstore"``
    (carries the label), ``"legacy"`` (a tier of the format before labels:
    an extent header at byte 0), ``"foreign"`` (anything else), or
    ``"unreadable"`` (a character device, read through its engine later).
    """

    path: str
    kind: str
    is_device: bool = False
    size_bytes: int | None = None
    label: StoreLabel | None = None
    head: bytes = b""
    detail: str = ""


def is_nvme_generic(path: str, st: os.stat_result) -> bool:
    """Whether the character device ``path`` (its ``os.stat``) is an NVMe generic node (``/dev/ngXnY``).

    Its sysfs entry says (``/sys/dev/char/MAJ:MIN/subsystem`` is the ``nvme-generic`` class, Linux 5.13+);
    where ``/sys`` has no entry for it (a container without ``/sys``), its name does (``ngXnY``).
    """
    entry = f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    if os.path.exists(entry):
        return os.path.basename(os.path.realpath(os.path.join(entry, "subsystem"))) == "nvme-generic"
    return re.fullmatch(r"ng[0-9]+n[0-9]+", os.path.basename(path)) is not None


def inspect_target(path: str, what: str = "tiers.nvme.path") -> Target:
    """Look at an NVMe tier's file or device without changing it (plain reads, no lock).

    Raises
    ------
    ConfigError
        ``path`` is a directory, not a file or device, a character device other than an NVMe
        generic node (:func:`is_nvme_generic`), or cannot be read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Target(path, "absent")
    except OSError as e:
        raise ConfigError(f"{what}={path!r}: cannot inspect: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}={path!r}: is a directory (its tier file is {DEFAULT_FILE_NAME} inside)")
    if stat.S_ISCHR(st.st_mode):
        if not is_nvme_generic(path, st):
            raise ConfigError(
                f"{what}={path!r}: a character device that is not an NVMe generic device "
                "(/dev/ngXnY); an NVMe tier is a file, a block device or an NVMe generic node"
            )
        return Target(path, "unreadable", is_device=True)
    is_blk = stat.S_ISBLK(st.st_mode)
    if not (is_blk or stat.S_ISREG(st.st_mode)):
        raise ConfigError(f"{what}={path!r}: not a regular file or a device")
    if not is_blk and st.st_size == 0:
        return Target(path, "empty", size_bytes=0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{what}={path!r}: cannot open to check what it holds: {e.strerror}") from None
    try:
        size = os.lseek(fd, 0, os.SEEK_END) if is_blk else st.st_size
        head = os.pread(fd, LABEL_BYTES, 0)
    except OSError as e:
        raise ConfigError(f"{what}={path!r}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        label = decode_label(head)
    except CorruptData as e:
        return Target(path, "foreign", is_blk, size, None, head[:16], detail=str(e))
    if label is not None:
        return Target(path, "tierstore", is_blk, size, label, head[:16])
    if head[:8] == fmt.MAGIC:
        return Target(path, "legacy", is_blk, size, None, head[:16])
    if not is_blk and head == fmt.UNLABELLED_PAGE:  # tierstore's own, its label not written yet
        return Target(path, "empty", is_blk, size, None, head[:16])
    return Target(path, "foreign", is_blk, size, None, head[:16])


#: How a user says ``format: true`` in each way of opening a tier's file (tierstore bench never opens an
#: existing file as a KV job's tier: it refuses one before this check, whatever ``format`` says).
FORMAT_HOW = "format: true in tiers.nvme, nvme_format=True in KVStore(...)"
#: The same for a device, which ``tierstore bench`` also opens (``device=/dev/ngXnY``).
FORMAT_HOW_DEVICE = f"{FORMAT_HOW}, --format=1 with device=/dev/... in tierstore bench"


def refusal(t: Target, what: str = "tiers.nvme.path") -> str:
    """The one-line message of a target that may be written only with ``format: true``."""
    size = format_bytes(t.size_bytes) if t.size_bytes is not None else "unknown size"
    found = f"first bytes {t.head.hex(' ')}" if t.head else "contents unknown"
    how = FORMAT_HOW_DEVICE if t.is_device else FORMAT_HOW
    if t.kind == "legacy":
        return (
            f"{what}={t.path!r}: holds a tierstore NVMe tier of the earlier format without a label "
            f"({size}); this tierstore cannot reopen it. Its blocks are a cache: delete the file, or "
            "reformat "
            f"it ({how}). Nothing was written"
        )
    if t.is_device:
        return (
            f"{what}={t.path!r}: a {size} device without tierstore's label ({found}); formatting it destroys "
            f"what it holds, so tierstore does it only when told to ({how}). Nothing was written"
        )
    why = f"a damaged tierstore label ({t.detail})" if t.detail else f"no tierstore label, {found}"
    return (
        f"{what}={t.path!r}: an existing {size} file with data tierstore did not write ({why}); tierstore "
        f"writes only to files it created: give a new path or an empty file, or let it overwrite this one "
        f"({FORMAT_HOW}); if it is a tierstore tier whose label was damaged, its blocks are a cache that "
        "cannot be trusted, and formatting it loses only that cache. Nothing was written"
    )


def check_target(path: str, *, format: bool = False, what: str = "tiers.nvme.path") -> Target:
    """Refuse a target tierstore may not write to (module doc); changes nothing.

    Parameters
    ----------
    path : str
        The tier's file or device (after :func:`resolve_nvme_path`).
    format : bool
        The user allowed formatting (``tiers.nvme.format``): a target without
        the label is accepted (and formatted when the tier opens).

    Returns
    -------
    Target
        What was found (its ``label`` gives the geometry to reopen with).

    Raises
    ------
    ForeignDataError
        A non-empty file or a device without tierstore's label, without ``format``.
    ConfigError
        The path cannot be inspected (see :func:`inspect_target`).
    """
    t = inspect_target(path, what)
    if t.kind in ("foreign", "legacy") and not format:
        raise ForeignDataError(refusal(t, what))
    return t
