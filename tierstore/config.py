"""Typed configuration of a store: one pydantic model per component.

:class:`StoreConfig` is what every way of opening tierstore validates into:
``KVStore.from_config``, the daemon's YAML (``tierstore serve``, whose
``layout``/``tiers``/``policies``/``remote`` sections are these models), and
the engine connectors' one free-form extra-config dict (vLLM
``kv_connector_extra_config``, SGLang ``--hicache-storage-backend-extra-config``),
which :meth:`StoreConfig.from_dict` validates at start-up.

Every model is ``extra="forbid"`` (an unknown key is an error that lists the
accepted keys). Sizes (``*_bytes``) accept ``64GiB``, ``4k``, ``1g`` or an int
(:func:`tierstore.units.parse_size`, base 1024); durations (``*_s``) accept
``30s``, ``500ms`` or seconds (:func:`tierstore.units.parse_time_s`). Both are
parsed once, at load.

Example (YAML, or the same keys as a JSON dict)::

    layout: {preset: llama-3.1-8b, tokens_per_block: 16}
    tiers:
      hbm: {capacity_bytes: 0}
      host: {capacity_bytes: 64GiB}
      nvme: {path: /mnt/nvme/kv, capacity_bytes: 1TiB, engine: auto}
    policies: {eviction: lru, admission: all, promotion: top}
    remote: {engine: mooncake, master: 127.0.0.1:50051, metadata: http://127.0.0.1:18080/metadata}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .errors import ConfigError
from .layout import _DTYPES, PRESETS, KVLayout, get_layout
from .policies.config import PoliciesConfig
from .policies.registry import ADMISSION
from .remote.settings import RemoteConfig
from .schema import (  # noqa: F401
    DurationS,
    OptionalSizeBytes,
    PositiveDurationS,
    SizeBytes,
    StrictModel,
    WaitS,
    format_validation_error,
    parse_model,
    read_yaml,
)

#: Admission policies for blocks demoted to NVMe ("all"/"none": admit all;
#: "reused"/"second"/"second_hit": second sighting; "predicted": reuse predictor):
#: the names of :data:`tierstore.policies.registry.ADMISSION`.
ADMISSION_POLICIES = tuple(ADMISSION.names())


class LayoutConfig(StrictModel):
    """The KV layout that defines ``block_bytes``: a preset or explicit dims."""

    preset: str | None = None
    num_layers: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    dtype: str = "bf16"
    tokens_per_block: int | None = Field(None, gt=0)
    block_order: Literal["layer_kv", "layer_fused", "kv_layer"] = "layer_kv"

    @field_validator("preset")
    @classmethod
    def _preset(cls, v):
        if v is not None and v.lower() not in PRESETS:
            raise ValueError(f"unknown preset; accepted values are {sorted(PRESETS)}")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v.lower() not in _DTYPES:
            raise ValueError(f"accepted values are {sorted(_DTYPES)}")
        return v

    @model_validator(mode="after")
    def _complete(self):
        dims = (self.num_layers, self.num_kv_heads, self.head_dim)
        if self.preset is None and any(d is None for d in dims):
            raise ValueError("give either 'preset' or all of num_layers, num_kv_heads, head_dim")
        if self.preset is not None and any(d is not None for d in dims):
            raise ValueError(
                "'preset' excludes num_layers/num_kv_heads/head_dim (use tokens_per_block to resize)"
            )
        return self

    def build(self) -> KVLayout:
        """The :class:`~tierstore.layout.KVLayout` this section describes."""
        if self.preset is not None:
            lay = get_layout(self.preset)
            lay = lay.with_tokens_per_block(self.tokens_per_block) if self.tokens_per_block else lay
            return dataclasses.replace(lay, block_order=self.block_order)
        return KVLayout(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.tokens_per_block or 16,
            "custom",
            self.block_order,
        )


class MemoryTierConfig(StrictModel):
    """A memory tier (HBM or pinned host DRAM); 0 disables it."""

    capacity_bytes: SizeBytes = 0


class HbmTierConfig(MemoryTierConfig):
    """The device tier. Without CUDA, ``device: auto`` keeps it in host memory
    (a CPU stand-in that runs the same code)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"


