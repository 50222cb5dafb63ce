"""Helpers shared by the engine connectors (vLLM, SGLang): model identity and
the engine's one free-form extra-config dict split into tierstore's typed
configuration plus the connector's own typed section.

Nothing here imports an engine.

Start and shutdown lines. Inside an engine, tierstore says two things at INFO
(:func:`log_store_opened`, :func:`close_store_logged`, one format for every
connector): when its store opens, the tiers and their capacities, the NVMe
path, the blocks recovered from it and the remote tier's state; when it
closes, the blocks written down to NVMe (or, without NVMe, the blocks that are
not kept).

Model identity. Two engines may share KV only if they run the same weights
(:class:`tierstore.identity.Namespace`). An engine names its model by a hub id
and an optional revision, or by a local directory. :func:`model_identity`
turns that into the namespace's ``model`` string:

* ``"<model>@<revision>"`` when a revision is pinned (a hub commit, a tag);
* ``"local@sha256:<digest>"`` for a local directory without a revision, where
  the digest is :func:`fingerprint_model_dir` (the config and the weight
  files' names, sizes and first/last bytes): two copies of the same
  checkpoint share KV, a retrained checkpoint in the same directory does not;
* ``"<model>@config-sha256:<digest>"`` for anything else (a hub id whose
  revision is not pinned): the digest of the model's config only. Different
  weights under an unchanged config would then share KV, so pin a revision;
  the connectors log a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from ..config import StoreConfig, parse_model
from ..errors import ConfigError
from ..units import format_bytes

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ..api import KVStore, KVStoreProtocol
    from ..layout import KVLayout
    from ..node.client import NodeKVStore

#: Weight files hashed by :func:`fingerprint_model_dir` (suffixes).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Bytes hashed at the start and at the end of each weight file.
EDGE_BYTES = 1 << 20
#: Lifetime hints the store accepts (:mod:`tierstore.fdp.lifetime`: long / medium / short).
LIFETIME_HINTS = ("system", "conversation", "query")


def fingerprint_model_dir(path: str, edge_bytes: int = EDGE_BYTES) -> str:
    """SHA-256 fingerprint of a local model directory (64 hex digits).

    Hashed, in sorted order of relative path: every ``*.json`` file's bytes
    (config, generation config, tokenizer files) and, for every weight file
    (:data:`WEIGHT_SUFFIXES`), its relative path, its size in bytes and its
    first and last ``edge_bytes`` bytes. For safetensors the first bytes are
    the header (tensor names, dtypes, shapes, offsets) and the first tensor's
    data, so another checkpoint of the same architecture differs there. Cost:
    about ``2 * edge_bytes`` read per weight file, whatever the model size.

    A fine-tune that changes only bytes in the middle of every weight file is
    not told apart: pin a revision (``--revision``) or set the connector's
    ``model_id`` to be exact.

    Raises
    ------
    ConfigError
        If ``path`` is not a directory or holds no config and no weights.
    """
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is not a directory")
    h = hashlib.sha256(b"tierstore/model-dir/v1\0")
    seen = 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .cache, .git
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if name.endswith(".json"):
                with open(full, "rb") as f:
                    data = f.read()
                h.update(b"json\0" + rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
                seen += 1
            elif name.endswith(WEIGHT_SUFFIXES):
                size = os.path.getsize(full)
                h.update(b"weights\0" + rel.encode() + b"\0" + size.to_bytes(8, "little"))
                with open(full, "rb") as f:
                    h.update(f.read(edge_bytes))
                    if size > edge_bytes:
                        f.seek(max(edge_bytes, size - edge_bytes))
                        h.update(f.read(edge_bytes))
                seen += 1
    if not seen:
        raise ConfigError(f"model path {path!r} holds no *.json and no weight files to fingerprint")
    return h.hexdigest()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 of a model config as canonical JSON (sorted keys; non-JSON values via ``str``)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(b"tierstore/model-config/v1\0" + blob.encode()).hexdigest()


def model_identity(
    model: str, revision: str | None, config: Mapping[str, Any] | None = None, override: str | None = None
) -> tuple[str, bool]:
    """The namespace ``model`` string for an engine's model (see the module docstring).

    Parameters
    ----------
    model : str
        Hub id or local directory, as the engine was started with.
    revision : str or None
        The pinned revision, if any.
    config : mapping, optional
        The model config (for the unpinned hub-id fallback).
    override : str, optional
        An explicit identity (connector config ``model_id``) that wins.

    Returns
    -------
    (str, bool)
        The identity, and whether it is exact (``False`` only for the
        config-only fallback, which callers warn about).
    """
    if override:
        return override, True
    if revision:
        return f"{model}@{revision}", True
    if os.path.isdir(model):
        return f"local@sha256:{fingerprint_model_dir(model)}", True
    return f"{model}@config-sha256:{config_fingerprint(config or {})}", False


#: What an engine's extra config may not carry, by default: the layout comes from the engine.
DERIVED_LAYOUT = {"layout": "'layout' is derived from the engine's KV cache; remove it"}
#: The message when a tier below the engine's own memory tiers has none of its own.
_NO_TIER = "no tier configured; give tiers.nvme {path, capacity_bytes} and/or tiers.host {capacity_bytes}"


def split_extra_config(
    extra: Mapping[str, Any] | None,
    section: str | None,
    section_model: type[BaseModel],
    what: str,
    *,
    refuse: Mapping[str, str] = DERIVED_LAYOUT,
    secondary: str | None = None,
    note: str = "",
) -> tuple[StoreConfig, Any]:
    """Validate an engine's extra-config dict: the store's sections plus the connector's own keys.

    The one splitter of every connector: the vLLM KV connector (its keys in a ``connector``
    section), vLLM's offloading tier and SGLang's HiCache backend (their keys at the top level,
    ``section=None``).

    Parameters
    ----------
    extra : mapping or None
        The engine's free-form dict (vLLM ``kv_connector_extra_config``, SGLang
        ``--hicache-storage-backend-extra-config``).
    section : str or None
        The key of the connector's own settings (e.g. ``"connector"``); ``None``: the own
        settings are the top-level keys that are fields of ``section_model``.
    section_model : type
        The pydantic model of the connector's own settings (``extra="forbid"``).
    what : str
        Names the source in error messages (``"invalid {what}: ..."``).
    refuse : mapping of str to str
        Store sections this connector does not take, each with the sentence that says why
        (default: ``layout``, derived from the engine).
    secondary : str, optional
        The connector sits below the engine's own HBM tier: ``tiers.hbm`` must be 0 (this
        sentence says why) and the host or the NVMe tier must be configured.
    note : str
        Appended to the unknown-key message (keys the engine pops before the connector sees them).

    Returns
    -------
    (StoreConfig, section_model instance)

    Raises
    ------
    ConfigError
        For a dict that is not a mapping, an unknown key anywhere, a bad value, a refused
        section, or (``secondary``, embedded store) an HBM tier or no tier at all; with
        ``store.url`` (the node service's store), for ``tiers``, ``policies`` or ``remote``.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"invalid {what}: expected a mapping, got {type(extra).__name__}")
    doc = dict(extra)
    if section is None:
        own = {k: doc.pop(k) for k in list(doc) if k in section_model.model_fields}
    else:
        own = doc.pop(section, None) or {}
    for key, why in refuse.items():
        if key in doc:
            raise ConfigError(f"invalid {what}: {why}")
    unknown = sorted(k for k in doc if k not in StoreConfig.model_fields)
    if unknown:
        own_keys = set(section_model.model_fields) if section is None else {section}
        accepted = sorted(set(StoreConfig.model_fields) - set(refuse) | own_keys)
        raise ConfigError(f"invalid {what}: unknown key(s) {unknown}; accepted keys are {accepted}{note}")
    store_cfg = StoreConfig.from_dict(doc, what)
    _check_store_source(store_cfg, what, secondary)
    return store_cfg, parse_model(
        section_model, own, what if section is None else f"{what} section {section!r}"
    )


def _check_store_source(store_cfg: StoreConfig, what: str, secondary: str | None) -> None:
    """:func:`split_extra_config`'s check of where the store is: embedded below the engine's HBM
    (``secondary``), no HBM tier and at least a host or an NVMe tier (with ``store.url``, the
    node service's store, :class:`StoreConfig` itself refuses ``tiers``, ``policies`` and
    ``remote``). Raises ``ConfigError``."""
    if store_cfg.store.url is None and secondary is not None:
        t = store_cfg.tiers
        if t.hbm.capacity_bytes:
            raise ConfigError(f"invalid {what}: tiers.hbm must be 0; {secondary}")
        if not t.host.capacity_bytes and t.nvme is None:
            raise ConfigError(f"invalid {what}: {_NO_TIER}")


def open_store(store_cfg: StoreConfig, layout: KVLayout, **runtime: Any) -> KVStoreProtocol:
    """The engine's store: embedded (:meth:`KVStore.from_config <tierstore.api.KVStore.from_config>`
    with ``runtime``) when ``store.url`` is unset, else the node service's
    (:class:`tierstore.node.client.NodeKVStore` on ``store.url``, with ``store.timeout_s`` and
    ``store.pool``; it connects at its first call).

    Raises
    ------
    ConfigError
        What ``from_config`` raises; run-time objects given for the node service's store.
    """
    loc = store_cfg.store
    if loc.url is None:
        from ..api import KVStore

        return KVStore.from_config(store_cfg, layout, **runtime)
    if runtime:
        raise ConfigError(
            f"run-time options {sorted(runtime)} do not apply to the node service's store "
            f"({loc.url}): its tiers and policies are the service's"
        )
    from ..node.client import NodeKVStore

    return NodeKVStore(loc.url, layout, timeout_s=loc.timeout_s, pool=loc.pool)


def _node_store(store: object) -> TypeGuard[NodeKVStore]:
    """Whether ``store`` is the node service's client (its module is imported only when used)."""
    mod = sys.modules.get("tierstore.node.client")
    return mod is not None and isinstance(store, mod.NodeKVStore)


def _node_summary(store: NodeKVStore) -> str:
    """:func:`store_summary` of the node service's client. Asking the service for its statistics
    connects at once, so a service that refuses this client (another block class, pool or
    protocol version) raises :class:`ConfigError` here, at start-up; one that is down is said."""
    st = store.stats()
    node = st.get("node")
    if node is None and "tenant" in st:  # a tenant of a daemon of several: its own figures only
        return (
            f"node service at {store.url}, pool {st['pool']['name']!r} (tenant {st['tenant']['name']!r}: "
            f"{format_bytes(int(st['tenant']['usage_bytes']))} resident)"
        )
    if node is None:
        return f"node service at {store.url} not answering (misses until it is up)"
    tiers = ", ".join(f"{t} {format_bytes(n)}" for t, n in st.get("bytes_per_tier", {}).items() if n)
    return (
        f"node service at {store.url}, pool {node['pool']!r} ({int(st.get('blocks', 0))} blocks"
        f"{': ' + tiers if tiers else ''})"
    )


def store_summary(store: KVStoreProtocol) -> str:
    """One line on an open store: tiers with capacities, the NVMe path and the
    blocks recovered from it (and dropped), the remote tier's state; for the node
    service's store, its URL, pool and blocks.

    Example: ``"tiers hbm 256.00KiB, host 256.00KiB, nvme 56.00MiB at /mnt/nvme/kv
    (12 blocks recovered; the 64.00MiB given hold 56.00MiB of KV blocks: extent headers and whole
    segments take the rest); remote tier off"``. The NVMe figure is the tier's block capacity
    (``KVStore.capacity_bytes``), the bytes given follow it when they differ.

    Raises
    ------
    ConfigError
        The node service refuses this client.
    """
    if _node_store(store):
        return _node_summary(store)
    return _embedded_summary(cast("KVStore", store))


def _embedded_summary(store: KVStore) -> str:
    cap = store.capacity_bytes()
    tiers = ", ".join(f"{t} {format_bytes(n)}" for t, n in cap.items() if n) or "none"
    parts = [f"tiers {tiers}"]
    if store.nvme is not None:
        st = store.nvme.stats() if hasattr(store.nvme, "stats") else {}
        path = getattr(getattr(store.nvme, "engine", None), "path", None) or getattr(store.nvme, "path", None)
        rec = f"{int(st.get('recovered_blocks', 0))} blocks recovered"
        dropped = int(st.get("recovery_dropped_blocks", 0))
        if dropped:
            rec += f", {dropped} dropped"
        nv = store.config.tiers.nvme
        if nv is not None and nv.capacity_bytes and nv.capacity_bytes != cap.get("nvme"):
            rest = "extent headers and whole segments"
            if nv.eviction_granularity == "block":
                rest += f" and the live fraction ({nv.live_fraction:g})"
            rec += (
                f"; the {format_bytes(nv.capacity_bytes)} given hold {format_bytes(cap.get('nvme', 0))} "
                f"of KV blocks: {rest} take the rest"
            )
        parts[0] += f" at {path or 'a device'} ({rec})"
    r = store.remote
    if r is None:
        parts.append("remote tier off")
    else:
        s = r.config
        state = r.state
        why = f": {r.stats().get('degraded_reason', '')}" if state == "degraded" else ""
        parts.append(
            f"remote tier {state}{why} (Mooncake master {s.master}, cluster {s.cluster!r}, "
            f"contributing {format_bytes(s.segment_bytes)})"
        )
    return "; ".join(parts)


def log_store_opened(log: logging.Logger, who: str, store: KVStoreProtocol, detail: str = "") -> None:
    """The start line: ``"tierstore opened for <who>: <store_summary>[; <detail>]"`` at INFO.

    Raises
    ------
    ConfigError
        The node service refuses this client (:func:`store_summary`).
    """
    log.info("tierstore opened for %s: %s%s", who, store_summary(store), f"; {detail}" if detail else "")


def close_store_logged(log: logging.Logger, who: str, store: KVStoreProtocol) -> int:
    """Close ``store`` and say what was kept, at INFO: the blocks written down to
    NVMe by the close (memory-only blocks, :meth:`KVStore.close <tierstore.api.KVStore.close>`)
    and the blocks on NVMe; without an NVMe tier, the blocks that are not kept. The node
    service's client only ends its session: the service keeps the blocks.

    Returns
    -------
    int
        Blocks written down to NVMe (0 for the node service's client).
    """
    if _node_store(store):
        store.close()
        log.info("tierstore closed for %s: the node service at %s keeps its blocks", who, store.url)
        return 0
    return _close_embedded_logged(log, who, cast("KVStore", store))


def _close_embedded_logged(log: logging.Logger, who: str, store: KVStore) -> int:
    blocks = int(store.stats().get("blocks", 0))
    on_nvme = int(store.bytes_per_tier().get("nvme", 0)) // store.layout.bytes_per_block
    nvme = store.nvme is not None
    written = store.close() or 0
    if nvme:
        log.info(
            "tierstore closed for %s: %d blocks written down to NVMe, %d blocks on NVMe for a restart "
            "on the same path",
            who,
            written,
            on_nvme + written,
        )
    else:
        log.info("tierstore closed for %s: no NVMe tier, the %d blocks in memory are not kept", who, blocks)
    return written
