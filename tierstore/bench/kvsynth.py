"""Synthetic KV workloads through the real store: ``rw=kvstore|kvload|kvmixed``.

A request stores or loads ``bs`` bytes rounded down to whole blocks of the
``layout`` preset (at least one block, a warning when ``bs`` is not whole blocks;
a Llama-3.1-8B 16-token block is 2 MiB), so ``bs=32m`` means 16-block prompts. One *I/O* of the report is one
KV block (IOPS are blocks per second, ``bs`` in the report is the block's bytes); the
latencies are per call (one store or load call per request).

* ``kvstore``: store ``size`` bytes of distinct prefixes; the tiers fill and demote
  (HBM -> host -> NVMe). Reports the write direction and per-tier bytes.
* ``kvload``: store a working set of ``size`` bytes (not timed), then look up and
  load its prefixes (``iodepth * numjobs`` threads) for one pass, or until
  ``runtime`` with ``time_based``. Promotion is off so every tier keeps serving
  its share; reports the read direction and per-tier hits.
* ``kvmixed``: requests of three lifetime classes drawn by ``lifetime_mix``:
  ``long`` reuse one of a few shared system/tool prefixes, ``medium`` continue one
  of many conversations (each turn extends the previous prompt), ``short`` are
  single queries never seen again. Each request looks up, loads the hit,
  stores the rest with its lifetime hint (FDP placement), and releases.

Continued in ``docs/BENCH.md`` (``tierstore/bench/kvsynth.py``).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..api import KVStore, leading_ok
from ..contract import Tier
from ..errors import ConfigError, Status
from ..identity import Namespace
from ..layout import get_layout
from .kvjobs import no_space_report, nvme_file, store_config
from .registry import current_progress, register_runner, remove_private_dir, stop_requested, warn
from .result import CpuUsage, DirectionRecorder, JobResult

__all__ = ["run_kv_synthetic"]

_NS = Namespace(model="bench-synthetic")


def _build(options: dict[str, Any], layout, path: str | None) -> KVStore:
    """The store for a synthetic job, from the same options as ``rw=kvtrace``
    (:func:`tierstore.bench.kvjobs.store_config`: file, sim or FDP device,
    placement, admission); ``path`` is the NVMe tier's file with ``device=file``."""
    cfg = store_config(
        options,
        options["hbm_size"],
        options["host_size"],
        options["nvme_size"],
        path,
        promotion="none" if options["rw"] == "kvload" else "top",
    )
    return KVStore.from_config(cfg, layout)


def _prompt_tokens(prefix_id: int, nblocks: int, tpb: int, start_block: int = 0) -> np.ndarray:
    base = np.arange(start_block * tpb, (start_block + nblocks) * tpb, dtype=np.int64)
    return base + (prefix_id << 32)


def _blocks(layout, keys: list[bytes]) -> list[torch.Tensor]:
    out = []
    for k in keys:
        raw = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
        raw[:] = k[0]
        raw[:32] = torch.frombuffer(bytearray(k), dtype=torch.uint8)
        out.append(raw)
    return out


def _not_loaded_reason(c: dict[str, Any], load_blocks: str) -> str:
    """Why fewer blocks were loaded than matched (empty when all were)."""
    parts = []
    skipped = c["matched"] - c["useful"] if load_blocks == "useful" else 0
    if skipped:
        tiers = ", ".join(f"{t}: {n}" for t, n in c["skipped_tiers"].items() if n)
        parts.append(
            f"{skipped} matched blocks were not loaded because the cost model judged recomputing them "
            f"faster than loading them ({tiers}); load_blocks=matched loads every matched block"
        )
    failed = c["attempted"] - c["loaded"]
    if failed:
        parts.append(
            f"{failed} blocks failed to load (I/O error, or evicted before the load) and count as misses"
        )
    return "; ".join(parts)


