"""The bench CLI at its edges (issue 19, items 4-6 and 10): failures, disk space, files left behind,
Ctrl-C and SIGTERM, status output."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple

import numpy as np
import pytest

from tierstore.bench import iojobs, registry
from tierstore.bench.output import render_json, render_normal
from tierstore.bench.registry import current_progress, register_runner
from tierstore.bench.result import DirectionResult, JobResult

from .conftest import REPO

_StatVfs = namedtuple("_StatVfs", "f_bavail f_frsize")


# ------------------------------------------------------------------ item 4: direct=0, worker failures
def test_direct0_buffered_write_moves_the_bytes(tmp_path, run_bench):
    """--direct=0 used to hand a Tensor to os.pwritev: no I/O, err= 0, exit 0."""
    (tmp_path / "write.0.0").touch()  # existed before the job: kept (unlink removes only created files)
    rc, out, err = run_bench(
        "--rw=write", "--bs=4k", "--size=16m", "--direct=0", f"--directory={tmp_path}", "--output-format=json"
    )
    assert rc == 0, err
    job = json.loads(out)["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] == 16 << 20 and job["write"]["total_ios"] == 4096
    assert (tmp_path / "write.0.0").stat().st_size == 16 << 20
    rc, out, err = run_bench(
        "--rw=randread",
        "--bs=4k",
        "--size=16m",
        "--direct=0",
        f"--directory={tmp_path}",
        "--name=write",
        "--runtime=0.3",
        "--time_based",
        "--output-format=json",
    )
    assert rc == 0, err
    assert json.loads(out)["jobs"][0]["read"]["io_bytes"] > 0


@pytest.mark.parametrize(
    "failure",
    [TypeError("a bytes-like object is required, not 'Tensor'"), OSError(errno.EIO, "Input/output error")],
    ids=["bug", "eio"],
)
def test_a_failed_worker_fails_the_job(tmp_path, run_bench, monkeypatch, failure):
    """Any failure in a worker ends the job with fio's err= set (the errno; EIO without one)
    and a non-zero exit, and the report of what was done is still printed."""
    calls = {"n": 0}
    real = iojobs._EngineTarget.write

    def flaky(self, buf, offset, placement):
        calls["n"] += 1
        if calls["n"] > 8:
            raise failure
        return real(self, buf, offset, placement)

    monkeypatch.setattr(iojobs._EngineTarget, "write", flaky)
    out = tmp_path / "r.txt"
    rc, _, err = run_bench(
        "--rw=write",
        "--bs=4k",
        "--size=4m",
        "--ioengine=memory",
        f"--output={out}",
        "--output-format=normal,json",
    )
    assert rc == 1
    text = out.read_text()
    assert "write: (groupid=0, jobs=1): err= 5: pid=" in text
    doc = json.loads(text[text.index("{\n") :])
    assert doc["jobs"][0]["error"] == errno.EIO
    assert doc["jobs"][0]["write"]["total_ios"] == 8  # the I/Os done before the failure
    assert f"err={errno.EIO} (EIO)" in err and type(failure).__name__ in err and "offset=" in err


# ------------------------------------------------------------------ item 5: disk space, layout, files
def test_size_over_free_space_is_refused_before_writing(tmp_path, run_bench, monkeypatch):
    """A --size larger than the free space used to fill the disk silently."""
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: _StatVfs(4096, 4096) if str(p).startswith(str(tmp_path)) else real(p)
    )  # 16 MiB free
    rc, out, err = run_bench(
        "--rw=randread", "--bs=4k", "--size=64m", "--runtime=1", "--time_based", f"--directory={tmp_path}"
    )
    assert rc == 1
    assert "needs 67108864 more bytes" in err and "16777216 bytes" in err and "nothing was written" in err
    # fresh-user trial 7: both sizes read "(0.0 GiB)"
    assert "(64.00MiB)" in err and "(16.00MiB) free" in err
    assert list(tmp_path.iterdir()) == []


def test_the_free_space_check_counts_a_file_per_clone(tmp_path, run_bench, monkeypatch):
    """Trial 11: numjobs=2 without filename= shared one file, so 2 x size fit where fio needs both
    files; each clone has its own file now and the check counts both."""
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: _StatVfs(4096, 4096) if str(p).startswith(str(tmp_path)) else real(p)
    )  # 16 MiB free: one 12 MiB file fits, two do not
    flags = ("--rw=write", "--bs=1m", "--size=12m", "--numjobs=2", f"--directory={tmp_path}")
    rc, out, err = run_bench(*flags)
    assert rc == 1 and "the 2 files" in err and "needs 25165824 more bytes" in err
    assert list(tmp_path.iterdir()) == []


def test_a_petabyte_size_is_refused_at_once(tmp_path, run_bench):
    t0 = time.monotonic()
    rc, _, err = run_bench(
        "--rw=randread", "--size=1p", "--runtime=1", "--time_based", f"--directory={tmp_path}"
    )
    assert rc == 1 and "free" in err and "size=1125899906842624 bytes" in err
    assert time.monotonic() - t0 < 10 and list(tmp_path.iterdir()) == []


def test_layout_line_and_created_files_removed(tmp_path, run_bench):
    rc, out, err = run_bench(
        "--rw=randread", "--bs=4k", "--size=2m", "--runtime=0.2", "--time_based", f"--directory={tmp_path}"
    )
    assert rc == 0, err
    assert out.startswith(
        "randread: Laying out IO file (1 file / 2MiB)\n"
    )  # fio's line, with the normal output
    assert list(tmp_path.iterdir()) == []  # unlink=1 (default): the job's file is gone
    # JSON on stdout stays parseable: the line goes to stderr then
    rc, out, err = run_bench(
        "--rw=randread",
        "--bs=4k",
        "--size=2m",
        "--runtime=0.2",
        "--time_based",
        f"--directory={tmp_path}",
        "--output-format=json",
        "--unlink=0",
    )
    assert rc == 0 and json.loads(out)["jobs"] and "Laying out IO file" in err
    assert (tmp_path / "randread.0.0").stat().st_size == 2 << 20  # unlink=0 keeps it
    # a file that existed before the job is never removed, whatever unlink says
    rc, _, err = run_bench(
        "--rw=randread", "--bs=4k", "--size=2m", "--runtime=0.2", "--time_based", f"--directory={tmp_path}"
    )
    assert rc == 0 and (tmp_path / "randread.0.0").exists()


def _bench_proc(args: list[str], cwd) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "tierstore.cli", "bench", *args, "--eta=always", "--eta-newline=0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
    )


def _wait_for_status_line(proc: subprocess.Popen, timeout_s: float = 90.0) -> bytes:
    """Read stderr until the job prints its first status line (the run has started)."""
    seen = b""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
        if line.startswith(b"Jobs: 1"):
            return seen
    proc.kill()
    raise AssertionError(f"no status line: {seen[-2000:]!r}")


def test_sigterm_prints_stats_and_removes_the_file(tmp_path):
    """The file of a read job (laid out) used to stay behind after SIGTERM."""
    proc = _bench_proc(
        ["--rw=randread", "--bs=4k", "--size=8m", "--runtime=60", "--time_based", f"--directory={tmp_path}"],
        tmp_path,
    )
    try:
        _wait_for_status_line(proc)
        assert (tmp_path / "randread.0.0").exists()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert b"randread: (groupid=0, jobs=1): err= 0" in out and b"  read: IOPS=" in out
    assert b"terminating on signal 15" in err and b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ item 6: Ctrl-C in kvload / kvstore
@pytest.mark.parametrize("rw", ["kvload", "kvstore"])
def test_ctrl_c_stops_workers_prints_stats_and_exits_130(tmp_path, rw):
    """Ctrl-C used to close the store under running workers (tracebacks; SIGABRT on some runs) and print
    nothing. Now: workers stop, the statistics so far are printed, exit 130, the NVMe file is removed."""
    size = "8m" if rw == "kvload" else "256m"
    for attempt in range(3):
        d = tmp_path / str(attempt)
        d.mkdir()
        proc = _bench_proc(
            [
                f"--rw={rw}",
                "--layout=tiny",
                "--bs=64k",
                f"--size={size}",
                "--hbm_size=1m",
                "--host_size=2m",
                "--nvme_size=16m",
                "--iodepth=4",
                "--runtime=60",
                "--time_based",
                f"--directory={d}",
            ],
            d,
        )
        try:
            _wait_for_status_line(proc)
            time.sleep(0.3 * attempt)  # interrupt at different points of the run
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130, (attempt, err[-3000:])
        assert b"Traceback" not in err and b"terminate called" not in err, err[-3000:]
        assert f"{rw}: (groupid=0, jobs=1): err= 0".encode() in out, out[-2000:]
        assert b"  kv           : requests=" in out
        assert list(d.iterdir()) == []


def test_the_command_starts_without_torch_so_ctrl_c_at_start_up_is_handled():
    """Importing the package used to import torch (seconds, 37 s on a loaded machine) before the command's
    Ctrl-C handler existed: a Ctrl-C then ended in a KeyboardInterrupt traceback and exit -2, not 130."""
    code = (
        "import sys, tierstore, tierstore.cli, tierstore.bench.cli\n"
        "print(sorted(m for m in ('torch', 'tierstore.api') if m in sys.modules))\n"
        "from tierstore import KVStore, Namespace\n"
        "print(KVStore.__module__, 'torch' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["[]", "tierstore.api True"]


def test_interrupted_run_reports_partial_kv_stats_in_process(tmp_path, run_bench, monkeypatch):
    """A stop request (what the first Ctrl-C does) ends a time-based kvload early with its statistics."""
    import threading

    timer = threading.Timer(1.5, registry.request_stop, args=(signal.SIGINT,))
    real_reset = registry.reset_stop

    def reset_then_arm():
        real_reset()
        timer.start()

    monkeypatch.setattr("tierstore.bench.cli.reset_stop", reset_then_arm)
    t0 = time.monotonic()
    rc, out, err = run_bench(
        "--rw=kvload",
        "--layout=tiny",
        "--bs=64k",
        "--size=4m",
        "--hbm_size=1m",
        "--host_size=2m",
        "--nvme_size=16m",
        "--runtime=60",
        "--time_based",
        f"--directory={tmp_path}",
        "--output-format=json",
    )
    timer.cancel()
    assert rc == 130 and time.monotonic() - t0 < 30  # not the 60 s runtime
    kv = json.loads(out)["jobs"][0]["kv"]
    assert kv["requests"] >= 0 and kv["wrong_kv_blocks"] == 0  # > 0 unless the fill outlasted the 1.5 s


# ------------------------------------------------------------------ item 10: text output, status lines
def test_waf_timeseries_only_in_json_and_plots():
    series = {"t_s": [float(i) for i in range(200)], "waf": [1.0 + i / 1000 for i in range(200)]}
    res = JobResult(
        jobname="kvtrace",
        options={"rw": "kvtrace", "bs": 32768, "iodepth": 1, "numjobs": 1},
        read=DirectionResult(io_bytes=4096, ops=1, runtime_s=1.0, clat_ns=np.array([1000])),
        device={"device": "model", "waf": 1.2, "waf_timeseries": series, "ruh_gc_bytes": {}},
    )
    text = render_normal([res], [None])
    assert "waf_timeseries" not in text and "WAF=1.200" in text
    assert "    ruh_gc_bytes  : none\n" in text  # an empty mapping is a word, not a blank value
    assert max(len(line) for line in text.splitlines()) < 300
    assert json.loads(render_json([res], [None]))["jobs"][0]["device"]["waf_timeseries"]["waf"][
        -1
    ] == pytest.approx(1.199)


def _slow_runner(options: dict) -> JobResult:
    progress = current_progress()
    progress.start(total=10, unit="req")
    for i in range(10):
        time.sleep(0.1)
        progress.update(i + 1)
    return JobResult(jobname=options["name"], options=options)


@pytest.fixture
def slow_job(monkeypatch):
    monkeypatch.setattr(registry, "_RUNNERS", dict(registry._RUNNERS))
    monkeypatch.setattr(registry, "RUNNER_MODULES", ())
    register_runner(["kvmixed"], _slow_runner, replace=True)


def test_status_lines_on_stderr_when_stdout_is_not_a_terminal(run_bench, slow_job):
    """95 s of silence on the full trace with redirected output: now fio-style status lines."""
    rc, out, err = run_bench("--rw=kvmixed", "--eta-newline=0.2", "--output-format=json")
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.startswith("Jobs: 1 (f=1): [kvmixed(1)][")]
    assert len(lines) >= 2, err
    assert all("req/s][eta " in ln for ln in lines)
    assert json.loads(out)["jobs"][0]["jobname"] == "kvmixed"  # stdout holds only the report
    rc, _, err = run_bench("--rw=kvmixed", "--eta-newline=0.2", "--eta=never")
    assert rc == 0 and "Jobs:" not in err
    rc, _, err = run_bench("--rw=kvmixed", "--status-interval=0.25", "--eta=never")
    assert rc == 0 and "Jobs: 1" in err  # --status-interval forces lines
    rc, _, err = run_bench("--rw=kvmixed", "--eta=sometimes")
    assert rc == 1 and "eta='sometimes'" in err
