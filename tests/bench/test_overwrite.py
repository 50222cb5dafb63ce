"""Plain jobs never write over a file tierstore did not create, unless told to (``format=1``).

fio writes into any ``filename=`` it is given; tierstore refuses a write job (or a read job whose
layout would extend the file) on an existing non-empty file that no tierstore job created, before
any write, and names the opt-in (house rule 9; issue 22 found the overwrite)."""

from __future__ import annotations

import hashlib
import os

import pytest


def _user_file(path, n_bytes: int = 3 << 20) -> str:
    path.write_bytes(os.urandom(n_bytes))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("rw", ["write", "randwrite", "randrw", "rw"])
def test_a_write_job_on_a_users_file_is_refused_and_the_file_unchanged(tmp_path, run_bench, rw):
    f = tmp_path / "mine.bin"
    digest = _user_file(f)
    rc, _, err = run_bench("--name=w", f"--rw={rw}", f"--filename={f}", "--size=1m", "--bs=4k")
    assert rc != 0
    assert "no tierstore job created" in err and "--format=1" in err and "Nothing was written" in err
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest and f.stat().st_size == 3 << 20


def test_a_read_job_that_would_extend_a_users_file_is_refused(tmp_path, run_bench):
    f = tmp_path / "small.bin"
    digest = _user_file(f, 64 << 10)
    rc, _, err = run_bench("--name=r", "--rw=read", f"--filename={f}", "--size=1m", "--bs=4k")
    assert rc != 0 and "--format=1" in err
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest


def test_a_read_job_reads_a_users_file_and_leaves_it(tmp_path, run_bench):
    f = tmp_path / "mine.bin"
    digest = _user_file(f)
    rc, out, err = run_bench("--name=r", "--rw=randread", f"--filename={f}", "--size=1m", "--bs=4k")
    assert rc == 0, err
    assert "read: IOPS=" in out
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest


def test_format_1_writes_over_a_users_file(tmp_path, run_bench):
    f = tmp_path / "scratch.bin"
    digest = _user_file(f)
    rc, _, err = run_bench("--name=w", "--rw=write", f"--filename={f}", "--size=1m", "--bs=4k", "--format=1")
    assert rc == 0, err
    assert hashlib.sha256(f.read_bytes()).hexdigest() != digest


def test_a_file_a_job_created_and_kept_is_written_again_without_format(tmp_path, run_bench):
    f = tmp_path / "kept.bin"
    rc, _, err = run_bench("--name=a", "--rw=write", f"--filename={f}", "--size=1m", "--bs=4k", "--unlink=0")
    assert rc == 0, err
    if not f.exists():
        pytest.fail("unlink=0 must keep the job's file")
    try:
        os.getxattr(f, "user.tierstore.bench")
    except OSError as e:
        pytest.skip(f"this file system keeps no user xattrs ({e.strerror}): the job's mark cannot be kept")
    rc, _, err = run_bench("--name=b", "--rw=randwrite", f"--filename={f}", "--size=1m", "--bs=4k")
    assert rc == 0, err


def test_a_users_file_copied_over_a_kept_job_file_is_refused(tmp_path, run_bench):
    """`cp` onto a job's kept file keeps the file's xattrs: the mark alone made it look like the
    job's own and the next write job overwrote the user's bytes (re-trial of issue 22)."""
    f = tmp_path / "keep.0.0"
    rc, _, err = run_bench(
        "--name=keep", "--rw=write", f"--filename={f}", "--size=1m", "--bs=4k", "--unlink=0"
    )
    assert rc == 0, err
    try:
        os.getxattr(f, "user.tierstore.bench")
    except OSError as e:
        pytest.skip(f"this file system keeps no user xattrs ({e.strerror})")
    with open(f, "r+b") as fh:  # what cp does to an existing target: same inode, new bytes
        fh.write(os.urandom(2 << 20))
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    rc, _, err = run_bench("--name=keep", "--rw=write", f"--filename={f}", "--size=1m", "--bs=4k")
    assert rc != 0 and "--format=1" in err
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest


def test_a_read_job_without_size_reads_the_file_at_its_size(tmp_path, run_bench):
    """fio: without size=, a job on an existing file uses its size; the default 64m made a read of a
    3 MiB user file 'extend' it and be refused."""
    f = tmp_path / "mine.bin"
    digest = _user_file(f)
    rc, out, err = run_bench("--name=r", "--rw=read", f"--filename={f}", "--bs=4k")
    assert rc == 0, err
    assert "io=3072KiB" in out
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("rw", ["read", "randread"])
def test_a_read_job_without_size_on_a_file_under_one_block_says_so(tmp_path, run_bench, rw):
    """A 6-byte file with bs=4k and no size= was refused as "would extend it to size=67108864
    bytes", a size the user never gave (fresh-user trial 9)."""
    f = tmp_path / "tiny"
    f.write_bytes(b"hello\n")
    rc, out, err = run_bench("--name=r", f"--rw={rw}", f"--filename={f}", "--bs=4k")
    assert rc != 0 and out == ""
    assert "the file holds 6 bytes, less than one block of bs=4096" in err and "Nothing was written" in err
    assert "67108864" not in err
    assert f.read_bytes() == b"hello\n"
