"""Markdown tables for bench/README_sglang.md from sglang_bench.py JSON files.

Usage (repository root)::

    python bench/results/sglang_2026-12-02/tables.py RUN.json [RUN2.json ...]

Prints the bandwidth table of the first file (median (min-max) GB/s) and the
per-run ratio table, one column per file, with the issue's goal and whether
every file's median meets it.
"""
import json
import sys

BW = [("ts_mem", "set_GBps"), ("file", "set_GBps"), ("ts_mem", "get_GBps"), ("file", "get_warm_GBps"),
      ("ts_nvme", "set_GBps"), ("file", "set_syncfs_GBps"), ("ts_nvme", "get_GBps"), ("file", "get_cold_GBps")]
PAIRS = [("set, DRAM", "set, DRAM: ts_mem vs HiCacheFile (page cache)"),
         ("get, DRAM", "get, DRAM: ts_mem vs HiCacheFile warm"),
         ("set, disk (vs +syncfs)", "set, disk: ts_nvme vs HiCacheFile+syncfs"),
         ("get, disk (cold)", "get, disk: ts_nvme vs HiCacheFile cold")]
GOAL = {"16KiB": 3.0, "128KiB": 3.0, "2MiB": 1.0}


def fmt(s, unit=""):
    return f"{s['median']:.3f}{unit} ({s['min']:.3f}-{s['max']:.3f})" if not unit else \
        f"{s['median']:.2f}{unit} ({s['min']:.2f}-{s['max']:.2f})"


def main(paths):
    docs = [json.load(open(p)) for p in paths]
    first = docs[0]
    print("| class | ts_mem set | file set | ts_mem get | file get warm | ts_nvme set | file set+syncfs "
          "| ts_nvme get | file get cold |")
    print("|---|" + "---:|" * 8)
    for cls, c in first["classes"].items():
        print(f"| {cls} | " + " | ".join(fmt(c["bandwidth_GBps"][f"{w}_{k}"]) for w, k in BW) + " |")
    print()
    names = [p.rsplit("/", 1)[-1].removesuffix(".json") for p in paths]
    print("| class | pair | " + " | ".join(names) + " | goal | met |")
    print("|---|---|" + "---:|" * len(names) + "---:|---|")
    for cls in first["classes"]:
        for label, key in PAIRS:
            vals = [d["classes"][cls]["ratios"][key] for d in docs]
            g = GOAL[cls]
            met = [v["median"] >= g for v in vals]
            m = "yes" if all(met) else ("**no**" if not any(met) else "**no** (" + ", ".join(
                n for n, ok in zip(names, met) if not ok) + ")")
            print(f"| {cls} | {label} | " + " | ".join(fmt(v, "x") for v in vals) + f" | {g:g}x | {m} |")
    print()
    ref = "(ref) set: ts_nvme vs HiCacheFile (page cache)"
    print("ref (durable ts_nvme set vs page-cache file set): " + "; ".join(
        f"{cls} " + " / ".join(f"{d['classes'][cls]['ratios'][ref]['median']:.2f}x" for d in docs)
        for cls in first["classes"]))
    for n, d in zip(names, docs):
        print(f"{n}: loadavg start {d['config']['loadavg_start']}, end {d['config']['loadavg_end']}")


if __name__ == "__main__":
    main(sys.argv[1:])
