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
