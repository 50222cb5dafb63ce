"""Typed configuration of the storage daemon (``tierstore serve --config FILE``).

One pydantic v2 model per component on :mod:`tierstore.schema`'s base (every
model ``extra="forbid"``; sizes and durations parsed once, at load); the store's
sections (``layout``, ``tiers``, ``policies``, ``remote``) are the library's own
models (:mod:`tierstore.config`). :func:`load_config` turns every validation
failure into one :class:`~tierstore.errors.ConfigError` whose lines name the
key, the value and what is accepted. See ``configs/daemon.yaml`` for a
documented example.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..config import LayoutConfig, PoliciesConfig, RemoteConfig, StoreConfig, TiersConfig
from ..errors import ConfigError
from ..identity import Namespace
from ..schema import DurationS, PositiveDurationS, SizeBytes, StrictModel, parse_model, read_yaml
from ..units import MAX_DURATION_S

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: a tenant's byte quota when its config gives none (no limit; ``+Inf`` in /metrics)
NO_QUOTA_BYTES = 1 << 62
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
#: node.socket_mode given as an int (an unquoted ``0600`` in YAML 1.1 is octal: 384) -> its text
_SOCKET_MODES = {0o600: "0600", 0o660: "0660"}


class ListenConfig(StrictModel):
    """Where the KV-block API listens (loopback by default)."""

    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535, description="TCP port; 0 picks a free one (printed in the log)")


class MetricsConfig(StrictModel):
    """Prometheus endpoint. ``/metrics`` is always served on the API listener too."""

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535, description="separate metrics port; null = API port only")


class LogConfig(StrictModel):
    """Structured JSON logs on stderr."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    access_log: bool = True


class PutsConfig(StrictModel):
    """Acknowledgement semantics of a put.

    ``durable: true`` (default, needs the NVMe tier): a put is answered only
    after every OK block is written with O_DIRECT and fdatasync'ed on NVMe
    (write-through; the memory tiers hold a cached copy). ``false``: a put is
    acknowledged once cached; blocks reach NVMe only on demotion.
    """

    durable: bool = True


class TenantConfig(StrictModel):
    """A tenant: its bearer credentials and byte quota."""

    name: str
    tokens: list[str] = Field(default_factory=list, description="plain bearer tokens (prefer token_sha256)")
    token_sha256: list[str] = Field(default_factory=list, description="hex SHA-256 of each bearer token")
    quota_bytes: SizeBytes = NO_QUOTA_BYTES

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
        return [hashlib.sha256(t.encode()).digest() for t in self.tokens] + [
            bytes.fromhex(h) for h in self.token_sha256
        ]


class PublicNamespaceConfig(StrictModel):
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
    quota_bytes: SizeBytes = NO_QUOTA_BYTES

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
            raise ValueError(
                f"not a valid Namespace ({e}); fields are model, tokenizer, chat_template, "
                "adapter, rope_scaling, kv_dtype, layout_version, tp_rank, tp_size, pp_rank, "
                "pp_size, tenant"
            ) from None
        return v

    @model_validator(mode="after")
    def _one(self):
        if (self.namespace is None) == (self.digest is None):
            raise ValueError(f"public namespace {self.name!r}: give exactly one of 'namespace' or 'digest'")
        return self

    def ns_digest(self) -> bytes:
        """The client-side namespace digest this declaration matches."""
        # exactly one of the two is set (_one)
        return (
            Namespace(**self.namespace).digest()
            if self.namespace is not None
            else bytes.fromhex(str(self.digest))
        )


class LimitsConfig(StrictModel):
    """Request limits and backpressure."""

    max_request_bytes: SizeBytes = 64 << 20
    max_manifest_bytes: SizeBytes = 1 << 20
    max_keys_per_request: int = Field(4096, ge=1)
    max_inflight_requests: int = Field(64, ge=1)
    worker_threads: int = Field(4, ge=1, le=256)
    request_timeout_s: PositiveDurationS = 60.0
    shutdown_timeout_s: DurationS = 30.0
    retry_after_s: DurationS = 1.0
    pin_quota_bytes: SizeBytes = 1 << 62
    default_lease_s: PositiveDurationS = Field(60.0, le=MAX_DURATION_S)
    max_lease_s: PositiveDurationS = Field(3600.0, le=MAX_DURATION_S)


