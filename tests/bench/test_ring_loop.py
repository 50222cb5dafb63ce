"""The io_uring loop of plain jobs (issue 22, item 8): SQEs fixed to buffer slots, a turn that waits for
``iodepth // 4`` completions and refills. What it must keep: the bytes of each I/O go to and come from
the offset it was issued for, every I/O is counted once, the read/write mix, and any depth against any
number of I/Os (no hang, nothing extra)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from tierstore.bench import iojobs
from tierstore.io import ring as ring_mod
from tierstore.io.ring import uring_available

pytestmark = pytest.mark.skipif(not uring_available()[0], reason="io_uring is not usable here")


@pytest.fixture(autouse=True)
def python_turn(monkeypatch):
    """These tests spy on the Python turn (the reference; tests/bench/test_ring_native.py tests the C one)."""
    monkeypatch.setattr(ring_mod, "_ringloop", None)


BS = 4096


def _job(run_bench, tmp_path, *args) -> dict:
    out = tmp_path / "o.json"
    got, _, err = run_bench(
        *args, "--bs=4k", "--ioengine=io_uring", "--output-format=json", f"--output={out}"
    )
    assert got == 0, err
    return json.loads(out.read_text())["jobs"][0]


def _block(i: int) -> bytes:
    """A block that names its own number (and differs from every other block)."""
    return np.full(BS // 8, i * 7919 + 13, dtype=np.int64).tobytes()


class _Spy:
    """Records, per ring, the slot buffers and what each queued I/O was (slot, offset, opcode), and checks
    every completed read's buffer against the file's block at the offset that slot was issued for."""

    def __init__(self, monkeypatch, expect_read=None):
        self.addrs: dict[int, list[int]] = {}
        self.slot_io: dict[tuple[int, int], tuple[int, int]] = {}
        self.opcode: dict[int, int] = {}
        self.writes: list[tuple[int, bytes]] = []  # (offset, bytes queued), in submission order
        self.reads_checked = 0
        self.max_queued = 0
        self.expect_read = expect_read
        spy = self
        fix, prep, reap = (
            ring_mod.Ring.fix_rw_slots,
            ring_mod.Ring.prep_fixed,
            ring_mod.Ring.submit_reap_results,
        )

        def fix_rw_slots(ring, opcode, fd, addrs, nbytes):
            spy.addrs[id(ring)], spy.opcode[id(ring)] = list(addrs), opcode
            return fix(ring, opcode, fd, addrs, nbytes)

        def prep_fixed(ring, slots, offsets, opcodes=None):
            ops = opcodes if opcodes is not None else [spy.opcode[id(ring)]] * len(slots)
            for slot, off, op in zip(slots, offsets, ops):
                spy.slot_io[id(ring), slot] = (off, op)
                if op == ring_mod.IORING_OP_WRITE:
                    spy.writes.append((off, ctypes.string_at(spy.addrs[id(ring)][slot], BS)))
            spy.max_queued = max(spy.max_queued, ring.sq_pending() + len(slots))
            return prep(ring, slots, offsets, opcodes)

        def submit_reap_results(ring, wait_nr=1):
            got = reap(ring, wait_nr)
            for slot, res, _ in got:
                off, op = spy.slot_io[id(ring), slot]
                if op == ring_mod.IORING_OP_READ and spy.expect_read is not None:
                    assert res == BS
                    assert ctypes.string_at(spy.addrs[id(ring)][slot], BS) == spy.expect_read(off), off
                    spy.reads_checked += 1
            return got

        monkeypatch.setattr(ring_mod.Ring, "fix_rw_slots", fix_rw_slots)
        monkeypatch.setattr(ring_mod.Ring, "prep_fixed", prep_fixed)
        monkeypatch.setattr(ring_mod.Ring, "submit_reap_results", submit_reap_results)


def test_a_write_job_leaves_in_each_block_the_bytes_queued_for_it(tmp_path, run_bench, monkeypatch):
    spy = _Spy(monkeypatch)
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randwrite",
        "--size=1m",
        "--iodepth=16",
        "--unlink=0",
        "--name=w",
        f"--directory={tmp_path}",
    )
    assert job["write"]["total_ios"] == 256 and job["error"] == 0
    data = (tmp_path / "w.0.0").read_bytes()
    last = dict(spy.writes)  # the last write queued to each offset
    assert len(spy.writes) == 256 and len(last) > 100  # random offsets: repeats, and many blocks
    # Two writes to one offset may be in flight together (iodepth 16; fio too, without
    # serialize_overlap): either may land last, so a block holds one of the writes queued for
    # *its* offset (exactly the last one where only one was queued): never another offset's bytes.
    queued: dict[int, list[bytes]] = {}
    for off, b in spy.writes:
        queued.setdefault(off, []).append(b)
    for off, bufs in queued.items():
        assert data[off : off + BS] in bufs, off
    once = [off for off, bufs in queued.items() if len(bufs) == 1]
    assert len(once) > 50 and all(data[off : off + BS] == last[off] for off in once)
    assert len(set(last.values())) > 1  # the slots' buffers differ: a mix-up would show


def test_a_read_job_brings_each_offset_into_the_slot_it_was_issued_for(tmp_path, run_bench, monkeypatch):
    path = tmp_path / "r.0.0"
    path.write_bytes(b"".join(_block(i) for i in range(512)))  # 2 MiB, each block names itself
    spy = _Spy(monkeypatch, expect_read=lambda off: _block(off // BS))
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--size=2m",
        "--iodepth=16",
        "--name=r",
        f"--filename={path}",
        "--numjobs=2",
    )
    assert job["read"]["total_ios"] == 2 * 512 == spy.reads_checked and job["error"] == 0


def test_randrw_through_the_ring_mixes_per_rwmixread_and_reads_what_is_there(
    tmp_path, run_bench, monkeypatch
):
    path = tmp_path / "m.0.0"
    path.write_bytes(b"".join(_block(i) for i in range(4096)))  # 16 MiB
    spy = _Spy(monkeypatch)
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randrw",
        "--rwmixread=70",
        "--size=16m",
        "--iodepth=16",
        "--name=m",
        f"--filename={path}",
        "--format=1",
    )
    r, w = job["read"]["total_ios"], job["write"]["total_ios"]
    assert r + w == 4096 and job["error"] == 0
    assert 0.66 < r / (r + w) < 0.74  # 70% reads, drawn per I/O (binomial sd 0.7%)
    assert len(spy.writes) == w and job["device"]["hbmw_bytes"] == job["write"]["io_bytes"]
    data = path.read_bytes()
    for off, want in dict(spy.writes).items():  # what was written is there
        assert data[off : off + BS] == want, off


@pytest.mark.parametrize("size, iodepth, ios", [("1m", 1, 256), ("20k", 16, 5), ("8k", 16, 2), ("4k", 4, 1)])
def test_any_depth_against_any_number_of_ios(tmp_path, run_bench, monkeypatch, size, iodepth, ios):
    """iodepth 1 (one I/O per turn), and iodepth above the job's I/Os, where the wait per turn
    (iodepth // 4) exceeds what is left in flight: every I/O once, no hang."""
    path = tmp_path / "d.0.0"
    path.write_bytes(b"".join(_block(i) for i in range(256)))
    spy = _Spy(monkeypatch, expect_read=lambda off: _block(off // BS))
    job = _job(
        run_bench,
        tmp_path,
        "--rw=read",
        f"--size={size}",
        f"--iodepth={iodepth}",
        "--name=d",
        f"--filename={path}",
    )
    assert job["read"]["total_ios"] == ios == spy.reads_checked and job["error"] == 0
    assert spy.max_queued <= iodepth


def test_the_turn_waits_for_a_quarter_of_the_depth_but_never_more_than_in_flight(
    monkeypatch, tmp_path, run_bench
):
    waits = []
    real = ring_mod.Ring.submit_reap_results

    def spy(ring, wait_nr=1):
        waits.append((wait_nr, ring.sq_pending()))
        return real(ring, wait_nr)

    monkeypatch.setattr(ring_mod.Ring, "submit_reap_results", spy)
    _job(run_bench, tmp_path, "--rw=read", "--size=80k", "--iodepth=16", f"--directory={tmp_path}")  # 20 I/Os
    assert waits[0] == (4, 16)  # 16 queued, wait for 4
    assert all(1 <= w <= 4 for w, _ in waits) and waits[-1][0] <= 4
    assert iojobs._REAP_DEPTH_DIVISOR == 4
