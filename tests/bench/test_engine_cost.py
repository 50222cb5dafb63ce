"""bench/engine_cost.py's table code on made-up per-run results: medians, min-max, met?, ABBA order,
rows that did not run (issue 25's one-run table)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .tools import BENCH, load_tool


@pytest.fixture(scope="module")
def ec():
    return load_tool("engine_cost")


def _frag(store: float, load: float) -> dict:
    return {
        f"{f}_{op}_over_memcpy": v
        for f in ("lists", "plans", "blocks")
        for op, v in (("store", store), ("load", load))
    }


def test_abba_order_puts_the_reference_between(ec):
    assert ec.abba(0, ["new", "base"]) == ["new", "base"]
    assert ec.abba(1, ["new", "base"]) == ["base", "new"]
    assert ec.abba(2, ["new", "base"], "ref") == ["new", "ref", "base"]
    assert ec.abba(3, ["new", "base"], "ref") == ["base", "ref", "new"]
    assert ec.abba(1, ["new"]) == ["new"]


def test_table_medians_spread_and_met(ec):
    rows = [r for r in ec.ROWS if r.source == "frag"]
    results = {
        "frag": {
            "quiet": {
                "new": [_frag(0.9, 0.85), _frag(0.7, 0.95), _frag(1.1, 0.81)],
                "base": [_frag(0.2, 0.3), {"error": "Traceback\nModuleNotFoundError: No module named 'x.y'"}],
            },
            "busy": {"new": [_frag(0.95, 0.5), _frag(0.9, 0.6)], "base": [{"error": "boom\nKeyError: 'k'"}]},
            "load": (1.25, 2.5),
        }
    }
    table = ec.build_table(results, {}, rows)
    views = table[0]
    assert views["row"] == "frag_views" and views["goal"] == "store ≥ 0.80x, load ≥ 0.80x"
    q = views["cells"][("new", "quiet")]
    assert q["values"]["lists_store_over_memcpy"]["median"] == 0.9  # median of 0.9, 0.7, 1.1
    assert q["text"] == "0.90x (0.70-1.10) / 0.85x (0.81-0.95)"
    assert views["cells"][("base", "quiet")]["text"].endswith("[1 of 2 runs: base lacks x.y]")
    assert views["cells"][("base", "busy")]["text"] == "failed: KeyError: 'k'"
    assert views["met"] == "no: busy load"  # busy load median 0.55 < 0.8; quiet both >= 0.8
    blocks = table[2]  # goal 0.9: the quiet store median 0.9 meets it, the quiet load 0.85 does not
    assert blocks["met"] == "no: quiet load, busy load"
    text = ec.render(table)
    assert len(text.splitlines()) == 2 + len(rows) and "1.25 -> 2.50" in text


def test_rows_not_run_say_why(ec):
    row = next(r for r in ec.ROWS if r.name == "sglang_get")
    notes = {"sglang": "not run: no SGLang venv at /x (--sglang-python)"}
    t = ec.build_table({}, notes, [row])[0]
    assert {c["text"] for c in t["cells"].values()} == {notes["sglang"]}
    assert t["met"] == "not measured"
    mem = next(r for r in ec.ROWS if r.name == "metadata")
    results = {"mem": {"quiet": {"new": [{"rss_bytes_per_block": 100.0}]}, "load": (1.0, 1.0)}}
    t = ec.build_table(
        results, {("mem", "busy"): "not run: quiet only", ("mem", "base"): "not run: no --base"}, [mem]
    )
    assert (
        t[0]["met"] == "yes (quiet only)" and t[0]["cells"][("base", "quiet")]["text"] == "not run: no --base"
    )


def test_every_issue_row_has_a_goal(ec):
    assert len(ec.ROWS) == 11 and all(r.measures and r.source in ec.SOURCES for r in ec.ROWS)
    m = ec.Measure("", "k", "<=", 2.0, "x")
    assert m.met(2.0) and not m.met(2.01)


def test_help_and_unknown_rows():
    script = str(BENCH / "engine_cost.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--rows" in r.stdout and "--base" in r.stdout
    r = subprocess.run([sys.executable, script, "--rows", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown ['nope']" in r.stderr