class NodeConfig(StrictModel):
    """The node service (``tierstore serve --node``, issue 24): one pool on a UNIX socket whose
    host tier is a shared memory segment that engine processes map.

    ``socket`` is the listening path (its directory must exist); ``socket_mode`` its file
    mode (``"0600"``: this user only; ``"0660"``: also the group; unquoted in YAML, ``0600``
    reads as the octal int 384 and ``0660`` as 432, taken as the same modes).

    Access, one rule: a session is admitted when its peer process's uid (``SO_PEERCRED``) is
    in ``allow_uids`` (null: the service's own uid) or its gid in ``allow_gids``; it is then
    bound to the tenant of the ``Hello``'s bearer token (the ``tenants`` credentials HTTP
    checks; a wrong token is refused, never downgraded), or, without a token, to ``tenant``
    (null: a token is required). Its keys and namespaces are scoped to that tenant as HTTP
    scopes them, and the tenant's quotas apply. Scoping is not isolation: every session maps
    the host tier (the shared segment) read-write, so a daemon of several tenants with a node
    socket is refused unless ``tenants_share_memory`` says they trust each other. A ticket not completed
    within ``lease_s`` is quarantined, then freed when its client is gone. ``op_timeout_s``
    bounds a frame's transfer and is the wait the service tells clients to use.
    """

    socket: str = Field(
        ..., min_length=1, max_length=107, description="UNIX socket path (sun_path is 108 bytes)"
    )
    socket_mode: Literal["0600", "0660"] = "0600"
    pool: str = Field("default", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    staging_blocks: int = Field(64, ge=0, le=1 << 20)
    lease_s: PositiveDurationS = 60.0
    op_timeout_s: PositiveDurationS = 10.0
    max_clients: int = Field(64, ge=1, le=4096)
    max_tickets_per_client: int = Field(64, ge=1, le=1 << 16)
    max_keys: int = Field(4096, ge=1, le=1 << 16)
    max_frame_bytes: SizeBytes = Field(4 << 20, ge=4096, le=1 << 30)
    allow_uids: list[int] | None = Field(
        None, description="peer uids admitted (SO_PEERCRED); null: the service's own uid only"
    )
    allow_gids: list[int] = Field(default_factory=list, description="peer gids admitted besides allow_uids")
    tenant: str | None = Field(
        None, description="tenant of a session that sends no token; null: a token is required"
    )
    tenants_share_memory: bool = Field(
        False,
        description="admit a daemon of several tenants: every session maps the host tier, so each "
        "can read and overwrite every tenant's blocks there",
    )

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _mode_int(cls, v):
        """YAML 1.1 reads an unquoted ``0600`` as the octal int 384 (``0660``: 432): the same modes."""
        if isinstance(v, int) and not isinstance(v, bool):
            if v in _SOCKET_MODES:
                return _SOCKET_MODES[v]
            raise ValueError(
                f"{v} (octal {v:#o}) is not a socket mode this service sets (0o600 or 0o660); "
                "write the mode quoted, e.g. '0600' or '0660'"
            )
        return v

    @field_validator("socket")
    @classmethod
    def _absolute(cls, v):
        if not os.path.isabs(v):
            raise ValueError("must be an absolute path (clients name it as unix:///absolute/path)")
        return v

    @field_validator("allow_uids", "allow_gids")
    @classmethod
    def _ids(cls, v):
        for i in v or ():
            if not 0 <= i < (1 << 32) - 1:
                raise ValueError(f"{i} is not a uid/gid (0 <= id < 4294967295)")
        return v

    def peer_uids(self) -> list[int]:
        """The uids admitted: ``allow_uids``, or the service's own uid when it is null."""
        return [os.getuid()] if self.allow_uids is None else list(self.allow_uids)


class DaemonConfig(StrictModel):
    """The whole daemon configuration (the YAML document)."""

    listen: ListenConfig = ListenConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    state_dir: str = Field(..., description="directory for the scope registry and invalidation log")
    layout: LayoutConfig
    tiers: TiersConfig
    policies: PoliciesConfig = PoliciesConfig()
    remote: RemoteConfig | None = None
    puts: PutsConfig = PutsConfig()
    tenants: list[TenantConfig]
    public_namespaces: list[PublicNamespaceConfig] = Field(default_factory=list)
    limits: LimitsConfig = LimitsConfig()
    node: NodeConfig | None = None

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
                    raise ValueError(
                        f"public namespace {p.name!r} names unknown tenant {who!r}; tenants are {names}"
                    )
        if self.node is not None and self.node.tenant is not None and self.node.tenant not in names:
            raise ValueError(f"node.tenant {self.node.tenant!r} is not a tenant; tenants are {names}")
        if self.node is not None and self.node.staging_blocks == 0 and self.tiers.nvme is not None:
            raise ValueError(
                "node.staging_blocks: 0 with an NVMe tier: a block on NVMe alone reaches a client "
                "through a staging slot, so every NVMe hit would be a miss; give it >= 1 (default 64)"
            )
        if self.node is not None and len(names) > 1 and not self.node.tenants_share_memory:
            # the host tier is the shared segment every socket session maps read-write: tenancy
            # scopes keys, it cannot keep one process from reading or writing another's memory
            raise ValueError(
                f"node: {len(names)} tenants ({names}) on one node socket: every session maps the "
                "host tier's shared memory, where any admitted process can read and overwrite every "
                "tenant's blocks (also those stored over HTTP). Run one daemon per tenant, or set "
                "node.tenants_share_memory: true if the tenants trust each other"
            )
        if self.puts.durable and self.tiers.nvme is None:
            raise ValueError("puts.durable=true needs tiers.nvme (or set puts.durable: false)")
        if (
            self.tiers.hbm.capacity_bytes == 0
            and self.tiers.host.capacity_bytes == 0
            and self.tiers.nvme is None
        ):
            raise ValueError("every tier is disabled: give tiers.host.capacity_bytes or tiers.nvme")
        return self

    def store_config(self) -> StoreConfig:
        """The store the daemon serves (over HTTP, or as the node service's pool): its ``tiers`` and
        ``remote``, and its ``policies`` with the limits' pin quota and default lease, write-through
        where puts are durable on an NVMe tier (a put is acknowledged once on NVMe), else
        write-back."""
        durable = self.puts.durable and self.tiers.nvme is not None
        pol = self.policies.model_copy(
            update={
                "pin_quota_bytes": self.limits.pin_quota_bytes,
                "default_lease_s": self.limits.default_lease_s,
                "write_policy": "write_through" if durable else "write_back",
            }
        )
        return StoreConfig(tiers=self.tiers, policies=pol, remote=self.remote)


def parse_config(doc: Any) -> DaemonConfig:
    """Validate a parsed YAML document.

    Raises
    ------
    ConfigError
        Naming each bad key, its value and what is accepted.
    """
    return parse_model(DaemonConfig, doc, "daemon config")


def load_config(path: str) -> DaemonConfig:
    """Read and validate a YAML config file.

    Raises
    ------
    ConfigError
        Unreadable file, YAML syntax error, or invalid content.
    """
    return parse_config(read_yaml(path))
