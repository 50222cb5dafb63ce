"""The main job: replay a request trace through the real tier manager.

For each request, in arrival order: look up its full blocks (with a request
reference), load the useful prefix (real bytes from HBM stand-in, host or NVMe),
store the blocks that missed, then release the request. Every stored block
carries its own key in its first 32 bytes, and every loaded block is checked
against it, so a wrong block served would be counted in ``wrong_kv_blocks``
(which must stay 0).

Scaling (so the run fits a small machine; reported in the output):

* **Bytes.** A trace block is 512 tokens; its real KV for Llama-3.1-8B is
  512 x 128 KiB = 64 MiB. The replay stores ``block_bytes`` per block instead
  (default 32 KiB, a 2048x scale-down), so every tier moves real bytes.
* **Time.** Requests are replayed back to back as fast as the store allows; the
  manager's clock is *trace time* (``timestamp_s * time_scale``), so leases and
  lifetimes follow the trace.
* **Capacity.** Tier sizes default to fractions of the trace's unique full-block
  bytes (HBM 2%, host 8%, NVMe 30%), or are given in bytes.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from .api import KVStore, leading_ok
from .config import StoreConfig
from .errors import ConfigError, Status
from .identity import Namespace, chain_ids
from .layout import PRESETS, KVLayout
from .trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, ideal_hit_ratio, read_mooncake

#: Real bytes of one 512-token block of Llama-3.1-8B (bf16), the scale reference.
REFERENCE_BLOCK_BYTES = PRESETS["llama-3.1-8b"].bytes_per_token * MOONCAKE_BLOCK_TOKENS


@dataclasses.dataclass
class ReplayConfig:
    """Options of a trace replay (every field has an embedded default).

    Parameters
    ----------
    trace : str or None
        Mooncake JSONL path; the packaged excerpt when ``None``.
    limit : int or None
        Replay only the first ``limit`` requests.
    block_bytes : int
        Bytes stored per 512-token trace block (scaled; multiple of 1024).
    hbm_bytes, host_bytes, nvme_bytes : int or None
        Tier capacities; ``None`` uses ``*_fraction`` of the unique full-block bytes.
    hbm_fraction, host_fraction, nvme_fraction : float
        Default capacities as fractions of the trace's unique bytes.
    directory : str or None
        Where the NVMe tier file goes (a temp dir when None).
    eviction : str
        Eviction policy name.
    time_scale : float
        Multiplier on trace time for the store's clock.
    sample_every : int
        Requests between time-series samples; 0 takes about 200 samples over the run.
    policies : dict
        Further :class:`~tierstore.config.PoliciesConfig` fields.
    nvme_options : dict
        Further :class:`~tierstore.config.NvmeTierConfig` fields (``device``,
        ``model``, ``fdp``, ``engine``, ``region_policy``, ...).
    runtime : dict
        Run-time objects for :func:`tierstore.build.assemble` (``classify``,
        ``admit``, ``reinsert``, ``cost``).
    keep_data : bool
        ``False``: the accounting mode (:class:`tierstore.config.TiersConfig`),
        for real block sizes (64 MiB) on this machine: no payload bytes exist,
        payloads and load destinations are ``meta`` tensors, the NVMe engine is
        ``null``; every decision, extent header and FTL write is the same as
        with data, but loaded bytes cannot be checked (``wrong_kv_blocks`` is
        ``None``).
    """

    trace: str | None = None
    limit: int | None = None
    block_bytes: int = 32 << 10
    hbm_bytes: int | None = None
    host_bytes: int | None = None
    nvme_bytes: int | None = None
    hbm_fraction: float = 0.02
    host_fraction: float = 0.08
    nvme_fraction: float = 0.30
    directory: str | None = None
    eviction: str = "lru"
    time_scale: float = 1.0
    sample_every: int = 0
    policies: dict = dataclasses.field(default_factory=dict)
    nvme_options: dict = dataclasses.field(default_factory=dict)
    runtime: dict = dataclasses.field(default_factory=dict)
    keep_data: bool = True

    def store_config(self, hbm_bytes: int, host_bytes: int, nvme_bytes: int, directory: str) -> StoreConfig:
        """The typed store config this replay opens (tiers sized by the caller)."""
        nv = None
        if nvme_bytes or self.nvme_options.get("device") == "sim":
            nv = {"path": directory, "capacity_bytes": nvme_bytes or None, **self.nvme_options}
            if not self.keep_data:
                nv["engine"] = "null"
            if nv.get("device") == "sim" and nv.get("engine", "auto") in ("auto", "memory", "null"):
                nv.pop("path")
        return StoreConfig.from_dict(
            {
                "tiers": {
                    "hbm": {"capacity_bytes": hbm_bytes},
                    "host": {"capacity_bytes": host_bytes},
                    "nvme": nv,
                    "keep_data": self.keep_data,
                },
                "policies": {"eviction": self.eviction, **self.policies},
            },
            "replay store config",
        )

    def layout(self) -> KVLayout:
        """A scaled layout whose 512-token block is ``block_bytes`` bytes (bf16, 1 KV head)."""
        per_token = self.block_bytes // MOONCAKE_BLOCK_TOKENS
        if self.block_bytes % (MOONCAKE_BLOCK_TOKENS * 4) or per_token < 4:
            raise ConfigError(
                f"block_bytes={self.block_bytes}: must be a multiple of "
                f"{MOONCAKE_BLOCK_TOKENS * 4} (2 KV x bf16 x 512 tokens)"
            )
        # 2 (K,V) * layers * heads * head_dim * 2 B = per_token  ->  layers=2, heads=1, head_dim=per_token/8
        return KVLayout(
            num_layers=2,
            num_kv_heads=1,
            head_dim=per_token // 8,
            dtype=torch.bfloat16,
            tokens_per_block=MOONCAKE_BLOCK_TOKENS,
            name="trace-scaled",
        )


@dataclasses.dataclass
class ReplayReport:
    """What a replay measured. Ratios are over full blocks (the exact-hit rule)."""

    requests: int
    kv: dict
    load_lat_ns: np.ndarray
    store_lat_ns: np.ndarray
    load_bytes: int
    store_bytes: int
    load_wall_s: float
    store_wall_s: float
    runtime_s: float
    timeseries: dict
    store_stats: dict
    config: dict
    device: dict = dataclasses.field(default_factory=dict)
    final_stats: dict = dataclasses.field(default_factory=dict)


class _TraceClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def unique_full_blocks(requests: list[TraceRequest]) -> int:
    """Distinct full-block ids (prefix-position-qualified) in the trace."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids[: r.full_blocks()])
    return len(seen)


