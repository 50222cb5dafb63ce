import errno
import os

import numpy as np
import pytest
import torch

from tierstore.errors import AlignmentError, ConfigError
from tierstore.io import alloc_aligned, open_engine
from tierstore.io.memory import MemoryEngine

from .conftest import make_engine


class Recorder:
    def __init__(self):
        self.writes, self.trims = [], []

    def on_write(self, offset_bytes, nbytes, placement):
        self.writes.append((offset_bytes, nbytes, placement))

    def on_trim(self, offset_bytes, nbytes):
        self.trims.append((offset_bytes, nbytes))


@pytest.mark.parametrize("nbytes", [4096, 8192, 3 << 20, (1 << 20) + 4096])
def test_round_trip_bit_exact(engine_kind, tmp_path, nbytes):
    eng = make_engine(engine_kind, tmp_path, 8 << 20, max_io_bytes=1 << 20, iodepth=4)
    keep, src = alloc_aligned(nbytes)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    keep2, dst = alloc_aligned(nbytes)
    assert eng.write(4096, src[:nbytes], placement=3).get() == nbytes
    eng.sync()
    fut = eng.read(4096, dst[:nbytes])
    assert fut.get() == nbytes and fut.done()
    assert torch.equal(src[:nbytes], dst[:nbytes])
    st = eng.stats()
    assert st["bytes_written"] == nbytes and st["bytes_read"] == nbytes
    assert st["bytes_by_placement"] == {3: nbytes}
    eng.close()


def test_numpy_and_mmap_buffers(engine_kind, tmp_path):
    eng = make_engine(engine_kind, tmp_path, 1 << 20)
    keep, t = alloc_aligned(8192)
    arr = t.numpy()
    arr[:] = np.arange(8192, dtype=np.uint8)
    eng.write(0, arr).get()
    keep2, out = alloc_aligned(8192)
    eng.read(0, memoryview(keep2)).get()
    assert bytes(memoryview(keep2)[:8192]) == arr.tobytes()
    eng.close()


@pytest.mark.parametrize("case", ["offset", "length", "address", "bounds", "negative"])
def test_alignment_errors_are_loud(engine_kind, tmp_path, case):
    eng = make_engine(engine_kind, tmp_path, 1 << 20)
    keep, buf = alloc_aligned(3 * 4096)
    with pytest.raises(AlignmentError):
        if case == "offset":
            eng.write(512, buf[:4096])
        elif case == "length":
            eng.write(0, buf[:4095])
        elif case == "address":
            eng.read(0, buf[1:4097])
        elif case == "bounds":
            eng.read((1 << 20) - 4096, buf[:8192])
        else:
            eng.write(-4096, buf[:4096])
    with pytest.raises(AlignmentError):
        eng.trim(100, 4096)
    assert eng.stats()["write_ops"] == 0
    eng.close()


def test_observer_sees_every_completed_write_and_trim(engine_kind, tmp_path):
    eng = make_engine(engine_kind, tmp_path, 4 << 20, max_io_bytes=64 << 10)
    rec = Recorder()
    eng.add_observer(rec)
    keep, buf = alloc_aligned(1 << 20)
    eng.write(0, buf[: 1 << 20], placement=1).get()
    eng.write(1 << 20, buf[:8192]).get()
    eng.trim(0, 1 << 20).get()
    assert rec.writes == [(0, 1 << 20, 1), (1 << 20, 8192, None)]
    assert rec.trims == [(0, 1 << 20)]
    eng.read(0, buf[:4096]).get()
    assert int(buf[:4096].sum()) == 0  # trimmed range reads back zeros
    eng.close()


def test_trim_many_trims_each_range_and_observers_see_each(engine_kind, tmp_path):
    eng = make_engine(engine_kind, tmp_path, 4 << 20, max_io_bytes=64 << 10)
    rec = Recorder()
    eng.add_observer(rec)
    keep, buf = alloc_aligned(1 << 20)
    buf.fill_(7)
    eng.write(0, buf[: 1 << 20]).get()
    ranges = [(8192, 4096), (65536, 3 * 4096), (0, 0), (1 << 19, 8192)]
    assert eng.trim_many(ranges).get() == 4096 + 3 * 4096 + 8192
    assert rec.trims == [(8192, 4096), (65536, 3 * 4096), (1 << 19, 8192)]
    st = eng.stats()
    assert st["trim_ops"] == 3 and st["bytes_trimmed"] == 4096 + 3 * 4096 + 8192
    eng.read(0, buf[: 1 << 20]).get()
    b = buf.numpy()
    for off, n in ranges:
        assert not b[off : off + n].any()  # trimmed ranges read back zeros
    assert (b[4096:8192] == 7).all() and (b[12288:65536] == 7).all()  # neighbours untouched
    eng.close()


def test_trim_many_checks_every_range_before_trimming_any():
    eng = MemoryEngine(1 << 20)
    rec = Recorder()
    eng.add_observer(rec)
    keep, buf = alloc_aligned(8192)
    buf.fill_(1)
    eng.write(0, buf[:8192]).get()
    for bad in ([(0, 4096), (100, 4096)], [(0, 4096), ((1 << 20) - 4096, 8192)]):
        with pytest.raises(AlignmentError):
            eng.trim_many(bad)
    assert rec.trims == [] and eng.stats()["trim_ops"] == 0
    eng.read(0, buf[:8192]).get()
    assert int(buf[:8192].min()) == 1  # nothing was trimmed
    assert eng.trim_many([]).get() == 0