class FdpConfig(StrictModel):
    """FDP placement: tag each NVMe write with the PID of its lifetime class.

    The PIDs come from the device's RUH Status (:mod:`tierstore.fdp.placement`);
    ``plids`` optionally picks, by index into that list as fio's ``plids=``
    does, the PIDs (reclaim group included) of the LONG, MEDIUM and SHORT
    classes. The explicit ``*_pid`` fields name PIDs directly; each must be one
    the device's RUH Status lists (checked when the store opens, before any
    write). Placement needs a device that reports RUH Status: ``device: fdp``
    (``/dev/ngXnY``), ``device: sim``, or a file with an FTL ``model``.
    """

    enabled: bool = False
    plids: list[int] = Field(default_factory=list)
    ruh_update_on_segment_open: bool | None = Field(
        None, description="send RUH Update when a segment opens; null: on with FDP placement"
    )
    long_pid: int | None = Field(None, ge=0, le=0xFFFF)
    medium_pid: int | None = Field(None, ge=0, le=0xFFFF)
    short_pid: int | None = Field(None, ge=0, le=0xFFFF)
    default_pid: int | None = Field(None, ge=0, le=0xFFFF)


class SimDeviceConfig(StrictModel):
    """The FTL model of an FDP SSD (:class:`tierstore.fdp.ftl.FTLModel`): the
    whole device with ``device: sim``, or an observer of the file's writes with
    ``device: file`` (then WAF is reported for the run; a model, not the disk)."""

    device_bytes: OptionalSizeBytes = Field(
        None, description="user capacity; null: tier capacity / utilization"
    )
    utilization: float = Field(0.9, gt=0, le=1)
    ru_size_bytes: OptionalSizeBytes = Field(None, description="reclaim unit; null: device / 60")
    op_fraction: float = Field(0.07, ge=0, lt=1)
    num_ruh: int = Field(8, ge=1, le=0xFFFF)
    isolation: Literal["initial", "persistent"] = "initial"
    gc: Literal["greedy", "cost_benefit"] = "greedy"
    page_bytes: SizeBytes = 4096


class NvmeTierConfig(StrictModel):
    """The NVMe tier: a crash-recoverable :class:`~tierstore.io.SegmentStorage`.

    ``device`` says what is underneath, explicitly:

    * ``file`` -- a file (or a directory, ``tierstore.nvme`` inside) on this
      file system, or a block device, through ``engine`` (O_DIRECT);
    * ``sim`` -- the FTL model of an FDP SSD (``model``), its data in memory
      (``engine: memory``) or in ``path``; a simulation, reported as such;
    * ``fdp`` -- a real FDP namespace ``/dev/ngXnY`` (placed writes through
      NVMe passthrough, discovery through nvme-cli).

    ``path``: a path that ends in ``/`` or names an existing directory is a
    directory (the tier is the file ``tierstore.nvme`` in it); any other path
    is the tier's file or device, in a directory that must exist
    (:func:`tierstore.io.label.resolve_nvme_path`).

    tierstore writes only to a file or device that is empty or carries its
    label (:mod:`tierstore.io.label`); ``format: true`` lets it format anything
    else (a non-empty file, a block device, ``/dev/ngXnY``), destroying what it
    holds, as ``mkfs`` does. A tier that carries the label is never erased,
    ``format`` or not. The segment size is fixed when the tier is formatted: a
    reopen with a larger capacity keeps every block, a smaller one drops the
    blocks of the segments past the new end and, in block mode, the oldest
    blocks beyond the live budget (counted in
    ``KVStore.stats()["nvme_backend"]["recovery_dropped_blocks"]``).

    ``eviction_granularity``: ``region`` (the default) evicts whole segments;
    ``block`` evicts single blocks in ``policies.eviction``'s order, keeps at
    most ``live_fraction`` of the tier's blocks live (the rest is room for
    holes), deallocates dead slots in runs of at least ``trim_min_bytes`` and
    records every eviction in a journal first (``journal_path``; default
    ``<path>.journal`` beside a file, in memory for ``device: sim`` without a
    path; required on a block device or ``device: fdp``). See
    :mod:`tierstore.io.block_eviction`.
    """

    device: Literal["file", "sim", "fdp"] = "file"
    path: str | None = Field(None, description="directory, file, block device, or /dev/ngXnY for device: fdp")
    capacity_bytes: OptionalSizeBytes = Field(
        None, description="null only with device: sim (utilization x device)"
    )
    format: bool = Field(
        False,
        description="let tierstore format a path without its label (a non-empty file, a "
        "device); what it holds is lost",
    )
    engine: Literal["auto", "posix", "uring", "memory", "null"] = "auto"
    segment_size_bytes: OptionalSizeBytes = None
    extent_size_bytes: SizeBytes = 16 << 20
    iodepth: int = Field(16, ge=1, le=1024)
    region_policy: Literal["lru", "fifo", "min_live"] = "lru"
    eviction_granularity: Literal["region", "block"] = "region"
    live_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="block mode: share of the tier's blocks kept live"
    )
    trim_min_bytes: SizeBytes = Field(1 << 20, description="block mode: shortest dead run worth a deallocate")
    journal_path: str | None = Field(None, description="block mode: the journal file (durable before a trim)")
    flush_on_close: bool = Field(True, description="write memory-only blocks to NVMe at a clean close")
    flush_timeout_s: DurationS = Field(30.0, ge=0)
    flush_max_bytes: OptionalSizeBytes = Field(
        None, description="cap on bytes written at close; null: no cap"
    )
    fdp: FdpConfig = FdpConfig()
    model: SimDeviceConfig | None = None

    @field_validator("capacity_bytes")
    @classmethod
    def _positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("must be > 0 (remove the 'nvme' section to disable the tier)")
        return v

    @field_validator("path", "journal_path")
    @classmethod
    def _no_nul(cls, v):
        if v is not None and "\x00" in v:
            raise ValueError(f"{v!r}: a path cannot hold a NUL byte")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.device in ("file", "fdp") and not self.path:
            raise ValueError(
                f"device: {self.device} needs a path (empty or missing): a directory (ends in '/' or "
                "exists), a file or a device; KVStore's nvme_path=, YAML's tiers.nvme.path"
            )
        if self.device != "sim" and self.capacity_bytes is None:
            raise ValueError(f"device: {self.device} needs capacity_bytes")
        if (
            self.device == "sim"
            and self.capacity_bytes is None
            and (self.model is None or self.model.device_bytes is None)
        ):
            raise ValueError("device: sim needs capacity_bytes or model.device_bytes")
        if self.engine in ("memory", "null") and self.device == "file":
            raise ValueError(f"engine: {self.engine} keeps no file; use device: sim")
        return self


