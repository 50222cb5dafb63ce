"""Tenancy of the daemon: credentials, scopes, the scope registry, the invalidation log, usage and quotas.

Tenancy and key scoping (both transports: HTTP and the node socket)
-------------------------------------------------------------------
A bearer token (HTTP ``Authorization: Bearer <token>``, the node socket's ``Hello``) maps to one
tenant; tokens are compared as SHA-256 digests with :func:`hmac.compare_digest`, against every
configured credential (no early exit). Clients send the 32-byte digest of their
:class:`~tierstore.identity.Namespace` and the chained block keys they computed
(``keys_for``). The server never uses these as storage keys. It derives::

    owner = tenant name                     (or "public:<name>" for a declared public namespace)
    scope = SHA-256("tierstore/scope/v2" 0x00 owner 0x00 client_namespace_digest || layout_fingerprint)
    keys  = SHA-256("tierstore/owner-keys/v1" 0x00 owner 0x00 layout_fingerprint)
    key   = SHA-256("tierstore/server-key/v2" || keys || client_key)

``scope`` is the store's namespace (invalidation, pin quota, usage); the key depends on the owner
only (client keys are chained from the namespace digest already), so a key-level call without a
namespace (the node socket's ``exists``/``load`` of raw keys) finds the tenant's own blocks.
A public namespace matches its declared digest, raw or scoped to the layout (the clients'
``digest``). Continued in ``docs/SERVER.md``: registry and invalidation log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..identity import DigestCache
from .config import DaemonConfig
from .http import ApiError, bearer_token
from .statefiles import (
    SCOPE_FIELDS,
    TOMB_FIELDS,
    ends_mid_line,
    foreign_state_file,
    read_state_records,
    skipped_lines_said,
)

__all__ = ["Tenancy", "owner_key_scope", "storage_key"]

log = logging.getLogger("tierstore.server")
_SCOPE_DOMAIN = b"tierstore/scope/v2"
_OWNER_DOMAIN = b"tierstore/owner-keys/v1"
_KEY_DOMAIN = b"tierstore/server-key/v2"
#: client key -> storage key entries memoised per owner (Tenancy.server_keys)
KEY_CACHE_ENTRIES = 1 << 15


def owner_key_scope(owner: str, layout_fingerprint: bytes) -> bytes:
    """The scope of ``owner``'s storage keys (module docstring: ``keys``)."""
    return hashlib.sha256(_OWNER_DOMAIN + b"\0" + owner.encode() + b"\0" + layout_fingerprint).digest()


def storage_key(key_scope: bytes, client_key: bytes) -> bytes:
    """The storage key of a client key within an owner's key scope (module docstring: ``key``)."""
    return hashlib.sha256(_KEY_DOMAIN + key_scope + client_key).digest()