def run_kv_synthetic(options: dict[str, Any]) -> JobResult:
    """Runner of ``rw=kvstore``, ``kvload`` and ``kvmixed``; see the module docstring."""
    rw = options["rw"]
    if rw not in ("kvstore", "kvload", "kvmixed"):
        raise ConfigError(f"rw={rw!r}: not a synthetic KV workload")
    layout = get_layout(options["layout"]).with_tokens_per_block(options["block_tokens"])
    _warn_partial_blocks(options, layout.bytes_per_block)
    own = not options["directory"]
    directory = tempfile.mkdtemp(prefix="tierstore-kv-") if own else options["directory"]
    nvme_path = None
    try:
        if options["nvme_size"] and options["device"] == "file":
            nvme_path = nvme_file(options, directory)  # build_store warns if it exceeds the free space
        store = _build(options, layout, nvme_path)
        try:
            return _SyntheticRun(options, rw, layout, store, nvme_path).run()
        finally:
            store.close()
    finally:
        if nvme_path is not None and options.get("unlink", True):
            try:
                os.unlink(nvme_path)
            except FileNotFoundError:
                pass
        if own:
            remove_private_dir(options, directory)


def call_blocks(bs: int, block_bytes: int) -> int:
    """KV blocks of a synthetic job's request (its prompt): ``bs`` rounded down to whole blocks, at least
    one."""
    return max(1, bs // block_bytes)


def io_unit(rw: str, bs: int, block_bytes: int) -> str:
    """The report's line on what a KV job's I/O and ``bs`` are (``kv.io_unit``, under the normal header)."""
    n = call_blocks(bs, block_bytes)
    grows = "; a conversation's grows by that much a turn" if rw == "kvmixed" else ""
    return (
        f"rw={rw}: one I/O is one KV block of {block_bytes} B, the bs shown; a request's prompt is the job's "
        f"bs={bs} B in whole blocks: {n} block{'s' if n != 1 else ''} ({n * block_bytes} B{grows})"
    )


def _warn_partial_blocks(options: dict[str, Any], block_bytes: int) -> None:
    """Warn (once, before the run) when a set ``bs`` is not whole KV blocks: prompts are not the bytes it
    says."""
    bs = options["bs"]
    if "bs" in options.get("_explicit", ()) and bs % block_bytes:
        n = call_blocks(bs, block_bytes)
        warn(
            f"bs={bs}: not a multiple of the KV block ({block_bytes} B: layout={options['layout']}, "
            f"block_tokens={options['block_tokens']}); a request's prompt is {n} whole "
            f"block{'s' if n != 1 else ''} ({n * block_bytes} B)"
        )


class _SyntheticRun:
    """One synthetic job: its store, fio's clock (``ramp_time`` not counted, then ``runtime``), the
    per-direction recorders, the lookup counts and the worker threads (see the module docstring)."""

    def __init__(
        self, options: dict[str, Any], rw: str, layout, store: KVStore, nvme_path: str | None
    ) -> None:
        self.options, self.rw, self.layout, self.store, self.nvme_path = options, rw, layout, store, nvme_path
        self.bb = layout.bytes_per_block
        self.tpb = layout.tokens_per_block
        self.nblk = call_blocks(options["bs"], self.bb)
        self.n_req = max(1, options["size"] // (self.nblk * self.bb))
        self.load_all = options.get("load_blocks", "useful") == "matched"
        self.rng = np.random.default_rng(options["seed"])
        self.cpu = CpuUsage()
        self.progress = current_progress()
        self.threads = max(1, options["iodepth"] * options["numjobs"])
        self.wrong = 0
        # fio's clock: ramp_time first (not counted), then runtime; set again
        # after kvload's fill, which like fio's file layout is not part of the run
        self.ramp_ns, self.runtime_ns = int(options["ramp_time"] * 1e9), int(options["runtime"] * 1e9)
        self.timed = bool(options["time_based"] and self.runtime_ns)
        self._reset_clock()
        #: store counters when the ramp ended: the kv section counts only what follows
        self.base_stats: dict = {}
        self.base_lock = threading.Lock()
        #: lookups counted after the ramp: matched / useful / attempted / loaded blocks
        self.counts: dict[str, Any] = {
            "matched": 0,
            "useful": 0,
            "attempted": 0,
            "loaded": 0,
            "lookup_blocks": 0,
            "skipped_tiers": {t.label: 0 for t in Tier},
        }
        #: (exception, worker name) of requests that raised: the first one ends the job with err= set
        self.failures: list[tuple[BaseException, str]] = []
        self.done = 0  # requests done
        self.counted = 0  # of them, done after the ramp

    def _reset_clock(self) -> None:
        self.t_begin = time.perf_counter_ns()
        self.ramp_end = self.t_begin + self.ramp_ns
        self.rd = DirectionRecorder(self.ramp_end)
        self.wr = DirectionRecorder(self.ramp_end)
        self.deadline = self.ramp_end + self.runtime_ns if self.runtime_ns else None

    def run(self) -> JobResult:
        """Run the job to its end (or a stop request, or a worker's failure) and report it."""
        rw, nblk, n_req = self.rw, self.nblk, self.n_req
        self.progress.start(total=n_req, unit="req")
        if rw == "kvload":  # fill first, outside the run (as fio lays out its files)
            for i in range(n_req):
                if stop_requested():
                    break
                self._store_req(i, nblk)
                if i % 16 == 0:
                    self.progress.update(i)
            self._reset_clock()
        timer = self._start_clock()
        self._start_progress()
        if rw == "kvstore":
            self._pool(lambda i: (self._store_req(i, nblk), self._tick()), range(n_req))
        elif rw == "kvload":
            self._pool(
                lambda i: (self._load_req(int(i), nblk), self._tick()),
                _passes(n_req, self.options["time_based"]),
            )
        else:
            self._pool(
                self._mixed_request(), range(n_req) if not self.options["time_based"] else _cycle(n_req)
            )
        self._show_progress()
        end = time.perf_counter_ns()
        timer.cancel()
        usage = self.cpu.stop()
        return self._result(end, usage)

    def _store_req(self, pid: int, nb: int, start: int = 0, hint: str | None = None) -> None:
        toks = _prompt_tokens(pid, start + nb, self.tpb)
        keys = self.store.keys_for(_NS, toks)[start:]
        t0 = time.perf_counter_ns()
        st = self.store.store(_NS, toks, _blocks(self.layout, keys), start_block=start, lifetime=hint)
        t1 = time.perf_counter_ns()
        ok = sum(1 for s in st if s is Status.OK)
        self.wr.record(ok * self.bb, t1 - t0, t1, ops=ok)  # one I/O per block stored; one latency per call

    def _load_req(self, pid: int, nb: int) -> int:
        store, counts = self.store, self.counts
        toks = _prompt_tokens(pid, nb, self.tpb)
        rid = ("bench", pid, threading.get_ident())
        try:
            t0 = time.perf_counter_ns()
            hit = store.lookup(_NS, toks, request_id=rid)
            want = hit.keys if self.load_all else hit.useful_keys
            st, outs = store.load(want)
            t1 = time.perf_counter_ns()
            n = leading_ok(st)
            for k, o in zip(want[:n], outs[:n]):
                if bytes(o.reshape(-1).view(torch.uint8)[:32].numpy()) != k:
                    self.wrong += 1
            if t1 >= self.ramp_end:
                with self.base_lock:
                    counts["lookup_blocks"] += len(toks) // self.tpb
                    counts["matched"] += hit.matched_blocks
                    counts["useful"] += hit.useful_blocks
                    counts["attempted"] += len(want)
                    counts["loaded"] += n
                    for t in hit.tiers[hit.useful_blocks : hit.matched_blocks]:
                        counts["skipped_tiers"][t.label] += 1
            if want:
                self.rd.record(
                    n * self.bb, t1 - t0, t1, ops=n
                )  # one I/O per block loaded; one latency per call
            return n
        finally:
            store.release(rid)

    def _mixed_request(self) -> Callable[[int], None]:
        """``kvmixed``'s request ``i``: its lifetime class drawn by ``lifetime_mix`` (see the module
        docstring); it loads what hits and stores the rest with its lifetime hint."""
        mix, nblk, n_req = self.options["lifetime_mix"], self.nblk, self.n_req
        classes = [c for c in ("long", "medium", "short") if mix.get(c, 0) > 0]
        w = np.array([mix[c] for c in classes], dtype=float)
        picks = self.rng.choice(len(classes), size=n_req, p=w / w.sum())
        n_sys = 4
        n_conv = max(1, n_req // 8)
        conv_turns: dict[int, int] = {}
        conv_lock = threading.Lock()
        conv_ids = self.rng.integers(0, n_conv, size=n_req)

        def one(i: int) -> None:
            j = i % n_req
            c = classes[picks[j]]
            if c == "long":
                pid, nb, hint = 1_000_000 + j % n_sys, nblk, "system"
            elif c == "medium":
                cid = int(conv_ids[j])
                with conv_lock:
                    turn = conv_turns.get(cid, 0)
                    conv_turns[cid] = turn + 1
                pid, nb, hint = 2_000_000 + cid, nblk * (turn + 1), "conversation"
            else:
                pid, nb, hint = 3_000_000 + i, nblk, "query"
            n = self._load_req(pid, nb)
            if n < nb:
                self._store_req(pid, nb - n, start=n, hint=hint)
            self._tick()

        return one

    def _pool(self, fn: Callable[[Any], Any], items: Iterable) -> None:
        """Run ``fn`` over ``items`` in ``iodepth * numjobs`` threads until they run out, the deadline
        passes, a stop is requested or a call raises (recorded in :attr:`failures`)."""
        it = iter(items)
        lock = threading.Lock()
        halt = threading.Event()

        def work() -> None:
            while not halt.is_set() and not stop_requested():
                if self.deadline is not None and time.perf_counter_ns() > self.deadline:
                    return
                with lock:
                    x = next(it, None)
                if x is None:
                    return
                try:
                    fn(x)
                except Exception as exc:  # noqa: BLE001 (ends the job with err= set; fio: td_verror)
                    with lock:
                        self.failures.append((exc, threading.current_thread().name))
                    halt.set()
                    return

        ts = [threading.Thread(target=work, name=f"{self.options['name']}-{i}") for i in range(self.threads)]
        for t in ts:
            t.start()
        try:
            for t in ts:
                t.join()
        finally:  # a second Ctrl-C: the workers still stop before the store closes
            halt.set()
            for t in ts:
                t.join()

    def _start_progress(self) -> None:
        """Requests done of ``size``, or seconds of ramp + runtime for a time-based run."""
        if self.timed:
            self.progress.start(total=(self.ramp_ns + self.runtime_ns) / 1e9, unit="s")
        else:
            self.progress.start(total=self.n_req, unit="req")

    def _show_progress(self) -> None:
        self.progress.update((time.perf_counter_ns() - self.t_begin) / 1e9 if self.timed else self.done)

    def _tick(self) -> None:
        self.done += 1
        if time.perf_counter_ns() >= self.ramp_end:
            with self.base_lock:
                self.counted += 1
        if self.done % 16 == 0:
            self._show_progress()

    def _snapshot_at_ramp_end(self) -> None:
        """Store counters once the ramp is over (a timer; at once without a ramp)."""
        with self.base_lock:
            if not self.base_stats:
                self.base_stats.update(self.store.stats())

    def _start_clock(self) -> threading.Timer:
        t = threading.Timer(
            max(0.0, (self.ramp_end - time.perf_counter_ns()) / 1e9), self._snapshot_at_ramp_end
        )
        t.daemon = True
        if self.ramp_ns:
            t.start()
        else:
            self._snapshot_at_ramp_end()
        return t

    def _result(self, end: int, usage: dict[str, Any]) -> JobResult:
        """The job's report: the directions, the ``kv`` section (counted after the ramp) and the error."""
        options, rw, counts = self.options, self.rw, self.counts
        now = self.store.stats()
        with self.base_lock:
            # a run that ended within the ramp counted nothing: subtract everything
            base = dict(self.base_stats) if self.base_stats else dict(now)
        s = {
            k: (v - base.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in now.items()
        }
        bpt = now["bytes_per_tier"]
        lb = counts["lookup_blocks"]
        read, write = self.rd.result(end), self.wr.result(end)
        kv: dict[str, Any] = {
            "requests": self.counted,
            "blocks_per_request": self.nblk,
            "block_bytes": self.bb,
            "lookup_hit_ratio": counts["matched"] / lb if lb else 0.0,
            "useful_hit_ratio": counts["loaded"] / lb if lb else 0.0,
            "saved_prefill_tokens": counts["loaded"] * self.tpb,
            "matched_blocks": counts["matched"],
            "useful_blocks": counts["useful"],
            "loaded_blocks": counts["loaded"],
            "load_blocks": "matched" if self.load_all else "useful",
            "hbm_bytes": bpt["hbm"],
            "host_bytes": bpt["host"],
            "nvme_bytes": bpt["nvme"],
            "hit_blocks_hbm": int(s.get("hit_blocks_hbm", 0)),
            "hit_blocks_host": int(s.get("hit_blocks_host", 0)),
            "hit_blocks_nvme": int(s.get("hit_blocks_nvme", 0)),
            "nvme_write_bytes": int(s.get("nvme_write_bytes", 0)),
            "wrong_kv_blocks": self.wrong,
        }
        space, error, message = no_space_report(now, self.nvme_path)
        kv.update(space)  # whole job, fill included: refused blocks are refused whenever they happen
        error, message = self._error(error, message)
        reason = _not_loaded_reason(counts, kv["load_blocks"])
        if reason:
            kv["not_loaded_reason"] = reason
        kv["load_lat_ns"] = read.clat_ns
        kv["io_unit"] = io_unit(self.rw, options["bs"], self.bb)
        device = self.store.device_stats() if self.store.nvme is not None else {}
        return JobResult(
            jobname=options.get("name") or rw,
            options={**options, "bs": self.bb},
            read=read,
            write=write,
            kv=kv,
            device=device,
            timeseries={},
            error=error,
            error_message=message,
            usr_cpu=usage["usr_cpu"],
            sys_cpu=usage["sys_cpu"],
            runtime_s=max(0, end - self.ramp_end) / 1e9,
            ctx=usage["ctx"],
            majf=usage["majf"],
            minf=usage["minf"],
        )

    def _error(self, error: int, message: str) -> tuple[int, str]:
        """fio's ``err=`` and message: a worker's failure first (the job did not run to its end), then
        wrong KV (fio's verify failure, EILSEQ), then the store's own (no space)."""
        if self.failures:
            exc, who = self.failures[0]
            error = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
            message = (
                f"{type(exc).__name__}: {exc} (in worker {who}"
                f"{'' if len(self.failures) == 1 else f'; {len(self.failures)} workers failed'})"
            )
        elif self.wrong:
            error, message = (
                errno.EILSEQ,
                (f"{self.wrong} loaded blocks did not hold the bytes stored under their key (wrong KV)"),
            )
        return error, message


def _passes(n: int, forever: bool):
    """``kvload``'s prefix ids: one pass over ``n``, or passes until the deadline when ``forever``."""
    i = 0
    while True:
        yield i % n
        i += 1
        if i >= n and not forever:
            return


def _cycle(n: int):
    i = 0
    while True:
        yield i
        i += 1


register_runner(["kvstore", "kvload", "kvmixed"], run_kv_synthetic)
