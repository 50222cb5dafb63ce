"""tierstore's own io_uring (tierstore/io/ring.py): raw ring round trips with
SQE64 and SQE128|CQE32, error and short completions, more requests than ring
slots, concurrent submitters, the availability probe and the posix fallback,
and that no third-party native library is loaded."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from tierstore.io import alloc_aligned, factory, open_engine
from tierstore.io import ring as R
from tierstore.io.engine import ShortIOError
from tierstore.io.posix import PosixEngine
from tierstore.io.uring import UringEngine

RING_SIZES = [pytest.param(False, False, id="sqe64"), pytest.param(True, True, id="sqe128-cqe32")]


def _direct_file(tmp_path, size_bytes: int) -> int:
    fd = os.open(tmp_path / "ring.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, size_bytes)
    return fd


def _iovecs(*pairs: tuple[int, int]):
    arr = (ctypes.c_uint64 * (2 * len(pairs)))()
    for i, (addr, n) in enumerate(pairs):
        arr[2 * i], arr[2 * i + 1] = addr, n
    return arr


def _addr(t: torch.Tensor) -> int:
    return t.data_ptr()


@pytest.mark.uring
@pytest.mark.parametrize("sqe128,cqe32", RING_SIZES)
def test_readv_writev_round_trip(tmp_path, sqe128, cqe32):
    fd = _direct_file(tmp_path, 1 << 20)
    keep, src = alloc_aligned(3 * 4096)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    keep2, dst = alloc_aligned(3 * 4096)
    try:
        with R.Ring(4, sqe128=sqe128, cqe32=cqe32) as ring:
            assert (ring.sqe_bytes, ring.cqe_bytes) == ((128, 32) if sqe128 else (64, 16))
            # one writev of two iovecs (8 KiB + 4 KiB) at offset 64 KiB
            wv = _iovecs((_addr(src), 8192), (_addr(src) + 8192, 4096))
            ring.prep_writev(fd, ctypes.addressof(wv), 2, 65536, user_data=1)
            sqe = ring.sqe_bytes_at(-1)
            assert len(sqe) == ring.sqe_bytes and sqe[0] == R.IORING_OP_WRITEV
            got = ring.submit_and_wait(1)
            assert [(ud, res) for ud, res, _ in got] == [(1, 3 * 4096)]
            assert all(len(big) == (16 if cqe32 else 0) for _, _, big in got)
            rv = _iovecs((_addr(dst), 3 * 4096))
            ring.prep_readv(fd, ctypes.addressof(rv), 1, 65536, user_data=2)
            got = ring.submit_and_wait(1)
            assert [(ud, res) for ud, res, _ in got] == [(2, 3 * 4096)]
            assert torch.equal(src, dst)
            # fixed-address READ/WRITE (no iovec)
            dst.zero_()
            ring.prep_write(fd, _addr(src), 4096, 0, user_data=3)
            ring.prep_read(fd, _addr(dst), 4096, 65536 + 4096, user_data=4)
            res = {}
            while len(res) < 2:
                res.update((ud, r) for ud, r, _ in ring.submit_and_wait(1))
            assert res == {3: 4096, 4: 4096}
            assert torch.equal(dst[:4096], src[4096:8192])
    finally:
        os.close(fd)


@pytest.mark.uring
@pytest.mark.parametrize("sqe128,cqe32", RING_SIZES)
def test_error_and_short_completions(tmp_path, sqe128, cqe32):
    fd = _direct_file(tmp_path, 8192)  # an 8 KiB file
    keep, buf = alloc_aligned(16384)
    try:
        with R.Ring(8, sqe128=sqe128, cqe32=cqe32) as ring:
            ring.prep_read(fd, _addr(buf), 16384, 4096, user_data=1)  # crosses EOF: short
            ring.prep_read(fd, _addr(buf), 4096, 65536, user_data=2)  # past EOF: 0 bytes
            ring.prep_write(fd, _addr(buf), 1000, 0, user_data=3)  # O_DIRECT, unaligned size
            ring.prep_read(-1, _addr(buf), 4096, 0, user_data=4)  # bad fd
            ring.prep_nop(user_data=5)
            res = {}
            while len(res) < 5:
                res.update((ud, r) for ud, r, _ in ring.submit_and_wait(1))
            assert res == {1: 4096, 2: 0, 3: -errno.EINVAL, 4: -errno.EBADF, 5: 0}
    finally:
        os.close(fd)


@pytest.mark.uring
def test_sq_full_is_an_error_not_an_overwrite():
    with R.Ring(2) as ring:
        for i in range(ring.sq_entries):
            ring.prep_nop(i)
        with pytest.raises(R.IoUringError) as ei:
            ring.prep_nop(99)
        assert ei.value.errno == errno.EBUSY
        got = ring.submit_and_wait(ring.sq_entries)
        assert sorted(ud for ud, _, _ in got) == list(range(ring.sq_entries))
    ring.close()  # idempotent
    with pytest.raises(R.IoUringError):
        ring.prep_nop(1)


@pytest.mark.uring
def test_uring_cmd_needs_sqe128_and_fits_80_bytes():
    with R.Ring(2) as ring:
        with pytest.raises(R.IoUringError):
            ring.prep_uring_cmd(-1, 0, b"x", 1)
    with R.Ring(2, sqe128=True, cqe32=True) as ring:
        with pytest.raises(R.IoUringError):
            ring.prep_uring_cmd(-1, 0, bytes(81), 1)
        ring.prep_uring_cmd(-1, 0xC0484E80, b"\x01" * 72, 7)
        sqe = ring.sqe_bytes_at(-1)
        assert sqe[0] == R.IORING_OP_URING_CMD and sqe[48:120] == b"\x01" * 72 and sqe[120:] == bytes(8)
        ((ud, res, big),) = ring.submit_and_wait(1)
        assert ud == 7 and res == -errno.EBADF and len(big) == 16


@pytest.mark.uring
def test_queue_runs_more_requests_than_ring_slots():
    q = R.RingQueue(R.Ring(4), max_inflight=4)
    seen = []
    for i in range(200):
        q.submit_nop(lambda res, arg, big: seen.append((arg, res)), arg=i)
    q.drain()
    assert sorted(seen) == [(i, 0) for i in range(200)] and q.inflight == 0
    q.close()


@pytest.mark.uring
def test_queue_fails_what_the_kernel_refused(monkeypatch):
    """An io_uring_enter error fails the requests it could not submit (their
    callbacks get -errno, their slots come back) instead of leaving them queued."""
    q = R.RingQueue(R.Ring(4), max_inflight=4)
    got = []

    def refuse(wait_nr=0):
        raise R.IoUringError(errno.EFAULT, "injected")

    monkeypatch.setattr(q.ring, "submit", refuse)
    q.submit_nop(lambda res, arg, big: got.append(res))
    assert got == [-errno.EFAULT] and q.inflight == 0 and q.ring.sq_pending() == 0
    monkeypatch.undo()
    q.submit_nop(lambda res, arg, big: got.append(res))
    q.drain()
    assert got == [-errno.EFAULT, 0]
    q.close()


@pytest.mark.uring
def test_engine_many_pieces_beyond_iodepth(tmp_path):
    """1 MiB in 4 KiB pieces at iodepth 2: 256 SQEs through a 2-entry ring."""
    eng = UringEngine(str(tmp_path / "d.bin"), 4 << 20, iodepth=2, max_io_bytes=4096)
    keep, src = alloc_aligned(1 << 20)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    keep2, dst = alloc_aligned(1 << 20)
    assert eng.write(8192, src).get() == 1 << 20
    assert eng.read(8192, dst).get() == 1 << 20
    assert torch.equal(src, dst)
    eng.close()


@pytest.mark.uring
def test_engine_short_read_and_error_cqe_raise(tmp_path):
    path = str(tmp_path / "d.bin")
    eng = UringEngine(path, 64 << 10, iodepth=4, max_io_bytes=8192)
    keep, buf = alloc_aligned(16384)
    os.truncate(path, 8192)  # the file shrinks behind the engine's back
    with pytest.raises(ShortIOError) as ei:
        eng.read(0, buf).get()
    assert (ei.value.got, ei.value.want) == (8192, 16384)
    ro = os.open(path, os.O_RDONLY | os.O_DIRECT)
    os.dup2(ro, eng.fd)  # now writes through eng.fd fail with EBADF
    os.close(ro)
    fut = eng.write(0, buf)
    with pytest.raises(OSError) as ei:
        fut.get()
    assert ei.value.errno == errno.EBADF and fut.done()
    assert eng.stats()["write_errors"] == 1
    eng.close()


@pytest.mark.uring
def test_engine_concurrent_submitters(tmp_path):
    """Four threads write and read back their own regions through one ring of 4 slots."""
    eng = UringEngine(str(tmp_path / "d.bin"), 16 << 20, iodepth=4, max_io_bytes=64 << 10)
    errors = []

    def worker(k: int) -> None:
        try:
            keep, src = alloc_aligned(1 << 20)
            keep2, dst = alloc_aligned(1 << 20)
            g = torch.Generator().manual_seed(k)
            for it in range(8):
                src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=g))
                off = (k * 4 + it % 4) << 20
                eng.write(off, src).get()
                f = eng.read(off, dst)
                if k % 2:  # half the threads poll, half block in get()
                    while not f.done():
                        pass
                assert f.get() == 1 << 20 and torch.equal(src, dst), (k, it)
        except BaseException as exc:  # noqa: BLE001 (reported below with the thread's id)
            errors.append((k, exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a submitter hung"
    assert errors == []
    assert eng._queue.inflight == 0
    eng.close()


# ------------------------------------------------------------- availability
@pytest.fixture
def io_uring_disabled(monkeypatch):
    """io_uring_setup fails with EPERM and the sysctl reads 2, as under
    ``kernel.io_uring_disabled=2``; the probe's cache is cleared around the test."""
    real = R._syscall()

    def fake(nr, *args):
        if nr == R._NR_SETUP:
            ctypes.set_errno(errno.EPERM)
            return -1
        return real(nr, *args)

    monkeypatch.delenv("TIERSTORE_IO_URING", raising=False)
    monkeypatch.setattr(R, "_syscall", lambda: fake)
    monkeypatch.setattr(R, "_sysctl_disabled", lambda: 2)
    monkeypatch.setattr(factory, "_fallbacks_logged", set())
    R.uring_available.cache_clear()
    yield
    R.uring_available.cache_clear()


