"""Several jobs in one run, as fio runs them (issue 22, item 6): every ``--name=`` on the command line
starts a job that inherits the options given before the first ``--name``; jobs run at once unless
``stonewall``; ``stonewall``/``new_group`` start a new reporting group; ``group_reporting`` merges a
group into one entry. Where fio is installed the same command line is run through fio and compared."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tierstore.bench import registry
from tierstore.bench.jobfile import parse_jobs
from tierstore.bench.registry import register_runner
from tierstore.bench.result import DirectionResult, JobResult

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")


def _fio(tmp_path, argv: list[str]) -> list[dict]:
    """fio's ``jobs[]`` for ``argv`` (run for real, tiny sizes, in ``tmp_path``)."""
    out = tmp_path / "fio.json"
    proc = subprocess.run(
        ["fio", *argv, "--output-format=json", f"--output={out}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    # fio 3.33 adds an empty entry (no jobname, groupid 2**32-1) when group_reporting is set on a later job
    return [j for j in json.loads(text[text.index("{") :])["jobs"] if "jobname" in j]


def _ours(tmp_path, run_bench, argv: list[str]) -> list[dict]:
    out = tmp_path / "ours.json"
    rc, _, err = run_bench(*argv, "--output-format=json", f"--output={out}")
    assert rc == 0, err
    return json.loads(out.read_text())["jobs"]


def _summary(jobs: list[dict]) -> list[tuple]:
    """What ran: (name, reporting group, read bytes, write bytes) per reported entry."""
    return [(j["jobname"], j["groupid"], j["read"]["io_bytes"], j["write"]["io_bytes"]) for j in jobs]


def _common(tmp_path) -> list[str]:
    """Options both tools read the same way: O_DIRECT files of 1 MiB in tmp_path, 4 KiB synchronous I/O."""
    d = tmp_path / "files"
    d.mkdir(exist_ok=True)
    return [f"--directory={d}", "--size=1m", "--bs=4k", "--direct=1", "--ioengine=psync"]


def test_every_name_on_the_command_line_is_a_job():
    """``--name=a ... --name=b ...`` used to run only b, silently."""
    a, b = parse_jobs(
        ["--bs=8k", "--name=a", "--rw=read", "--size=8m", "--name=b", "--rw=write", "--size=4m"]
    )
    assert (a.name, a.options["rw"], a.options["size"], a.options["bs"]) == ("a", "read", 8 << 20, 8192)
    assert (b.name, b.options["rw"], b.options["size"], b.options["bs"]) == ("b", "write", 4 << 20, 8192)
    assert a.explicit == {"name": "a", "rw": "read", "size": "8m"} and a.global_explicit == {"bs": "8k"}
    # options after a --name belong to that job only, as in fio
    (c, d) = parse_jobs(["--name=c", "--rw=read", "--iodepth=4", "--name=d", "--rw=write"])
    assert (c.options["iodepth"], d.options["iodepth"]) == (4, 1)


@needs_fio
def test_two_named_jobs_run_both_as_fio_does(tmp_path, run_bench):
    argv = [*_common(tmp_path), "--name=a", "--rw=read", "--name=b", "--rw=write"]
    ours, fio = _ours(tmp_path, run_bench, argv), _fio(tmp_path, argv)
    assert _summary(ours) == _summary(fio) == [("a", 0, 1 << 20, 0), ("b", 0, 0, 1 << 20)]


@needs_fio
def test_stonewall_and_new_group_number_groups_as_fio_does(tmp_path, run_bench):
    argv = [
        *_common(tmp_path),
        "--name=a",
        "--rw=write",
        "--name=b",
        "--stonewall",
        "--rw=read",
        "--name=c",
        "--new_group",
        "--rw=randread",
        "--name=d",
        "--rw=read",
    ]
    ours, fio = _ours(tmp_path, run_bench, argv), _fio(tmp_path, argv)
    assert _summary(ours) == _summary(fio)
    assert [j["groupid"] for j in ours] == [0, 1, 2, 2]


@needs_fio
def test_group_reporting_merges_a_group_as_fio_does(tmp_path, run_bench):
    argv = [
        *_common(tmp_path),
        "--group_reporting",
        "--name=a",
        "--rw=read",
        "--name=b",
        "--rw=write",
        "--name=c",
        "--new_group",
        "--rw=read",
    ]
    ours, fio = _ours(tmp_path, run_bench, argv), _fio(tmp_path, argv)
    assert _summary(ours) == _summary(fio) == [("a", 0, 1 << 20, 1 << 20), ("c", 1, 1 << 20, 0)]
    assert ours[0]["read"]["total_ios"] == fio[0]["read"]["total_ios"] == 256
    # fio's merged entry shows the last member's job options; so does ours
    assert ours[0]["job options"]["name"] == fio[0]["job options"]["name"] == "b"


@needs_fio
def test_group_reporting_on_a_later_job_joins_the_previous_one(tmp_path, run_bench):
    argv = [
        *_common(tmp_path),
        "--name=a",
        "--rw=read",
        "--name=b",
        "--group_reporting",
        "--rw=write",
        "--name=c",
        "--rw=read",
    ]
    ours, fio = _ours(tmp_path, run_bench, argv), _fio(tmp_path, argv)
    assert _summary(ours) == _summary(fio)
    assert len(ours) == 2


@needs_fio
def test_command_line_jobs_run_before_job_file_jobs_as_in_fio(tmp_path, run_bench):
    job = tmp_path / "j.fio"
    job.write_text("[x]\nrw=read\n")
    argv = [*_common(tmp_path), str(job), "--name=y", "--rw=write"]
    ours, fio = _ours(tmp_path, run_bench, argv), _fio(tmp_path, argv)
    assert _summary(ours) == _summary(fio)
    assert [j["jobname"] for j in ours] == ["y", "x"]


def test_job_file_and_command_line_give_the_same_groups(tmp_path):
    job = tmp_path / "j.fio"
    job.write_text("[global]\nsize=1m\n[a]\nrw=read\n[b]\nrw=write\nstonewall\n[c]\nrw=read\nnew_group\n")
    from_file = parse_jobs([], [str(job)])
    from_flags = parse_jobs(
        [
            "--size=1m",
            "--name=a",
            "--rw=read",
            "--name=b",
            "--rw=write",
            "--stonewall",
            "--name=c",
            "--rw=read",
            "--new_group",
        ]
    )

    def groups(jobs):
        return [(j.name, j.groupid, j.waits_for_previous) for j in jobs]

    assert groups(from_file) == groups(from_flags) == [("a", 0, False), ("b", 1, True), ("c", 2, False)]


# ------------------------------------------------------------------ when jobs run
_SPANS: dict[str, tuple[float, float]] = {}


def _timed_runner(options: dict) -> JobResult:
    t0 = time.monotonic()
    time.sleep(0.4)
    _SPANS[options["name"]] = (t0, time.monotonic())
    return JobResult(
        jobname=options["name"], options=options, read=DirectionResult(io_bytes=4096, ops=1, runtime_s=0.4)
    )


@pytest.fixture
def timed_jobs(monkeypatch):
    monkeypatch.setattr(registry, "_RUNNERS", dict(registry._RUNNERS))
    monkeypatch.setattr(registry, "RUNNER_MODULES", ())
    register_runner(["read", "write"], _timed_runner, replace=True)
    _SPANS.clear()
    return _SPANS


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_jobs_run_at_once_unless_stonewall(run_bench, timed_jobs):
    """fio starts every job of a run at once; the job-file path used to run them one after another."""
    rc, _, err = run_bench(
        "--name=a",
        "--rw=read",
        "--name=b",
        "--rw=write",
        "--name=c",
        "--rw=read",
        "--new_group",
        "--eta=never",
    )
    assert rc == 0, err
    assert _overlap(timed_jobs["a"], timed_jobs["b"]) and _overlap(timed_jobs["b"], timed_jobs["c"])
    timed_jobs.clear()
    rc, _, err = run_bench(
        "--name=a",
        "--rw=read",
        "--name=b",
        "--rw=write",
        "--name=c",
        "--rw=read",
        "--stonewall",
        "--name=d",
        "--rw=write",
        "--eta=never",
    )
    assert rc == 0, err
    assert _overlap(timed_jobs["a"], timed_jobs["b"]) and _overlap(timed_jobs["c"], timed_jobs["d"])
    assert timed_jobs["c"][0] >= max(timed_jobs["a"][1], timed_jobs["b"][1])  # waited for a and b


def test_jobs_of_a_job_file_run_at_once_too(tmp_path, run_bench, timed_jobs):
    job = tmp_path / "j.fio"
    job.write_text("[a]\nrw=read\n[b]\nrw=write\n[c]\nrw=read\nstonewall\n")
    rc, out, err = run_bench(str(job), "--eta=never")
    assert rc == 0, err
    assert _overlap(timed_jobs["a"], timed_jobs["b"]) and timed_jobs["c"][0] >= timed_jobs["b"][1]
    assert "Run status group 0 (all jobs):" in out and "Run status group 1 (all jobs):" in out


def test_group_reporting_refuses_to_merge_kv_jobs(run_bench):
    rc, _, err = run_bench(
        "--group_reporting", "--name=a", "--rw=kvstore", "--name=b", "--rw=kvload", "--parse-only"
    )
    assert rc == 1 and "group_reporting" in err and "'b'" in err and len(err.strip().splitlines()) == 1
