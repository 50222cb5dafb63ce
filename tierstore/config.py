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

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .layout import KVLayout, PRESETS, _DTYPES, get_layout
from .units import parse_size, parse_time_s

#: Admission policies for blocks demoted to NVMe.
ADMISSION_POLICIES = ("all", "reused")


def _size(v: Any, info) -> int:
    return parse_size(v, info.field_name)


def _dur(v: Any, info) -> float:
    return parse_time_s(v, info.field_name)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayoutConfig(_Model):
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
            raise ValueError("'preset' excludes num_layers/num_kv_heads/head_dim (use tokens_per_block to resize)")
        return self

    def build(self) -> KVLayout:
        """The :class:`~tierstore.layout.KVLayout` this section describes."""
        if self.preset is not None:
            lay = get_layout(self.preset)
            lay = lay.with_tokens_per_block(self.tokens_per_block) if self.tokens_per_block else lay
            return dataclasses.replace(lay, block_order=self.block_order)
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.tokens_per_block or 16, "custom", self.block_order)


class MemoryTierConfig(_Model):
    """A memory tier (HBM or pinned host DRAM); 0 disables it."""

    capacity_bytes: int = 0
    _c = field_validator("capacity_bytes", mode="before")(_size)


class FdpConfig(_Model):
    """FDP placement: the PID each lifetime class is written with.

    Take the PIDs from the device's RUH Status (``nvme fdp status``), see
    :mod:`tierstore.fdp.placement`. Disabled: writes carry no placement.
    """

    enabled: bool = False
    long_pid: int = Field(0, ge=0, le=0xFFFF)
    medium_pid: int = Field(0, ge=0, le=0xFFFF)
    short_pid: int = Field(0, ge=0, le=0xFFFF)
    default_pid: int = Field(0, ge=0, le=0xFFFF)


class NvmeTierConfig(_Model):
    """The NVMe tier: a crash-recoverable :class:`~tierstore.io.SegmentStorage`."""

    path: str = Field(..., description="directory, file, or a block/char device such as /dev/ng0n1")
    capacity_bytes: int
    engine: Literal["posix", "uring"] = "posix"
    segment_size_bytes: int | None = None
    extent_size_bytes: int = 16 << 20
    iodepth: int = Field(16, ge=1, le=1024)
    fdp: FdpConfig = FdpConfig()
    _c = field_validator("capacity_bytes", "extent_size_bytes", mode="before")(_size)

    @field_validator("segment_size_bytes", mode="before")
    @classmethod
    def _seg(cls, v, info):
        return None if v is None else parse_size(v, info.field_name)

    @field_validator("capacity_bytes")
    @classmethod
    def _positive(cls, v):
        if v <= 0:
            raise ValueError("must be > 0 (remove the 'nvme' section to disable the tier)")
        return v


class TiersConfig(_Model):
    """Tier capacities. Without ``nvme`` nothing survives a restart."""

    hbm: MemoryTierConfig = MemoryTierConfig()
    host: MemoryTierConfig = MemoryTierConfig()
    nvme: NvmeTierConfig | None = None


class PoliciesConfig(_Model):
    """Eviction (names registered in :mod:`tierstore.policies`) and NVMe admission."""

    eviction: str = "lru"
    admission: str = "all"
    promotion: Literal["top", "one", "none"] = "top"

    @field_validator("eviction")
    @classmethod
    def _ev(cls, v):
        from .policies import policy_names
        if v not in policy_names():
            raise ValueError(f"accepted values are {policy_names()}")
        return v

    @field_validator("admission")
    @classmethod
    def _adm(cls, v):
        if v not in ADMISSION_POLICIES:
            raise ValueError(f"accepted values are {list(ADMISSION_POLICIES)}")
        return v


class RemoteConfig(_Model):
    """A shared remote tier on a distributed KV store (Mooncake Store).

    Parameters mirror ``MooncakeDistributedStore.setup(local_hostname,
    metadata_server, global_segment_size, local_buffer_size, protocol,
    device_name, master_server_address)`` (Mooncake ``mooncake-store`` Python API).
    """

    engine: Literal["mooncake"] = "mooncake"
    master: str = Field("127.0.0.1:50051", description="master RPC address host:port")
    metadata: str = Field("http://127.0.0.1:18080/metadata", description="metadata server URL or P2PHANDSHAKE")
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = Field(256 << 20, description="memory this client contributes to the cluster")
    local_buffer_bytes: int = Field(64 << 20, description="registered buffer for zero-copy gets and puts")
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = Field("", description="RDMA device name(s); empty for TCP")
    publish_queue_blocks: int = Field(256, ge=1, description="bounded queue of asynchronous puts")
    timeout_s: float = 5.0
    admission: Literal["all", "reused"] = "all"
    _b = field_validator("segment_bytes", "local_buffer_bytes", mode="before")(_size)
    _t = field_validator("timeout_s", mode="before")(_dur)


class StoreConfig(_Model):
    """A whole store: layout, tiers, policies and an optional remote tier.

    ``layout`` may be left out where the caller knows it (an engine connector
    derives it from the engine's model config).
    """

    layout: LayoutConfig | None = None
    tiers: TiersConfig = TiersConfig()
    policies: PoliciesConfig = PoliciesConfig()
    remote: RemoteConfig | None = None

    @classmethod
    def from_dict(cls, doc: Any, what: str = "store config") -> "StoreConfig":
        """Validate a dict (parsed YAML/JSON, or an engine's extra config).

        Raises
        ------
        ConfigError
            Naming each bad key, its value and what is accepted.
        """
        return parse_model(cls, doc, what)

    @classmethod
    def from_yaml(cls, path: str) -> "StoreConfig":
        """Read and validate a YAML file. Raises :class:`ConfigError`."""
        return cls.from_dict(read_yaml(path), f"store config {path!r}")


def _accepted_keys(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """Field names of the model that owns the unknown key at ``loc``."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return None
        ann = cur.model_fields[part].annotation
        cur = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
        if cur is None and hasattr(ann, "__args__"):  # list[Model]
            cur = next((a for a in ann.__args__ if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return sorted(cur.model_fields)
    return None


def format_validation_error(err: ValidationError, root: type[BaseModel], what: str) -> str:
    """One line per problem: ``key=value: what is accepted``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(document)"
        val = e.get("input")
        if e["type"] == "extra_forbidden":
            acc = _accepted_keys(root, tuple(e["loc"]))
            lines.append(f"{key}: unknown key; accepted keys here are {acc}")
            continue
        if e["type"] == "missing":
            lines.append(f"{key}: required key is missing")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        inner = f"{e['loc'][-1]}=" if e["loc"] else None
        if inner and msg.startswith(inner) and ": " in msg:  # parse_size/parse_time_s repeat key=value
            msg = msg.split(": ", 1)[1]
        shown = repr(val) if not isinstance(val, dict) else "{...}"
        lines.append(f"{key}={shown}: {msg}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def parse_model(model: type[BaseModel], doc: Any, what: str):
    """Validate ``doc`` into ``model``; every failure is one :class:`ConfigError`."""
    if not isinstance(doc, dict):
        raise ConfigError(f"invalid {what}: the document must be a mapping, got {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, what)) from None
    except ConfigError as e:  # raised by parse_size/parse_time_s inside a validator
        raise ConfigError(f"invalid {what}: {e}") from None


def read_yaml(path: str) -> Any:
    """Parse a YAML file. Raises :class:`ConfigError` for an unreadable file or bad syntax."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: YAML syntax error: {e}") from None
