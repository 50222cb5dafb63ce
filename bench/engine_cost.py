#!/usr/bin/env python3
"""Issue 25's table in one run: what the engine pays, every row, quiet and busy, against a base checkout.

Each row of issue 25's table is measured by the benchmark that owns it, in a fresh process whose
``PYTHONPATH`` is the checkout under test: this one ("new") and ``--base`` ("base", e.g.
``git worktree add --detach /tmp/base c38303e``, the commit before the issue's work). Sources:

* ``frag``, ``stall``, ``meta``, ``mem``: ``core_bench.py``'s workers (this interpreter);
* ``sglang``: ``sglang_bench.py``'s DRAM pair (``ts_mem`` against ``HiCacheFile`` in the page
  cache, 16 KiB pages) in ``--sglang-python`` (SGLang's venv);
* ``daemon``: ``server_bench.measure`` (the checkout's daemon against the aiohttp baseline, 2 MiB);
* ``vllm``: ``vllm_bench.py``'s TTFT workers in ``--vllm-python``: ``ts_host`` of each checkout and
  ``vllm_apc`` (vLLM's prefix cache, no tierstore: one process between the two checkouts).

Each of ``--runs`` runs measures a source quiet, then with ``--busy`` competitors spinning on the
CPUs (``tierstore.bench.busy``), each time both checkouts back to back, new first in even runs and
base first in odd ones (ABBA). ``mem`` (RSS growth: no time in it) runs ``--mem-runs`` times, quiet.
A cell is the median of the per-run values with min-max; the load average is kept per worker and
before/after each source. The goals and the met? test come from ``ROWS`` (issue 25's goals); met?
is the new checkout's verdict, in both columns. A source whose venv is absent, or a worker that
fails, leaves its cells "not run: <why>" / "failed: <why>" ("base lacks X" when the base checkout
has no such module, attribute or option). Under the table, the rate rows' floors (``FLOORS``):
what the ``meta`` worker measured in the same process and run beside each rate (the SHA-256 chain
alone, the key table's probe alone, a one-block call), as µs a block next to the goal's.

Example (the defaults: ~23 min estimated on a quiet 2-vCPU machine; see bench/README.md)::

    python bench/engine_cost.py --base /tmp/base --dir /work/tmp-cost --json OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The torchvision stand-in SGLang's imports need (``tests/integrations/sglang/stubs/README.md``).
SGLANG_STUBS = os.path.join(ROOT, "tests", "integrations", "sglang", "stubs")


# =============================================================================== the goals
@dataclasses.dataclass(frozen=True)
class Measure:
    """One figure of a row: ``key`` of its source's (flattened) result, and the goal it must meet."""

    label: str
    key: str
    op: str  # ">=" or "<="
    limit: float
    unit: str  # "x", "blocks/s", "ms", "B", "us"

    def met(self, value: float) -> bool:
        return value >= self.limit if self.op == ">=" else value <= self.limit

    def goal(self) -> str:
        sym = "≥" if self.op == ">=" else "≤"
        return f"{self.label + ' ' if self.label else ''}{sym} {fmt(self.limit, self.unit)}"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    what: str
    source: str
    measures: tuple[Measure, ...]


#: Sources in the order they run; ``mem`` is measured quiet only (RSS growth holds no time).
SOURCES = ("frag", "stall", "meta", "mem", "sglang", "daemon", "vllm")
CORE_SOURCES = ("frag", "stall", "meta", "mem")


