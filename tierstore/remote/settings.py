"""The remote tier's settings: ``RemoteConfig`` (the ``remote`` section) and ``MooncakeTuning``.

:class:`RemoteConfig` is the one place the remote tier's configured values, defaults and
checks live: YAML, ``KVStore(remote=...)``, an engine's extra config and the daemon validate
into it (re-exported by :mod:`tierstore.config`), and :class:`~tierstore.remote.mooncake.MooncakeTier`
takes it as is. :class:`MooncakeTuning` holds the knobs no configuration carries (threads,
header slots, reconnect back-off, ...), for tests and benchmarks. :func:`parse_remote_options`
splits one flat dict of both (a test worker's options) into the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from ..errors import ConfigError
from ..schema import DurationS, SizeBytes, StrictModel, parse_model

__all__ = ["MIN_SEGMENT_BYTES", "MooncakeTuning", "RemoteConfig", "parse_remote_options"]

#: Smallest segment Mooncake 0.3.13.post1 mounts ("Total size must be at least 16777216"
#: from client_buffer_allocation.cpp; setup returns -600), measured here.
MIN_SEGMENT_BYTES = 16 << 20


class RemoteConfig(StrictModel):
    """A shared remote tier on a distributed KV store (Mooncake Store).

    Parameters mirror ``MooncakeDistributedStore.setup(local_hostname,
    metadata_server, global_segment_size, local_buffer_size, protocol,
    device_name, master_server_address)`` (Mooncake ``mooncake-store`` Python
    API). ``publish_queue_blocks`` costs ``publish_queue_blocks x (block + 64 B)`` of
    registered memory; ``local_buffer_bytes`` gives ``local_buffer_bytes // (block + 64 B)``
    load slots (at least 2).

    Raises
    ------
    ConfigError
        Through :func:`tierstore.schema.parse_model`: ``master`` not ``host:port``, an empty
        ``metadata``, a ``segment_bytes`` between 0 and :data:`MIN_SEGMENT_BYTES`, a
        ``timeout_s`` that is not > 0, and the usual unknown keys and bad values.
    """

    engine: Literal["mooncake"] = "mooncake"
    master: str = Field("127.0.0.1:50051", description="master RPC address host:port")
    metadata: str = Field(
        "http://127.0.0.1:18080/metadata", description="metadata server URL or P2PHANDSHAKE"
    )
    local_hostname: str = "127.0.0.1"
    segment_bytes: SizeBytes = Field(256 << 20, description="memory this client contributes to the cluster")
    local_buffer_bytes: SizeBytes = Field(64 << 20, description="registered staging memory for loads")
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = Field("", description="RDMA device name(s); empty for TCP")
    publish_queue_blocks: int = Field(64, ge=1, description="bounded queue of asynchronous puts")
    timeout_s: DurationS = Field(5.0, gt=0, description="longest wait for one Mooncake call")
    admission: Literal["all", "reused"] = "all"
    publish: Literal["store", "evict"] = Field(
        "store",
        description="store: publish blocks when stored (shared at once); evict: when they leave "
        "this store's last tier (a victim cache: no copy both here and remote)",
    )
    cluster: str = Field("default", description="deployment name in object names")
    name_secret: str | None = Field(None, description="HMAC key for object names (its UTF-8 bytes, >= 16)")
    mooncake_tenant: str = Field("default", description="Mooncake tenant_id (with --enable_multi_tenants)")
    max_batch_blocks: int = Field(16, ge=1, description="blocks per batch_put_from / batch_get_into call")

    @field_validator("master")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if ":" not in v:
            raise ValueError("host:port")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: str) -> str:
        if not v:
            raise ValueError("a metadata server URL or P2PHANDSHAKE")
        return v

    @field_validator("segment_bytes")
    @classmethod
    def _segment(cls, v: int) -> int:
        if 0 < v < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"0 (contribute none) or at least {MIN_SEGMENT_BYTES >> 20} MiB "
                "(Mooncake's setup refuses smaller segments with -600)"
            )
        return v

    @property
    def name_secret_bytes(self) -> bytes | None:
        """``name_secret`` as the bytes :class:`~tierstore.remote.format.ObjectNamer` keys with."""
        return None if self.name_secret is None else self.name_secret.encode()


@dataclasses.dataclass(frozen=True)
class MooncakeTuning:
    """Knobs of a :class:`~tierstore.remote.mooncake.MooncakeTier` that no configuration carries.

    Parameters
    ----------
    call_threads : int
        Threads that run the Mooncake calls a caller waits for (a hung call holds one).
    publish_threads : int
        Publish calls in flight at once.
    header_slots : int
        Registered 64-byte header slots for zero-copy loads.
    reconnect_backoff_s : tuple of float
        First and longest delay between reconnect probes, seconds.
    republish_after_s : float
        A key published within this time is not published again (``EXISTS``).
    mooncake_local_buffer_bytes : int
        ``local_buffer_size`` passed to Mooncake's ``setup`` (its own local buffer, for its
        copying calls, unused here).
    set_env : bool
        Set the Mooncake environment defaults named in :mod:`tierstore.remote.mooncake`.

    Raises
    ------
    ConfigError
        For a count < 1, a negative size, or a back-off that is not ``0 < first <= longest``.
    """

    call_threads: int = 4
    publish_threads: int = 1
    header_slots: int = 1024
    reconnect_backoff_s: tuple[float, float] = (0.1, 5.0)
    republish_after_s: float = 60.0
    mooncake_local_buffer_bytes: int = 16 << 20
    set_env: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"remote.{field}={getattr(self, field)!r}: {why}")

        if int(self.mooncake_local_buffer_bytes) < 0:
            raise bad("mooncake_local_buffer_bytes", "must be >= 0")
        for f in ("call_threads", "header_slots", "publish_threads"):
            if int(getattr(self, f)) < 1:
                raise bad(f, "must be >= 1")
        lo, hi = self.reconnect_backoff_s
        if not 0 < lo <= hi:
            raise bad("reconnect_backoff_s", "need 0 < first <= longest")


def parse_remote_options(
    options: Mapping[str, Any], what: str = "remote options"
) -> tuple[RemoteConfig, MooncakeTuning]:
    """Split one flat dict of :class:`RemoteConfig` fields and :class:`MooncakeTuning` knobs.

    Raises
    ------
    ConfigError
        For an unknown key (the message lists both sets) or a bad value.
    """
    knobs = {f.name for f in dataclasses.fields(MooncakeTuning)}
    doc = dict(options)
    unknown = sorted(set(doc) - knobs - set(RemoteConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"invalid {what}: unknown key(s) {unknown}; accepted keys are "
            f"{sorted(RemoteConfig.model_fields)} and {sorted(knobs)}"
        )
    tuning = {k: doc.pop(k) for k in list(doc) if k in knobs}
    if "reconnect_backoff_s" in tuning:  # a JSON list from a worker's command line
        tuning["reconnect_backoff_s"] = tuple(tuning["reconnect_backoff_s"])
    return parse_model(RemoteConfig, doc, what), MooncakeTuning(**tuning)
