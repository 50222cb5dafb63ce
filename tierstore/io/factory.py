"""``open_engine``: one entry point for every :class:`IOEngine` backend."""
from __future__ import annotations

from .engine import DEFAULT_BLOCK_SIZE_BYTES, DEFAULT_MAX_IO_BYTES, IOEngine
from ..errors import ConfigError
from ..units import parse_size

ENGINE_KINDS = ("posix", "uring", "memory", "kvikio")


def open_engine(kind: str, path: str | None, size_bytes: int | str, *, iodepth: int = 16,
                max_io_bytes: int | str = DEFAULT_MAX_IO_BYTES,
                block_size_bytes: int = DEFAULT_BLOCK_SIZE_BYTES) -> IOEngine:
    """Open a device.

    Parameters
    ----------
    kind : {"posix", "uring", "memory", "kvikio"}
        Backend.
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
    if kind == "uring":
        from .uring import UringEngine
        return UringEngine(path, size, iodepth=iodepth, max_io_bytes=mio, block_size_bytes=block_size_bytes)
    if kind == "kvikio":
        from .kvikio import KvikioEngine
        return KvikioEngine(path, size, block_size_bytes=block_size_bytes)
    raise ConfigError(f"engine={kind!r}: accepted values are {list(ENGINE_KINDS)}")