#: Issue 25's table, one figure a line: row, its source, the figure's label ("-": none) and key in the
#: source's result, its goal (the same in both columns: op, limit, unit). A row meets its goal when
#: every figure of it does.
GOALS = """
frag_views     frag    store  lists_store_over_memcpy            >=  0.8   x
frag_views     frag    load   lists_load_over_memcpy             >=  0.8   x
frag_plans     frag    store  plans_store_over_memcpy            >=  0.8   x
frag_plans     frag    load   plans_load_over_memcpy             >=  0.8   x
blocks         frag    store  blocks_store_over_memcpy           >=  0.9   x
blocks         frag    load   blocks_load_over_memcpy            >=  0.9   x
stall          stall   p99.9  p999_demoting_over_idle            <=  2     x
stall          stall   max    busy.max_ms                        <=  5     ms
store_tokens   meta    -      chain64.store_tokens_blocks_per_s  >=  5e5   blocks/s
lookup_tokens  meta    -      chain64.lookup_tokens_blocks_per_s >=  1e6   blocks/s
lookup_keys    meta    64     chain64.lookup_keys_blocks_per_s   >=  2e6   blocks/s
lookup_keys    meta    256    chain256.lookup_keys_blocks_per_s  >=  2e6   blocks/s
metadata       mem     -      rss_bytes_per_block                <=  128   B
sglang_get     sglang  -      get_over_file                      >=  3     x
sglang_get     sglang  -      get_us_per_page                    <=  10    us
daemon_put     daemon  -      put_over_baseline                  >=  0.9   x
vllm_ttft      vllm    -      warm_over_apc                      <=  1.2   x
"""
#: What each row measures (the table's first column).
WHAT = {
    "frag_views": "store_fragments/load_fragments, 64 per-layer views a block / copy_",
    "frag_plans": "the same through KVPagePool plans / copy_",
    "blocks": "store/load of whole 2 MiB blocks / copy_",
    "stall": "lookup p99.9 while another thread demotes to NVMe / idle; longest lookup",
    "store_tokens": "store by tokens, 64-block prompts",
    "lookup_tokens": "lookup by tokens, 64-block prompts",
    "lookup_keys": "lookup by keys, chain 64 / 256",
    "metadata": "metadata per indexed block, RSS growth (goal at 10M blocks)",
    "sglang_get": "SGLang batch_get_v1, 16 KiB pages from DRAM / HiCacheFile warm; per page",
    "daemon_put": "daemon 2 MiB batch puts acknowledged from the host tier / in-memory aiohttp baseline",
    "vllm_ttft": "vLLM warm TTFT, tierstore's host tier / vLLM's prefix cache",
}


#: What bounds each rate row from below, measured in the same worker process and run as the rate
#: (``core_bench._meta_floors``): a figure's key in the chain's result (``chainN.<key>``), whether it
#: is per block or per call (then shared by the chain's N blocks), and what it is. Shown under the
#: table; the goals and met? do not read it.
FLOORS = {
    "store_tokens": (
        ("floor_hash_us_per_block", "block", "the SHA-256 chain alone (block_hashes)"),
        ("floor_store_tokens_1_us", "call", "a store of a 1-block prompt"),
    ),
    "lookup_tokens": (
        ("floor_hash_us_per_block", "block", "the SHA-256 chain alone (block_hashes)"),
        ("floor_probe_us_per_block", "block", "the key table's probe alone (KeyTable.get_many)"),
        ("floor_lookup_tokens_1_us", "call", "a lookup of a 1-block prompt"),
    ),
    "lookup_keys": (
        ("floor_probe_us_per_block", "block", "the key table's probe alone (KeyTable.get_many)"),
        ("floor_lookup_keys_1_us", "call", "a lookup_keys of 1 key"),
    ),
}


def parse_goals(text: str) -> tuple[Row, ...]:
    """``GOALS`` as rows, in its order."""
    rows: dict[str, tuple[str, list[Measure]]] = {}
    for line in text.strip().splitlines():
        name, source, label, key, op, limit, unit = line.split()
        if op not in (">=", "<=") or source not in SOURCES:
            raise ValueError(f"GOALS: {line!r}: op must be >= or <=, source one of {SOURCES}")
        rows.setdefault(name, (source, []))[1].append(
            Measure("" if label == "-" else label, key, op, float(limit), unit)
        )
    return tuple(Row(name, WHAT[name], src, tuple(ms)) for name, (src, ms) in rows.items())


ROWS = parse_goals(GOALS)


# =============================================================================== table code
def fmt(v: float, unit: str, with_unit: bool = True) -> str:
    """``v`` in ``unit`` the way the table prints it (k/M for blocks/s, 3 significant digits)."""
    if unit == "blocks/s":
        num = f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.0f}k"
    elif unit == "B":
        num = f"{v:.0f}"
    else:
        num = f"{v:.2f}" if unit == "x" else f"{v:.3g}"
    if not with_unit:
        return num
    return num + ("x" if unit == "x" else f" {unit}")


