"""Plain jobs per ioengine (issue 22, items 7 and 8): fio's engine names, io_uring batches per
``io_uring_enter``, synchronous engines at depth 1, ``randrw`` with ``rwmixread``, failures."""

from __future__ import annotations

import errno
import json

import pytest

from tierstore.bench import iojobs
from tierstore.bench.jobfile import IOENGINES, engine_kind, schema_help
from tierstore.io import ring as ring_mod
from tierstore.io.ring import uring_available

needs_uring = pytest.mark.skipif(not uring_available()[0], reason="io_uring is not usable here")


def _job(run_bench, tmp_path, *args, rc=0) -> dict:
    out = tmp_path / "o.json"
    got, _, err = run_bench(*args, f"--directory={tmp_path}", "--output-format=json", f"--output={out}")
    assert got == rc, err
    return json.loads(out.read_text())["jobs"][0]


@pytest.fixture
def enters(monkeypatch):
    """Counts io_uring_enter calls of every ring in this process (the Python turn's: the C turn's enters
    are its own, tests/bench/test_ring_native.py)."""
    monkeypatch.setattr(ring_mod, "_ringloop", None)
    count = {"n": 0}
    real = ring_mod.Ring._enter

    def counting(self, to_submit, min_complete, flags):
        count["n"] += 1
        return real(self, to_submit, min_complete, flags)

    monkeypatch.setattr(ring_mod.Ring, "_enter", counting)
    return count


@needs_uring
@pytest.mark.parametrize("engine", ["uring", "io_uring", "libaio"])
def test_uring_jobs_batch_many_ios_per_enter(tmp_path, run_bench, enters, engine):
    """One Python call and at least one io_uring_enter per I/O made 4 KiB random reads at depth 16 ten
    times slower than fio (3.9k vs 41.8k IOPS): now a batch of I/Os goes in per enter."""
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--bs=4k",
        "--size=8m",
        "--iodepth=16",
        f"--ioengine={engine}",
        "--runtime=1",
        "--time_based",
    )
    ios = job["read"]["total_ios"]
    assert ios > 500
    assert ios / enters["n"] >= 4, (ios, enters["n"])  # ~16 when the device keeps up; 1 or less before
    assert job["iodepth_level"]["16"] == 100.0


@needs_uring
def test_uring_sequential_job_moves_exactly_size(tmp_path, run_bench):
    job = _job(
        run_bench,
        tmp_path,
        "--rw=read",
        "--bs=4k",
        "--size=4m",
        "--iodepth=8",
        "--ioengine=io_uring",
        "--numjobs=2",
    )
    assert job["read"]["total_ios"] == 2 * 1024 and job["read"]["io_bytes"] == 2 * (4 << 20)
    assert job["read"]["short_ios"] == 0 and job["error"] == 0


@needs_uring
def test_uring_write_job_feeds_the_ftl_model(tmp_path, run_bench):
    job = _job(
        run_bench, tmp_path, "--rw=randwrite", "--bs=4k", "--size=4m", "--iodepth=16", "--ioengine=io_uring"
    )
    assert job["write"]["io_bytes"] == 4 << 20
    assert job["device"]["hbmw_bytes"] == job["write"]["io_bytes"]  # every completed write reached the model
    assert not list(tmp_path.glob("*.0.0"))  # its file is removed (unlink=1)


@needs_uring
def test_a_failed_completion_fails_the_uring_job(tmp_path, run_bench, monkeypatch):
    monkeypatch.setattr(ring_mod, "_ringloop", None)  # the Python turn (the C turn's: test_ring_native.py)
    real = ring_mod.Ring.reap_results
    calls = {"n": 0}

    def failing(self):
        got = real(self)
        calls["n"] += 1
        if calls["n"] == 5 and got:
            got[0] = (got[0][0], -errno.EIO)
        return got

    monkeypatch.setattr(ring_mod.Ring, "reap_results", failing)
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--bs=4k",
        "--size=4m",
        "--iodepth=8",
        "--ioengine=io_uring",
        "--runtime=5",
        "--time_based",
        rc=1,
    )
    assert job["error"] == errno.EIO and 0 < job["read"]["total_ios"]
    assert job["read"]["runtime"] < 4000  # it stopped at the failure, not at the runtime


