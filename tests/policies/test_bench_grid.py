"""The policy grid's pieces on a tiny agent trace: generator, references, lifetime recorder, one cell."""

from __future__ import annotations

import json

import pytest

from tierstore.bench import lifetimes, references

from ..bench.tools import load_tool

agent_workload = load_tool("agent_workload")
policy_grid = load_tool("policy_grid")


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
    assert all(r["hash_ids"][: w.system_blocks] == system for r in rows)  # shared system prefix


def _req(ids, t=0.0):
    from tierstore.trace import TraceRequest

    return TraceRequest(t, 512 * len(ids), 1, tuple(ids))


def test_references_by_hand():
    # a b | a b | c | a b : flat LRU of 2 blocks loses "a b" to "c"; Belady bypasses "c" (never reused)
    reqs = [_req([1, 2]), _req([1, 2]), _req([3]), _req([1, 2])]
    ref = references.references(reqs, 2)
    assert ref["flat_lru"] == pytest.approx(2 / 7)
    assert ref["belady"] == pytest.approx(4 / 7) == pytest.approx(ref["infinite"])
    d = references.distance(3 / 7, ref)
    assert d["gap_closed"] == pytest.approx(0.5)
    # the prefix rule: block 2 after another first block is another chain key
    assert references.chain_keys([_req([1, 2]), _req([5, 2])]) == [[0, 1], [2, 3]]


def test_belady_never_below_flat_lru_on_agent_trace(tmp_path):
    reqs = [
        _req(r["hash_ids"][:-1], r["timestamp"] / 1000)
        for r in agent_workload.AgentWorkload(sessions=60, seed=2).generate()
    ]
    ks = references.chain_keys(reqs)
    for cap in (8, 32, 128, 10**6):
        lru = references.flat_lru_hit_ratio(ks, cap)
        opt = references.belady_hit_ratio(ks, cap)
        assert lru <= opt + 1e-12
    assert references.belady_hit_ratio(ks, 10**6) == pytest.approx(references.flat_lru_hit_ratio(ks, 10**6))


def test_lifetime_summary_against_known_deaths():
    rec = lifetimes.LifetimeRecorder(lambda e, now: 0)
    for i in range(9):  # nine writes, lifetimes 1..9 s; predicted class = (lifetime-1)//3 is perfect
        rec.writes.append((bytes([i]), 0.0, i // 3))
        rec.death_s[i] = float(i + 1)
    rec.now_s = 100.0
    s = rec.summary()
    assert s["accuracy"] == pytest.approx(1.0) and s["spearman"] > 0.9
    assert s["confusion"] == [[3, 0, 0], [0, 3, 0], [0, 0, 3]]


def test_lifetime_summary_chance_keeps_the_predicted_shares():
    rec = lifetimes.LifetimeRecorder(lambda e, now: 0)
    for i in range(9):  # true classes 0,0,0,1,1,1,2,2,2; predicted: six SHORT, three LONG, unrelated
        rec.writes.append((bytes([i]), 0.0, 2 if i % 3 == 0 else 0))
        rec.death_s[i] = float(i + 1)
    rec.now_s = 100.0
    s = rec.summary()
    # random assignment with shares (2/3, 0, 1/3) against true shares (1/3, 1/3, 1/3): 1/3
    assert s["chance_same_shares"] == pytest.approx(1 / 3)
    assert s["accuracy"] == pytest.approx(3 / 9)  # SHORT right for 1,2; LONG right for 6
    assert s["chance"] == pytest.approx(1 / 3)


def test_one_cell(tmp_path):
    trace = tmp_path / "t.jsonl"
    agent_workload.AgentWorkload(sessions=120, seed=1).write(str(trace))
    r = policy_grid.run_cell(str(trace), "default", 0.3, None)
    assert r["wrong_kv_blocks"] == 0 and r["saved_prefill_tokens"] > 0
    assert 0 < r["lookup_hit_ratio"] <= r["belady"] + 1e-9
    assert r["useful_hit_ratio"] <= r["lookup_hit_ratio"]
    assert r["e2e_wa"] >= 1.0 and r["host_wa"] >= 1.0
    again = policy_grid.run_cell(str(trace), "default", 0.3, None)  # deterministic: counts have noise 0
    timing = {k for k in r if k in policy_grid.TIMING_COLS}
    assert timing and {k: v for k, v in r.items() if k not in timing} == {
        k: v for k, v in again.items() if k not in timing
    }