def spread(s: dict, unit: str) -> str:
    """A median with its min-max: ``1.23x (1.02-1.44)``, ``86.2 ms (70.7-102)``."""
    return f"{fmt(s['median'], unit)} ({fmt(s['min'], unit, False)}-{fmt(s['max'], unit, False)})"


def abba(run: int, trees: list, reference=None) -> list:
    """The order of one run: ``trees`` in even runs, reversed in odd ones; ``reference`` (a
    measurement that belongs to neither tree) between the first and the second."""
    order = list(trees) if run % 2 == 0 else list(trees)[::-1]
    if reference is not None:
        order.insert(1, reference)
    return order


def stat(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}


def why(err: str) -> str:
    """One line for a failed worker: "base lacks X" where the checkout lacks a module, name or option."""
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    for pat in (
        r"No module named '([^']+)'",
        r"cannot import name '([^']+)'",
        r"has no attribute '([^']+)'",
        r"unrecognized arguments: (.+)",
        r"unexpected keyword argument '([^']+)'",
    ):
        m = re.search(pat, err)
        if m:
            return f"lacks {m.group(1)}"
    return last[:160]


def cell(row: Row, runs: list[dict] | None, note: str | None, who: str = "new") -> dict:
    """A row's cell from its source's per-run flat results (or ``note`` why there are none); a
    failure reads "``who`` lacks X" when the checkout lacks a module, name or option."""
    if runs is None:
        return {"text": note or "not run", "values": None}
    errs = [why(r["error"]) for r in runs if "error" in r]
    errs = [f"{who} {e}" if e.startswith("lacks ") else f"failed: {e}" for e in errs]
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"text": errs[0], "values": None}
    values, parts = {}, []
    for m in row.measures:
        vals = [r[m.key] for r in good if m.key in r]
        if not vals:
            return {"text": f"failed: no {m.key} in the result", "values": None}
        values[m.key] = stat(vals)
        parts.append(spread(values[m.key], m.unit))
    text = " / ".join(parts)
    if errs:
        text += f" [{len(errs)} of {len(runs)} runs: {errs[0]}]"
    flags = sorted({f for r in good for f in r.get("flags", [])})
    if flags:
        text += " [" + "; ".join(flags) + "]"
    return {"text": text, "values": values}


def verdict(row: Row, cells: dict) -> str:
    """met? for the new checkout: every measure's median meets its goal in every measured column."""
    misses, measured = [], []
    for mode in ("quiet", "busy"):
        vals = cells.get(("new", mode), {}).get("values")
        if vals is None:
            continue
        measured.append(mode)
        for m in row.measures:
            if not m.met(vals[m.key]["median"]):
                misses.append(f"{mode} {m.label or m.key}".strip())
    if not measured:
        return "not measured"
    if misses:
        return "no: " + ", ".join(misses)
    return "yes" if len(measured) == 2 else f"yes ({measured[0]} only)"


def build_table(results: dict, notes: dict, rows: list[Row]) -> list[dict]:
    """One dict a row: goal, the four cells (``(tree, mode)``), met?, the load before/after its source.

    ``results[source][mode][tree]`` is that source's list of per-run flat results; ``notes[source]``
    (or ``notes[(source, mode)]``, ``notes[(source, tree)]``) says why a source, mode or tree was not run.
    """
    out = []
    for row in rows:
        src = results.get(row.source, {})
        cells = {}
        for tree in ("new", "base"):
            for mode in ("quiet", "busy"):
                runs = src.get(mode, {}).get(tree)
                note = notes.get(row.source) or notes.get((row.source, mode)) or notes.get((row.source, tree))
                cells[(tree, mode)] = cell(row, runs, note, tree)
        out.append(
            {
                "row": row.name,
                "what": row.what,
                "goal": ", ".join(m.goal() for m in row.measures),
                "cells": cells,
                "met": verdict(row, cells),
                "load": src.get("load"),
            }
        )
    return out


