"""KV-cache workloads through the real tier manager.

``rw=kvtrace`` replays a Mooncake JSONL trace (:mod:`tierstore.replay`): the
``read`` direction is the loads of prefix hits (one op per request that loaded
blocks; latency = the whole load call), the ``write`` direction is the stores
of missed blocks (one op per request that stored). The ``kv`` section carries
hit ratios, saved prefill tokens and per-tier bytes; the ``device`` section the
NVMe backend's counters and the FDP figures (HBMW/MBMW/MBE, WAF, per-RUH bytes,
end-to-end WA); ``timeseries["waf"]`` is the cumulative WAF at each sample.

Device choice (:mod:`tierstore.wiring`):

* ``device`` not given on the command line (the schema default is ``sim``, but
  a plain ``--rw=kvtrace`` keeps its meaning): the NVMe tier is a segment file
  in ``directory`` as before, and an FTL *model* observes its engine (RU =
  segment, capacity = the tier) so WAF is always reported -- the ``device``
  line says it is a model.
* ``device=sim``: the simulated FDP device (memory engine + FTL model):
  ``device_size`` if given, else ``nvme tier / utilization``; the tier is
  ``utilization x device`` (whole RUs); ``ru_size`` if given, else device/60.
* ``device=/dev/ngXnY``: a real FDP namespace (not verified on hardware).

``dataplacement=fdp`` tags NVMe writes with the PID of the block's lifetime
class; ``none`` leaves every write untagged (default handle).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..policies.admission import make_admission
from ..replay import ReplayConfig, run_replay
from ..wiring import StoreConfig, build_store
from .registry import current_progress, register_runner
from .result import CpuUsage, DirectionResult, JobResult

__all__ = ["run_kvtrace"]


def _direction(lat_ns: np.ndarray, nbytes: int, wall_s: float) -> DirectionResult:
    return DirectionResult(io_bytes=int(nbytes), ops=int(lat_ns.size), runtime_s=max(wall_s, 1e-9),
                           clat_ns=lat_ns.astype(np.int64))


def replay_config(options: dict[str, Any]) -> ReplayConfig:
    """Map bench options onto a :class:`~tierstore.replay.ReplayConfig`."""
    explicit = options.get("_explicit", frozenset())
    return ReplayConfig(
        trace=options["trace"] or None,
        limit=options["number_ios"] or None,
        block_bytes=options["trace_block_size"],
        hbm_bytes=options["hbm_size"] if "hbm_size" in explicit else None,
        host_bytes=options["host_size"] if "host_size" in explicit else None,
        nvme_bytes=options["nvme_size"] if "nvme_size" in explicit else None,
        directory=options["directory"] or None,
        nvme_backend=options.get("nvme_backend", "segment"),
        eviction=options["eviction"],
        time_scale=1.0 / options["time_scale"] if options["time_scale"] > 0 else 1.0,
    )


def store_config(options: dict[str, Any], layout, hbm_bytes: int, host_bytes: int, nvme_path: str,
                 nvme_bytes: int, clock) -> StoreConfig:
    """Map bench options onto a :class:`~tierstore.wiring.StoreConfig` (see module doc)."""
    explicit = options.get("_explicit", frozenset())
    dev_opt = str(options.get("device", "sim")) if "device" in explicit else ""
    common = dict(layout=layout, hbm_bytes=hbm_bytes, host_bytes=host_bytes, clock=clock,
                  dataplacement=options.get("dataplacement", "none"), op_fraction=options.get("op", 0.07),
                  plids=tuple(options.get("plids", ()) or ()),
                  ru_size_bytes=options["ru_size"] if "ru_size" in explicit else None,
                  manager_options={"eviction": options["eviction"],
                                   "admit_to_nvme": make_admission(options.get("admission", "none"))})
    util = float(options.get("utilization", 0.9))
    if dev_opt == "sim":
        dev = options["device_size"] if "device_size" in explicit else None
        return StoreConfig(mode="sim", nvme_bytes=None if dev else nvme_bytes, device_bytes=dev,
                           utilization=util, **common)
    if dev_opt:
        dev = options["device_size"] if "device_size" in explicit else None
        return StoreConfig(mode="device", path=dev_opt, device_bytes=dev, utilization=util, **common)
    eng = options.get("ioengine", "posix")
    return StoreConfig(mode="file", path=nvme_path, nvme_bytes=nvme_bytes,
                       engine=eng if eng in ("posix", "uring") else "posix", **common)


def store_factory(options: dict[str, Any], cfg: ReplayConfig, box: list):
    """A :func:`~tierstore.replay.run_replay` store factory that records the wiring in ``box``."""
    def factory(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, clock):
        explicit = options.get("_explicit", frozenset())
        if "device" not in explicit and (not nvme_bytes or cfg.nvme_backend == "slot"):
            from ..api import KVStore  # no NVMe tier, or the slot backend: no segments to wire
            return KVStore(layout, hbm_bytes=hbm_bytes, host_bytes=host_bytes,
                           nvme_path=nvme_path if nvme_bytes else None, nvme_bytes=nvme_bytes,
                           nvme_backend=cfg.nvme_backend, eviction=cfg.eviction, clock=clock)
        wired = build_store(store_config(options, layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, clock))
        wired.store.wiring = wired
        box.append(wired)
        return wired.store
    return factory


def run_kvtrace(options: dict[str, Any]) -> JobResult:
    """Runner of ``rw=kvtrace``: replay a trace and report fio-style figures."""
    cfg = replay_config(options)
    progress = current_progress()
    started = []

    def prog(done: int, total: int) -> None:
        if not started:
            progress.start(total=total, unit="req")
            started.append(True)
        progress.update(done)

    wired_box: list = []
    factory = store_factory(options, cfg, wired_box)

    def on_sample(store, sample: dict) -> None:
        if wired_box:
            d = wired_box[0].device_stats()
            sample["waf"] = d.get("waf", float("nan"))
            sample["e2e_wa"] = d.get("e2e_wa", float("nan"))

    cpu = CpuUsage()
    rep = run_replay(cfg, progress=prog, on_sample=on_sample, store_factory=factory)
    usage = cpu.stop()
    kv = dict(rep.kv)
    device = dict(rep.device) if rep.device else {}
    device.update({f"nvme_{k}": v for k, v in rep.store_stats.items() if isinstance(v, (int, float))})
    if "waf" in rep.timeseries:  # also in the JSON (fio's output has no timeseries section)
        device["waf_timeseries"] = {"t_s": list(rep.timeseries["t_s"]), "waf": list(rep.timeseries["waf"])}
    return JobResult(
        jobname=options.get("name") or "kvtrace",
        options={**options, "bs": cfg.block_bytes},  # one KV I/O = one trace block
        read=_direction(rep.load_lat_ns, rep.load_bytes, rep.load_wall_s),
        write=_direction(rep.store_lat_ns, rep.store_bytes, rep.store_wall_s),
        kv=kv, device=device, timeseries=rep.timeseries,
        usr_cpu=usage["usr_cpu"], sys_cpu=usage["sys_cpu"], runtime_s=rep.runtime_s,
        ctx=usage.get("ctx", 0), majf=usage.get("majf", 0), minf=usage.get("minf", 0),
    )


register_runner(["kvtrace"], run_kvtrace)