def make_state_dir(path: str) -> None:
    """Create the daemon's ``state_dir`` (and its parents) unless it is a directory already.

    Start-up calls it before it opens the store, so a ``state_dir`` that cannot be one leaves
    nothing behind (no NVMe tier file created first).

    Raises
    ------
    ConfigError
        Naming ``state_dir``: it (or an ancestor) exists and is not a directory, or it cannot be
        created.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"state_dir={path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"state_dir={path}: cannot create the directory: {e.strerror}") from None


class Tenancy:
    """Credentials, scopes, the scope registry, tombstones and per-owner usage.

    Parameters
    ----------
    cfg : DaemonConfig
        The daemon config (tenants, public namespaces, state_dir).
    block_bytes : int
        Bytes per block (usage accounting).
    layout_fingerprint : bytes
        :meth:`KVLayout.fingerprint` of the daemon's layout, mixed into every scope.
    """

    def __init__(self, cfg: DaemonConfig, block_bytes: int, layout_fingerprint: bytes = b"") -> None:
        self.block_bytes = block_bytes
        self.layout_fingerprint = layout_fingerprint
        self._creds: list[tuple[bytes, str]] = [(d, t.name) for t in cfg.tenants for d in t.token_digests()]
        self.quota_bytes: dict[str, int] = {t.name: t.quota_bytes for t in cfg.tenants}
        self.public: dict[bytes, Any] = {}
        as_client = DigestCache(scope=layout_fingerprint)  # the clients' layout-scoped digest
        for p in cfg.public_namespaces:
            self.public[p.ns_digest()] = p
            self.public[as_client(p.ns_digest())] = p
            self.quota_bytes[f"public:{p.name}"] = p.quota_bytes
        self._key_scopes: dict[str, bytes] = {}
        self._key_cache: dict[str, dict[bytes, bytes]] = {}
        self._key_prefixes: dict[str, Any] = {}  # owner -> SHA-256 of _KEY_DOMAIN + key scope
        make_state_dir(cfg.state_dir)
        self._scopes_path = os.path.join(cfg.state_dir, "scopes.jsonl")
        self._tomb_path = os.path.join(cfg.state_dir, "invalidations.jsonl")
        #: state files whose last line is torn: the next append starts a new line first
        self._torn = {p for p in (self._scopes_path, self._tomb_path) if ends_mid_line(p)}
        self.scope_owner: dict[bytes, str] = {}
        self.tombstones: dict[bytes, int] = {}
        for rec in self._read_jsonl(self._scopes_path, SCOPE_FIELDS):
            # a scope recorded under another layout (or before layouts were
            # recorded) is unreachable now: its blocks are dropped at start
            if rec.get("layout") == layout_fingerprint.hex():
                self.scope_owner[bytes.fromhex(rec["scope"])] = rec["owner"]
        for rec in self._read_jsonl(self._tomb_path, TOMB_FIELDS):
            self.tombstones[bytes.fromhex(rec["scope"])] = int(rec["seq"])
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._keys: dict[bytes, set] = {}  # scope -> server keys put (pruned lazily)
        self._owner_scopes: dict[str, set] = {}  # owner -> scopes

    @staticmethod
    def _read_jsonl(path: str, fields: dict[str, type]) -> list[dict]:
        """The records of a state file.

        Raises
        ------
        ConfigError
            The file is not tierstore's (:func:`~tierstore.server.statefiles.foreign_state_file`).
        """
        records, skipped = read_state_records(path, fields)
        refusal = foreign_state_file(path, records, skipped)
        if refusal:
            raise ConfigError(f"state_dir: {refusal}")
        if skipped:
            log.warning(skipped_lines_said(path, skipped))
        return records

    def _append(self, path: str, rec: dict) -> None:
        with self._file_lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            line = json.dumps(rec) + "\n"
            if path in self._torn:  # a crash's torn tail: end it, so it does not swallow this record
                line = "\n" + line
                self._torn.discard(path)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- auth -------------------------------------------------------------
    def authenticate(self, header: str | None) -> str | None:
        """Tenant of an ``Authorization`` header, or ``None``. Constant time per credential."""
        token = bearer_token(header)
        return None if token is None else self.tenant_of_token(token)

    def tenant_of_token(self, token: str) -> str | None:
        """Tenant of a bearer token (the node socket's ``Hello``), or ``None``. Constant time per
        credential."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for d, name in self._creds:
            if hmac.compare_digest(d, digest):
                found = name
        return found

    # -- scopes -----------------------------------------------------------
    def resolve(self, tenant: str, client_ns: bytes, write: bool) -> tuple[bytes, str]:
        """``(scope digest, owner)`` of a client namespace for ``tenant``.

        Raises
        ------
        ApiError
            403 for a write to a public namespace the tenant may not write, or a
            read of one it may not read.
        """
        pub = self.public.get(client_ns)
        if pub is not None:
            if write and tenant not in pub.writers:
                raise ApiError(
                    403, "forbidden", f"public namespace {pub.name!r} is not writable by this tenant"
                )
            if not write and pub.readers != "*" and tenant not in pub.readers and tenant not in pub.writers:
                raise ApiError(
                    403, "forbidden", f"public namespace {pub.name!r} is not readable by this tenant"
                )
            owner = f"public:{pub.name}"
        else:
            owner = tenant
        scope = hashlib.sha256(
            _SCOPE_DOMAIN + b"\0" + owner.encode() + b"\0" + client_ns + self.layout_fingerprint
        ).digest()
        if write and scope not in self.scope_owner:  # reads of unknown scopes leave no state behind
            with self._lock:
                known = scope in self.scope_owner
                self.scope_owner[scope] = owner
            if not known:
                self._append(
                    self._scopes_path,
                    {"scope": scope.hex(), "owner": owner, "layout": self.layout_fingerprint.hex()},
                )
        return scope, owner

    def key_scope(self, owner: str) -> bytes:
        """The scope of ``owner``'s storage keys (every namespace of the owner shares it)."""
        ks = self._key_scopes.get(owner)
        if ks is None:
            ks = self._key_scopes[owner] = owner_key_scope(owner, self.layout_fingerprint)
        return ks

    def server_keys(self, owner: str, client_keys: Sequence[bytes]) -> list[bytes]:
        """Storage keys of ``owner``'s client keys.

        Memoised per owner (:data:`KEY_CACHE_ENTRIES` at most, then started over: about 200
        bytes an entry): a request's keys are mostly those of the previous ones (exists, lookup,
        then load of one prefix), and a SHA-256 costs ~0.7 us a key in Python. A miss is
        hashed from a copy of the owner's hasher with the domain and key scope absorbed
        (:func:`storage_key`'s digest; a new ``hashlib.sha256`` costs ~1 us more, measured
        35 -> 14 us for 32 keys on the 2-vCPU VM).
        """
        cache = self._key_cache.get(owner)
        if cache is None or len(cache) > KEY_CACHE_ENTRIES:
            cache = self._key_cache[owner] = {}  # a racing thread keeps filling the old one: harmless
        out: list = list(map(cache.get, client_keys))  # the hits in C; then the misses one by one
        if None in out:
            prefix = self._key_prefixes.get(owner)
            if prefix is None:  # the domain and the owner's key scope absorbed once
                prefix = self._key_prefixes[owner] = hashlib.sha256(_KEY_DOMAIN + self.key_scope(owner))
            copy = prefix.copy  # copy + update + digest: ~0.4 us a key here, a new hasher ~1.1 us
            for i, sk in enumerate(out):
                if sk is None:
                    k = client_keys[i]
                    h = copy()
                    h.update(k)
                    out[i] = cache[k] = h.digest()  # = storage_key(key_scope(owner), k)
        return out

    def scoped(
        self, tenant: str, client_ns: bytes, client_keys: Sequence[bytes], write: bool
    ) -> tuple[bytes, str, list[bytes]]:
        """``(scope, owner, storage keys)`` of a request of ``tenant`` (both transports).

        Raises
        ------
        ApiError
            As :meth:`resolve`.
        """
        scope, owner = self.resolve(tenant, client_ns, write)
        return scope, owner, self.server_keys(owner, client_keys)

    # -- usage / quota ----------------------------------------------------
    def adopt(self, store) -> None:
        """Rebuild usage from the store's index after a restart."""
        with self._lock:
            resident = store.namespaces()
            for scope, owner in self.scope_owner.items():
                d = store.digest(scope)
                if d not in resident:
                    continue
                self._keys.setdefault(scope, set()).update(store.keys_of_namespace(d))
                self._owner_scopes.setdefault(owner, set()).add(scope)

    def _used_blocks(self, owner: str) -> int:
        return sum(len(self._keys.get(s, ())) for s in self._owner_scopes.get(owner, ()))

    def _prune(self, owner: str, store) -> None:
        for s in self._owner_scopes.get(owner, ()):
            put = self._keys.get(s)
            if put:
                ks = list(put)
                self._keys[s] = {k for k, r in zip(ks, store.resident(ks)) if r}

    def reserve(self, owner: str, scope: bytes, keys: Sequence[bytes], store) -> list[bytes]:
        """Charge ``keys`` to ``owner``'s quota; returns the newly charged keys.

        Raises
        ------
        ApiError
            429 when the owner's quota would be exceeded (nothing is charged then).
        """
        quota = self.quota_bytes.get(owner, 1 << 62)
        with self._lock:
            have = self._keys.get(scope)
            if have is None:  # first charge of this scope here: what the store already holds in it
                # (recovered blocks of a scope this state_dir did not name at start) is the owner's
                have = self._keys[scope] = set(store.keys_of_namespace(store.digest(scope)))
                self._owner_scopes.setdefault(owner, set()).add(scope)
            new = [k for k in dict.fromkeys(keys) if k not in have]
            if (self._used_blocks(owner) + len(new)) * self.block_bytes > quota:
                self._prune(owner, store)
                have = self._keys[scope]
                new = [k for k in dict.fromkeys(keys) if k not in have]
                if (self._used_blocks(owner) + len(new)) * self.block_bytes > quota:
                    raise ApiError(
                        429,
                        "quota_exceeded",
                        f"storing {len(new)} new blocks would exceed the quota of {quota} bytes "
                        f"(in use: {self._used_blocks(owner) * self.block_bytes} bytes); "
                        "retry after invalidating or when blocks are evicted",
                    )
            have.update(new)
            self._owner_scopes.setdefault(owner, set()).add(scope)
            return new

    def unreserve(self, scope: bytes, keys: Sequence[bytes]) -> None:
        """Return the charge of keys that were not stored."""
        with self._lock:
            self._keys.get(scope, set()).difference_update(keys)

    def usage_bytes(self, store) -> dict[str, int]:
        """Bytes resident per owner (prunes evicted keys)."""
        with self._lock:
            out = {}
            for owner in set(self.quota_bytes) | set(self._owner_scopes):
                self._prune(owner, store)
                out[owner] = self._used_blocks(owner) * self.block_bytes
            return out

    def owner_usage_bytes(self, owner: str, store) -> int:
        """Bytes resident of one owner (prunes its evicted keys): :meth:`usage_bytes` of one."""
        with self._lock:
            self._prune(owner, store)
            return self._used_blocks(owner) * self.block_bytes

    def invalidated(self, scope: bytes) -> None:
        """Forget ``scope``'s usage (the store made the invalidation durable)."""
        with self._lock:
            self._keys.pop(scope, None)