@pytest.mark.parametrize("engine", ["psync", "sync", "pvsync", "pvsync2"])
def test_synchronous_engines_run_one_io_at_a_time_per_clone(tmp_path, run_bench, engine, monkeypatch):
    threads = []
    real = iojobs._sync_lane

    def spy(*args):
        threads.append(1)
        return real(*args)

    monkeypatch.setattr(iojobs, "_sync_lane", spy)
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randread",
        "--bs=4k",
        "--size=2m",
        "--iodepth=16",
        f"--ioengine={engine}",
        "--numjobs=2",
    )
    assert len(threads) == 2  # one per clone: fio's synchronous engines ignore iodepth
    assert job["iodepth_level"]["1"] == 100.0 and job["read"]["total_ios"] == 2 * 512
    assert job["job options"]["ioengine"] == engine


def test_posix_keeps_iodepth_threads_per_clone(tmp_path, run_bench, monkeypatch):
    threads = []
    real = iojobs._sync_lane
    monkeypatch.setattr(iojobs, "_sync_lane", lambda *a: (threads.append(1), real(*a))[1])
    job = _job(
        run_bench, tmp_path, "--rw=write", "--bs=4k", "--size=1m", "--iodepth=4", "--ioengine=posixaio"
    )
    assert len(threads) == 4 and job["write"]["io_bytes"] == 1 << 20


def test_randrw_mixes_reads_and_writes_per_rwmixread(tmp_path, run_bench):
    job = _job(
        run_bench,
        tmp_path,
        "--rw=randrw",
        "--rwmixread=70",
        "--bs=4k",
        "--size=16m",
        "--iodepth=4",
        "--ioengine=psync",
    )
    r, w = job["read"]["total_ios"], job["write"]["total_ios"]
    assert r + w == 4096
    assert 0.66 < r / (r + w) < 0.74  # 70% reads, drawn per I/O (binomial sd 0.7%)
    assert job["device"]["hbmw_bytes"] == job["write"]["io_bytes"]  # only writes reach the FTL model
    job = _job(
        run_bench, tmp_path, "--rw=randrw", "--rwmixwrite=10", "--bs=4k", "--size=16m", "--ioengine=psync"
    )
    assert 0.86 < job["read"]["total_ios"] / 4096 < 0.94  # fio: rwmixwrite alone sets the read share to 90%


def test_rw_alias_readwrite_is_sequential_mixed(tmp_path, run_bench):
    job = _job(run_bench, tmp_path, "--rw=readwrite", "--bs=4k", "--size=2m", "--ioengine=psync")
    assert job["job options"]["rw"] == "readwrite"  # as written, as fio shows it
    assert job["read"]["total_ios"] > 0 and job["write"]["total_ios"] > 0
    assert job["read"]["total_ios"] + job["write"]["total_ios"] == 512


def test_every_fio_engine_name_maps_and_cmdhelp_says_how():
    text = schema_help("ioengine")
    for name in ("io_uring", "libaio", "psync", "sync", "posixaio", "pvsync", "pvsync2"):
        assert engine_kind(name) in ("uring", "posix") and name in text
    assert set(IOENGINES) >= {"posix", "uring", "auto", "memory", "kvikio"}


def test_an_engine_we_do_not_have_is_one_line_naming_what_is_accepted(run_bench):
    rc, out, err = run_bench("--rw=read", "--ioengine=windowsaio", "--parse-only")
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "ioengine='windowsaio'" in err and "io_uring" in err and "psync" in err


def test_kv_jobs_take_fio_engine_names(tmp_path, run_bench):
    job = _job(
        run_bench,
        tmp_path,
        "--rw=kvstore",
        "--layout=tiny",
        "--bs=64k",
        "--size=2m",
        "--hbm_size=256k",
        "--host_size=512k",
        "--nvme_size=16m",
        "--ioengine=psync",
    )
    assert job["device"]["device"].startswith("file (posix engine)")
