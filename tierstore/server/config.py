"""Typed configuration of the storage daemon (``tierstore serve --config FILE``).

One pydantic v2 model per component, every model ``extra="forbid"`` (an unknown
key is an error). Sizes (``*_bytes``) accept ``64GiB``, ``4k``, ``1g`` or an int
(:func:`tierstore.units.parse_size`, base 1024) and durations (``*_s``) accept
``30s``, ``500ms`` or a number of seconds (:func:`tierstore.units.parse_time_s`);
both are parsed once, at load. :func:`load_config` turns every validation
failure into one :class:`~tierstore.errors.ConfigError` whose lines name the
key, the value and what is accepted. See ``configs/daemon.yaml`` for a
documented example.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from ..identity import Namespace
from ..layout import KVLayout, PRESETS, _DTYPES, get_layout
from ..units import parse_size, parse_time_s

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
#: Admission policies for blocks demoted to NVMe (only used when ``puts.durable`` is false).
ADMISSION_POLICIES = ("all", "reused")


def _size(v: Any, info) -> int:
    return parse_size(v, info.field_name)


def _dur(v: Any, info) -> float:
    return parse_time_s(v, info.field_name)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Model):
    """Where the KV-block API listens (loopback by default)."""

    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535, description="TCP port; 0 picks a free one (printed in the log)")


class MetricsConfig(_Model):
    """Prometheus endpoint. ``/metrics`` is always served on the API listener too."""

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535, description="separate metrics port; null = API port only")


class LogConfig(_Model):
    """Structured JSON logs on stderr."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    access_log: bool = True


class LayoutConfig(_Model):
    """The KV layout that defines ``block_bytes``: a preset or explicit dims."""

    preset: str | None = None
    num_layers: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    dtype: str = "bf16"
    tokens_per_block: int | None = Field(None, gt=0)

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
            return lay.with_tokens_per_block(self.tokens_per_block) if self.tokens_per_block else lay
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.tokens_per_block or 16, "custom")


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
        from ..policies import policy_names
        if v not in policy_names():
            raise ValueError(f"accepted values are {policy_names()}")
        return v

    @field_validator("admission")
    @classmethod
    def _adm(cls, v):
        if v not in ADMISSION_POLICIES:
            raise ValueError(f"accepted values are {list(ADMISSION_POLICIES)}")
        return v


class PutsConfig(_Model):
    """Acknowledgement semantics of a put.

    ``durable: true`` (default, needs the NVMe tier): a put is answered only
    after every OK block is written with O_DIRECT and fdatasync'ed on NVMe
    (write-through; the memory tiers hold a cached copy). ``false``: a put is
    acknowledged once cached; blocks reach NVMe only on demotion.
    """

    durable: bool = True


class TenantConfig(_Model):
    """A tenant: its bearer credentials and byte quota."""

    name: str
    tokens: list[str] = Field(default_factory=list, description="plain bearer tokens (prefer token_sha256)")
    token_sha256: list[str] = Field(default_factory=list, description="hex SHA-256 of each bearer token")
    quota_bytes: int = 1 << 62
    _q = field_validator("quota_bytes", mode="before")(_size)

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME_RE.match(v) or v == "public":
            raise ValueError("1-64 of [A-Za-z0-9_.-], not starting with a symbol, and not 'public'")
        return v

    @field_validator("tokens")
    @classmethod
    def _tok(cls, v):
        for t in v:
            if len(t) < 16:
                raise ValueError("each token needs >= 16 characters")
        return v

    @field_validator("token_sha256")
    @classmethod
    def _hash(cls, v):
        out = [h.lower() for h in v]
        for h in out:
            if not _HEX64_RE.match(h):
                raise ValueError("each entry must be 64 hex digits (sha256sum of the token)")
        return out

    @model_validator(mode="after")
    def _has_cred(self):
        if not self.tokens and not self.token_sha256:
            raise ValueError(f"tenant {self.name!r} has no credential: give tokens or token_sha256")
        return self

    def token_digests(self) -> list[bytes]:
        """SHA-256 of every credential (plain tokens are hashed here)."""
        return [hashlib.sha256(t.encode()).digest() for t in self.tokens] + \
               [bytes.fromhex(h) for h in self.token_sha256]