def run_replay(
    cfg: ReplayConfig,
    progress: Callable[[int, int], None] | None = None,
    on_sample: Callable[[KVStore, dict], None] | None = None,
    on_open: Callable[[KVStore], None] | None = None,
) -> ReplayReport:
    """Replay ``cfg.trace`` through a fresh :class:`KVStore`.

    Parameters
    ----------
    cfg : ReplayConfig
    progress : callable, optional
        ``progress(done_requests, total_requests)``.
    on_sample : callable, optional
        Called at each time-series sample with the store and the sample dict (it
        may add keys, e.g. the device's WAF).
    on_open : callable, optional
        Called with the store once it is open, before the first request.

    Returns
    -------
    ReplayReport

    Raises
    ------
    TraceFormatError, FileNotFoundError
        For a bad or missing trace.
    """
    session = ReplaySession(cfg, progress, on_sample, on_open)
    try:
        while session.step():
            pass
        return session.report
    finally:
        session.close()


def _close_unflushed(store) -> None:
    """Close a replay's store without ``flush_on_close`` (a store without that option: plainly)."""
    import inspect

    if "flush" in inspect.signature(store.close).parameters:
        store.close(flush=False)
    else:
        store.close()


class ReplaySession:
    """A replay that advances one request at a time (:func:`run_replay` runs one to the end).

    Several sessions can be interleaved by trace time (``next_time_s``), e.g.
    two stores whose NVMe tiers share one simulated device. Arguments as
    :func:`run_replay`; the store is open after construction (``store``).

    Attributes
    ----------
    store : KVStore
    requests : list of TraceRequest
    report : ReplayReport or None
        Set when the last request has run.
    """

    def __init__(self, cfg: ReplayConfig, progress=None, on_sample=None, on_open=None) -> None:
        self.requests = reqs = read_mooncake(cfg.trace, cfg.limit)
        layout = cfg.layout()
        bb = layout.bytes_per_block
        uniq = unique_full_blocks(reqs)
        unique_bytes = uniq * bb

        def cap(explicit, frac):
            return int(explicit) if explicit is not None else int(unique_bytes * frac) // bb * bb

        hbm, host, nvme = (
            cap(cfg.hbm_bytes, cfg.hbm_fraction),
            cap(cfg.host_bytes, cfg.host_fraction),
            cap(cfg.nvme_bytes, cfg.nvme_fraction),
        )
        self._own_dir = cfg.directory is None
        self.directory = tempfile.mkdtemp(prefix="tierstore-replay-") if self._own_dir else cfg.directory
        self.report: ReplayReport | None = None
        self._done = 0
        clock = _TraceClock()
        try:
            self.store = KVStore.from_config(
                cfg.store_config(hbm, host, nvme, self.directory), layout, clock=clock, **cfg.runtime
            )
            nvme = int(self.store.device_stats().get("nvme_bytes", nvme))
            if on_open is not None:
                on_open(self.store)
            self._gen = _replay(
                self.store,
                reqs,
                layout,
                cfg,
                clock,
                dict(
                    hbm_bytes=hbm,
                    host_bytes=host,
                    nvme_bytes=nvme,
                    unique_blocks=uniq,
                    directory=self.directory,
                ),
                progress,
                on_sample,
            )
        except BaseException:
            self.close()
            raise

    @property
    def next_time_s(self) -> float:
        """Trace time of the next request (``inf`` when none is left)."""
        if self._done >= len(self.requests):
            return float("inf")
        return self.requests[self._done].timestamp_s

    def step(self) -> bool:
        """Run the next request; ``False`` (and ``report`` set) once the trace is done."""
        if self.report is not None:
            return False
        try:
            next(self._gen)
            self._done += 1
            return True
        except StopIteration as stop:
            self.report = stop.value
            return False

    def close(self) -> None:
        """Close the store (if the replay did not finish) and remove the temporary directory."""
        gen = getattr(self, "_gen", None)
        if gen is not None and self.report is None:
            gen.close()  # a started replay's finally closes the store
        if getattr(self, "store", None) is not None:
            _close_unflushed(self.store)  # idempotent; no writes after the report (see _replay)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclasses.dataclass