def render(table: list[dict]) -> str:
    """The table as markdown: row, goal, quiet new/base, busy new/base, met?, load before -> after."""
    head = "| row | goal | quiet: new | quiet: base | busy: new | busy: base | met? | load 1m |"
    lines = [head, "|" + "---|" * 8]
    for t in table:
        c = t["cells"]
        load = "-" if not t["load"] else f"{t['load'][0]:.2f} -> {t['load'][1]:.2f}"
        lines.append(
            f"| {t['row']}: {t['what']} | {t['goal']} | {c[('new', 'quiet')]['text']} | "
            f"{c[('base', 'quiet')]['text']} | {c[('new', 'busy')]['text']} | "
            f"{c[('base', 'busy')]['text']} | {t['met']} | {load} |"
        )
    return "\n".join(lines)


def floor_lines(results: dict, rows: list[Row], tree: str = "new") -> list[str]:
    """One line per rate measure and mode of ``FLOORS``: the goal and the measured median as µs a
    block (wall clock, like the rates), beside the floors measured in the same runs (medians with
    min-max of the per-run figures; a per-call floor also shared by the chain's blocks)."""
    lines = []
    for row in rows:
        if row.name == "sglang_get":
            lines += _sglang_cpu_lines(row, results.get(row.source, {}), tree)
        if row.name in COPY_FLOORS:
            lines += _copy_floor_lines(row, results.get(row.source, {}), tree)
        if row.name == "daemon_put":
            lines += _daemon_durable_lines(row, results.get(row.source, {}), tree)
        for m in row.measures if row.name in FLOORS else ():
            prefix = m.key.split(".")[0]  # "chain64"
            chain = int(prefix.removeprefix("chain"))
            for mode in ("quiet", "busy"):
                good = [
                    r for r in results.get(row.source, {}).get(mode, {}).get(tree) or [] if "error" not in r
                ]
                rates = [r[m.key] for r in good if m.key in r]
                if not rates:
                    continue
                goal = f"{'≥' if m.op == '>=' else '≤'} {fmt(m.limit, m.unit)}"
                head = (
                    f"- {row.name}{' ' + m.label if m.label else ''}, {mode}: goal {goal} = "
                    f"{1e6 / m.limit:.2f} us a block; measured "
                    f"{1e6 / statistics.median(rates):.2f} us a block"
                )
                parts = []
                for key, per, what in FLOORS[row.name]:
                    vals = [r[f"{prefix}.{key}"] for r in good if f"{prefix}.{key}" in r]
                    if not vals:
                        parts.append(f"{what}: not measured")
                        continue
                    st = stat(vals)
                    txt = f"{what} {st['median']:.3g} us a {per} ({st['min']:.3g}-{st['max']:.3g})"
                    if per == "call":
                        txt += f" = {st['median'] / chain:.3g} us a block of {chain}"
                    parts.append(txt)
                lines.append(head + "; in the same runs: " + "; ".join(parts))
    return lines


#: The copy rows' floors (``core_bench._frag_floor``, the same worker and run): the same bytes copied
#: in plain torch with tierstore's thread structure (its Copier: the caller and its copy threads, one
#: OpenMP thread each, the same pieces), over the same ``copy_``: what the row could reach with no
#: index, plan or check work. Key of the floor per measure label; plans and views copy the same
#: strided per-layer pieces.
COPY_FLOORS = {
    "frag_views": {"store": "floor_views_store_over_memcpy", "load": "floor_views_load_over_memcpy"},
    "frag_plans": {"store": "floor_views_store_over_memcpy", "load": "floor_views_load_over_memcpy"},
    "blocks": {"store": "floor_blocks_over_memcpy", "load": "floor_blocks_over_memcpy"},
}


def _copy_floor_lines(row: Row, src: dict, tree: str) -> list[str]:
    """A copy row's measured ratio beside its floor's (:data:`COPY_FLOORS`), per mode."""
    lines = []
    for mode in ("quiet", "busy"):
        good = [r for r in src.get(mode, {}).get(tree) or [] if "error" not in r]
        parts = []
        for m in row.measures:
            key = COPY_FLOORS[row.name].get(m.label)
            got = [r[m.key] for r in good if m.key in r]
            floor = [r[key] for r in good if key in r]
            if got and floor:
                parts.append(
                    f"{m.label} {spread(stat(got), 'x')} against its floor {spread(stat(floor), 'x')}"
                )
        if parts:
            lines.append(f"- {row.name}, {mode} (ratio to copy_): " + "; ".join(parts))
    return lines


