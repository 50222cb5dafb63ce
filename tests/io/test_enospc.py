"""ENOSPC on a real, small file system (loop-mounted ext4): the store is
rejected with NO_SPACE and existing entries stay intact."""

import contextlib
import os

import pytest
import torch

from tierstore.errors import Status
from tierstore.io import SegmentStorage

from . import loopfs
from .test_segments import content


@pytest.fixture
def small_fs():
    """A 16 MiB ext4, loop-mounted for this test only (see tests/io/loopfs.py:
    unmounted on teardown, and cannot outlive the test process)."""
    why = loopfs.unavailable_reason()
    if why:
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        try:
            mnt = stack.enter_context(loopfs.loop_ext4(16 << 20))
        except loopfs.MountUnavailable as exc:
            pytest.skip(str(exc))
        yield mnt


@pytest.mark.parametrize("engine", ["posix", "uring"])
def test_enospc_rejects_store_and_keeps_entries(small_fs, engine):
    bb = 64 << 10
    path = str(small_fs / "store.bin")
    # 64 MiB sparse store on a 16 MiB file system: the file system fills first.
    s = SegmentStorage(
        path, 64 << 20, bb, segment_size_bytes=1 << 20, engine=engine, extent_size_bytes=256 << 10
    )
    try:
        _fill_and_check(s, bb)
    finally:
        s.close()
    s = SegmentStorage(
        path, 64 << 20, bb, segment_size_bytes=1 << 20, engine=engine, extent_size_bytes=256 << 10
    )
    try:
        assert len(s.keys()) > 25
        for k in s.keys():
            d = torch.empty(bb, dtype=torch.uint8)
            assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, bb))
    finally:
        s.close()


