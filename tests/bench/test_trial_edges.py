"""What a new user's trial of ``tierstore bench`` hit: fio command lines pasted with ``--opt value``,
fio options tierstore does not have, what ``bs`` means for KV jobs, and the messages of refused files."""

from __future__ import annotations

import os

import pytest

from tierstore.bench.jobfile import parse_jobs


# ------------------------------------------------------------------ 1: fio's --opt value and unknown fio
# options
def test_space_separated_values_parse_as_fio_does(run_bench):
    """``--bs 4k`` used to make '4k' a job file and ``--rw read`` set rw='1'."""
    rc, out, err = run_bench(
        "--time_based",
        "--group_reporting",
        "--name",
        "j",
        "--rw",
        "read",
        "--bs",
        "8k",
        "--size",
        "1m",
        "--direct",
        "0",
        "--stonewall",
        "--output-format",
        "json",
        "--showcmd",
    )
    assert rc == 0, err
    assert out.split() == [
        "tierstore",
        "bench",
        "--name=j",
        "--rw=read",
        "--bs=8k",
        "--size=1m",
        "--time_based=1",
        "--direct=0",
        "--stonewall=1",
        "--group_reporting=1",
    ]


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--name"], "--name"),
        (["--name=j", "--bs", "--rw=read"], "--bs"),
        (["--name=j", "--rw=read", "--output-format"], "--output-format"),
    ],
)
def test_an_option_without_its_value_is_fios_error(run_bench, argv, option):
    rc, out, err = run_bench("--parse-only", *argv)
    assert rc == 1 and out == ""
    assert f"option '{option}' requires an argument" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--name"],
        ["--name=j", "--bs", "--rw=read"],
        ["--name=j", "--rw=read", "--eta"],  # a value missing
        ["--nosuch=1"],
        ["--rw=bogus"],
        ["--iodepth=0"],
        ["--name=j", "--verify=md5"],  # a value refused
    ],
)
def test_every_command_line_refusal_begins_the_same_way(run_bench, argv):
    """A missing value said "option '--bs' requires an argument" where every other refusal of the command
    line begins "command line:" (a fresh-user trial leftover): one prefix for both."""
    rc, out, err = run_bench("--parse-only", *argv)
    assert rc == 1 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(
        ("tierstore bench: error: command line: ", "tierstore bench: error: command line job 'j': ")
    ), line


def test_a_bare_value_option_in_a_flag_list_is_refused():
    """parse_jobs(["--name"]) used to make a job named '1'."""
    with pytest.raises(Exception, match=r"option '--name' requires an argument"):
        parse_jobs(["--name"])


@pytest.mark.parametrize("option", ["verify", "thread", "loops", "norandommap", "randrepeat", "filesize"])
@pytest.mark.parametrize("form", ["--{}=1", "--{}"])
def test_a_fio_option_tierstore_lacks_says_so_in_one_line(run_bench, option, form):
    rc, _, err = run_bench("--parse-only", "--name=j", form.format(option))
    assert rc == 1
    (line,) = err.strip().splitlines()
    assert f"fio option '{option}' is not supported by tierstore bench" in line
    assert "known options are" not in line and len(line) < 200


def test_a_typo_names_the_nearest_option(run_bench):
    rc, _, err = run_bench("--parse-only", "--iodeth=4")
    assert rc == 1 and "iodeth: unknown option; did you mean iodepth?" in err


# ------------------------------------------------------------------ 2: what bs is for a KV job
def test_kv_header_says_what_bs_is_and_warns_once_on_partial_blocks(run_bench):
    """kvload used to print the layout's block as bs=, silently rounding the job's bs down."""
    rc, out, err = run_bench("--name=j", "--rw=kvload", "--bs=100k", "--size=2m", "--device=sim")
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "warning: bs=" in line]
    assert len(warnings) == 1 and "not a multiple of the KV block (8192 B" in warnings[0]
    assert "a request's prompt is 12 whole blocks (98304 B)" in warnings[0]
    header = out.splitlines()
    assert header[0].startswith("j: (g=0): rw=kvload, bs=(R) 8192B-8192B")
    assert (
        "one I/O is one KV block of 8192 B" in header[1]
        and "prompt is the job's bs=102400 B in whole blocks: 12 blocks" in header[1]
    )


def test_kv_bs_of_whole_blocks_gives_no_warning(run_bench):
    rc, out, err = run_bench("--name=j", "--rw=kvstore", "--bs=32k", "--size=1m", "--device=sim")
    assert rc == 0, err
    assert "warning: bs=" not in err and "4 blocks (32768 B)" in out.splitlines()[1]


def test_kvtrace_says_bs_is_not_used(run_bench, tmp_path):
    rc, out, err = run_bench("--rw=kvtrace", "--number_ios=50", "--bs=1m", f"--directory={tmp_path}")
    assert rc == 0, err
    assert "warning: bs=1048576: not used by rw=kvtrace" in err
    assert "rw=kvtrace: one I/O is one trace block of 32768 B (trace_block_size)" in out


def test_cmdhelp_bs_says_what_it_is_for_kv_jobs(run_bench):
    rc, out, _ = run_bench("--cmdhelp=bs")
    assert rc == 0
    assert "rw=kvstore|kvload|kvmixed: bytes of a request's prompt" in out and "rw=kvtrace: not used" in out


# ------------------------------------------------------------------ 3: a KV job refusing an existing file
@pytest.mark.parametrize("fmt", [[], ["--format=1"]])
def test_kv_job_says_an_existing_file_is_not_its_own(tmp_path, run_bench, fmt):
    """It used to guess "a run still going ... or an NVMe tier left by a run with unlink=0"."""
    (tmp_path / "kvstore.0.0").write_bytes(b"precious")
    rc, _, err = run_bench("--rw=kvstore", f"--directory={tmp_path}", "--size=1m", *fmt)
    assert rc == 1
    assert "kvstore.0.0': exists, and this job did not create it" in err
    assert "choose another filename= or directory=" in err
    assert "still going" not in err and "unlink=0" not in err and "--format=1" not in err
    assert (tmp_path / "kvstore.0.0").read_bytes() == b"precious"


def test_kvtrace_says_runtime_and_size_are_not_used(run_bench, tmp_path):
    """The re-trial ran `--rw=kvtrace --runtime=2 --size=4m`: the whole trace, 16 s, a 192 MiB tier, not a
    word."""
    rc, _, err = run_bench(
        "--rw=kvtrace", "--number_ios=50", "--runtime=2", "--size=4m", f"--directory={tmp_path}"
    )
    assert rc == 0, err
    assert "warning: runtime=2" in err and "warning: size=4194304: not used by rw=kvtrace" in err


def test_a_file_under_dev_is_refused_with_the_reason(tmp_path):
    """``--directory=/dev/shm`` said "this job needs a real NVMe namespace; the development host has
    none" (fresh-user trial 4c): the reason is that a job creates no file under /dev."""
    from tierstore.bench.iojobs import run_io_job
    from tierstore.bench.jobfile import parse_jobs
    from tierstore.errors import ConfigError

    job = parse_jobs(["--name=x", "--rw=randread", "--size=4m", "--bs=4k", "--directory=/dev/shm"])[0]
    with pytest.raises(ConfigError, match="creates no file"):
        run_io_job(dict(job.options))
    assert not os.path.exists("/dev/shm/x.0.0")
