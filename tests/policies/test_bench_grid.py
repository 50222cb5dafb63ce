"""The policy grid's pieces on a tiny agent trace: generator, recording NVMe stand-in, FTL WAF, one cell."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH))

agent_workload = pytest.importorskip("agent_workload")
policy_grid = pytest.importorskip("policy_grid")


def test_agent_workload_is_deterministic_mooncake_format(tmp_path):
    w = agent_workload.AgentWorkload(sessions=20, seed=3)
    a, b = w.generate(), w.generate()
    assert a == b and len(a) > 20
    p = tmp_path / "a.jsonl"
    w.write(str(p))
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert all(-(-r["input_length"] // 512) == len(r["hash_ids"]) for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    system = list(range(w.system_blocks))
    assert all(r["hash_ids"][:w.system_blocks] == system for r in rows)  # shared system prefix


def test_lifetimes_and_ftl_waf():
    log = [("w", 0.0, 0, None, b"a"), ("w", 1.0, 1, None, b"b"), ("d", 5.0, 0, b"a"), ("w", 6.0, 0, None, b"c")]
    life = policy_grid.lifetimes(log, end_s=10.0)
    assert life == {0: (5.0, True), 1: (9.0, False), 3: (4.0, False)}
    assert policy_grid.ftl_waf(log, 1024, 4096, lambda i: None) == pytest.approx(1.0)
    assert policy_grid.ftl_waf(log, 64, 4096, lambda i: None) != policy_grid.ftl_waf(log, 64, 4096, lambda i: None)  # nan


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_one_cell(tmp_path, policy):
    trace = tmp_path / "t.jsonl"
    agent_workload.AgentWorkload(sessions=120, seed=1).write(str(trace))
    rows = policy_grid.run_cell(str(trace), policy, "second", 0.5, None)
    assert [r["placement"] for r in rows] == ["none", "predicted", "oracle"]
    r = rows[0]
    assert r["wrong_kv_blocks"] == 0 and r["saved_prefill_tokens"] > 0
    assert 0 <= r["lookup_hit_ratio"] <= 1 and r["useful_hit_ratio"] <= r["lookup_hit_ratio"]
    assert all(r["waf"] >= 1.0 for r in rows)
    again = policy_grid.run_cell(str(trace), policy, "second", 0.5, None)  # deterministic: noise 0
    assert [{k: v for k, v in x.items() if k != "wall_s"} for x in rows] == \
        [{k: v for k, v in x.items() if k != "wall_s"} for x in again]
