"""tierstore's own copy threading (io/copies.py): every piece once, one OpenMP thread per copying
thread, the caller's torch setting restored, and no wait for a helper that never started."""

from __future__ import annotations

import threading

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.io.copies import OMP_SET, Copier, one_omp_thread


def test_run_calls_every_piece_once_over_the_copy_threads():
    c = Copier(threads=3, split_bytes=1)
    seen: list[int] = []
    lock = threading.Lock()

    def piece(i):
        def f():
            with lock:
                seen.append(i)

        return f

    try:
        for _ in range(20):
            seen.clear()
            c.run([piece(i) for i in range(50)], nbytes=50)
            assert sorted(seen) == list(range(50))
    finally:
        c.close()


def test_copy_in_pieces_equals_copy():
    c = Copier(threads=2, split_bytes=1 << 10, chunk_bytes=1 << 12)
    src = torch.randint(0, 255, (300, 1000), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    try:
        c.copy(dst, src)
    finally:
        c.close()
    assert torch.equal(dst, src)


def test_a_piece_that_raises_is_raised_by_run_after_the_others_stop():
    c = Copier(threads=2, split_bytes=1)

    def bad():
        raise ValueError("piece 3")

    try:
        with pytest.raises(ValueError, match="piece 3"):
            c.run([lambda: None] * 3 + [bad] + [lambda: None] * 3, nbytes=7)
        c.run([lambda: None] * 4, nbytes=4)  # usable afterwards
    finally:
        c.close()


def test_the_caller_does_not_wait_for_a_helper_that_never_started():
    """A descheduled helper (here: busy with something else) claims nothing; the caller copies it all."""
    c = Copier(threads=2, split_bytes=1)
    release = threading.Event()
    try:
        c._helpers().submit(release.wait, 30)  # the one helper is held
        done: list[int] = []
        t = threading.Thread(target=lambda: c.run([lambda i=i: done.append(i) for i in range(8)], nbytes=8))
        t.start()
        t.join(10)
        assert not t.is_alive(), "run() waited for a helper that had not started"
        assert sorted(done) == list(range(8))
    finally:
        release.set()
        c.close()


@pytest.mark.skipif(OMP_SET is None, reason="no OpenMP runtime loaded by this torch")
def test_copies_use_one_omp_thread_and_leave_the_callers_setting_alone():
    before = torch.get_num_threads()
    c = Copier(threads=2, split_bytes=1)
    inside: list[int] = []
    lock = threading.Lock()

    def piece():
        with lock:
            inside.append(torch.get_num_threads())

    try:
        c.run([piece] * 16, nbytes=16)
    finally:
        c.close()
    assert set(inside) == {1}
    assert torch.get_num_threads() == before
    with one_omp_thread():
        other: list[int] = []
        t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 1
    assert other == [before]  # per thread: another thread keeps torch's setting
    assert torch.get_num_threads() == before


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        Copier(threads=0)
    with pytest.raises(ConfigError):
        Copier(split_bytes=0)


def test_configure_replaces_the_shared_copier_for_later_stores():
    from tierstore.io import copies
    from tierstore.movers.memory import MemoryHandler

    old = copies.shared_copier()
    try:
        new = copies.configure(threads=1, split_bytes=1 << 20, chunk_bytes=1 << 16)
        assert copies.shared_copier() is new and new.threads == 1 and new.chunk_bytes == 1 << 16
        assert MemoryHandler({}).copier is new
    finally:
        copies.configure(old.threads, old.split_bytes, old.chunk_bytes)


def test_extent_pipeline_gathers_scatters_and_maps_over_its_copy_threads(tmp_path):
    from tierstore.io.batch import ExtentPipeline
    from tierstore.io.memory import MemoryEngine
    from tierstore.io.pages import KVPagePool

    pool = torch.randint(0, 255, (4, 2, 6, 4096), dtype=torch.uint8)
    pipe = ExtentPipeline(MemoryEngine(16 << 20), 1 << 20, copy_threads=3)
    try:
        plans = KVPagePool(pool).plans(range(6))
        staging = torch.zeros(6 * pool[:, :, 0].numel(), dtype=torch.uint8)
        offs = [b * pool[:, :, 0].numel() for b in range(6)]
        assert pipe.gather_blocks(plans, staging, offs) == [p.nbytes for p in plans]
        out = torch.zeros_like(pool)
        pipe.scatter_blocks(staging, offs, KVPagePool(out).plans(range(6), destination=True))
        assert torch.equal(out, pool)
        assert pipe.map(lambda x: x * x, range(37)) == [x * x for x in range(37)]
    finally:
        pipe.close()
