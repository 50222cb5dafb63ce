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


def _meta(keys_rate: float, floors: bool = True) -> dict:
    """A flat meta result: rates in blocks/s and (with ``floors``) the floors in µs."""
    out = {}
    for chain in (64, 256):
        p = f"chain{chain}."
        out |= {
            p + "store_tokens_blocks_per_s": 2.5e5,
            p + "lookup_tokens_blocks_per_s": 5e5,
            p + "lookup_keys_blocks_per_s": keys_rate,
        }
        if floors:
            out |= {
                p + "floor_hash_us_per_block": 0.8,
                p + "floor_probe_us_per_block": 0.3,
                p + "floor_lookup_keys_1_us": 32.0,
                p + "floor_lookup_tokens_1_us": 40.0,
                p + "floor_store_tokens_1_us": 128.0,
            }
    return out


def test_floor_lines_put_the_floors_beside_each_rate(ec):
    rows = [r for r in ec.ROWS if r.source == "meta"]
    results = {
        "meta": {
            "quiet": {"new": [_meta(1e6), _meta(5e5), {"error": "boom"}], "base": [_meta(1e6, floors=False)]},
            "busy": {"new": [_meta(2.5e5, floors=False)]},
        }
    }
    lines = ec.floor_lines(results, rows)
    keys64 = next(ln for ln in lines if ln.startswith("- lookup_keys 64, quiet"))
    # goal 2M/s = 0.5 us a block; median of 1M and 500k = 750k/s = 1.33 us a block
    assert "goal ≥ 2.00M blocks/s = 0.50 us a block; measured 1.33 us a block" in keys64
    assert "KeyTable.get_many) 0.3 us a block (0.3-0.3)" in keys64
    assert "a lookup_keys of 1 key 32 us a call (32-32) = 0.5 us a block of 64" in keys64
    keys256 = next(ln for ln in lines if ln.startswith("- lookup_keys 256, quiet"))
    assert "= 0.125 us a block of 256" in keys256
    tokens = next(ln for ln in lines if ln.startswith("- lookup_tokens, quiet"))
    assert (
        "SHA-256 chain alone (block_hashes) 0.8 us a block" in tokens
        and "1-block prompt 40 us a call" in tokens
    )
    store = next(ln for ln in lines if ln.startswith("- store_tokens, quiet"))
    assert "= 2.00 us a block; measured 4.00 us a block" in store and "= 2 us a block of 64" in store
    # a run without floors (an older checkout's worker) says so; the base tree is not shown
    busy = next(ln for ln in lines if ln.startswith("- lookup_keys 64, busy"))
    assert "a lookup_keys of 1 key: not measured" in busy
    assert len(lines) == 2 * 4  # 4 rate measures, quiet and busy
    text = ec.render_floors(lines)
    assert text.startswith("\n\nFloors and CPU beside the rows") and text.count("\n- ") == 8
    assert ec.render_floors([]) == ""
    # the goals and met? read none of it
    assert ec.build_table(results, {}, rows)[2]["met"] == "no: quiet 64, quiet 256, busy 64, busy 256"


def test_meta_worker_measures_the_floors_in_its_run():
    cb = load_tool("core_bench")
    out = cb.worker_meta({"chains": [4], "meta_ops": 64})["chain4"]
    for key in (
        "floor_hash_us_per_block",
        "floor_probe_us_per_block",
        "floor_lookup_keys_1_us",
        "floor_lookup_tokens_1_us",
        "floor_store_tokens_1_us",
    ):
        assert out[key] > 0 and out[key.replace("_us", "_cpu_us")] > 0, key
    assert out["floor_hash_us_per_block"] == pytest.approx(1e6 / out["hash_blocks_per_s"])


def test_sglang_row_shows_the_threads_cpu_beside_the_wall(ec):
    rows = [r for r in ec.ROWS if r.source == "sglang"]

    def run(wall: float, cpu: float) -> dict:
        return {
            "get_over_file": 3.5,
            "get_us_per_page": wall,
            "get_cpu_us_per_page": cpu,
            "file_get_cpu_us_per_page": 30.0,
        }

    results = {
        "sglang": {
            "quiet": {"new": [run(14.0, 7.0), run(9.0, 6.5), run(20.0, 8.0)]},
            "busy": {"new": [{"get_us_per_page": 5.0}]},
        }
    }
    lines = ec.floor_lines(results, rows)
    assert lines == [
        "- sglang_get, quiet: goal ≤ 10 us a page; measured 14 us (9-20) a page wall, of which the calling "
        "thread ran 7 us (6.5-8) (CPU; HiCacheFile warm: 30 us (30-30))"
    ]  # busy: an older worker without the CPU figure shows no line
    assert ec.build_table(results, {}, rows)[0]["met"].startswith("no: quiet get_us_per_page")


def test_copy_rows_show_their_floor_and_the_daemon_row_its_durable_puts(ec):
    rows = [r for r in ec.ROWS if r.source in ("frag", "daemon")]
    frag = {
        "lists_store_over_memcpy": 0.7,
        "lists_load_over_memcpy": 0.72,
        "plans_store_over_memcpy": 0.8,
        "plans_load_over_memcpy": 0.82,
        "blocks_store_over_memcpy": 0.95,
        "blocks_load_over_memcpy": 0.9,
        "floor_views_store_over_memcpy": 0.86,
        "floor_views_load_over_memcpy": 0.93,
        "floor_blocks_over_memcpy": 1.02,
    }
    results = {
        "frag": {
            "quiet": {"new": [frag, {"error": "boom"}]},
            "busy": {"new": [{"blocks_store_over_memcpy": 0.8}]},
        },
        "daemon": {"quiet": {"new": [{"put_over_baseline": 1.0, "durable_put_over_baseline": 0.6}]}},
    }
    lines = ec.floor_lines(results, rows)
    views = next(ln for ln in lines if ln.startswith("- frag_views, quiet"))
    assert "store 0.70x (0.70-0.70) against its floor 0.86x" in views and "load 0.72x" in views
    plans = next(ln for ln in lines if ln.startswith("- frag_plans, quiet"))
    assert "load 0.82x (0.82-0.82) against its floor 0.93x" in plans
    blocks = next(ln for ln in lines if ln.startswith("- blocks, quiet"))
    assert "store 0.95x (0.95-0.95) against its floor 1.02x" in blocks
    assert not any(ln.startswith("- blocks, busy") for ln in lines)  # no floor measured: no line
    daemon = next(ln for ln in lines if ln.startswith("- daemon_put, quiet"))
    assert "durably" in daemon and "0.60x" in daemon
    assert len(lines) == 4
