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
