"""bench/replay_counts.py: the counts issue 23 compares before and after each refactor piece."""

import copy
import importlib.util
import json
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "bench" / "replay_counts.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("replay_counts", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def short(tool):
    """The default matrix configuration on the excerpt's first 150 requests, run twice."""
    return tool.run_config("default", limit=150), tool.run_config("default", limit=150)


def test_two_runs_give_the_same_counts_and_digest(tool, short):
    a, b = short
    assert a["sha256"] == b["sha256"] == tool.digest(a["counts"])
    kv = a["counts"]["kv"]
    assert kv["requests"] == 150 and kv["hit_blocks"] > 0 and kv["nvme_write_bytes"] > 0
    assert tool.compare({"default": a}, {"default": b}) == ([], [])


def test_timings_and_paths_are_left_out_counts_kept(tool, short):
    counts = short[0]["counts"]
    flat = tool._flat(counts)
    assert not [k for k in flat if k.endswith("_ns") or "latency" in k or k.endswith(".device")]
    assert "kv.useful_blocks" in flat and "nvme.region_kept_blocks" in flat
    assert "nvme.engine.write_ops" in flat  # nested counters are kept
    assert json.loads(tool.canonical(counts)) == counts


def test_compare_names_each_differing_key_and_a_configuration_the_baseline_lacks(tool, short):
    before = {"default": short[0], "full": short[0]}
    after = {"default": copy.deepcopy(short[0]), "excerpt": short[0]}
    after["default"]["counts"]["kv"]["hit_blocks_nvme"] += 1
    after["default"]["counts"]["nvme"]["engine"]["write_ops"] = -1
    diffs, skipped = tool.compare(before, after)
    assert skipped == ["full"]
    assert [d.split(":")[0] for d in diffs] == [
        "default.counts.kv.hit_blocks_nvme",
        "default.counts.nvme.engine.write_ops",
        "excerpt",
    ]


def test_the_command_exits_1_on_a_difference(tool, short, tmp_path, capsys):
    base = {"meta": {}, "configs": {"default": copy.deepcopy(short[0])}}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    assert tool.main(["--only", "default", "--limit", "150", "--compare", str(path)]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    base["configs"]["default"]["counts"]["kv"]["saved_prefill_tokens"] += 512
    path.write_text(json.dumps(base))
    assert tool.main(["--only", "default", "--limit", "150", "--compare", str(path)]) == 1
    assert "default.counts.kv.saved_prefill_tokens" in capsys.readouterr().out


def test_a_memory_footprint_is_not_a_decision_a_count_is(tool, short):
    a = short[0]
    b = copy.deepcopy(a)
    b["counts"]["index"]["index_bytes"] += 4096  # the key table's layout, not a decision
    assert tool.compare({"default": a}, {"default": b}) == ([], [])
    b["counts"]["kv"]["hit_blocks"] += 1
    diffs, _ = tool.compare({"default": a}, {"default": b})
    hits = a["counts"]["kv"]["hit_blocks"]
    assert diffs == [f"default.counts.kv.hit_blocks: {hits!r} -> {hits + 1!r}"]