def test_failed_write_is_not_observed_nor_counted():
    eng = MemoryEngine(1 << 20)
    eng.write_limit_bytes = 4096
    rec = Recorder()
    eng.add_observer(rec)
    keep, buf = alloc_aligned(8192)
    with pytest.raises(OSError) as ei:
        eng.write(0, buf[:8192]).get()
    assert ei.value.errno == errno.ENOSPC
    assert rec.writes == [] and eng.stats()["bytes_written"] == 0
    assert eng.stats()["write_errors"] == 1


def test_factory_rejects_unknown_kind(tmp_path):
    with pytest.raises(ConfigError):
        open_engine("spdk", str(tmp_path / "x"), 1 << 20)
    with pytest.raises(ConfigError):
        open_engine("memory", None, 1000)


@pytest.mark.parametrize("kind", ["posix", "uring"])
def test_file_is_opened_with_o_direct(tmp_path, kind):
    import fcntl
    import os

    eng = open_engine(kind, str(tmp_path / "d.bin"), 1 << 20)
    assert fcntl.fcntl(eng.fd, fcntl.F_GETFL) & os.O_DIRECT
    eng.close()


@pytest.mark.parametrize("kind", ["posix", "uring"])
def test_preallocate_allocates_a_range_and_reads_zeros(tmp_path, kind):
    from .conftest import make_engine

    eng = make_engine(kind, tmp_path, 8 << 20)
    path = eng.path
    before = os.stat(path).st_blocks
    eng.preallocate(1 << 20, 4 << 20)
    after = os.stat(path).st_blocks
    assert (after - before) * 512 >= 4 << 20  # allocated, file size unchanged
    assert os.stat(path).st_size == 8 << 20
    keep, buf = alloc_aligned(4096)
    buf.fill_(7)
    eng.read(1 << 20, buf).get()
    assert int(buf.sum()) == 0
    with pytest.raises(AlignmentError):
        eng.preallocate(1, 4096)  # unaligned offset is refused
    eng.close()


def test_preallocate_enospc_releases_the_partial_range(tmp_path):
    from tierstore.io._fileops import preallocate

    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    try:
        with pytest.raises(OSError) as ei:  # far more than the disk holds
            preallocate(fd, 0, 1 << 62, False)
        assert ei.value.errno in (errno.ENOSPC, errno.EFBIG, errno.EINVAL)
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)


#: Calls that wake another Python thread with the GIL held: the woken thread can preempt the
#: waker, which then holds the GIL descheduled (a concurrent.futures pool: ``SimpleQueue.put`` to
#: its worker, ``Condition.notify_all`` from ``Future.set_result`` to the waiter).
_GIL_HELD_WAKEUPS = {"SimpleQueue.put", "SimpleQueue.get", "notify", "notify_all", "set_result"}


def test_posix_engine_wakes_its_workers_and_waiters_only_with_the_gil_released(tmp_path):
    """Issue 25 item 4: every hand-off of a piece to a worker and of its completion back is an
    eventfd write (``os.eventfd_write`` releases the GIL around the wake-up), none is a queue or
    condition hand-off; the workers never outnumber ``iodepth`` and ``close`` stops them."""
    import sys
    import threading

    seen: list[str] = []

    def prof(frame, event, arg):
        if event == "c_call":
            seen.append(getattr(arg, "__qualname__", getattr(arg, "__name__", "")))
        elif event == "call":
            seen.append(frame.f_code.co_name)

    threading.setprofile(prof)  # the engine's workers start after this, at the first submit
    sys.setprofile(prof)
    try:
        eng = make_engine("posix", tmp_path, 16 << 20, iodepth=4, max_io_bytes=1 << 20)
        keep, buf = alloc_aligned(8 << 20)  # 8 pieces a call
        buf.copy_(torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8))
        for off in (0, 8 << 20):
            assert eng.write(off, buf).get() == 8 << 20
        keep2, back = alloc_aligned(8 << 20)
        assert eng.read(8 << 20, back).get() == 8 << 20
        workers = [t for t in threading.enumerate() if t.name.startswith("tierstore-io")]
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert torch.equal(back, buf)
    assert 1 <= len(workers) <= 4
    assert not _GIL_HELD_WAKEUPS & set(seen), sorted(_GIL_HELD_WAKEUPS & set(seen))
    assert seen.count("eventfd_write") >= 24  # 24 pieces handed over (and some completions)
    eng.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("tierstore-io") and t.is_alive()]


def test_eventfd_workers_run_what_was_submitted_then_refuse():
    from tierstore.io.posix import EventfdWorkers

    pool = EventfdWorkers(3, "t-io")
    ran: list[int] = []

    def piece(i: int) -> int:
        if i == 7:
            raise OSError(errno.EIO, "piece 7")
        ran.append(i)
        return i

    jobs = [pool.submit(piece, i) for i in range(20)]
    pool.shutdown()  # the pieces already submitted still run
    assert sorted(ran) == [i for i in range(20) if i != 7]
    assert [j.wait() for j in jobs if j is not jobs[7]] == [i for i in range(20) if i != 7]
    with pytest.raises(OSError, match="piece 7"):
        jobs[7].wait()
    with pytest.raises(RuntimeError):
        pool.submit(piece, 1)
    pool.shutdown()  # twice is harmless