def _fill_and_check(s, bb):
    stored, rejected = [], 0
    for _ in range(400):
        keys = [os.urandom(32) for _ in range(4)]
        st = s.put(keys, [content(k, bb) for k in keys])
        stored += [k for k, x in zip(keys, st) if x is Status.OK]
        if Status.NO_SPACE in st:
            rejected += st.count(Status.NO_SPACE)
            assert set(st) <= {Status.OK, Status.NO_SPACE}
            for k, x in zip(keys, st):
                assert s.contains(k) == (x is Status.OK)
            break
    assert rejected > 0, "file system never filled"
    # segments are allocated whole (fallocate) before they are written, so the
    # full file system shows at segment allocation, before any data is written
    assert s.stats()["preallocate_errors"] > 0
    assert len(stored) > 50
    for k in stored:
        d = torch.empty(bb, dtype=torch.uint8)
        assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, bb))
    # another put is still rejected cleanly
    k = os.urandom(32)
    assert s.put([k], [content(k, bb)]) == [Status.NO_SPACE] and not s.contains(k)
    # deleting whole segments punches holes: the file system gets space back
    s.delete(stored[: len(stored) // 2])
    assert s.stats()["segments_reclaimed"] > 0
    k2 = [os.urandom(32) for _ in range(4)]
    assert s.put(k2, [content(k, bb) for k in k2]) == [Status.OK] * 4
    assert set(s.keys()) == set(stored[len(stored) // 2 :]) | set(k2)


def test_enospc_when_segment_0_is_reused_keeps_the_label_and_the_data(small_fs):
    """A full file system when segment 0, reclaimed, is allocated again: the failed fallocate
    is punched back out, and that must not take the label page with it (the tier would not
    reopen: found by the node soak, bench/node_soak.py)."""
    from tierstore.io import label as lbl

    bb = 64 << 10
    path = str(small_fs / "store.bin")
    geometry = {"segment_size_bytes": 1 << 20, "extent_size_bytes": 256 << 10}
    s = SegmentStorage(path, 8 << 20, bb, **geometry)
    filler = small_fs / "filler"
    try:
        keys = [os.urandom(32) for _ in range(24)]
        for i in range(0, 24, 4):  # segment 0, then segment 1
            assert s.put(keys[i : i + 4], [content(k, bb) for k in keys[i : i + 4]]) == [Status.OK] * 4
        first = [k for k in keys if s.locate(k)[0] == 0]
        s.delete(first)
        assert s.stats()["segments_reclaimed"] >= 1
        kept = [k for k in keys if s.contains(k)]
        with open(filler, "wb") as f:  # every free byte of the file system
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\xa5" * (64 << 10))
                    f.flush()
        for _ in range(40):  # fill the open segment; the next one (segment 0) cannot be allocated
            k = os.urandom(32)
            if s.put([k], [content(k, bb)]) == [Status.NO_SPACE]:
                break
            kept.append(k)
        assert s.stats()["preallocate_errors"] > 0
    finally:
        s.close()
        filler.unlink()
    with open(path, "rb") as f:
        assert lbl.decode_label(f.read(lbl.LABEL_BYTES)) is not None
    s = SegmentStorage(path, 8 << 20, bb, **geometry)
    try:
        for k in kept:
            d = torch.empty(bb, dtype=torch.uint8)
            assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, bb))
    finally:
        s.close()


def test_segment_allocation_never_covers_the_label(tmp_path):
    """Every range the store asks the engine to allocate lies past the label page (a failed
    allocation is punched back out: that must never reach the label)."""
    from tierstore.io import label as lbl

    bb = 64 << 10
    s = SegmentStorage(
        str(tmp_path / "s.bin"), 16 << 20, bb, segment_size_bytes=1 << 20, extent_size_bytes=256 << 10
    )
    asked: list[tuple[int, int]] = []
    real = s.engine.preallocate

    def record(offset, length):
        asked.append((offset, length))
        return real(offset, length)

    s.engine.preallocate = record
    s._segs._preallocate = record
    try:
        for _ in range(12):
            keys = [os.urandom(32) for _ in range(8)]
            assert s.put(keys, [content(k, bb) for k in keys]) == [Status.OK] * 8
    finally:
        s.close()
    assert any(off < (1 << 20) for off, _ in asked), "segment 0 was never allocated"
    assert all(off >= lbl.LABEL_BYTES for off, _ in asked)


def test_a_file_system_that_fills_after_start_shows_in_usable_bytes(small_fs):
    """Fresh-user trial 11: another process filled the NVMe tier's file system after start; puts
    kept being acknowledged by evicting older blocks and the tier looked whole (put_no_space 0,
    capacity unchanged). usable_bytes says what the tier can use, and comes back with the room."""
    bb, seg = 64 << 10, 1 << 20
    s = SegmentStorage(
        str(small_fs / "store.bin"), 8 << 20, bb, segment_size_bytes=seg, extent_size_bytes=256 << 10
    )
    filler = small_fs / "filler"
    try:
        whole = s.capacity_blocks() * bb  # the unit of the store's capacity_bytes()
        assert "usable_bytes" not in s.stats()  # only while the tier is short of its capacity
        k = [os.urandom(32) for _ in range(4)]
        assert s.put(k, [content(x, bb) for x in k]) == [Status.OK] * 4
        with open(filler, "wb") as f:  # another process fills the file system
            with contextlib.suppress(OSError):
                while True:
                    f.write(bytes(1 << 20))
        for _ in range(200):
            k = [os.urandom(32) for _ in range(4)]
            s.put(k, [content(x, bb) for x in k])
            if s.stats()["preallocate_errors"]:
                break
        st = s.stats()
        assert st["preallocate_errors"] > 0
        assert 0 < st["usable_bytes"] < whole
        held = s.n_segments - st["segments_free"]
        assert st["usable_bytes"] == s.capacity_blocks() * held // s.n_segments * bb
        filler.unlink()  # room again: once more segments hold space, the tier is whole again
        for _ in range(200):
            k = [os.urandom(32) for _ in range(4)]
            s.put(k, [content(x, bb) for x in k])
            if s.stats()["segments_free"] == 0:
                break
        assert "usable_bytes" not in s.stats()  # whole again
    finally:
        s.close()
