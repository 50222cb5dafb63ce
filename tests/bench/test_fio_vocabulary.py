"""fio vocabulary users paste (issue 22, item 7): ``--output-format=terse`` (fio's terse v3),
``--minimal``, ``tierstore --version``."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys

import pytest

from tierstore.cli import main as tierstore_main

from .conftest import REPO

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
_TERSE_FIELDS = 121  # fio 3.33 terse v3 without disk utilization (man fio, TERSE OUTPUT)


def _kind(field: str) -> str:
    """What a terse field looks like: a percentile ``P%=V``, a percentage, a number, or text."""
    if re.fullmatch(r"[0-9.]+%=[0-9]+", field):
        return "pct="
    if re.fullmatch(r"[0-9.]+%", field):
        return "pct"
    if re.fullmatch(r"-?[0-9]+(\.[0-9]+)?", field):
        return "num"
    return "text"


def _fio_terse(tmp_path, argv: list[str]) -> list[list[str]]:
    proc = subprocess.run(
        ["fio", *argv, "--output-format=terse"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    return [line.split(";") for line in proc.stdout.splitlines() if line.startswith("3;")]


def _ours_terse(run_bench, argv: list[str]) -> list[list[str]]:
    rc, out, err = run_bench(*argv, "--output-format=terse")
    assert rc == 0, err
    return [line.split(";") for line in out.splitlines()]


@needs_fio
def test_terse_v3_has_fios_fields_in_fios_places(tmp_path, run_bench):
    """--output-format=terse used to be refused as an unknown format."""
    d = tmp_path / "files"
    d.mkdir()
    argv = [
        f"--directory={d}",
        "--size=1m",
        "--bs=4k",
        "--direct=1",
        "--ioengine=psync",
        "--name=r",
        "--rw=randread",
        "--name=w",
        "--rw=write",
        "--new_group",
        "--description=two words",
    ]
    ours, fio = _ours_terse(run_bench, argv), _fio_terse(tmp_path, argv)
    assert len(ours) == len(fio) == 2
    for o, f in zip(ours, fio):
        # fio adds 9 disk-utilization fields (it sampled /dev/vda) before the description; we sample no disk
        f = f[:_TERSE_FIELDS] + f[_TERSE_FIELDS + 9 :]
        assert len(o) == len(f) == _TERSE_FIELDS + (1 if o[2] == "w" else 0)
        assert [_kind(x) for x in o] == [_kind(x) for x in f]
        assert (o[0], o[2], o[3], o[4]) == (f[0], f[2], f[3], f[4])  # version, name, group, error
        assert o[5] == f[5] and o[46] == f[46]  # read and write KiB
        assert [x.split("=")[0] for x in o[17:37]] == [x.split("=")[0] for x in f[17:37]]  # percentile labels
    assert ours[1][-1] == fio[1][-1] == "two words"
    r = ours[0]
    assert int(r[5]) == 1024 and int(r[7]) > 0 and int(r[8]) > 0  # KiB, IOPS, runtime ms
    assert int(r[13]) <= float(r[15]) <= int(r[14])  # clat min <= mean <= max (usec)
    assert float(r[92].rstrip("%")) == 100.0  # IO depth <=1: psync
    assert sum(float(x.rstrip("%")) for x in r[99:121]) == pytest.approx(100.0, abs=0.2)  # latency shares


def test_minimal_is_terse_and_other_terse_versions_are_refused(run_bench):
    rc, out, err = run_bench("--rw=randread", "--ioengine=memory", "--size=1m", "--minimal")
    assert rc == 0, err
    (line,) = out.splitlines()
    assert (
        line.split(";")[:3] == ["3", line.split(";")[1], "randread"] and len(line.split(";")) == _TERSE_FIELDS
    )
    rc, _, err = run_bench(
        "--rw=randread", "--ioengine=memory", "--size=1m", "--minimal", "--terse-version=5"
    )
    assert rc == 1 and "terse-version='5'" in err and len(err.strip().splitlines()) == 1


def test_tierstore_version_from_package_metadata(capsys):
    """``tierstore --version`` used to be "unknown command '--version'", exit 2."""
    assert tierstore_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tierstore {importlib.metadata.version('tierstore')}"
    r = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0 and r.stdout.startswith("tierstore ") and r.stderr == ""


# ------------------------------------------------------------------ the kvtrace report
def test_kvtrace_report_leads_with_one_verdict_and_explains_its_figures(tmp_path, run_bench):
    """The report used to open with fio's job line and a wall of kv counters; WAF, e2e_wa and
    host_write_amplification were printed without saying what they are; IOPS counted calls."""
    out = tmp_path / "r.txt"
    rc, _, err = run_bench(
        "--rw=kvtrace",
        "--number_ios=200",
        f"--directory={tmp_path}",
        "--output-format=normal,json",
        f"--output={out}",
    )
    assert rc == 0, err
    text = out.read_text()
    normal, doc = text[: text.index("{\n")], json.loads(text[text.index("{\n") :])
    first = normal.splitlines()[0]
    kv = doc["jobs"][0]["kv"]
    assert first == f"kvtrace: {kv['verdict']}"
    assert (
        f"hit ratio {kv['useful_hit_ratio']:.1%}" in first
        and f"vs {kv['ideal_hit_ratio']:.1%} with an infinite" in first
        and f"saved {kv['saved_prefill_tokens']:,} prefill tokens" in first
    )
    assert sum(1 for line in normal.splitlines() if "infinite" in line) == 1  # one verdict, not repeated
    for term in (
        "WAF = media bytes written / host bytes written",
        "e2e_wa = media bytes written / bytes the store",
        "host_write_amplification = ",
    ):
        assert term in normal, term
    read, write = doc["jobs"][0]["read"], doc["jobs"][0]["write"]
    assert (
        read["total_ios"] == kv["loaded_blocks"]
        and read["io_bytes"] == kv["loaded_blocks"] * kv["block_bytes"]
    )
    assert read["clat_ns"]["N"] <= read["total_ios"]  # latencies per call, I/Os per block
    assert write["total_ios"] == write["io_bytes"] // kv["block_bytes"] > write["clat_ns"]["N"]
    assert "(IOPS are KV blocks/s, 32.0KiB each; the latencies are per load call:" in normal


def test_verdict_wording():
    from tierstore.bench.kvjobs import verdict

    line = verdict(
        {
            "useful_hit_ratio": 0.25,
            "lookup_hit_ratio": 0.3,
            "ideal_hit_ratio": 0.5,
            "lookup_blocks": 4000,
            "saved_prefill_tokens": 512_000,
            "prompt_tokens": 2_048_000,
        }
    )
    assert line == (
        "hit ratio 25.0% of 4,000 prompt blocks vs 50.0% with an infinite cache (the trace's ideal, 50% "
        "of it); 30.0% matched, the rest not worth loading or failed; saved 512,000 prefill tokens of "
        "2,048,000 prompt tokens (25.0%)"
    )
    assert "\n" not in line