class TiersConfig(StrictModel):
    """Tier capacities. Without ``nvme`` nothing survives a restart.

    ``keep_data: false`` is the accounting mode, for experiments whose question
    is where bytes would go (a trace replayed at a real block size, 64 MiB per
    512-token Llama-3.1-8B block, onto the FTL model): the memory pools live on
    torch's ``meta`` device (no bytes), the NVMe tier (``engine: null``, which
    it requires) writes every extent's real header and accounts its payload and
    padding without bytes, and a load reports ``OK`` without delivering bytes.
    Payloads and load destinations must then be ``meta`` tensors too; a store in
    this mode never serves KV.
    """

    hbm: HbmTierConfig = HbmTierConfig()
    host: MemoryTierConfig = MemoryTierConfig()
    nvme: NvmeTierConfig | None = None
    keep_data: bool = True

    @model_validator(mode="after")
    def _accounting(self):
        if not self.keep_data and self.nvme is not None and self.nvme.engine != "null":
            raise ValueError("keep_data: false needs tiers.nvme.engine: null (an engine that keeps no data)")
        return self


#: ``KVStore`` keywords that are not the field name of their section: keyword -> dotted path.
OPTION_ALIASES = {
    "device": "tiers.hbm.device",
    "nvme_engine": "tiers.nvme.engine",
    "nvme_device": "tiers.nvme.device",
    "nvme_format": "tiers.nvme.format",
}
#: ``NvmeTierConfig`` fields a ``KVStore`` keyword sets under its own name (the path and the
#: capacity are arguments of their own; ``fdp`` and ``model`` need a config).
NVME_OPTIONS = (
    "segment_size_bytes",
    "extent_size_bytes",
    "iodepth",
    "region_policy",
    "flush_on_close",
    "flush_timeout_s",
    "flush_max_bytes",
    "eviction_granularity",
    "live_fraction",
    "trim_min_bytes",
    "journal_path",
)


class StoreLocation(StrictModel):
    """Where an engine's store lives (the ``store`` section of a connector's extra config).

    ``url`` unset (the default): the store is embedded in the engine process, built from the
    config's other sections. ``url: unix:///run/tierstore/node.sock``: the node service's store
    (``tierstore serve --node``), shared by every engine process on the node; its tiers and
    policies are the service's, so the config then carries no ``tiers``, ``policies`` or
    ``remote``. ``timeout_s`` bounds every wait for the service (a miss after it); ``pool``
    names the service's pool (default: its only one).
    """

    url: str | None = None
    timeout_s: WaitS = 5.0
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")

    @field_validator("url")
    @classmethod
    def _unix(cls, v):
        if v is not None and (not v.startswith("unix:///") or len(v) > len("unix://") + 107):
            raise ValueError("expected unix:///absolute/path/node.sock (at most 107 bytes of path)")
        return v