def test_probe_reports_the_reason(io_uring_disabled):
    ok, why = R.uring_available()
    assert not ok and "EPERM" in why and "kernel.io_uring_disabled=2" in why
    with pytest.raises(R.IoUringUnavailable) as ei:
        R.Ring(4)
    assert ei.value.errno == errno.EPERM


def test_auto_falls_back_to_posix_with_one_log_line(io_uring_disabled, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tierstore.io")
    engines = [open_engine("auto", str(tmp_path / f"d{i}.bin"), 1 << 20) for i in range(3)]
    try:
        assert all(isinstance(e, PosixEngine) for e in engines)
        keep, buf = alloc_aligned(4096)
        buf.fill_(5)
        assert engines[0].write(0, buf).get() == 4096
    finally:
        for e in engines:
            e.close()
    lines = [r for r in caplog.records if r.name == "tierstore.io"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "io_uring unavailable" in msg and "kernel.io_uring_disabled=2" in msg and "posix" in msg


def test_explicit_uring_unavailable_raises_before_opening(io_uring_disabled, tmp_path):
    path = tmp_path / "d.bin"
    with pytest.raises(R.IoUringUnavailable) as ei:
        open_engine("uring", str(path), 1 << 20)
    assert "ioengine=uring" in str(ei.value) and "kernel.io_uring_disabled=2" in str(ei.value)
    assert not path.exists()


def test_bench_cli_explicit_uring_unavailable_is_a_clear_error(io_uring_disabled, tmp_path, capsys):
    from tierstore.bench.cli import main

    rc = main(
        [
            "--name=x",
            "--ioengine=uring",
            "--rw=write",
            "--bs=64k",
            "--size=1m",
            f"--filename={tmp_path / 'x.bin'}",
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "io_uring" in err and "kernel.io_uring_disabled=2" in err
    assert "Traceback" not in err


def test_environment_switch_disables_io_uring(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TIERSTORE_IO_URING", "0")
    monkeypatch.setattr(factory, "_fallbacks_logged", set())
    R.uring_available.cache_clear()
    try:
        assert R.uring_available() == (False, "TIERSTORE_IO_URING=0 in the environment")
        with caplog.at_level(logging.WARNING, logger="tierstore.io"):
            eng = open_engine("auto", str(tmp_path / "d.bin"), 1 << 20)
        eng.close()
        assert isinstance(eng, PosixEngine) and "TIERSTORE_IO_URING=0" in caplog.text
        with pytest.raises(R.IoUringUnavailable):
            open_engine("uring", str(tmp_path / "d.bin"), 1 << 20)
    finally:
        R.uring_available.cache_clear()


def test_other_architectures_are_refused(monkeypatch):
    monkeypatch.delenv("TIERSTORE_IO_URING", raising=False)
    monkeypatch.setattr(R.platform, "machine", lambda: "aarch64")
    R.uring_available.cache_clear()
    try:
        ok, why = R.uring_available()
        assert not ok and "x86-64" in why and "aarch64" in why
        with pytest.raises(R.IoUringUnavailable):
            R.Ring(4)
    finally:
        R.uring_available.cache_clear()


@pytest.mark.uring
def test_no_third_party_native_library_is_loaded(tmp_path):
    """Creating rings and doing I/O maps no new shared object (only libc, already
    mapped, is reached through ctypes.CDLL(None)) and imports no liburing. tierstore's own
    ``tierstore.io._ringloop`` (built from tierstore/io/_ringloop.c with the compiler's default
    -march, the plain jobs' C turn) is the one exception."""
    code = f"""
import sys
import tierstore.io  # torch, numpy: loaded before the snapshot
def sos():
    with open("/proc/self/maps") as f:
        return {{l.split()[-1] for l in f if ".so" in l.split()[-1]}}
before = sos()
from tierstore.io import alloc_aligned, open_engine
from tierstore.io.ring import Ring, uring_available
from tierstore.fdp.passthrough import IoUring
assert uring_available() == (True, ""), uring_available()
e = open_engine("uring", {str(tmp_path / "d.bin")!r}, 1 << 20)
keep, buf = alloc_aligned(8192)
e.write(0, buf).get(); e.read(0, buf).get(); e.close()
with IoUring(4, big=True) as r:
    r.prep_nop(1); r.submit_and_wait(1)
new = {{p for p in sos() - before if "/tierstore/io/_ringloop." not in p}}
assert not new, new
assert not [m for m in sys.modules if "liburing" in m], sorted(sys.modules)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
