"""The NVMe tier's label and the check before any write (:mod:`tierstore.io.label`, issue 22 items 1, 3, 4,
13)."""

from __future__ import annotations

import fcntl
import hashlib
import os

import pytest
import torch

from tierstore.errors import ConfigError, CorruptData, ForeignDataError, Status
from tierstore.io import SegmentStorage, label
from tierstore.io import format as fmt
from tierstore.io._fileops import lock_holder_pid, process_alive
from tierstore.io.label import (
    LABEL_BYTES,
    StoreLabel,
    check_target,
    decode_label,
    inspect_target,
    resolve_nvme_path,
)
from tierstore.io.posix import PosixEngine

from .test_segments import content

BB = 16 << 10
SEG = 256 << 10


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_label_round_trip_and_damage():
    page = StoreLabel(SEG, BB, 12).encode()
    assert len(page) == LABEL_BYTES and page[:8] == b"TSKVLBL1"
    got = decode_label(page)
    assert (got.segment_size_bytes, got.block_bytes, got.n_segments) == (SEG, BB, 12) and len(
        got.store_id
    ) == 16
    assert decode_label(bytes(LABEL_BYTES)) is None and decode_label(os.urandom(LABEL_BYTES)) is None
    for byte in (8, 16, 24, 32, 40, 60):  # every field is under the CRC
        bad = bytearray(page)
        bad[byte] ^= 1
        with pytest.raises(CorruptData):
            decode_label(bytes(bad))


def test_the_one_path_rule(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert resolve_nvme_path(str(d)) == str(d / "tierstore.nvme")
    assert resolve_nvme_path(str(d) + "/") == str(d) + "/tierstore.nvme"
    assert resolve_nvme_path(str(d), file_name="rank0.nvme") == str(d / "rank0.nvme")
    assert resolve_nvme_path(str(tmp_path / "kv")) == str(tmp_path / "kv")  # no extension: a file
    with pytest.raises(ConfigError, match="a path ending in '/' names a directory"):
        resolve_nvme_path(str(tmp_path / "new") + "/")
    with pytest.raises(ConfigError, match=r"the directory .*/missing does not exist"):
        resolve_nvme_path(str(tmp_path / "missing" / "kv"))
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_nvme_path(str(tmp_path / "f" / "kv"))
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]  # nothing created


def test_inspect_tells_what_a_path_holds(tmp_path):
    assert inspect_target(str(tmp_path / "none")).kind == "absent"
    (tmp_path / "empty").write_bytes(b"")
    assert inspect_target(str(tmp_path / "empty")).kind == "empty"
    with open(tmp_path / "holes", "wb") as f:
        f.truncate(64 << 20)
    assert inspect_target(str(tmp_path / "holes")).kind == "foreign"  # not empty, not provably ours
    with open(tmp_path / "marked", "wb") as f:  # tierstore's file before its label (format.UNLABELLED_PAGE)
        f.write(fmt.UNLABELLED_PAGE)
        f.truncate(64 << 20)
    assert inspect_target(str(tmp_path / "marked")).kind == "empty"
    with open(tmp_path / "marked_more", "wb") as f:  # the mark, then one more byte on its page: not ours
        f.write(fmt.UNLABELLED_PAGE[:-1] + b"x")
    assert inspect_target(str(tmp_path / "marked_more")).kind == "foreign"
    with open(tmp_path / "late", "wb") as f:  # zeros at the start, data further in: not empty
        f.seek(8 << 20)
        f.write(b"data")
    t = inspect_target(str(tmp_path / "late"))
    assert t.kind == "foreign" and t.head == bytes(16)
    (tmp_path / "legacy").write_bytes(fmt.MAGIC + bytes(8184))
    assert inspect_target(str(tmp_path / "legacy")).kind == "legacy"
    (tmp_path / "ours").write_bytes(StoreLabel(SEG, BB, 8).encode())
    t = inspect_target(str(tmp_path / "ours"))
    assert t.kind == "tierstore" and t.label.segment_size_bytes == SEG
    with pytest.raises(ConfigError, match="a character device that is not an NVMe generic device"):
        inspect_target("/dev/null")
    with pytest.raises(ConfigError, match="is a directory"):
        inspect_target(str(tmp_path))
    for name in ("holes", "late", "legacy"):
        with pytest.raises(ForeignDataError):
            check_target(str(tmp_path / name))
        assert check_target(str(tmp_path / name), format=True).kind in ("foreign", "legacy")


def test_segment_storage_refuses_a_foreign_file_before_any_write(tmp_path):
    """SegmentStorage opened from a path checks it first; given an engine (as for /dev/ngXnY, which
    read(2) cannot read), it checks the label through the engine."""
    p = tmp_path / "x.bin"
    p.write_bytes(os.urandom(8 * SEG))
    before = _sha(p)
    with pytest.raises(ForeignDataError, match="first bytes"):
        SegmentStorage(str(p), 8 * SEG, BB, segment_size_bytes=SEG)
    eng = PosixEngine(str(p), 8 * SEG)  # the file is as large as the engine: opening it wrote nothing
    try:
        with pytest.raises(ForeignDataError, match="first bytes"):
            SegmentStorage(str(p), 8 * SEG, BB, segment_size_bytes=SEG, engine=eng, label=True)
    finally:
        eng.close()
    assert _sha(p) == before