class StoreConfig(StrictModel):
    """A whole store: layout, tiers, policies and an optional remote tier.

    ``layout`` may be left out where the caller knows it (an engine connector
    derives it from the engine's model config). ``store.url`` names a node service
    instead (:class:`StoreLocation`; opened by
    :func:`tierstore.integrations._common.open_store`); ``tiers``, ``policies`` and
    ``remote`` are then the service's, and refused here.
    """

    layout: LayoutConfig | None = None
    tiers: TiersConfig = TiersConfig()
    policies: PoliciesConfig = PoliciesConfig()
    remote: RemoteConfig | None = None
    store: StoreLocation = StoreLocation()

    @model_validator(mode="after")
    def _one_source(self):
        """``store.url`` names the node service, whose tiers and policies are its own: ``tiers``,
        ``policies`` or ``remote`` given beside it would be ignored, so they are refused."""
        owned = sorted(k for k in ("tiers", "policies", "remote") if k in self.model_fields_set)
        if self.store.url is not None and owned:
            raise ValueError(
                f"store.url={self.store.url!r} names the node service, whose tiers and policies are "
                f"its own; remove {owned} (or store.url, for a store embedded in this process)"
            )
        return self

    @classmethod
    def from_dict(cls, doc: Any, what: str = "store config") -> StoreConfig:
        """Validate a dict (parsed YAML/JSON, or an engine's extra config).

        Raises
        ------
        ConfigError
            Naming each bad key, its value and what is accepted.
        """
        return parse_model(cls, doc, what)

    @classmethod
    def from_options(
        cls,
        hbm_bytes: int | str = 0,
        host_bytes: int | str = 0,
        nvme_path: str | None = None,
        nvme_bytes: int | str = 0,
        **options: Any,
    ) -> StoreConfig:
        """The config ``KVStore(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, **options)``
        opens, without its run-time objects.

        ``options`` are :class:`PoliciesConfig` fields, :data:`NVME_OPTIONS`, the
        :data:`OPTION_ALIASES` and ``remote`` (a :class:`RemoteConfig` or its dict). Sizes are
        bytes or size strings (``"64MiB"``). The NVMe tier exists when both ``nvme_path`` and
        ``nvme_bytes`` are given; one without the other is refused.

        Raises
        ------
        ConfigError
            For an unknown option (the message lists the accepted ones), a bad value, NVMe
            options without an NVMe tier, or only one of ``nvme_path`` and ``nvme_bytes``.
        """
        nvme_keys = set(NVME_OPTIONS) | {k for k, v in OPTION_ALIASES.items() if v.startswith("tiers.nvme.")}
        accepted = set(PoliciesConfig.model_fields) | nvme_keys | {"device", "remote"}
        unknown = set(options) - accepted
        if unknown:
            raise ConfigError(f"KVStore: unknown option(s) {sorted(unknown)}; accepted: {sorted(accepted)}")

        def model(m, fields):
            return parse_model(m, fields, f"KVStore options ({m.__name__})")

        remote = options.pop("remote", None)
        if remote is not None and not isinstance(remote, RemoteConfig):
            remote = model(RemoteConfig, dict(remote))
        given = {k: options.pop(k) for k in list(options) if k in nvme_keys}
        nv = {OPTION_ALIASES.get(k, k).rsplit(".", 1)[-1]: v for k, v in given.items()}
        hbm = model(HbmTierConfig, dict(capacity_bytes=hbm_bytes, device=options.pop("device", "auto")))
        host = model(MemoryTierConfig, dict(capacity_bytes=host_bytes))
        nvme = None
        if (nvme_path is None) != (not nvme_bytes):
            # one without the other opened a store with no NVMe tier, silently
            raise ConfigError(
                f"nvme_path={nvme_path!r}, nvme_bytes={nvme_bytes!r}: an NVMe tier needs both "
                "(a path and a capacity, e.g. nvme_bytes=64 << 20 or '64MiB'); give neither for "
                "a store in memory only"
            )
        if nvme_path is not None and nvme_bytes:
            nvme = model(NvmeTierConfig, dict(path=nvme_path, capacity_bytes=nvme_bytes, **nv))
        elif given:
            raise ConfigError(f"{sorted(given)} need an NVMe tier (nvme_path and nvme_bytes)")
        return cls(
            tiers=TiersConfig(hbm=hbm, host=host, nvme=nvme),
            policies=model(PoliciesConfig, options),
            remote=remote,
        )

    @classmethod
    def from_yaml(cls, path: str) -> StoreConfig:
        """Read and validate a YAML file. Raises :class:`ConfigError`."""
        return cls.from_dict(read_yaml(path), f"store config {path!r}")