def _daemon_durable_lines(row: Row, src: dict, tree: str) -> list[str]:
    """The daemon row's durable puts (O_DIRECT write and fdatasync before the answer) beside the
    goal's write-back figure, in the same runs."""
    lines = []
    for mode in ("quiet", "busy"):
        good = [r for r in src.get(mode, {}).get(tree) or [] if "durable_put_over_baseline" in r]
        if good:
            dur = spread(stat([r["durable_put_over_baseline"] for r in good]), "x")
            lines.append(
                f"- {row.name}, {mode}: puts acknowledged durably (fdatasync'ed on NVMe) / baseline {dur}"
            )
    return lines


def _sglang_cpu_lines(row: Row, src: dict, tree: str) -> list[str]:
    """The SGLang row's get per page, wall beside the calling thread's CPU in the same gets (what is
    left of the wall without the host's other load; ``sglang_bench`` times one get a pass)."""
    m = next(m for m in row.measures if m.key == "get_us_per_page")
    lines = []
    for mode in ("quiet", "busy"):
        good = [r for r in src.get(mode, {}).get(tree) or [] if "get_cpu_us_per_page" in r]
        if good:
            wall, cpu, file = (
                spread(stat([r[k] for r in good]), "us")
                for k in ("get_us_per_page", "get_cpu_us_per_page", "file_get_cpu_us_per_page")
            )
            lines.append(
                f"- {row.name}, {mode}: goal {m.goal()} a page; measured {wall} a page wall, of which "
                f"the calling thread ran {cpu} (CPU; HiCacheFile warm: {file})"
            )
    return lines


def render_floors(lines: list[str]) -> str:
    """The floor lines under a heading ("" when there are none)."""
    if not lines:
        return ""
    return (
        "\n\nFloors and CPU beside the rows (new checkout, measured in the same worker process and run"
        " as the row's figure; medians (min-max) of the runs; wall clock unless CPU):\n" + "\n".join(lines)
    )


