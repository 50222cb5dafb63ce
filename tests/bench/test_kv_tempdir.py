"""KV jobs without ``--directory`` put their NVMe tier in a private temporary directory, as plain jobs
do (issue 22, item 5): two runs at once both succeed, and the directory is gone afterwards, also after a
failure or a stop request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from tierstore.bench import kvjobs, registry
from tierstore.bench.cli import main

from .conftest import REPO


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The system temporary directory of this process points at an empty ``tmp_path`` subdirectory."""
    tmp = tmp_path / "systmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_two_kvtrace_runs_at_once_both_succeed(tmp_path):
    """Both used to put their tier at $TMPDIR/kvtrace.0.0: the second failed with "exists"."""
    tmp = tmp_path / "systmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "bench",
                "--rw=kvtrace",
                "--number_ios=300",
                "--output-format=json",
                "--eta=never",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=env,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out)["jobs"][0]["kv"]["requests"] == 300
    assert list(tmp.iterdir()) == []  # each private directory was removed


def test_kvtrace_leaves_a_file_of_another_run_alone(private_tmp, capsys):
    """Another run's tier at the old fixed path neither stops this run nor is touched by it."""
    other = private_tmp / "kvtrace.0.0"
    other.write_bytes(b"another run's tier")
    assert main(["--rw=kvtrace", "--number_ios=50", "--output-format=json"]) == 0, capsys.readouterr().err
    assert other.read_bytes() == b"another run's tier"
    assert [p.name for p in private_tmp.iterdir()] == ["kvtrace.0.0"]


def test_kvtrace_private_directory_removed_after_a_failure(private_tmp, monkeypatch, capsys):
    seen = []

    def failing_replay(cfg, **kwargs):
        seen.append(cfg.nvme_options["path"])
        assert os.path.dirname(cfg.nvme_options["path"]) != str(private_tmp)  # a directory of its own
        open(cfg.nvme_options["path"], "wb").close()
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(kvjobs, "run_replay", failing_replay)
    assert main(["--rw=kvtrace", "--number_ios=50"]) == 1
    assert "Input/output error" in capsys.readouterr().err
    assert seen and list(private_tmp.iterdir()) == []


def test_kvtrace_private_directory_removed_after_a_stop_request(private_tmp, monkeypatch, capsys):
    """What the first Ctrl-C does: the replay stops, the directory goes."""
    timer = threading.Timer(0.5, registry.request_stop, args=(signal.SIGINT,))
    real_reset = registry.reset_stop

    def reset_then_arm():
        real_reset()
        timer.start()

    monkeypatch.setattr("tierstore.bench.cli.reset_stop", reset_then_arm)
    rc = main(["--rw=kvtrace", "--number_ios=100000"])
    timer.cancel()
    assert rc == 130, capsys.readouterr().err
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--rw=write", "--bs=4k", "--size=256k", "--ioengine=psync"], "write.0.0"),
        (["--rw=kvtrace", "--number_ios=50"], "kvtrace.0.0"),
    ],
)
def test_unlink_0_keeps_the_private_directory_and_names_it(private_tmp, capsys, flags, name):
    """Trial 11: ``--unlink=0`` without directory= reported .../tierstore-bench-XXX/write.0.0 and then
    removed that directory anyway; the README says --unlink=0 keeps the job's files."""
    assert main([*flags, "--unlink=0", "--output-format=json"]) == 0, capsys.readouterr().err
    (kept,) = private_tmp.iterdir()
    assert (kept / name).is_file() and f"kept in {kept}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [["--rw=write", "--bs=4k", "--size=256k", "--ioengine=psync"], ["--rw=kvtrace", "--number_ios=50"]],
)
def test_a_relative_filename_is_under_the_working_directory_for_every_job(
    private_tmp, tmp_path, monkeypatch, capsys, flags
):
    """Trial 11: a relative filename= went to the working directory for plain jobs and to a private
    temporary directory (removed) for KV jobs. One rule now, fio's: the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main([*flags, "--filename=mine.dat", "--unlink=0", "--output-format=json"]) == 0, (
        capsys.readouterr().err
    )
    assert (work / "mine.dat").is_file()


def test_numjobs_clones_have_a_file_each_as_in_fio_unless_filename_is_given(tmp_path, capsys):
    """Trial 11: --numjobs=2 without filename= had both clones write one write.0.0, where fio writes
    write.0.0 and write.1.0 (jobname.jobnum.filenum), each of size= and each written whole."""
    flags = ["--rw=write", "--bs=64k", "--size=1m", "--ioengine=psync", "--numjobs=2", "--unlink=0"]
    each = tmp_path / "each"
    each.mkdir()
    assert main([*flags, f"--directory={each}", "--output-format=json"]) == 0, capsys.readouterr().err
    job = json.loads(capsys.readouterr().out)["jobs"][0]
    assert job["write"]["total_ios"] == 32
    assert sorted(p.name for p in each.iterdir()) == ["write.0.0", "write.1.0"]
    for p in each.iterdir():  # every block of each file written (allocated), not one file twice
        assert p.stat().st_size == 1 << 20 and p.stat().st_blocks * 512 >= 1 << 20
    shared = tmp_path / "shared"
    shared.mkdir()
    assert main([*flags, f"--directory={shared}", "--filename=one", "--output-format=json"]) == 0
    assert [p.name for p in shared.iterdir()] == ["one"]