class PublicNamespaceConfig(_Model):
    """A namespace explicitly shared across tenants.

    Clients address it with the same :class:`~tierstore.identity.Namespace`
    fields (``namespace``, digested by the daemon at load; set ``tenant:
    public`` there by convention) or the digest itself (``digest``).
    """

    name: str
    namespace: dict[str, Any] | None = None
    digest: str | None = None
    readers: list[str] | Literal["*"] = "*"
    writers: list[str] = Field(default_factory=list)
    quota_bytes: int = 1 << 62
    _q = field_validator("quota_bytes", mode="before")(_size)

    @field_validator("digest")
    @classmethod
    def _dig(cls, v):
        if v is not None and not _HEX64_RE.match(v.lower()):
            raise ValueError("must be 64 hex digits (Namespace.digest().hex())")
        return None if v is None else v.lower()

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v):
        if v is None:
            return v
        try:
            Namespace(**v)
        except (TypeError, ConfigError) as e:
            raise ValueError(f"not a valid Namespace ({e}); fields are model, tokenizer, chat_template, "
                             "adapter, rope_scaling, kv_dtype, layout_version, tp_rank, tp_size, pp_rank, "
                             "pp_size, tenant") from None
        return v

    @model_validator(mode="after")
    def _one(self):
        if (self.namespace is None) == (self.digest is None):
            raise ValueError(f"public namespace {self.name!r}: give exactly one of 'namespace' or 'digest'")
        return self

    def ns_digest(self) -> bytes:
        """The client-side namespace digest this declaration matches."""
        return Namespace(**self.namespace).digest() if self.namespace is not None else bytes.fromhex(self.digest)


class LimitsConfig(_Model):
    """Request limits and backpressure."""

    max_request_bytes: int = 64 << 20
    max_manifest_bytes: int = 1 << 20
    max_keys_per_request: int = Field(4096, ge=1)
    max_inflight_requests: int = Field(64, ge=1)
    worker_threads: int = Field(4, ge=1, le=256)
    request_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    retry_after_s: float = 1.0
    pin_quota_bytes: int = 1 << 62
    default_lease_s: float = 60.0
    max_lease_s: float = 3600.0
    _b = field_validator("max_request_bytes", "max_manifest_bytes", "pin_quota_bytes", mode="before")(_size)
    _t = field_validator("request_timeout_s", "shutdown_timeout_s", "retry_after_s", "default_lease_s",
                         "max_lease_s", mode="before")(_dur)

    @field_validator("request_timeout_s", "default_lease_s", "max_lease_s")
    @classmethod
    def _pos(cls, v):
        if v <= 0:
            raise ValueError("must be > 0")
        return v


class DaemonConfig(_Model):
    """The whole daemon configuration (the YAML document)."""

    listen: ListenConfig = ListenConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    state_dir: str = Field(..., description="directory for the scope registry and invalidation log")
    layout: LayoutConfig
    tiers: TiersConfig
    policies: PoliciesConfig = PoliciesConfig()
    puts: PutsConfig = PutsConfig()
    tenants: list[TenantConfig]
    public_namespaces: list[PublicNamespaceConfig] = Field(default_factory=list)
    limits: LimitsConfig = LimitsConfig()

    @model_validator(mode="after")
    def _cross(self):
        names = [t.name for t in self.tenants]
        if not names:
            raise ValueError("at least one tenant is required")
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        digests = [d for t in self.tenants for d in t.token_digests()]
        if len(set(digests)) != len(digests):
            raise ValueError("two credentials are equal (each token must map to one tenant)")
        for p in self.public_namespaces:
            for who in list(p.writers) + ([] if p.readers == "*" else list(p.readers)):
                if who not in names:
                    raise ValueError(f"public namespace {p.name!r} names unknown tenant {who!r}; tenants are {names}")
        if self.puts.durable and self.tiers.nvme is None:
            raise ValueError("puts.durable=true needs tiers.nvme (or set puts.durable: false)")
        if self.tiers.hbm.capacity_bytes == 0 and self.tiers.host.capacity_bytes == 0 and self.tiers.nvme is None:
            raise ValueError("every tier is disabled: give tiers.host.capacity_bytes or tiers.nvme")
        return self


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


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``key=value: what is accepted``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(document)"
        val = e.get("input")
        if e["type"] == "extra_forbidden":
            acc = _accepted_keys(DaemonConfig, tuple(e["loc"]))
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
    return "invalid daemon config:\n  " + "\n  ".join(lines)


def parse_config(doc: Any) -> DaemonConfig:
    """Validate a parsed YAML document.

    Raises
    ------
    ConfigError
        Naming each bad key, its value and what is accepted.
    """
    if not isinstance(doc, dict):
        raise ConfigError(f"invalid daemon config: the document must be a mapping, got {type(doc).__name__}")
    try:
        return DaemonConfig.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    except ConfigError as e:  # raised by parse_size/parse_time_s inside a validator
        raise ConfigError(f"invalid daemon config: {e}") from None


def load_config(path: str) -> DaemonConfig:
    """Read and validate a YAML config file.

    Raises
    ------
    ConfigError
        Unreadable file, YAML syntax error, or invalid content.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: YAML syntax error: {e}") from None
    return parse_config(doc)