class _Tally:
    """A replay's running counts: what :func:`_report` sums up (latencies in ns, wall times in s)."""

    load_lat: list = dataclasses.field(default_factory=list)
    store_lat: list = dataclasses.field(default_factory=list)
    load_bytes: int = 0
    store_bytes: int = 0
    load_wall: float = 0.0
    store_wall: float = 0.0
    wrong: int = 0
    loaded_blocks: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    useful_blocks: int = 0
    #: the time series of :func:`_sample`
    ts: dict = dataclasses.field(
        default_factory=lambda: {
            "t_s": [],
            "hbm_bytes": [],
            "host_bytes": [],
            "nvme_bytes": [],
            "hit_ratio": [],
        }
    )


def _replay(store: KVStore, reqs, layout, cfg, clock, sizes, progress, on_sample):
    """Generator: yields after each request; its return value is the :class:`ReplayReport`."""
    bb = layout.bytes_per_block
    ns = Namespace(model="mooncake-trace", kv_dtype="bf16").digest()
    keep = cfg.keep_data
    template = torch.arange(bb, dtype=torch.int64).to(torch.uint8) if keep else None
    tally = _Tally()
    t_start = time.perf_counter()
    every = cfg.sample_every or max(1, len(reqs) // 200)
    try:
        for i, r in enumerate(reqs):
            clock.now_s = r.timestamp_s * cfg.time_scale
            nfull = r.full_blocks()
            keys = chain_ids(ns, r.hash_ids[:nfull])
            rid = ("trace", i)
            n_ok = _lookup_and_load(store, keys, rid, r.input_length, bb, keep, tally)
            new = keys[n_ok:]
            if new:
                _store_missed(store, ns, new, n_ok, bb, template, tally)
            store.release(rid)
            store.drain()  # deterministic: identical counts run to run
            if progress is not None and (i % 50 == 0 or i == len(reqs) - 1):
                progress(i + 1, len(reqs))
            if i % every == 0 or i == len(reqs) - 1:
                _sample(store, clock, tally, on_sample)
            yield i  # ReplaySession.step: one request done
        runtime = time.perf_counter() - t_start
        return _report(store, reqs, layout, cfg, sizes, tally, runtime)
    finally:
        # A replay is a measurement: its report covers every byte the store wrote, so what sits
        # only in memory at the end is not written down at close (flush_on_close would add
        # writes after the report; on an FDP device HBMW would then exceed the reported bytes).
        _close_unflushed(store)


def _lookup_and_load(
    store: KVStore, keys: list, rid, prompt_tokens: int, bb: int, keep: bool, tally: _Tally
) -> int:
    """Look up one request's full blocks and load its useful prefix (checked against the keys when
    ``keep``); returns how many leading blocks loaded."""
    res = store.lookup_keys(keys, request_id=rid, num_prompt_tokens=prompt_tokens)
    tally.lookup_blocks += len(keys)
    tally.hit_blocks += res.matched_blocks
    tally.useful_blocks += res.useful_blocks
    if not res.useful_blocks:
        return 0
    dests = None if keep else [torch.empty(bb, dtype=torch.uint8, device="meta") for _ in res.useful_keys]
    t0 = time.perf_counter_ns()
    st, outs = store.load(res.useful_keys, dests)
    dt = time.perf_counter_ns() - t0
    tally.load_wall += dt / 1e9
    n_ok = leading_ok(st)
    store.drain()  # background cleaning a load asked for lands before this request's store
    for k, o in zip(res.useful_keys[:n_ok] if keep else (), outs[:n_ok]):
        if bytes(o.reshape(-1).view(torch.uint8)[:32].numpy()) != k:
            tally.wrong += 1
    tally.load_lat.append(dt)
    tally.load_bytes += n_ok * bb
    tally.loaded_blocks += n_ok
    return n_ok


def _store_missed(
    store: KVStore, ns: bytes, new: list, first_position: int, bb: int, template, tally: _Tally
) -> None:
    """Store the blocks a request missed: each carries its key in its first 32 bytes (``template``:
    the rest of a block's bytes), or ``meta`` tensors when the replay keeps no data (``template`` None)."""
    blocks = []
    for k in new:
        if template is None:
            blocks.append(torch.empty(bb, dtype=torch.uint8, device="meta"))
            continue
        b = template.clone()
        b[:32] = torch.frombuffer(bytearray(k), dtype=torch.uint8)
        blocks.append(b)
    t0 = time.perf_counter_ns()
    st = store.store_keys(ns, new, blocks, first_position=first_position)
    dt = time.perf_counter_ns() - t0
    tally.store_wall += dt / 1e9
    tally.store_lat.append(dt)
    tally.store_bytes += sum(bb for s in st if s is Status.OK)


def _sample(store: KVStore, clock, tally: _Tally, on_sample) -> None:
    """One point of the time series: bytes per tier and the hit ratio so far, at trace time."""
    bpt = store.bytes_per_tier()
    sample = {
        "t_s": clock.now_s,
        "hbm_bytes": bpt["hbm"],
        "host_bytes": bpt["host"],
        "nvme_bytes": bpt["nvme"],
        "hit_ratio": tally.hit_blocks / max(1, tally.lookup_blocks),
    }
    if on_sample is not None:
        on_sample(store, sample)
    for k, v in sample.items():
        tally.ts.setdefault(k, []).append(v)


def _report(store: KVStore, reqs, layout, cfg, sizes, tally: _Tally, runtime: float) -> ReplayReport:
    """The :class:`ReplayReport` of a finished replay (the store is quiescent: invariants checked)."""
    store.check_invariants(quiescent=True)
    snap = store.stats()
    stats = snap.pop("nvme_backend", {})
    device = store.device_stats() if store.nvme is not None else {}
    bpt = store.bytes_per_tier()
    lat = np.asarray(tally.load_lat, dtype=np.int64)
    lookup_blocks, loaded_blocks = tally.lookup_blocks, tally.loaded_blocks
    kv = {
        "requests": len(reqs),
        "lookup_blocks": lookup_blocks,
        "hit_blocks": tally.hit_blocks,
        "useful_blocks": tally.useful_blocks,
        "loaded_blocks": loaded_blocks,
        "lookup_hit_ratio": tally.hit_blocks / max(1, lookup_blocks),
        "useful_hit_ratio": loaded_blocks / max(1, lookup_blocks),
        "ideal_hit_ratio": ideal_hit_ratio(reqs),
        "ideal_hit_ratio_all_blocks": ideal_hit_ratio(reqs, full_blocks_only=False),
        "saved_prefill_tokens": loaded_blocks * MOONCAKE_BLOCK_TOKENS,
        "prompt_tokens": int(sum(r.input_length for r in reqs)),
        "partial_tail_tokens": int(snap.get("partial_tail_tokens", 0)),
        "wrong_kv_blocks": tally.wrong if cfg.keep_data else None,
        "keep_data": cfg.keep_data,
        "io_error_blocks": int(snap.get("io_errors", 0)),
        "block_bytes": layout.bytes_per_block,
        "block_tokens": MOONCAKE_BLOCK_TOKENS,
        "bytes_scale_factor": REFERENCE_BLOCK_BYTES / layout.bytes_per_block,
        "hbm_capacity_bytes": sizes["hbm_bytes"],
        "host_capacity_bytes": sizes["host_bytes"],
        "nvme_capacity_bytes": sizes["nvme_bytes"],
        "unique_blocks": sizes["unique_blocks"],
        "hbm_bytes": bpt["hbm"],
        "host_bytes": bpt["host"],
        "nvme_bytes": bpt["nvme"],
        **{k: int(snap.get(k, 0)) for k in _COUNTED},
        "promotions": int(sum(v for k, v in snap.items() if k.startswith("promotions_"))),
        "dropped_blocks": int(snap.get("dropped_blocks", 0)),
        "store_no_space_blocks": int(snap.get("store_no_space", 0)),
        "load_lat_ns": lat,
        "trace_duration_s": reqs[-1].timestamp_s - reqs[0].timestamp_s,
    }
    for p in (50, 90, 99):
        kv[f"load_lat_p{p}_ns"] = int(np.percentile(lat, p)) if lat.size else 0
    return ReplayReport(
        len(reqs),
        kv,
        lat,
        np.asarray(tally.store_lat, dtype=np.int64),
        tally.load_bytes,
        tally.store_bytes,
        tally.load_wall,
        tally.store_wall,
        runtime,
        tally.ts,
        stats,
        # runtime objects (a store, locks) are neither deep-copied nor reported
        {k: v for k, v in dataclasses.asdict(dataclasses.replace(cfg, runtime={})).items() if k != "runtime"}
        | {"layout": layout.to_dict()},
        device,
        dict(snap, nvme_backend=stats),
    )


#: Store counters the report copies under their own names (0 when the store has none).
_COUNTED = (
    "hit_blocks_hbm",
    "hit_blocks_host",
    "hit_blocks_nvme",
    "load_bytes_hbm",
    "load_bytes_host",
    "load_bytes_nvme",
    "store_bytes_hbm",
    "store_bytes_host",
    "store_bytes_nvme",
    "nvme_write_bytes",
    "nvme_read_bytes",
    "evictions_hbm",
    "evictions_host",
    "evictions_nvme",
    "demotions_hbm_host",
    "demotions_host_nvme",
)
