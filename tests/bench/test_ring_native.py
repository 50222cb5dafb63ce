"""The C turn of plain io_uring jobs (``tierstore.io._ringloop``, issue 22 item 8): the same I/O as the
Python turn (the reference), the bytes of each I/O at its offset, failures reported with their offset
and errno, the deadline honoured, the fallback used and said when the module is missing, nothing leaked."""

from __future__ import annotations

import errno
import json
import mmap
import os
import time

import numpy as np
import pytest

from tierstore.bench import iojobs
from tierstore.io import ring as ring_mod
from tierstore.io.engine import buffer_address
from tierstore.io.ring import (
    IORING_OP_READ,
    IORING_OP_WRITE,
    SLOT_STATE_COLS,
    TURN_LOG_COLS,
    Ring,
    native_turn,
    run_fixed_turns,
    uring_available,
)

pytestmark = [
    pytest.mark.skipif(not uring_available()[0], reason="io_uring is not usable here"),
    pytest.mark.skipif(not native_turn()[0], reason=native_turn()[1] or "C turn built"),
]

BS = 4096
COL = {c: i for i, c in enumerate(TURN_LOG_COLS)}


def _block(i: int) -> bytes:
    """A block that names its own number (and differs from every other block)."""
    return np.full(BS // 8, i * 7919 + 13, dtype=np.int64).tobytes()


def _job(run_bench, tmp_path, *args, rc=0) -> tuple[dict, str]:
    out = tmp_path / "o.json"
    got, _, err = run_bench(
        *args, "--bs=4k", "--ioengine=io_uring", "--output-format=json", f"--output={out}"
    )
    assert got == rc, err
    return json.loads(out.read_text())["jobs"][0], err


class _Ring:
    """A ring fixed to ``depth`` page-aligned slots on ``path`` (O_DIRECT), as a plain job sets one up."""

    def __init__(self, path, depth: int, opcode: int, flags: int = os.O_RDONLY) -> None:
        self.fd = os.open(path, flags | os.O_DIRECT)
        self.mem = mmap.mmap(-1, depth * BS)
        self.addrs = [buffer_address(memoryview(self.mem)) + i * BS for i in range(depth)]
        self.ring = Ring(depth)
        self.ring.fix_rw_slots(opcode, self.fd, self.addrs, BS)
        self.state = np.zeros((depth, SLOT_STATE_COLS), dtype=np.int64)
        self.log = np.zeros((4096 + depth, len(TURN_LOG_COLS)), dtype=np.int64)

    def run(self, offsets, opcodes=None, tags=None, *, drain=False, deadline_ns=0, return_ns=0, wait_nr=1):
        return run_fixed_turns(
            self.ring,
            self.state,
            np.asarray(offsets, dtype=np.int64),
            opcodes,
            tags,
            self.log,
            deadline_ns=deadline_ns,
            return_ns=return_ns,
            wait_nr=wait_nr,
            drain=drain,
        )

    def slot_bytes(self, slot: int) -> bytes:
        return bytes(self.mem[slot * BS : (slot + 1) * BS])

    def close(self) -> None:
        self.ring.close()
        self.mem.close()
        os.close(self.fd)


def test_reads_bring_each_offset_into_the_slot_the_log_names(tmp_path):
    path = tmp_path / "r.dat"
    path.write_bytes(b"".join(_block(i) for i in range(64)))
    r = _Ring(path, 8, IORING_OP_READ)
    rng = np.random.default_rng(1)
    try:
        checked = 0
        for _ in range(20):  # 8 I/Os per call on 8 slots: each slot is used once, then drained
            offsets = rng.integers(0, 64, size=8) * BS
            got = r.run(offsets, wait_nr=2)
            rows = [r.log[i].copy() for i in range(got.logged)]
            assert got.issued == 8 and got.reason == 0
            got = r.run([], drain=True)
            rows += [r.log[i].copy() for i in range(got.logged)]
            assert got.reason == 1 and got.inflight == 0 and len(rows) == 8
            assert sorted(int(x[COL["offset"]]) for x in rows) == sorted(offsets.tolist())
            for x in rows:
                assert x[COL["res"]] == BS and x[COL["opcode"]] == IORING_OP_READ
                assert 0 < x[COL["done_ns"]] - x[COL["start_ns"]] < 10**10
                assert r.slot_bytes(int(x[COL["slot"]])) == _block(int(x[COL["offset"]]) // BS)
                checked += 1
        assert checked == 160
    finally:
        r.close()


def test_writes_put_each_slots_bytes_at_its_offset_and_carry_tags(tmp_path):
    path = tmp_path / "w.dat"
    path.write_bytes(bytes(64 * BS))
    r = _Ring(path, 16, IORING_OP_WRITE, os.O_RDWR)
    try:
        for slot in range(16):
            r.mem[slot * BS : (slot + 1) * BS] = _block(1000 + slot)
        offsets = np.arange(64, dtype=np.int64) * BS  # every block once
        tags = np.arange(64, dtype=np.int64) + 500
        rows, at = [], 0
        while at < 64:
            got = r.run(offsets[at:], None, tags[at:], return_ns=1, wait_nr=4)  # return after each turn
            rows += [r.log[i].copy() for i in range(got.logged)]
            at += got.issued
        got = r.run([], drain=True)
        rows += [r.log[i].copy() for i in range(got.logged)]
        assert len(rows) == 64 and got.inflight == 0
        data = path.read_bytes()
        for x in rows:
            off, slot = int(x[COL["offset"]]), int(x[COL["slot"]])
            assert data[off : off + BS] == _block(1000 + slot), off
            assert x[COL["tag"]] == 500 + off // BS and x[COL["opcode"]] == IORING_OP_WRITE
    finally:
        r.close()


def test_a_failed_io_names_its_offset_and_errno_and_the_rest_is_drained(tmp_path):
    path = tmp_path / "e.dat"
    path.write_bytes(bytes(64 * BS))
    r = _Ring(path, 8, IORING_OP_READ)
    try:
        offsets = np.arange(40, dtype=np.int64) * BS
        offsets[13] += 512 + 100  # not a multiple of the logical block: O_DIRECT refuses it (EINVAL)
        got = r.run(offsets, wait_nr=2)
        assert got.reason == 2 and got.err_res == -errno.EINVAL and got.err_offset == 13 * BS + 612
        assert got.err_opcode == IORING_OP_READ and got.inflight == 0 and got.issued < 40
        assert not r.state[:, 0].any()  # no slot left busy
        logged = r.log[: got.logged, COL["offset"]].tolist()
        assert 13 * BS + 612 not in logged and all(o % BS == 0 for o in logged)
    finally:
        r.close()


def test_nothing_is_issued_at_or_after_the_deadline(tmp_path):
    path = tmp_path / "d.dat"
    path.write_bytes(bytes(64 * BS))
    r = _Ring(path, 8, IORING_OP_READ)
    try:
        got = r.run(np.zeros(100, dtype=np.int64), deadline_ns=time.perf_counter_ns())
        assert (got.issued, got.logged, got.reason, got.inflight) == (0, 0, 1, 0)
        got = r.run(np.zeros(4000, dtype=np.int64), deadline_ns=time.perf_counter_ns() + 2_000_000, wait_nr=2)
        assert got.reason == 1 and got.inflight == 0 and got.logged == got.issued  # stopped, drained
        assert got.issued < 4000 or pytest.skip("the disk did 4000 reads in 2 ms")
        assert r.log[: got.logged, COL["done_ns"]].max() > 0
    finally:
        r.close()


def test_refuses_a_ring_not_fixed_and_bad_sizes(tmp_path):
    with Ring(8) as ring:
        with pytest.raises(ring_mod.IoUringError):
            run_fixed_turns(
                ring,
                np.zeros((8, 5), np.int64),
                np.zeros(1, np.int64),
                None,
                None,
                np.zeros((9, 7), np.int64),
                deadline_ns=0,
                return_ns=0,
                wait_nr=1,
                drain=False,
            )
    path = tmp_path / "s.dat"
    path.write_bytes(bytes(8 * BS))
    r = _Ring(path, 8, IORING_OP_READ)
    try:
        with pytest.raises(ValueError):  # the log cannot hold n + depth rows
            run_fixed_turns(
                r.ring,
                r.state,
                np.zeros(10, np.int64),
                None,
                None,
                np.zeros((10, 7), np.int64),
                deadline_ns=0,
                return_ns=0,
                wait_nr=1,
                drain=False,
            )
        with pytest.raises(ValueError):  # opcodes of another length
            r.run(np.zeros(4, np.int64), np.zeros(3, np.uint8))
    finally:
        r.close()


def _issued(monkeypatch, native: bool) -> list[tuple[int, int]]:
    """Spy on what a job issues, in issue order, through the C turn or the Python one: (offset, opcode)."""
    seen: list[tuple[int, int]] = []
    if native:
        real = iojobs.run_fixed_turns

        def spy(ring, state, offsets, opcodes, tags, log, **kw):
            got = real(ring, state, offsets, opcodes, tags, log, **kw)
            ops = (
                opcodes[: got.issued].tolist()
                if opcodes is not None
                else [int(ring._fixed_bytes[0])] * got.issued
            )
            seen.extend(zip(offsets[: got.issued].tolist(), ops))
            return got

        monkeypatch.setattr(iojobs, "run_fixed_turns", spy)
    else:
        monkeypatch.setattr(ring_mod, "_ringloop", None)
        real_prep = ring_mod.Ring.prep_fixed

        def prep(ring, slots, offsets, opcodes=None):
            ops = opcodes if opcodes is not None else [int(ring._fixed_bytes[0])] * len(slots)
            seen.extend(zip(offsets, ops))
            return real_prep(ring, slots, offsets, opcodes)

        monkeypatch.setattr(ring_mod.Ring, "prep_fixed", prep)
    return seen


@pytest.mark.parametrize("rw", ["randrw", "randwrite", "read"])
def test_the_c_and_the_python_turn_issue_the_same_ios_for_the_same_seed(tmp_path, run_bench, rw):
    """More I/Os than one draw of offsets (4096): the stream must not depend on how many each turn takes."""
    path = tmp_path / "s.0.0"
    path.write_bytes(b"".join(_block(i) for i in range(6144)))  # 24 MiB
    got = {}
    for native in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            seen = _issued(mp, native)
            job, err = _job(
                run_bench,
                tmp_path,
                f"--rw={rw}",
                "--size=24m",
                "--iodepth=12",
                "--name=s",
                f"--filename={path}",
                "--format=1",
                "--seed=7",
            )
            assert ("turn in C" in err) == native and ("turn in Python" in err) == (not native)
            assert job["error"] == 0 and job["read"]["total_ios"] + job["write"]["total_ios"] == 6144
            got[native] = list(seen)
    assert len(got[True]) == 6144 and got[True] == got[False]
    if rw == "randrw":
        assert 0.45 < sum(op == IORING_OP_READ for _, op in got[True]) / 6144 < 0.55  # fio's rwmixread=50


def test_a_c_turn_write_job_then_a_read_back_job_moves_the_bytes_exactly(tmp_path, run_bench, monkeypatch):
    """A sequential write job through the C turn writes every block once with a slot's bytes; a read job
    through the C turn of the same file reads them back (each completed read checked by its slot's bytes
    in the log, via the spy below, before the slot is reused: depth 1)."""
    path = tmp_path / "b.0.0"
    slots: dict[int, bytes] = {}
    real_fix = ring_mod.Ring.fix_rw_slots

    def fix(ring, opcode, fd, addrs, nbytes):
        import ctypes

        if opcode == IORING_OP_WRITE:
            slots.update({i: ctypes.string_at(a, nbytes) for i, a in enumerate(addrs)})
        return real_fix(ring, opcode, fd, addrs, nbytes)

    monkeypatch.setattr(ring_mod.Ring, "fix_rw_slots", fix)
    rows = []
    real_run = iojobs.run_fixed_turns

    def spy(ring, state, offsets, opcodes, tags, log, **kw):
        got = real_run(ring, state, offsets, opcodes, tags, log, **kw)
        rows.extend(log[i].copy() for i in range(got.logged))
        return got

    monkeypatch.setattr(iojobs, "run_fixed_turns", spy)
    job, _ = _job(
        run_bench,
        tmp_path,
        "--rw=write",
        "--size=1m",
        "--iodepth=16",
        "--name=b",
        "--unlink=0",
        f"--directory={tmp_path}",
    )
    assert job["write"]["total_ios"] == 256 and job["error"] == 0 and len(rows) == 256
    data = path.read_bytes()
    assert sorted(int(x[COL["offset"]]) for x in rows) == [i * BS for i in range(256)]
    for x in rows:
        off = int(x[COL["offset"]])
        assert data[off : off + BS] == slots[int(x[COL["slot"]])], off
    assert len({data[i * BS : (i + 1) * BS] for i in range(256)}) > 1
    job, _ = _job(
        run_bench,
        tmp_path,
        "--rw=read",
        "--size=1m",
        "--iodepth=16",
        "--name=b",
        "--format=1",
        f"--filename={path}",
    )
    assert job["read"]["total_ios"] == 256 and job["read"]["io_bytes"] == 1 << 20 and job["error"] == 0


def test_a_failed_io_fails_the_job_with_its_errno_and_offset(tmp_path, run_bench, monkeypatch):
    real = iojobs._Draw.next_arrays
    calls = {"n": 0}

    def misaligned(self, n):
        offsets, writes = real(self, n)
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk: I/Os of the first are done and logged
            offsets = offsets.copy()
            offsets[3] += 100  # O_DIRECT refuses an offset off the logical block size: EINVAL
            calls["bad"] = int(offsets[3])
        return offsets, writes

    monkeypatch.setattr(iojobs._Draw, "next_arrays", misaligned)
    job, err = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--size=4m",
        "--iodepth=8",
        "--runtime=5",
        "--time_based",
        f"--directory={tmp_path}",
        rc=1,
    )
    assert job["error"] == errno.EINVAL and 0 < job["read"]["total_ios"]
    assert f"(read offset={calls['bad']}, buflen=4096)" in err, err
    assert job["read"]["runtime"] < 4000  # it stopped at the failure, not at the runtime


def test_one_enter_per_turn_submits_every_free_slot_and_waits_for_wait_nr(tmp_path):
    """The point of the turn (issue 22 item 8): I/Os go in as a batch per ``io_uring_enter``, and each
    enter waits for ``wait_nr`` completions (the last ones excepted), so ``wait_nr`` or more per enter."""
    path = tmp_path / "b.dat"
    path.write_bytes(bytes(256 * BS))
    r = _Ring(path, 16, IORING_OP_READ)
    try:
        offsets = np.random.default_rng(3).integers(0, 256, size=2000) * BS
        got = r.run(offsets, wait_nr=4)
        done, enters = got.logged, got.enters
        assert got.issued == 2000
        got = r.run([], drain=True, wait_nr=4)
        done, enters = done + got.logged, enters + got.enters
        assert done == 2000 and done / enters >= 4 * 0.95, (
            done,
            enters,
        )  # 16 in flight: the tail waits for fewer
    finally:
        r.close()


def test_a_job_through_the_c_turn_waits_for_one_completion_per_enter(tmp_path, run_bench, monkeypatch):
    count = {"enters": 0, "ios": 0, "wait_nr": set()}
    real = iojobs.run_fixed_turns

    def counting(*a, **kw):
        got = real(*a, **kw)
        count["enters"] += got.enters
        count["ios"] += got.logged
        count["wait_nr"].add(kw["wait_nr"])
        return got

    monkeypatch.setattr(iojobs, "run_fixed_turns", counting)
    job, _ = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--size=8m",
        "--iodepth=16",
        "--runtime=1",
        "--time_based",
        f"--directory={tmp_path}",
    )
    assert job["read"]["total_ios"] == count["ios"] > 500 and count["wait_nr"] == {
        iojobs._NATIVE_REAP_MIN
    } == {1}
    assert count["enters"] <= count["ios"] + 1  # never more than one enter per I/O


