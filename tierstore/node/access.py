"""The daemon's tenancy on the node socket: :class:`NodeAccess`.

:class:`~tierstore.node.server.NodeServer` admits a peer by its credentials (``SO_PEERCRED``
against ``node.allow_uids`` / ``node.allow_gids``) and then asks this object to bind the session
to a tenant (the ``Hello``'s bearer token, checked against the ``tenants`` credentials as HTTP
checks an ``Authorization`` header, or ``node.tenant`` for a session without a token) and to
scope every request: namespaces and keys are mapped by the same
:meth:`~tierstore.server.tenancy.Tenancy.scoped` as the HTTP transport's, so one tenant's blocks
are one set of storage keys over either transport and another tenant never reaches them. The
tenant's byte quota (``tenants[].quota_bytes``, public namespaces' ``quota_bytes``) is charged
on the same :class:`~tierstore.server.tenancy.Tenancy` object, leases are bounded by
``limits.max_lease_s``; the store's pin quota (``limits.pin_quota_bytes``) and default lease are
the store's own, so they hold for both transports already. Refusals are
:class:`~tierstore.node.protocol.ProtocolError` values with the wire's error codes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..errors import ConfigError, Status
from ..server.config import NO_QUOTA_BYTES, DaemonConfig
from ..server.http import ApiError
from ..server.tenancy import Tenancy
from ..units import check_duration_s
from . import protocol as P

__all__ = ["NodeAccess", "Scoped"]

_ZERO_NS = bytes(P.NS_BYTES)
_KEPT = (Status.OK, Status.EXISTS)
_CODE_OF_STATUS = {401: P.ErrorCode.AUTH, 403: P.ErrorCode.FORBIDDEN, 429: P.ErrorCode.QUOTA}


@dataclasses.dataclass(frozen=True)
class Scoped:
    """A request's keys and namespace, scoped to its session's tenant.

    Attributes
    ----------
    ns : bytes or None
        The store's namespace digest (``store.digest(scope)``, as HTTP's calls digest it);
        ``None`` for a key-level read sent without a namespace.
    keys : list of bytes
        Storage keys, 32 bytes each, in the request's order.
    scope : bytes or None
        The tenancy scope (usage, invalidation), ``None`` with ``ns``.
    owner : str
        The tenant, or ``public:<name>`` for a declared public namespace.
    """

    ns: bytes | None
    keys: list[bytes]
    scope: bytes | None
    owner: str


def _refusal(e: ApiError) -> P.ProtocolError:
    return P.ProtocolError(_CODE_OF_STATUS.get(e.status, P.ErrorCode.BAD_REQUEST), e.message)


class NodeAccess:
    """Tenant binding, scoping, quotas and lease bounds of node sessions (module docstring).

    Parameters
    ----------
    cfg : DaemonConfig
        The daemon config (``node``, ``tenants``, ``limits``); ``cfg.node`` must be set.
    tenancy : Tenancy
        The daemon's tenancy, shared with the HTTP transport (one usage book).
    store : KVStore
        The pool's store (its ``digest`` of a scope is the namespace HTTP's calls use).
    """

    def __init__(self, cfg: DaemonConfig, tenancy: Tenancy, store) -> None:
        assert cfg.node is not None
        self.tenancy = tenancy
        self.store = store
        self.default_tenant = cfg.node.tenant
        self.max_lease_s = cfg.limits.max_lease_s
        self._tenants = {t.name for t in cfg.tenants}
        self._publics: dict[str, list[str]] = {}  # tenant -> public owners it may read

    def bind(self, token: str) -> str:
        """The tenant of a session whose ``Hello`` carried ``token`` ("" for none).

        Raises
        ------
        ProtocolError
            ``AUTH`` for a token no tenant has, or no token where ``node.tenant`` is unset.
        """
        if token:
            tenant = self.tenancy.tenant_of_token(token)
            if tenant is None:
                raise P.ProtocolError(P.ErrorCode.AUTH, "invalid token (no tenant has it)")
            return tenant
        if self.default_tenant is None:
            raise P.ProtocolError(
                P.ErrorCode.AUTH,
                "this service needs a tenant's token (NodeKVStore(token=...) or TIERSTORE_TOKEN), "
                "or node.tenant in its config for sessions without one",
            )
        return self.default_tenant

    def scoped(self, tenant: str, ns: bytes, keys: Sequence[bytes], write: bool) -> Scoped:
        """``keys`` and ``ns`` of a request of ``tenant``; a read with the all-zero namespace (a
        key-level call without one) finds the tenant's own keys and those of the public namespaces
        it may read (:meth:`_key_level`), never another tenant's.

        Raises
        ------
        ProtocolError
            ``FORBIDDEN`` for a public namespace the tenant may not read or write.
        """
        if ns == _ZERO_NS and not write:
            return Scoped(None, self._key_level(tenant, keys), None, tenant)
        try:
            scope, owner, skeys = self.tenancy.scoped(tenant, ns, keys, write)
        except ApiError as e:
            raise _refusal(e) from None
        return Scoped(self.store.digest(scope), skeys, scope, owner)

    def _readable_publics(self, tenant: str) -> list[str]:
        """Owners (``public:<name>``) of the public namespaces ``tenant`` may read."""
        owners = self._publics.get(tenant)
        if owners is None:
            pubs = {p.name: p for p in self.tenancy.public.values()}  # two digests per namespace
            owners = self._publics[tenant] = [
                f"public:{name}"
                for name, p in sorted(pubs.items())
                if p.readers == "*" or tenant in p.readers or tenant in p.writers
            ]
        return owners

    def _key_level(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        """Storage keys of a read that names no namespace: the tenant's own key, or, where that is
        not resident, the key of the first public namespace the tenant may read that holds it
        (what an embedded store finds under the same key). Another tenant's keys are never tried."""
        own = self.tenancy.server_keys(tenant, keys)
        publics = self._readable_publics(tenant)
        if not publics or not own:
            return own
        out = list(own)
        todo = [i for i, r in enumerate(self.store.resident(own)) if not r]
        for owner in publics:
            if not todo:
                break
            cand = self.tenancy.server_keys(owner, [keys[i] for i in todo])
            held = self.store.resident(cand)
            for i, k, r in zip(todo, cand, held):
                if r:
                    out[i] = k
            todo = [i for i, r in zip(todo, held) if not r]
        return out

    def sees_whole_store(self, tenant: str) -> bool:
        """Whether ``tenant``'s statistics may be the whole store's: it is the only tenant (every
        block is its own or of a public namespace only it can write)."""
        return self._tenants <= {tenant}

    def quota_bytes(self, tenant: str) -> int | None:
        """``tenant``'s byte quota, or ``None`` when it has none (the config's "no quota" value,
        :data:`~tierstore.server.config.NO_QUOTA_BYTES`, is no figure to show; ``+Inf`` in
        ``/metrics``)."""
        q = self.tenancy.quota_bytes.get(tenant)
        return None if q is None or q >= NO_QUOTA_BYTES else q

    def tenant_stats(self, tenant: str, core) -> dict:
        """A ``Stats`` reply's body for ``tenant`` on a daemon of several tenants: its own
        resident bytes and quota (:meth:`Tenancy.owner_usage_bytes`; :meth:`quota_bytes`, ``None``
        for none) and the pool ``core``'s
        fixed geometry; no figure that another tenant's activity moves."""
        h = core.segment.header
        return {
            "tenant": {
                "name": tenant,
                "usage_bytes": self.tenancy.owner_usage_bytes(tenant, self.store),
                "quota_bytes": self.quota_bytes(tenant),
            },
            "pool": {
                "name": core.name,
                "block_bytes": core.layout.bytes_per_block,
                "host_slots": h.host_slots,
                "staging_slots": h.staging_slots,
            },
        }

    def namespace(self, tenant: str, ns: bytes, write: bool) -> tuple[bytes, bytes]:
        """``(store namespace digest, scope)`` of ``ns`` for ``tenant`` (pin, invalidate).

        Raises
        ------
        ProtocolError
            As :meth:`scoped`.
        """
        try:
            scope, _ = self.tenancy.resolve(tenant, ns, write)
        except ApiError as e:
            raise _refusal(e) from None
        return self.store.digest(scope), scope

    def reserve(self, owner: str, scope: bytes | None, keys: Sequence[bytes]) -> list[bytes]:
        """Charge the storage ``keys`` of a store in ``scope`` to ``owner``'s quota; the keys
        newly charged.

        Raises
        ------
        ProtocolError
            ``QUOTA`` when the owner's byte quota would be exceeded (nothing charged).
        """
        assert scope is not None
        try:
            return self.tenancy.reserve(owner, scope, keys, self.store)
        except ApiError as e:
            raise _refusal(e) from None

    def settle(self, scope: bytes, charged: Sequence[bytes], keys: Sequence[bytes], statuses) -> list[bytes]:
        """Return the charge of the ``charged`` keys whose status is not kept (OK or EXISTS);
        the charged keys still held."""
        statuses = statuses if isinstance(statuses, list) else list(statuses)
        if statuses.count(Status.OK) + statuses.count(Status.EXISTS) == len(statuses):  # all kept: no sets
            return list(charged)
        dropped = {k for k, st in zip(keys, statuses) if st not in _KEPT}
        back = [k for k in charged if k in dropped]
        if back:
            self.tenancy.unreserve(scope, back)
        return [k for k in charged if k not in dropped]

    def unreserve(self, scope: bytes, keys: Sequence[bytes]) -> None:
        """Return the charge of keys that were not stored (a ticket aborted)."""
        if keys:
            self.tenancy.unreserve(scope, keys)

    def invalidated(self, scope: bytes) -> None:
        """Forget ``scope``'s usage after the store dropped its blocks."""
        self.tenancy.invalidated(scope)

    def lease_s(self, lease_s: float | None) -> float | None:
        """A pin's lease, bounded as HTTP bounds it (``limits.max_lease_s``).

        Raises
        ------
        ProtocolError
            ``BAD_REQUEST`` for a lease that is not finite, of 0 or past ``max_lease_s``
            (:func:`~tierstore.units.check_duration_s`).
        """
        if lease_s is None:
            return None
        try:
            return check_duration_s(lease_s, "lease_s", self.max_lease_s)
        except ConfigError as e:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, str(e)) from None
