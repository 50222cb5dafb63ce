"""Typed errors and status values shared by every layer.

Expected outcomes (a miss, a rejected store, no space) are *values* of
:class:`Status`, modelled on CacheLib Navy's ``Status``. Broken invariants and
bad input raise the typed exceptions below; nothing relies on ``assert``.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Outcome of a per-block operation.

    Values
    ------
    OK        the operation took effect.
    EXISTS    a store of a key already stored or in flight (idempotent, not an error).
    MISS      the key is not resident in any tier (or was unreadable: a miss beats wrong KV).
    NO_SPACE  no tier could take the block; the caller recomputes.
    REJECTED  refused by quota, admission or a bad request.
    IO_ERROR  a transfer failed (EIO, short read, checksum); the block counts as a miss.
    """

    OK = "ok"
    EXISTS = "exists"
    MISS = "miss"
    NO_SPACE = "no_space"
    REJECTED = "rejected"
    IO_ERROR = "io_error"


class TierStoreError(Exception):
    """Base class of every error tierstore raises."""


class ConfigError(TierStoreError, ValueError):
    """A configuration key or value is invalid. The message names the key, the
    value and what is accepted."""


class LayoutError(TierStoreError, ValueError):
    """A buffer does not match the KV layout (shape, dtype, size or alignment)."""


class InvariantError(TierStoreError, RuntimeError):
    """An internal invariant broke (negative refcount, double free, ...)."""


class StoreClosedError(TierStoreError):
    """A call on a store that was closed (:meth:`tierstore.api.KVStore.close`,
    ``RemoteKVStore.close``, an engine connector's shutdown). Nothing of the
    call took effect: a closed store acknowledges no store and serves no load."""


class StoreLockedError(TierStoreError):
    """The NVMe tier's file or device is open in another store (another
    process, or another store of this one). The message names the path and,
    where the kernel says it, the holder's PID. Nothing was written."""


class ForeignDataError(ConfigError):
    """The NVMe tier's path holds data tierstore did not write (a non-empty
    file or a device without tierstore's label), or a device tierstore may
    format only when told to (``format: true``). The message names the path
    and what was found. Nothing was written."""


class QuotaExceeded(TierStoreError):
    """A pin or store would exceed a namespace's byte quota."""


class AlignmentError(TierStoreError, ValueError):
    """An O_DIRECT offset, length or buffer address is not aligned."""


class CorruptData(TierStoreError):
    """Stored bytes failed validation (magic, version, checksum, length)."""


class TraceFormatError(TierStoreError, ValueError):
    """A request trace line is malformed. The message names the line number."""
