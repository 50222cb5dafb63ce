"""End to end: registry, runners, normal/json output, --output, --plot, progress."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tierstore.bench import registry
from tierstore.bench.registry import (
    BenchProgress,
    current_progress,
    get_runner,
    job_progress,
    register_runner,
)
from tierstore.bench.result import DirectionRecorder, DirectionResult, JobResult
from tierstore.errors import ConfigError


def _fake_kv_runner(options: dict) -> JobResult:
    """A stand-in KV runner: deterministic latencies, kv/device sections and time series."""
    rng = np.random.default_rng(options["seed"])
    load_lat_ns = rng.lognormal(mean=np.log(200_000), sigma=0.6, size=5000).astype(np.int64)
    t_s = np.linspace(0.0, 10.0, 41)
    hbmw = 1e6 * (1 + t_s)
    mbmw = hbmw * (1.0 + 0.08 * t_s)
    current_progress().update(1.0)
    write = DirectionResult(
        io_bytes=5000 * 65536,
        ops=5000,
        runtime_s=10.0,
        clat_ns=rng.integers(20_000, 80_000, size=5000),
        iops_samples=[500.0] * 20,
        bw_samples_bytes_s=[500.0 * 65536] * 20,
    )
    return JobResult(
        jobname=options["name"],
        options=options,
        write=write,
        read=DirectionResult(),
        kv={
            "lookup_hit_ratio": 0.61,
            "useful_hit_ratio": 0.55,
            "ideal_hit_ratio": 0.7,
            "saved_prefill_tokens": 123456,
            "hbm_bytes": 1 << 30,
            "host_bytes": 3 << 30,
            "nvme_bytes": 20 << 30,
            "load_lat_ns": load_lat_ns,
        },
        device={
            "hbmw_bytes": int(hbmw[-1]),
            "mbmw_bytes": int(mbmw[-1]),
            "mbe_bytes": int(mbmw[-1] * 0.9),
            "waf": float(mbmw[-1] / hbmw[-1]),
            "ruh_bytes": {0: 1 << 20, 1: 2 << 20, 2: 3 << 20},
        },
        timeseries={
            "t_s": list(t_s),
            "waf": list(mbmw / hbmw),
            "hbm_bytes": list(np.minimum(t_s, 4) * (1 << 28)),
            "host_bytes": list(np.minimum(t_s, 6) * (1 << 29)),
            "nvme_bytes": list(t_s * (1 << 30)),
        },
        usr_cpu=12.5,
        sys_cpu=3.0,
        runtime_s=10.0,
    )


@pytest.fixture
def fake_kv(monkeypatch):
    monkeypatch.setattr(registry, "_RUNNERS", dict(registry._RUNNERS))
    monkeypatch.setattr(registry, "RUNNER_MODULES", ())  # keep the real kv runners out
    register_runner(["kvtrace", "kvmixed"], _fake_kv_runner, replace=True)
    return _fake_kv_runner


def test_registry_rejects_double_registration(monkeypatch, fake_kv):
    def other(options):
        raise AssertionError("not called")

    with pytest.raises(ConfigError, match="already registered"):
        register_runner("kvtrace", other)
    register_runner("kvtrace", fake_kv)  # the same function again is fine
    assert get_runner("kvtrace") is fake_kv


def test_unregistered_rw_is_a_clear_error(monkeypatch, run_bench):
    monkeypatch.setattr(registry, "_RUNNERS", {})
    monkeypatch.setattr(registry, "RUNNER_MODULES", ())
    rc, _, err = run_bench("--rw=kvload")
    assert rc == 1 and "rw='kvload': no runner is registered" in err


def test_kv_job_normal_and_json(tmp_path, run_bench, fake_kv):
    out = tmp_path / "r.txt"
    rc, stdout, err = run_bench(
        "--rw=kvmixed",
        "--name=mix",
        "--dataplacement=fdp",
        "--plids=0,1,2",
        "--output-format=normal,json",
        f"--output={out}",
    )
    assert rc == 0, err
    assert stdout == ""
    text = out.read_text()
    normal, js = text[: text.index("{\n")], text[text.index("{\n") :]
    assert "mix: (groupid=0, jobs=1): err= 0: pid=" in normal
    assert "  write: IOPS=500, BW=31.2MiB/s (32.8MB/s)(312MiB/10000msec)" in normal
    assert "    clat (usec): min=" in normal and "    clat percentiles (nsec):" in normal
    assert "     |  1.00th=[" in normal and "99.99th=[" in normal
    assert "  kv           : lookup_hit_ratio=0.61" in normal and "saved_prefill_tokens=123456" in normal
    assert "    load lat (usec): min=" in normal and "    load lat percentiles (usec):" in normal
    assert "  device       : HBMW=" in normal and "WAF=1.800" in normal
    assert "  WRITE: bw=31.2MiB/s (32.8MB/s)" in normal
    doc = json.loads(js)
    job = doc["jobs"][0]
    assert job["job options"]["dataplacement"] == "fdp" and job["job options"]["plids"] == "0,1,2"
    assert job["kv"]["saved_prefill_tokens"] == 123456 and job["kv"]["nvme_bytes"] == 20 << 30
    load = job["kv"]["load_lat_ns"]
    assert load["N"] == 5000 and set(load["percentile"]) >= {"50.000000", "99.000000", "99.900000"}
    assert load["percentile"]["50.000000"] == pytest.approx(200_000, rel=0.1)
    assert job["device"]["waf"] == pytest.approx(1.8) and job["device"]["ruh_bytes"] == {
        "0": 1 << 20,
        "1": 2 << 20,
        "2": 3 << 20,
    }
    assert job["write"]["iops_stddev"] == 0.0 and job["write"]["iops_samples"] == 20


def test_plot_pngs(tmp_path, run_bench, fake_kv):
    plots = tmp_path / "plots"
    rc, _, err = run_bench(
        "--rw=kvtrace", "--output-format=json", f"--output={tmp_path / 'o.json'}", f"--plot={plots}"
    )
    assert rc == 0, err
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["kvtrace-lat-cdf.png", "kvtrace-tier-bytes.png", "kvtrace-waf.png"]
    for p in plots.iterdir():
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 10_000


def test_plain_write_job_with_sim_device(tmp_path, run_bench):
    plots = tmp_path / "plots"
    rc, out, err = run_bench(
        "--rw=randwrite",
        "--ioengine=memory",
        "--size=2m",
        "--bs=4k",
        "--runtime=0.6",
        "--time_based",
        "--dataplacement=fdp",
        "--plids=0,1,2",
        "--output-format=json",
        f"--plot={plots}",
    )
    assert rc == 0, err
    job = json.loads(out)["jobs"][0]
    dev = job["device"]
    assert dev["hbmw_bytes"] == job["write"]["io_bytes"]
    assert dev["mbmw_bytes"] >= dev["hbmw_bytes"] and dev["waf"] >= 1.0
    assert set(dev["ruh_host_bytes"]) == {"0", "1", "2"}
    assert (plots / "randwrite-waf.png").exists() and (plots / "randwrite-lat-cdf.png").exists()


def test_posix_engine_on_a_file(tmp_path, run_bench):
    rc, out, err = run_bench(
        "--rw=write",
        f"--directory={tmp_path}",
        "--size=1m",
        "--bs=64k",
        "--iodepth=2",
        "--numjobs=2",
        "--output-format=json",
    )
    assert rc == 0, err
    job = json.loads(out)["jobs"][0]
    assert job["write"]["io_bytes"] == 2 << 20 and job["write"]["total_ios"] == 32
    rc, out, err = run_bench(
        "--rw=read",
        f"--directory={tmp_path}",
        "--size=1m",
        "--bs=64k",
        "--name=write",
        "--output-format=json",
    )
    assert rc == 0, err
    assert json.loads(out)["jobs"][0]["read"]["io_bytes"] == 1 << 20


def test_job_file_with_two_jobs(tmp_path, run_bench):
    path = tmp_path / "two.fio"
    path.write_text("[global]\nioengine=memory\nsize=1m\nbs=4k\n\n[r]\nrw=randread\n\n[w]\nrw=write\n")
    rc, out, err = run_bench("--output-format=json", str(path))
    assert rc == 0, err
    doc = json.loads(out)
    assert [j["jobname"] for j in doc["jobs"]] == ["r", "w"]
    assert doc["global options"] == {"ioengine": "memory", "size": "1m", "bs": "4k"}
    assert doc["jobs"][0]["read"]["total_ios"] == 256 and doc["jobs"][1]["write"]["total_ios"] == 256


def test_runner_error_exit_1(run_bench):
    rc, _, err = run_bench("--rw=read", "--ioengine=memory", "--bs=4k", "--size=1k")
    assert rc == 1 and "size=1024: must be at least bs=4096" in err


def test_bad_output_format(run_bench):
    rc, _, err = run_bench("--rw=read", "--output-format=xml")
    assert rc == 1 and "output-format='xml'" in err and "'json+'" in err


def test_progress_quiet_without_terminal(capsys):
    with job_progress("job") as progress:
        assert current_progress() is progress
        assert progress.enabled is False  # pytest captures stderr: not a terminal
        progress.start(total=10, unit="s")
        progress.update(5)
    assert capsys.readouterr().err == ""
    assert current_progress().enabled is False


def test_progress_draws_on_terminal_after_delay(monkeypatch):
    progress = BenchProgress("job", enabled=True, delay_s=0.0)
    progress.start(total=4, unit="req")
    progress.advance(2)
    assert progress._progress is not None and progress.completed == 2
    progress.close()
    late = BenchProgress("job", enabled=True, delay_s=60.0)
    late.start(total=4)
    late.advance(1)
    assert late._progress is None  # short runs stay quiet


def test_recorder_samples():
    rec = DirectionRecorder(start_ns=0, sample_interval_s=0.5)
    for i in range(100):
        rec.record(4096, 1000 + i, done_ns=i * 10_000_000)  # 100 ops over 1 s
    res = rec.result(end_ns=1_000_000_000)
    assert res.ops == 100 and res.io_bytes == 409600
    assert res.iops_samples == [100.0, 100.0]
    assert res.runtime_s == pytest.approx(1.0)


def test_progress_follows_a_real_run():
    import io

    from rich.console import Console

    from tierstore.bench.iojobs import run_io_job
    from tierstore.bench.jobfile import parse_jobs

    sink = io.StringIO()
    (job,) = parse_jobs(["--rw=randread", "--ioengine=memory", "--size=1m", "--runtime=0.4", "--time_based"])
    with job_progress("randread", enabled=True, delay_s=0.0) as progress:
        progress.console = Console(file=sink, force_terminal=True, width=100)
        result = run_io_job(dict(job.options))
        assert progress.total == pytest.approx(0.4) and progress.completed > 0
    assert result.read.ops > 0
    assert "randread" in sink.getvalue()


def test_cmdhelp(run_bench):
    rc, out, _ = run_bench("--cmdhelp=plids")
    assert rc == 0 and "RUH Status" in out
    rc, out, _ = run_bench("--cmdhelp")
    assert rc == 0 and all(k in out for k in ("eviction", "lifetime_mix", "dataplacement"))


def test_progress_without_rich_prints_status_lines_on_a_terminal(monkeypatch, capsys):
    """The core install has no rich (tierstore[bench]): on a terminal the bar becomes fio's status lines."""
    import sys as _sys

    from tierstore.bench.registry import StatusOptions

    monkeypatch.setitem(_sys.modules, "rich", None)  # import rich -> ImportError
    monkeypatch.setattr(_sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(_sys.stderr, "isatty", lambda: True)
    with job_progress("job", status=StatusOptions(eta_newline_s=0.05)) as progress:
        assert progress.enabled is False and progress.line_interval_s == 0.05
        progress.start(total=10, unit="req")
        progress.update(5)
        deadline = time.monotonic() + 10
        while progress.lines == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "Jobs: 1 (f=1): [job(1)][50.0%]" in capsys.readouterr().err


def test_help_is_plain_text_that_names_every_command_option(run_bench):
    """Trial 6: ``--help`` printed the module's reST (``Usage::``, double backquotes), pointed at a
    file a wheel does not carry and named none of --cmdhelp, --output-format, --parse-only. Now a
    plain text; every ``--flag`` it names is one the command line takes."""
    import re

    from tierstore.bench.cli import _BOOL_FLAGS, _VALUE_FLAGS

    rc, out, _ = run_bench("--help")
    assert rc == 0 and out.startswith("usage: tierstore bench")
    assert "``" not in out and "::" not in out
    named = set(re.findall(r"^  --([a-z-]+)", out, flags=re.M))
    assert {"cmdhelp", "parse-only", "showcmd", "output-format", "output", "version"} <= named
    assert named - {"rw"} <= _VALUE_FLAGS | _BOOL_FLAGS


def test_job_file_with_two_sections_of_one_name_runs_both(tmp_path, run_bench):
    """Trial 11: fio runs ``[w] rw=write`` then ``[w] rw=read`` as two jobs; tierstore ran the read."""
    path = tmp_path / "dup.fio"
    path.write_text("[global]\nioengine=memory\nsize=1m\nbs=4k\n[w]\nrw=write\n[w]\nrw=read\n")
    rc, out, err = run_bench("--output-format=json", str(path))
    assert rc == 0, err
    jobs = json.loads(out)["jobs"]
    assert [(j["jobname"], j["job options"]["rw"]) for j in jobs] == [("w", "write"), ("w", "read")]
    assert jobs[0]["write"]["total_ios"] == 256 and jobs[1]["read"]["total_ios"] == 256
