"""KV jobs: where the NVMe tier lives, what the shipped job files measure, what is loaded, full disks
(issue 19, items 7 and 8, CLI side)."""

from __future__ import annotations

import errno
import json
import os
from collections import namedtuple

import pytest

from tierstore.bench.cli import main
from tierstore.bench.jobfile import parse_jobs, schema_help
from tierstore.bench.kvjobs import store_config

from .conftest import REPO

_StatVfs = namedtuple("_StatVfs", "f_bavail f_frsize")
_SMALL = [
    "--layout=tiny",
    "--bs=64k",
    "--size=4m",
    "--hbm_size=256k",
    "--host_size=512k",
    "--nvme_size=16m",
    "--iodepth=2",
]


def _run(tmp_path, *args, rc=0):
    out = tmp_path / "o.json"
    got = main([*args, "--output-format=json", f"--output={out}"])
    assert got == rc
    return json.loads(out.read_text())["jobs"][0]


def _mode(flags, files=()):
    (job,) = parse_jobs(flags, files)
    opts = dict(job.options, _explicit=frozenset(job.explicit) | frozenset(job.global_explicit))
    return store_config(opts, 0, 1 << 20, 16 << 20, "/tmp/x.0.0").tiers.nvme


def test_device_default_is_what_cmdhelp_says_and_file_is_accepted(tmp_path):
    """--cmdhelp said the default was sim while leaving it out gave a file; --device=file was refused."""
    assert "(default: file)" in schema_help("device")
    assert _mode(["--rw=kvload"]).device == "file"
    assert _mode(["--rw=kvload", "--device=file"]).device == "file"
    assert _mode(["--rw=kvload", "--device=sim"]).device == "sim"
    assert _mode(["--rw=kvload", "--device=/dev/ng0n1"]).device == "fdp"
    job = _run(tmp_path, "--rw=kvstore", "--device=file", f"--directory={tmp_path}", *_SMALL)
    assert job["device"]["device"].startswith("file (posix engine)")
    assert job["device"]["engine_write_bytes"] > 0  # the bytes went to a file
    assert job["kv"]["nvme_bytes"] > 0 and list(tmp_path.glob("*.0.0")) == []  # removed at the end (unlink=1)
    rc = main(["--rw=kvstore", "--device=floppy", "--parse-only"])
    assert rc == 1


@pytest.mark.parametrize("name", ["kvload", "kvstore", "kvmixed", "kvtrace"])
def test_shipped_kv_job_files_put_the_nvme_tier_on_disk(name):
    """The four job files set device=sim: a memory engine, their ioengine=posix and directory= ignored."""
    path = str(REPO / "bench" / "jobs" / f"{name}.fio")
    cfg = _mode([], [path])
    assert cfg.device == "file" and cfg.engine == "posix" and cfg.path == "/tmp/x.0.0"
    (job,) = parse_jobs([], [path])
    assert job.options["directory"] == ""  # a private temporary directory: runs at once never meet (issue 22)
    if name == "kvload":  # a load test loads what it matched (a bandwidth test), see the file's comment
        assert job.options["load_blocks"] == "matched"


def test_kvstore_job_file_writes_its_nvme_file(tmp_path):
    job = _run(
        tmp_path,
        str(REPO / "bench" / "jobs" / "kvstore.fio"),
        f"--directory={tmp_path}",
        "--layout=tiny",
        "--bs=64k",
        "--size=8m",
        "--hbm_size=256k",
        "--host_size=512k",
        "--nvme_size=16m",
        "--iodepth=2",
    )
    assert job["device"]["device"].startswith(f"file (posix engine) {tmp_path}/kvstore.0.0")
    assert job["device"]["engine_write_bytes"] >= job["kv"]["nvme_bytes"] > 0


def test_kv_job_refuses_an_existing_file(tmp_path, capsys):
    (tmp_path / "kvstore.0.0").write_bytes(b"precious")
    assert main(["--rw=kvstore", f"--directory={tmp_path}", *_SMALL]) == 1
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "kvstore.0.0").read_bytes() == b"precious"


_LLAMA_SMALL = [
    "--layout=llama-3.1-8b",
    "--bs=4k",
    "--size=48m",
    "--hbm_size=4m",
    "--host_size=8m",
    "--nvme_size=512m",
    "--iodepth=2",
]


