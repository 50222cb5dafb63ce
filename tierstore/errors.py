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


class QuotaExceeded(TierStoreError):
    """A pin or store would exceed a namespace's byte quota."""


class AlignmentError(TierStoreError, ValueError):
    """An O_DIRECT offset, length or buffer address is not aligned."""


class CorruptData(TierStoreError):
    """Stored bytes failed validation (magic, version, checksum, length)."""


class TraceFormatError(TierStoreError, ValueError):
    """A request trace line is malformed. The message names the line number."""
