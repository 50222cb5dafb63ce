"""``open_engine``: one entry point for every :class:`IOEngine` backend.

``kind="auto"`` takes io_uring where this process can use it
(:func:`tierstore.io.ring.uring_available`) and posix otherwise, saying why in
one ``logging.warning`` line (once per process and reason); an explicit
``kind="uring"`` where io_uring is unavailable raises instead.
"""

from __future__ import annotations

import logging

from ..errors import ConfigError
from ..units import parse_size
from .engine import DEFAULT_BLOCK_SIZE_BYTES, DEFAULT_MAX_IO_BYTES, IOEngine

ENGINE_KINDS = ("posix", "uring", "auto", "memory", "kvikio")

_log = logging.getLogger("tierstore.io")
_fallbacks_logged: set[str] = set()


def _warn_fallback(reason: str) -> None:
    if reason not in _fallbacks_logged:
        _fallbacks_logged.add(reason)
        _log.warning("ioengine=auto: io_uring unavailable (%s); using posix", reason)


def open_engine(
    kind: str,
    path: str | None,
    size_bytes: int | str,
    *,
    iodepth: int = 16,
    max_io_bytes: int | str = DEFAULT_MAX_IO_BYTES,
    block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES,
) -> IOEngine:
    """Open a device.

    Parameters
    ----------
    kind : {"posix", "uring", "auto", "memory", "kvikio"}
        Backend; ``"auto"`` is uring where available, else posix (one warning line).
    path : str or None
        File or block device (ignored for ``"memory"``).
    size_bytes : int or str
        Device size (``"1g"`` accepted), multiple of ``block_size_bytes``.
    iodepth : int
        I/Os in flight (posix threads, io_uring SQEs).
    max_io_bytes : int or str
        Largest single I/O; larger requests are split.
    block_size_bytes : int
        O_DIRECT alignment unit.

    Raises
    ------
    ConfigError
        Unknown ``kind`` or bad sizes.
    tierstore.io.ring.IoUringUnavailable
        ``kind="uring"`` where io_uring cannot be used (the message says why).
    tierstore.io.kvikio.KvikioUnavailable
        ``kind="kvikio"`` without kvikio/CUDA.
    OSError
        The device cannot be opened with O_DIRECT.
    """
    size = parse_size(size_bytes, "size_bytes")
    mio = parse_size(max_io_bytes, "max_io_bytes")
    if kind == "memory":
        from .memory import MemoryEngine

        return MemoryEngine(size, block_size_bytes)
    if path is None:
        raise ConfigError(f"engine={kind!r} needs a path")
    if kind == "posix":
        from .posix import PosixEngine

        return PosixEngine(path, size, iodepth=iodepth, max_io_bytes=mio, block_size_bytes=block_size_bytes)
    if kind in ("uring", "auto"):
        from .ring import IoUringError, uring_available
        from .uring import UringEngine

        ok, why = uring_available()
        if ok or kind == "uring":
            try:
                return UringEngine(
                    path, size, iodepth=iodepth, max_io_bytes=mio, block_size_bytes=block_size_bytes
                )
            except IoUringError as exc:  # the ring itself (the file is closed again)
                if kind == "uring":
                    raise
                why = exc.strerror or str(exc)
        _warn_fallback(why)
        from .posix import PosixEngine

        return PosixEngine(path, size, iodepth=iodepth, max_io_bytes=mio, block_size_bytes=block_size_bytes)
    if kind == "kvikio":
        from .kvikio import KvikioEngine

        return KvikioEngine(path, size, block_size_bytes=block_size_bytes)
    raise ConfigError(f"engine={kind!r}: accepted values are {list(ENGINE_KINDS)}")
