"""Parsing of sizes and durations, as fio does it.

Sizes take ``k``, ``m``, ``g``, ``t`` suffixes with base 1024 (fio's default,
``kb_base=1024``) and optional ``i``/``b``/``ib`` (``64GiB``, ``4k``, ``16MiB``).
Durations take ``ns``, ``us``, ``ms``, ``s``, ``m``, ``h``, ``d`` suffixes;
a bare number is seconds (fio's ``runtime=`` default unit).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping

from .errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|ms|s|m|h|d)?\s*$", re.IGNORECASE)
_TIME_MULT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: int | str, key: str = "size") -> int:
    """Parse a byte size such as ``4k``, ``16MiB`` or ``1g`` (base 1024).

    Parameters
    ----------
    value : int or str
        The size. An ``int`` is taken as bytes.
    key : str
        The config key, used in the error message.

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    ConfigError
        If the value is negative, not a number, or has an unknown suffix.
    """
    n = _parse_quantity(
        value,
        key,
        "size",
        ("4k, 16m or 1g", "4096, 4k, 16MiB or 1g (base 1024)"),
        int,
        _SIZE_RE,
        _SIZE_MULT,
        "",
    )
    if n != int(n):
        raise ConfigError(f"{key}={value!r}: not a whole number of bytes")
    return int(n)


def parse_time_s(value: int | float | str, key: str = "time") -> float:
    """Parse a duration such as ``30``, ``500ms``, ``2m`` into seconds.

    Raises
    ------
    ConfigError
        If the value is negative, not a number, or has an unknown suffix.
    """
    return float(
        _parse_quantity(
            value,
            key,
            "duration",
            ("30s or 500ms", "30, 30s, 500ms, 10us or 2m"),
            (int, float),
            _TIME_RE,
            _TIME_MULT_S,
            "s",
        )
    )


def _parse_quantity(
    value,
    key: str,
    what: str,
    examples: tuple[str, str],
    numbers,
    pattern: re.Pattern,
    units: Mapping[str, float],
    default_unit: str,
) -> int | float:
    """``value`` in the base unit: a number of type ``numbers`` as is, or a string that ``pattern``
    matches as a number and a unit of ``units`` (``default_unit`` when none is given).

    Raises
    ------
    ConfigError
        Naming ``key`` and ``examples``: a bool, a negative number, or a string ``pattern`` refuses.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a {what} such as {examples[0]}")
    if isinstance(value, numbers):
        if value < 0:
            raise ConfigError(f"{key}={value}: a {what} must be >= 0")
        return value
    m = pattern.match(str(value))
    if not m:
        raise ConfigError(f"{key}={value!r}: expected a {what} such as {examples[1]}")
    return float(m.group(1)) * units[(m.group(2) or default_unit).lower()]


#: The longest lease or wait tierstore takes (seconds; a day). A pin is "a lease that expires"
#: (README); ``float("inf")`` also overflowed a socket's ``time_t`` timeout (issue of the node client).
MAX_DURATION_S = 86400.0


def check_duration_s(value: float, key: str, max_s: float = MAX_DURATION_S) -> float:
    """``value`` as a float if it is a finite duration in ``(0, max_s]`` seconds.

    The one check of every lease and timeout a caller gives in seconds (``KVStore.pin``,
    ``KVStore.load(timeout_s=)``, the node and HTTP clients, the daemon's requests).

    Raises
    ------
    ConfigError
        Naming ``key``: not a number, a bool, NaN, infinite, <= 0 or past ``max_s``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{key}={value!r}: expected a number of seconds")
    v = float(value)
    if not (math.isfinite(v) and 0 < v <= max_s):
        raise ConfigError(f"{key}={value!r}: must be a finite number of seconds in (0, {max_s:g}]")
    return v


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.5GiB`` (fio prints MiB/GiB the same way)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}TiB"