def test_kvload_reports_matched_vs_loaded_and_why(tmp_path):
    """kvload read ~half of what it stored and never said so: the cost model skips NVMe blocks
    that recompute faster than they load (one 16-token 2 MiB block here, on a disk measured slow)."""
    job = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", *_LLAMA_SMALL)
    kv = job["kv"]
    assert kv["matched_blocks"] == 24 and kv["lookup_hit_ratio"] == 1.0
    assert kv["loaded_blocks"] == kv["useful_blocks"] <= kv["matched_blocks"]
    assert job["read"]["io_bytes"] == kv["loaded_blocks"] * kv["block_bytes"]
    skipped = kv["matched_blocks"] - kv["useful_blocks"]
    if skipped:  # the cost model calibrates on measured loads: how many it skips depends on the disk
        assert (
            f"{skipped} matched blocks were not loaded because the cost model judged recomputing them faster"
            in kv["not_loaded_reason"]
            and "load_blocks=matched" in kv["not_loaded_reason"]
        )
    else:
        assert "not_loaded_reason" not in kv


def test_kvload_says_why_nothing_was_loaded_when_recompute_wins(tmp_path, monkeypatch):
    """The same report made deterministic: a cost model whose prefill is faster than any tier
    (no calibration) judges every matched block not worth loading; the report says so and why."""
    import tierstore.build
    from tierstore.policies.cost import CostModel

    monkeypatch.setattr(
        tierstore.build, "CostModel", lambda: CostModel(prefill_tokens_per_s=1e15, measured_window=0)
    )
    kv = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", *_LLAMA_SMALL)["kv"]
    assert (kv["matched_blocks"], kv["useful_blocks"], kv["loaded_blocks"]) == (24, 0, 0)
    assert kv["not_loaded_reason"].startswith(
        "24 matched blocks were not loaded because the cost model judged "
        "recomputing them faster than loading them ("
    )
    kv = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", "--load_blocks=matched", *_LLAMA_SMALL)[
        "kv"
    ]
    assert kv["loaded_blocks"] == kv["matched_blocks"] == 24 and "not_loaded_reason" not in kv


def test_not_loaded_reason_names_the_cause_and_the_tiers():
    from tierstore.bench.kvsynth import _not_loaded_reason

    counts = {
        "matched": 24,
        "useful": 9,
        "attempted": 9,
        "loaded": 7,
        "skipped_tiers": {"hbm": 0, "host": 0, "nvme": 15},
    }
    text = _not_loaded_reason(counts, "useful")
    assert text.startswith(
        "15 matched blocks were not loaded because the cost model judged recomputing them "
        "faster than loading them (nvme: 15); load_blocks=matched loads every matched block"
    )
    assert "2 blocks failed to load" in text
    assert _not_loaded_reason(dict(counts, useful=24, attempted=24, loaded=24), "matched") == ""


def test_load_blocks_matched_loads_every_matched_block(tmp_path):
    job = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", "--load_blocks=matched", *_LLAMA_SMALL)
    kv = job["kv"]
    assert kv["loaded_blocks"] == kv["matched_blocks"] == 24
    assert job["read"]["io_bytes"] == 48 << 20 and kv["hit_blocks_nvme"] > 0
    assert "not_loaded_reason" not in kv and kv["wrong_kv_blocks"] == 0


@pytest.mark.parametrize("rw,method", [("kvstore", "store"), ("kvload", "load"), ("kvmixed", "load")])
def test_a_failed_kv_worker_fails_the_job(tmp_path, monkeypatch, capsys, rw, method):
    """A KV worker that raised printed a thread traceback, and the job still reported err= 0 and exit 0."""
    from tierstore.api import KVStore

    real = getattr(KVStore, method)
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 6:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, *a, **k)

    monkeypatch.setattr(KVStore, method, flaky)
    out = tmp_path / "o.txt"
    rc = main(
        [f"--rw={rw}", f"--directory={tmp_path}", *_SMALL, "--output-format=normal,json", f"--output={out}"]
    )
    assert rc == 1
    text = out.read_text()
    assert f"{rw}: (groupid=0, jobs=1): err= 5: pid=" in text
    job = json.loads(text[text.index("{\n") :])["jobs"][0]
    assert job["error"] == errno.EIO and job["kv"]["wrong_kv_blocks"] == 0
    err = capsys.readouterr().err
    assert "err=5 (EIO)" in err and "OSError" in err and "in worker" in err and "Traceback" not in err
    assert list(tmp_path.glob("*.0.0")) == []  # the NVMe file is still removed


def test_wrong_kv_fails_the_job_as_a_verify_error(tmp_path, monkeypatch):
    """A loaded block that does not hold its key's bytes is fio's verify failure (EILSEQ), never err= 0."""
    from tierstore.api import KVStore

    real = KVStore.load

    def corrupting(self, *a, **k):
        st, outs = real(self, *a, **k)
        for o in outs[:1]:
            if o is not None:
                o.view(-1)[:1] = 0 if o.view(-1)[0] else 1
        return st, outs

    monkeypatch.setattr(KVStore, "load", corrupting)
    job = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", *_SMALL, rc=1)
    assert job["kv"]["wrong_kv_blocks"] > 0 and job["error"] == errno.EILSEQ


