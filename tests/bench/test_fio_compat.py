"""fio compatibility: statistics as fio computes them, JSON keys as fio writes them, fio-plot reads our
JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tierstore.bench.fiostat import (
    FIO_PERCENTILES,
    lat_buckets,
    lat_summary,
    plat_idx_to_val,
    plat_val_to_idx,
)

from .conftest import FIXTURES


def _fio_json(tmp_path) -> dict:
    """fio's own JSON: run fio briefly when installed, else the committed fio-3.33 capture."""
    if shutil.which("fio"):
        out = tmp_path / "fio.json"
        proc = subprocess.run(
            [
                "fio",
                "--name=randread",
                "--rw=randread",
                "--bs=4k",
                "--size=1m",
                "--runtime=200ms",
                "--time_based",
                f"--filename={tmp_path / 'f'}",
                "--output-format=json",
                f"--output={out}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        text = out.read_text() if out.exists() else ""
        if proc.returncode == 0 and text.lstrip().startswith("{"):
            return json.loads(text[text.index("{") :])
    return json.loads((FIXTURES / "fio-3.33-randread.json").read_text())


def test_histogram_buckets_match_fio():
    # values fio 3.33 itself printed as percentiles / json+ bin keys (fixtures)
    fio_plus = json.loads((FIXTURES / "fio-3.33-randread.jsonplus.json").read_text())
    bins = fio_plus["jobs"][0]["read"]["clat_ns"]["bins"]
    keys = np.array([int(k) for k in bins], dtype=np.int64)
    assert np.array_equal(plat_idx_to_val(plat_val_to_idx(keys)), keys)
    pct = fio_plus["jobs"][0]["read"]["clat_ns"]["percentile"]
    vals = np.array(list(pct.values()), dtype=np.int64)
    assert np.array_equal(plat_idx_to_val(plat_val_to_idx(vals)), vals)
    # small values are exact; powers of two land on the right group
    small = np.arange(0, 128)
    assert np.array_equal(plat_idx_to_val(plat_val_to_idx(small)), small)
    assert plat_idx_to_val(plat_val_to_idx(np.array([1 << 20])))[0] == (1 << 20) + (1 << 13)


def test_percentiles_from_fio_histogram_replay_fio():
    """Re-bin fio's own json+ histogram: our percentile rule gives fio's printed percentiles."""
    fio_plus = json.loads((FIXTURES / "fio-3.33-randread.jsonplus.json").read_text())
    clat = fio_plus["jobs"][0]["read"]["clat_ns"]
    samples = np.repeat(np.array([int(k) for k in clat["bins"]]), list(clat["bins"].values()))
    ours = lat_summary(samples, FIO_PERCENTILES, bins=True)
    assert ours["percentile"] == clat["percentile"]
    assert ours["bins"] == clat["bins"]
    assert ours["N"] == clat["N"]


def test_latency_buckets_fio_semantics():
    lat = np.array([1, 3, 999, 1_000, 49_999, 50_000, 1_999_999, 2_000_000_000, 5_000_000_000])
    b = lat_buckets(lat)
    share = 100.0 / lat.size
    assert b["latency_ns"]["2"] == pytest.approx(share)  # [0, 2) ns
    assert b["latency_ns"]["4"] == pytest.approx(share)  # [2, 4) ns
    assert b["latency_ns"]["1000"] == pytest.approx(share)  # [750, 1000) ns
    assert b["latency_us"]["2"] == pytest.approx(share)  # 1 us
    assert b["latency_us"]["50"] == pytest.approx(share)  # 49 us in [20, 50)
    assert b["latency_us"]["100"] == pytest.approx(share)  # 50 us in [50, 100)
    assert b["latency_ms"]["2"] == pytest.approx(share)  # 1 ms
    assert b["latency_ms"][">=2000"] == pytest.approx(2 * share)
    assert sum(sum(d.values()) for d in b.values()) == pytest.approx(100.0)


def _shape(d):
    return {
        k: _shape(v) if isinstance(v, dict) and k not in ("percentile", "bins", "job options") else None
        for k, v in d.items()
    }


def test_json_keys_match_fio(tmp_path, bench_json):
    fio = _fio_json(tmp_path)
    ours = bench_json("--rw=randread", "--runtime=0.3", "--time_based")
    assert set(fio) - {"disk_util", "global options"} <= set(ours)
    fj, oj = fio["jobs"][0], ours["jobs"][0]
    assert set(oj) - set(fj) == {"kv", "device"}
    assert set(fj) - set(oj) == set()
    for direction in ("read", "write", "trim"):
        assert list(oj[direction]) == list(fj[direction]), direction
        for lat in ("slat_ns", "clat_ns", "lat_ns"):
            assert set(oj[direction][lat]) == set(fj[direction][lat]), (direction, lat)
    for key in (
        "latency_ns",
        "latency_us",
        "latency_ms",
        "iodepth_level",
        "iodepth_submit",
        "iodepth_complete",
    ):
        assert list(oj[key]) == list(fj[key]), key
    assert list(oj["read"]["clat_ns"]["percentile"]) == list(fj["read"]["clat_ns"]["percentile"])
    assert _shape(oj["sync"]) == _shape(fj["sync"])
    for key in ("rw", "bs", "iodepth", "numjobs", "name"):
        assert isinstance(oj["job options"][key], str)


def test_json_values_consistent_units(bench_json):
    doc = bench_json("--rw=randwrite", "--runtime=0.6", "--time_based", "--iodepth=2")
    w = doc["jobs"][0]["write"]
    assert w["total_ios"] > 0 and w["io_bytes"] == w["total_ios"] * 4096
    assert w["io_kbytes"] == w["io_bytes"] // 1024
    assert w["bw_bytes"] == pytest.approx(w["io_bytes"] * 1000 / w["runtime"], rel=1e-6, abs=1)
    assert w["bw"] == w["bw_bytes"] // 1024
    assert w["iops"] == pytest.approx(w["total_ios"] * 1000 / w["runtime"])
    assert 500 <= w["runtime"] <= 5000
    c = w["clat_ns"]
    assert c["min"] <= c["percentile"]["50.000000"] <= c["max"] * 1.02 and c["N"] == w["total_ios"]
    assert w["iops_samples"] >= 1 and w["iops_min"] <= w["iops_mean"] <= w["iops_max"] + 1
    assert doc["jobs"][0]["iodepth_level"]["2"] == 100.0
    assert doc["jobs"][0]["read"]["total_ios"] == 0 and "percentile" not in doc["jobs"][0]["read"]["clat_ns"]
    assert doc["fio version"].startswith("tierstore-")


def test_json_plus_has_bins(bench_json):
    doc = bench_json("--rw=randread", "--runtime=0.2", "--time_based", fmt="json+")
    clat = doc["jobs"][0]["read"]["clat_ns"]
    assert sum(clat["bins"].values()) == clat["N"]
    assert all(k.isdigit() for k in clat["bins"])


def test_fio_plot_charts_our_json(tmp_path, bench_json):
    pytest.importorskip("fio_plot", reason="fio-plot is not installed (pip install fio-plot)")
    doc = bench_json("--rw=randread", "--runtime=0.2", "--time_based")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "randread-1-1.json").write_text(json.dumps(doc))
    for args, name in ((["-L", "-t", "iops"], "bar3d.png"), (["-l"], "line2d.png"), (["-H"], "hist.png")):
        png = tmp_path / name
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fio_plot",
                "-i",
                str(data_dir),
                "-T",
                "tierstore",
                *args,
                "-r",
                "randread",
                "-d",
                "1",
                "-n",
                "1",
                "-o",
                str(png),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fio_plot_json_parsing_reads_our_fields(tmp_path, bench_json):
    pytest.importorskip("fio_plot", reason="fio-plot is not installed (pip install fio-plot)")
    from fio_plot.fiolib import jsonimport, jsonparsing

    doc = bench_json("--rw=randread", "--runtime=0.2", "--time_based", "--iodepth=2")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "r.json").write_text(json.dumps(doc))
    settings = {
        "input_directory": [str(data_dir)],
        "rw": "randread",
        "iodepth": [2],
        "numjobs": [1],
        "filter": ["read", "write"],
        "include_hosts": None,
        "exclude_hosts": None,
        "compare_graph": False,
    }
    dataset = jsonparsing.parse_json_data(
        settings, jsonimport.import_json_dataset(settings, jsonimport.list_json_files(settings))
    )
    (row,) = dataset[0]["data"]
    read = doc["jobs"][0]["read"]
    assert row["iops"] == pytest.approx(read["iops"]) and row["bw"] == read["bw"]
    assert row["lat"] == pytest.approx(read["lat_ns"]["mean"])
    assert (row["rw"], int(row["iodepth"]), row["bs"]) == ("randread", 2, "4k")