# =============================================================================== workers (engine venvs)
def worker_sglang(a: dict) -> dict:
    """``sglang_bench.py``'s DRAM pair, one pass each, in ABBA order by run: tierstore's host tier
    (``ts_mem``) and HiCacheFile in the page cache; get = ``batch_get_v1`` through SGLang's controller."""
    import sglang_bench

    cls = "16KiB"
    layers, heads, head_dim, page = sglang_bench.CLASSES[cls]
    page_bytes = 2 * layers * heads * head_dim * 2 * page
    n = max(1, a["total_bytes"] // page_bytes)
    pool = sglang_bench.make_pool(cls, n)
    opts = argparse.Namespace(host_fraction=1.0, settle=a["settle_s"])
    names = abba(a["run"], ["ts_mem", "file"])
    got = {name: sglang_bench.run_pass(name, cls, pool, n, a["dir"], opts) for name in names}
    ts, file = got["ts_mem"]["get_GBps"], got["file"]["get_warm_GBps"]
    return {
        "pages": n,
        "get_over_file": ts / file,
        "get_us_per_page": page_bytes / (ts * 1e9) * 1e6,
        "file_get_us_per_page": page_bytes / (file * 1e9) * 1e6,
        # the calling thread's CPU in the same gets: the wall less what the host's load added
        "get_cpu_us_per_page": got["ts_mem"]["get_cpu_us_per_page"],
        "file_get_cpu_us_per_page": got["file"]["get_warm_cpu_us_per_page"],
        "set_over_file": got["ts_mem"]["set_GBps"] / got["file"]["set_GBps"],
    }


def worker_daemon(a: dict) -> dict:
    """``server_bench.measure``: the checkout's daemon and the aiohttp baseline, one ABBA pair per
    acknowledgement, 2 MiB. The goal's figure is ``put_over_baseline``: puts answered from the host
    tier (``puts.durable: false``, write-back), like for like with the baseline, which answers from
    its dict; ``durable_put_over_baseline`` (answered once O_DIRECT-written and fdatasync'ed on the
    NVMe tier, the daemon's default) is shown beside it."""
    import shutil

    import server_bench

    out: dict = {}
    for durable, prefix in ((False, ""), (True, "durable_")):
        work = tempfile.mkdtemp(dir=a["dir"], prefix="engine-cost-daemon-")
        try:
            res, order = server_bench.measure(
                work,
                [2],
                a["ops"],
                a["clients"],
                [a["run"]],
                a["host_bytes"],
                a["nvme_bytes"],
                root=a["tree"],
                durable=durable,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        ts, base = res["tierstore"][0], res["baseline"][0]
        out.update(
            {
                f"{prefix}order": order[0],
                f"{prefix}put_over_baseline": ts[(2, "put")][0] / base[(2, "put")][0],
                f"{prefix}get_over_baseline": ts[(2, "get")][0] / base[(2, "get")][0],
                f"{prefix}put_gbps": ts[(2, "put")][0] / 1e9,
                f"{prefix}baseline_put_gbps": base[(2, "put")][0] / 1e9,
            }
        )
    return out


def worker_vllm(a: dict) -> dict:
    """One ``vllm_bench.py`` TTFT worker (its own process: vLLM keeps one connector per process)."""
    import vllm_bench

    if not os.path.exists(os.path.join(a["model"], "config.json")):
        vllm_bench.make_bench_llama(a["model"], "ttft")  # seeded: the same model for every process
    opts = argparse.Namespace(
        nvme_parent=a["dir"],
        models={"ttft": a["model"]},
        reps=a["reps"],
        prompt_tokens=a["prompt_tokens"],
        seed=a["run"],
    )
    r = vllm_bench.run_worker(opts, "ttft", a["config"], vllm_bench.TTFT_CONFIGS[a["config"]])
    return {
        "warm_s": r["warm_s"],
        "cold_s": r["cold_s"],
        "short_hits": sum(c != r["expected_cached_tokens"] for c in r["warm_cached_tokens"]),
        "process_s": r["process_s"],
    }


WORKERS = {"sglang": worker_sglang, "daemon": worker_daemon, "vllm": worker_vllm}


# =============================================================================== driver
def _flat(r: dict) -> dict:
    import core_bench

    out = core_bench._flat(r) if "error" not in r else dict(r)
    if "busy.p999_us" in out and out.get("idle.p999_us"):  # the stall part: demoting over idle
        out["p999_demoting_over_idle"] = out["busy.p999_us"] / out["idle.p999_us"]
    return out


def vllm_samples(tree: dict, apc: dict) -> list[dict]:
    """Per-prompt samples of the vLLM row: a checkout's warm TTFT over vLLM's prefix cache's on the
    same prompt (the same seed gives both processes the same prompts)."""
    if "error" in tree or "error" in apc:
        return [{"error": tree.get("error") or "vllm_apc: " + apc["error"]}]
    flags = [f"{tree['short_hits']} warm requests hit less than expected"] if tree["short_hits"] else []
    return [
        {"warm_over_apc": t / p, "warm_ms": t * 1e3, "apc_warm_ms": p * 1e3, "flags": flags}
        for t, p in zip(tree["warm_s"], apc["warm_s"])
    ]


def worker_args(src: str, a: argparse.Namespace, tree: str, run: int, reference: bool = False) -> dict:
    """What a source's worker is given (the sizes of its row; see ``--help``)."""
    wa: dict = {"dir": a.dir, "run": run, "tree": tree}
    wa.update(
        {
            "frag": {"frag_blocks": a.frag_blocks},
            "stall": {"stall_bytes": a.stall_bytes, "idle_s": a.idle_s},
            "meta": {"chains": [64, 256], "meta_ops": a.meta_ops},
            "mem": {"mem_blocks": a.mem_blocks},
            "sglang": {"total_bytes": a.sglang_bytes, "settle_s": a.settle_s},
            "daemon": {"ops": a.daemon_ops, "clients": 2, "host_bytes": "1GiB", "nvme_bytes": "2GiB"},
            "vllm": {
                "model": a.vllm_model,
                "reps": a.vllm_reps,
                "prompt_tokens": 1024,
                "config": "vllm_apc" if reference else "ts_host",
            },
        }[src]
    )
    return wa


def invoke(src: str, a: argparse.Namespace, tree: str, run: int, reference: bool = False) -> dict:
    """One worker of ``src`` in a fresh process with ``tree`` first on its path."""
    import core_bench

    wa = worker_args(src, a, tree, run, reference)
    if src in CORE_SOURCES:
        return core_bench.run_worker(tree, src, wa, a.timeout_s)
    python = {"sglang": a.sglang_python, "vllm": a.vllm_python}.get(src, sys.executable)
    extra = (SGLANG_STUBS,) if src == "sglang" else ()
    return core_bench.run_worker(tree, src, wa, a.timeout_s, python=python, script=__file__, extra_path=extra)


def measure_source(src: str, a: argparse.Namespace, trees: list, started: float) -> tuple[dict, list]:
    """``src`` over its runs and modes, ABBA; returns ``{mode: {tree: [flat per run]}, "load": ..}``
    and the raw results."""
    from tierstore.bench.busy import competitors

    modes = ["quiet"] + (["busy"] if a.busy > 0 and src != "mem" else [])
    runs = {"mem": a.mem_runs, "vllm": a.vllm_runs}.get(src, a.runs)
    out: dict = {m: {name: [] for name, _ in trees} for m in modes}
    raw = []
    load0 = os.getloadavg()[0]
    for run in range(runs):
        for mode in modes:
            got: dict = {}
            with competitors(a.busy if mode == "busy" else 0):
                ref = ("vllm_apc", ROOT) if src == "vllm" else None
                for name, tree in abba(run, trees, ref):
                    r = invoke(src, a, tree, run, reference=name == "vllm_apc")
                    r["loadavg_1m"] = os.getloadavg()[0]
                    got[name] = r
                    print(
                        f"[{time.time() - started:6.0f} s] {src} run {run} {mode} {name}: "
                        f"{json.dumps(r)[:300]}",
                        file=sys.stderr,
                        flush=True,
                    )
            for name, _ in trees:
                if src == "vllm":
                    out[mode][name] += vllm_samples(got[name], got["vllm_apc"])
                else:
                    out[mode][name].append(_flat(got[name]))
            raw.append({"run": run, "mode": mode, "order": list(got), "results": got})
    out["load"] = (load0, os.getloadavg()[0])
    return out, raw


def _commit(tree: str) -> str:
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", tree, "status", "--porcelain", "-uno"], capture_output=True, text=True
    )
    return (r.stdout.strip() or "?") + ("+changes" if dirty.stdout.strip() else "")


def header(a: argparse.Namespace, trees: list, sources: list[str]) -> str:
    """What was measured, with which sizes, on which commits."""
    sizes = {
        "frag": f"{a.frag_blocks} Llama-3.1-8B blocks of 2 MiB a call, median of 5 passes",
        "stall": f"256 KiB blocks demoted until {a.stall_mib} MiB reach NVMe, {a.idle_s} s idle probes",
        "meta": f"64 B blocks, {a.meta_ops} blocks a chain length (64, 256)",
        "mem": f"{a.mem_blocks} blocks on a NullEngine NVMe tier, {a.mem_runs} run(s), quiet only",
        "sglang": f"{a.sglang_bytes >> 20} MiB of 16 KiB pages a pass, {a.settle_s} s settle",
        "daemon": f"2 clients x {a.daemon_ops} puts of 2 MiB a run, write-back then durable",
        "vllm": f"1,024-token prompts, {a.vllm_runs} run(s) x {a.vllm_reps} prompts (per-prompt ratios)",
    }
    trees_txt = ", ".join(f"{name} = {tree} ({_commit(tree)})" for name, tree in trees)
    lines = [
        f"engine_cost: issue 25's table, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {trees_txt}",
        f"{a.runs} runs ABBA (medians, min-max); busy = {a.busy} spinning process(es); {os.cpu_count()} CPUs",
    ]
    lines += [f"  {s}: {sizes[s]}" for s in sources]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SOURCE", "ARGS"), help=argparse.SUPPRESS)
    ap.add_argument("--base", help="the checkout to compare against (e.g. a worktree of c38303e)")
    ap.add_argument(
        "--rows", default=",".join(r.name for r in ROWS), help="rows to measure (comma-separated)"
    )
    ap.add_argument("--runs", type=int, default=5, help="ABBA runs of every source but mem and vllm")
    ap.add_argument(
        "--busy", type=int, default=1, metavar="N", help="competing spinning processes (0: quiet only)"
    )
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where NVMe files and work directories go")
    ap.add_argument("--frag-blocks", type=int, default=64, help="2 MiB blocks a frag call")
    ap.add_argument("--stall-mib", type=int, default=256, help="MiB demoted to NVMe while lookups are timed")
    ap.add_argument("--idle-s", type=float, default=1.0, help="seconds of idle lookups before/after a stall")
    ap.add_argument("--meta-ops", type=int, default=50_000, help="blocks stored/looked up per chain length")
    ap.add_argument("--mem-blocks", type=int, default=1_000_000, help="blocks indexed for the metadata row")
    ap.add_argument("--mem-runs", type=int, default=1, help="runs of the metadata row (RSS: deterministic)")
    ap.add_argument("--sglang-mib", type=int, default=32, help="MiB of 16 KiB pages a SGLang pass")
    ap.add_argument("--settle-s", type=float, default=0.2, help="idle seconds before a SGLang timed phase")
    ap.add_argument("--daemon-ops", type=int, default=32, help="2 MiB puts per client per daemon run")
    ap.add_argument("--vllm-runs", type=int, default=2, help="ABBA runs of the vLLM row (3 engines a run)")
    ap.add_argument("--vllm-reps", type=int, default=3, help="prompts a vLLM engine process times")
    ap.add_argument("--sglang-python", default=os.path.join(ROOT, ".nox", "sglang", "bin", "python"))
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".nox", "vllm", "bin", "python"))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per worker process")
    ap.add_argument("--json", help="write every run's results and the table here")
    ap.add_argument("--md", help="write the table (markdown, with its header) here")
    a = ap.parse_args(argv)
    names = [r.name for r in ROWS]
    a.row_list = [r for r in a.rows.split(",") if r]
    bad = [r for r in a.row_list if r not in names]
    if bad:
        ap.error(f"--rows: unknown {bad}; rows are {names}")
    a.stall_bytes, a.sglang_bytes = a.stall_mib << 20, a.sglang_mib << 20
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        src, wargs = a.worker
        print(json.dumps(WORKERS[src](json.loads(wargs))))
        return 0
    rows = [r for r in ROWS if r.name in a.row_list]
    sources = [s for s in SOURCES if any(r.source == s for r in rows)]
    trees = [("new", ROOT)] + ([("base", os.path.abspath(a.base))] if a.base else [])
    notes: dict = {}
    for src in sources:
        if not a.base:
            notes[(src, "base")] = "not run: no --base"
        if a.busy <= 0:
            notes[(src, "busy")] = "not run: --busy 0"
    notes[("mem", "busy")] = "not run: RSS growth holds no time (quiet only)"
    for src, py, what in (("sglang", a.sglang_python, "SGLang"), ("vllm", a.vllm_python, "vLLM")):
        if src in sources and not os.path.exists(py):
            notes[src] = f"not run: no {what} venv at {py} (--{src}-python)"
    os.makedirs(a.dir, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="engine-cost-", dir=a.dir)
    a.vllm_model = os.path.join(tmp.name, "vllm-model")
    started = time.time()
    head = header(a, trees, sources)
    print(head, file=sys.stderr, flush=True)
    results, raw = {}, {}
    for src in sources:
        if src in notes:
            continue
        results[src], raw[src] = measure_source(src, a, trees, started)
    tmp.cleanup()
    table = build_table(results, notes, rows)
    floors = floor_lines(results, rows)
    elapsed = time.time() - started
    text = (
        f"{head}\ntook {elapsed:.0f} s; load average at the end {os.getloadavg()[0]:.2f}\n\n{render(table)}"
        + render_floors(floors)
    )
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    if a.json:
        doc = {
            "args": {k: v for k, v in vars(a).items() if k != "worker"},
            "elapsed_s": elapsed,
            "table": [dict(t, cells={f"{k[0]}.{k[1]}": v for k, v in t["cells"].items()}) for t in table],
            "text": text,
            "floors": floors,
            "raw": raw,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