def test_full_disk_is_reported_with_enospc(tmp_path, monkeypatch, capsys):
    """A full file system printed err= 0 and store_no_space_blocks=0 while blocks were refused."""
    from tierstore.io.posix import PosixEngine

    real = PosixEngine.preallocate
    calls = {"n": 0}

    def full_after_two(self, offset, length):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, offset, length)

    monkeypatch.setattr(PosixEngine, "preallocate", full_after_two)
    out = tmp_path / "o.txt"
    rc = main(
        [
            "--rw=kvstore",
            f"--directory={tmp_path}",
            "--size=8m",
            *_SMALL[:2],
            *_SMALL[3:],
            "--output-format=normal,json",
            f"--output={out}",
        ]
    )
    assert rc == 1
    text = out.read_text()
    job = json.loads(text[text.index("{\n") :])["jobs"][0]
    kv = job["kv"]
    assert job["error"] == errno.ENOSPC and "err=28: pid=" in text
    assert kv["nvme_allocation_failures"] > 0
    assert kv["store_no_space_blocks"] + kv["demoted_no_space_blocks"] > 0
    err = capsys.readouterr().err
    assert "err=28 (ENOSPC)" in err and "ran out of space" in err
    # the condition is logged once (a 40 MB file system printed 113 identical lines), with the count at the
    # end
    assert err.count("cannot allocate") == 1 and kv["nvme_allocation_failures"] >= 2, err
    assert f"{kv['nvme_allocation_failures']} segment allocations failed" in err
    assert "tierstore bench: warning: segment " in err


def test_warns_when_the_nvme_tier_is_larger_than_free_space(tmp_path, monkeypatch, capsys):
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: _StatVfs(2048, 4096) if str(p).startswith(str(tmp_path)) else real(p)
    )  # 8 MiB free
    assert (
        main(
            [
                "--rw=kvstore",
                f"--directory={tmp_path}",
                *_SMALL,
                "--output-format=json",
                f"--output={tmp_path / 'o.json'}",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "is larger than the" in ln]
    assert len(warnings) == 1, err  # one line (the bench and the store build used to print one each)
    # free = statvfs's 8 MiB plus what the tier's own file already holds (its 4 KiB unlabelled
    # marker page, written before the file grows: io/format.UNLABELLED_PAGE)
    head = "tierstore bench: warning: NVMe tier of 16777216 bytes is larger than the "
    assert warnings[0].startswith(head), warnings[0]
    free = int(warnings[0][len(head) :].split(" ", 1)[0])
    assert 8388608 <= free <= 8388608 + 4096, warnings[0]
    assert (
        main(
            [
                "--rw=kvstore",
                f"--directory={tmp_path}",
                *_SMALL,
                "--nvme_size=4m",
                "--output-format=json",
                f"--output={tmp_path / 'o.json'}",
            ]
        )
        == 0
    )
    assert (
        "is larger than the" not in capsys.readouterr().err
    )  # (8 KiB blocks: the header-share warning stays)


def test_a_failed_block_counts_only_the_leading_run_in_saved_prefill_tokens(tmp_path, monkeypatch):
    """Issue 19 item 3, bench side: with one failed block in the middle of a prefix, the engine uses the
    blocks before it only; saved_prefill_tokens took the store's reused_tokens and counted the blocks after
    it too. Here the second block of every load of three or more fails while the store itself loaded all."""
    from tierstore.api import KVStore, leading_ok
    from tierstore.errors import Status

    real = KVStore.load
    seen = {"lead": 0, "after": 0}

    def one_fails(self, keys, *a, **k):
        st, outs = real(self, keys, *a, **k)
        if len(st) >= 3 and st[1] is Status.OK:
            st, outs = list(st), list(outs)
            st[1], outs[1] = Status.IO_ERROR, None
        seen["lead"] += leading_ok(st)
        seen["after"] += sum(s is Status.OK for s in st[leading_ok(st) :])
        return st, outs

    monkeypatch.setattr(KVStore, "load", one_fails)
    job = _run(tmp_path, "--rw=kvload", f"--directory={tmp_path}", "--load_blocks=matched", *_SMALL)
    kv = job["kv"]
    assert seen["after"] > 0  # OK blocks after a failed one were loaded: they must not count
    assert kv["loaded_blocks"] == seen["lead"] < kv["matched_blocks"]
    assert kv["saved_prefill_tokens"] == seen["lead"] * 16  # the tiny layout's 16-token blocks
    assert kv["wrong_kv_blocks"] == 0 and "blocks failed to load" in kv["not_loaded_reason"]