def test_a_time_based_job_stops_at_its_runtime_with_sane_latencies(tmp_path, run_bench):
    job, _ = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--size=8m",
        "--iodepth=16",
        "--runtime=1",
        "--time_based",
        f"--directory={tmp_path}",
    )
    r = job["read"]
    assert job["error"] == 0 and r["total_ios"] > 500 and 900 <= r["runtime"] <= 1500
    assert 0 < r["clat_ns"]["min"] <= r["clat_ns"]["mean"] <= r["clat_ns"]["max"] < 1.5e9
    assert r["lat_ns"]["mean"] >= r["clat_ns"]["mean"] * 0.99 and job["iodepth_level"]["16"] == 100.0


def test_without_the_module_the_python_turn_runs_and_says_so(tmp_path, run_bench, monkeypatch):
    monkeypatch.setattr(ring_mod, "_ringloop", None)
    monkeypatch.setattr(ring_mod, "_RINGLOOP_MISSING", "tierstore.io._ringloop is not built (test)")
    called = {"n": 0}

    def refuse(*a, **kw):
        called["n"] += 1
        raise AssertionError("the C turn ran without its module")

    monkeypatch.setattr(iojobs, "run_fixed_turns", refuse)
    job, err = _job(
        run_bench, tmp_path, "--rw=randread", "--size=1m", "--iodepth=8", f"--directory={tmp_path}"
    )
    assert job["read"]["total_ios"] == 256 and job["error"] == 0 and called["n"] == 0
    assert "io_uring turn in Python (tierstore.io._ringloop is not built (test))" in err
    assert native_turn() == (False, "tierstore.io._ringloop is not built (test)")
    with pytest.raises(ring_mod.IoUringUnavailable):
        run_fixed_turns(
            None, None, None, None, None, None, deadline_ns=0, return_ns=0, wait_nr=1, drain=False
        )


def _rings_open() -> tuple[int, int]:
    fds = sum(
        "io_uring" in os.readlink(f"/proc/self/fd/{n}")
        for n in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{n}")
    )
    with open("/proc/self/maps", encoding="ascii") as fh:
        maps = sum("io_uring" in line for line in fh)
    return fds, maps


def test_no_ring_fd_or_mapping_outlives_a_job(tmp_path, run_bench, monkeypatch):
    before = _rings_open()
    for rw in ("randread", "randwrite", "randrw"):
        _job(
            run_bench,
            tmp_path,
            f"--rw={rw}",
            "--size=1m",
            "--iodepth=16",
            "--numjobs=2",
            f"--directory={tmp_path}",
        )
    real = iojobs._Draw.next_arrays

    def misaligned(self, n):  # a job that fails: its rings are closed too
        offsets, writes = real(self, n)
        return offsets + 100, writes

    monkeypatch.setattr(iojobs._Draw, "next_arrays", misaligned)
    job, _ = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--size=1m",
        "--iodepth=16",
        "--numjobs=2",
        f"--directory={tmp_path}",
        rc=1,
    )
    assert job["error"] == errno.EINVAL
    assert _rings_open() == before