def test_format_zeroes_every_chain_start_so_nothing_older_is_recovered(tmp_path):
    """A target holding an unlabelled tier (the earlier format) is formatted with format=True: the
    chains it held are never recovered, in this open or the next."""
    p = str(tmp_path / "old.nvme")
    old = SegmentStorage(p, 8 * SEG, BB, segment_size_bytes=SEG, label=False)
    keys = [os.urandom(32) for _ in range(60)]
    for i in range(0, 60, 4):
        assert old.put(keys[i : i + 4], [content(k, BB) for k in keys[i : i + 4]]) == [Status.OK] * 4
    assert len({old.locate(k)[0] for k in keys}) >= 3
    old.close()
    with pytest.raises(ForeignDataError, match="earlier format"):
        SegmentStorage(p, 8 * SEG, BB, segment_size_bytes=SEG)
    for _ in range(2):
        s = SegmentStorage(p, 8 * SEG, BB, segment_size_bytes=SEG, format=True)
        try:
            assert len(s) == 0 and s.stats()["recovered_blocks"] == 0
        finally:
            s.close()


def test_grow_and_shrink_keep_the_label_geometry(tmp_path):
    p = str(tmp_path / "kv.nvme")
    s = SegmentStorage(p, 8 * SEG, BB, segment_size_bytes=SEG)
    keys = [os.urandom(32) for _ in range(40)]
    for i in range(0, 40, 4):
        assert s.put(keys[i : i + 4], [content(k, BB) for k in keys[i : i + 4]]) == [Status.OK] * 4
    where = {k: s.locate(k)[0] for k in keys}
    s.close()
    s = SegmentStorage(p, 16 * SEG, BB, segment_size_bytes=SEG)  # grow: every block
    assert len(s) == 40 and s.stats()["recovery_dropped_blocks"] == 0
    s.close()
    with open(p, "rb") as f:
        assert decode_label(f.read(LABEL_BYTES)).n_segments == 16
    s = SegmentStorage(p, 2 * SEG, BB, segment_size_bytes=SEG)  # shrink to 2 segments
    try:
        kept = sum(1 for v in where.values() if v < 2)
        st = s.stats()
        assert len(s) == st["recovered_blocks"] == kept and st["recovery_dropped_blocks"] == 40 - kept > 0
        for k in keys:
            d = torch.empty(BB, dtype=torch.uint8)
            ok = s.get([k], [d])[0]
            assert (ok is Status.OK and torch.equal(d, content(k, BB))) if where[k] < 2 else ok is Status.MISS
    finally:
        s.close()
    with pytest.raises(ConfigError, match="formatted with segment_size_bytes=262144, opened with 524288"):
        SegmentStorage(p, 16 * SEG, BB, segment_size_bytes=2 * SEG)
    with pytest.raises(ConfigError, match=r"holds blocks of 16384 bytes, but was opened for 8192"):
        SegmentStorage(p, 8 * SEG, BB // 2, segment_size_bytes=SEG)


def test_lock_holder_is_read_from_proc_locks(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"")
    fd = os.open(p, os.O_RDWR)
    other = os.open(p, os.O_RDONLY)
    try:
        assert lock_holder_pid(other) is None
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert lock_holder_pid(other) == os.getpid()
        assert process_alive(os.getpid())
    finally:
        os.close(fd)
        os.close(other)
    assert not process_alive(2**22 + 12345)  # above pid_max's limit: no such process


def test_only_an_nvme_generic_character_device_is_a_tier_target(monkeypatch):
    """/dev/null (a character device, not /dev/ngXnY) used to pass the check and fail at open with
    "the file system refuses O_DIRECT (e.g. tmpfs)"."""
    with pytest.raises(ConfigError) as err:
        check_target("/dev/null", format=True)
    assert "'/dev/null': a character device that is not an NVMe generic device (/dev/ngXnY)" in str(err.value)
    assert "O_DIRECT" not in str(err.value)
    st = os.stat("/dev/null")
    assert not label.is_nvme_generic("/dev/null", st)
    monkeypatch.setattr(label, "is_nvme_generic", lambda path, st: True)  # what /dev/ng0n1 is
    assert inspect_target("/dev/null").kind == "unreadable"


def test_only_a_device_refusal_offers_benchs_format(tmp_path):
    """A KV job of tierstore bench never opens an existing file (it refuses one first), so a file's refusal
    must not offer --format=1 in tierstore bench; a device's (device=/dev/...) may."""
    (tmp_path / "f").write_bytes(b"user data")
    with pytest.raises(ForeignDataError) as err:
        check_target(str(tmp_path / "f"))
    assert "nvme_format=True in KVStore(...)" in str(err.value) and "tierstore bench" not in str(err.value)
    dev = label.refusal(label.Target("/dev/ng9n1", "foreign", True, 1 << 30, None, b"\x01" * 16))
    assert "--format=1 with device=/dev/... in tierstore bench" in dev
