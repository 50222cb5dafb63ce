"""Trace replay (rw=kvtrace) on a small limit, and clear errors for bad trace lines."""

from __future__ import annotations

import json

import pytest

from tierstore.errors import TraceFormatError
from tierstore.replay import ReplayConfig, run_replay


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    return run_replay(ReplayConfig(limit=400, block_bytes=8 << 10, directory=str(d), sample_every=100))


def test_hit_ratio_in_range(small_report):
    kv = small_report.kv
    assert kv["requests"] == 400
    assert 0 < kv["lookup_hit_ratio"] <= kv["ideal_hit_ratio"]
    assert kv["saved_prefill_tokens"] == kv["loaded_blocks"] * kv["block_tokens"] > 0


def test_bytes_in_all_three_tiers(small_report):
    kv = small_report.kv
    assert kv["hbm_bytes"] > 0 and kv["host_bytes"] > 0 and kv["nvme_bytes"] > 0
    assert kv["nvme_write_bytes"] > 0 and kv["demotions_host_nvme"] > 0


def test_no_wrong_blocks(small_report):
    assert small_report.kv["wrong_kv_blocks"] == 0
    assert small_report.kv["io_error_blocks"] == 0


def test_timeseries_aligned(small_report):
    ts = small_report.timeseries
    assert len(ts["t_s"]) == len(ts["hit_ratio"]) == len(ts["nvme_bytes"]) >= 4


GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        json.dumps({"timestamp": 5, "input_length": 10}),
        json.dumps({**GOOD, "input_length": -3}),
        json.dumps({**GOOD, "input_length": 1025}),  # 3 blocks of 512 tokens, 2 hash_ids
        json.dumps({**GOOD, "input_length": 512}),  # 1 block, 2 hash_ids
    ],
)
def test_bad_line_names_the_line(tmp_path, bad):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + bad + "\n")
    with pytest.raises(TraceFormatError, match=rf"{p.name}:3"):
        run_replay(ReplayConfig(trace=str(p), directory=str(tmp_path)))


def test_hash_ids_that_contradict_input_length_are_said_with_the_rule(tmp_path):
    """Fresh-user trial 7: a line whose hash_ids contradict input_length was replayed as given."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({**GOOD, "input_length": 1536}) + "\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:1: 2 hash_ids for input_length 1536.*= 3"):
        run_replay(ReplayConfig(trace=str(p), directory=str(tmp_path)))


def test_empty_trace_is_an_error(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        run_replay(ReplayConfig(trace=str(p), directory=str(tmp_path)))


def test_runtime_objects_are_not_copied_into_the_report(tmp_path):
    """A caller-given run-time object that cannot be copied (it holds a lock, as a
    store's NVMe backend does) is used by the replay, not deep-copied into the report."""
    import threading

    class Classify:
        def __init__(self):
            self.lock = threading.Lock()
            self.calls = 0

        def __call__(self, entry, now_s):
            from tierstore.fdp.lifetime import LifetimeClass

            with self.lock:
                self.calls += 1
            return LifetimeClass.MEDIUM

    c = Classify()
    rep = run_replay(
        ReplayConfig(
            limit=60,
            block_bytes=8 << 10,
            directory=str(tmp_path),
            sample_every=100,
            hbm_bytes=64 << 10,
            host_bytes=64 << 10,
            nvme_bytes=4 << 20,
            runtime={"classify": c},
        )
    )
    assert c.calls > 0
    assert "runtime" not in rep.config and rep.config["limit"] == 60
