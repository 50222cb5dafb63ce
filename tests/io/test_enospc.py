"""ENOSPC on a real, small file system (loop-mounted ext4): the store is
rejected with NO_SPACE and existing entries stay intact."""
import os
import shutil
import subprocess

import pytest
import torch

from tierstore.errors import Status
from tierstore.io import SegmentStorage

from .test_segments import content


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 for a loop-mounted file system")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"loop mount unavailable: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("engine", ["posix", "uring"])
def test_enospc_rejects_store_and_keeps_entries(small_fs, engine):
    bb = 64 << 10
    path = str(small_fs / "store.bin")
    # 64 MiB sparse store on a 16 MiB file system: the file system fills first.
    s = SegmentStorage(path, 64 << 20, bb, segment_size_bytes=1 << 20, engine=engine,
                       extent_size_bytes=256 << 10)
    try:
        _fill_and_check(s, bb)
    finally:
        s.close()
    s = SegmentStorage(path, 64 << 20, bb, segment_size_bytes=1 << 20, engine=engine,
                       extent_size_bytes=256 << 10)
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
    assert set(s.keys()) == set(stored[len(stored) // 2:]) | set(k2)
