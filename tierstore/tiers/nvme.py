"""The simple NVMe tier backend: fixed-size slots in one file, written with O_DIRECT.

This is the core's plain path behind the :class:`~tierstore.tiers.storage.BlockStorage`
seam. The batched, log-structured, crash-recoverable engine of :mod:`tierstore.io`
(``SegmentStorage``) replaces it as the default; this one stays as a reference
and for small deployments.

On-disk slot layout (little-endian; all slots ``slot_bytes`` apart)::

    offset  size  field
    0       8     magic  b"TSSLOT01"
    8       4     format version (1)
    12      4     payload length in bytes (== block_bytes)
    16      32    block key (chained SHA-256, see tierstore.identity)
    48      32    namespace digest
    80      4     CRC32C of the payload (Castagnoli, RFC 3720 Appendix B.4; ``crc32c`` package)
    84      44    zero
    128     n     payload
    ...           zero padding up to slot_bytes

``slot_bytes = align_up(128 + block_bytes, 4096)``.

**O_DIRECT alignment** (Linux open(2), "O_DIRECT"): file offset, transfer length
and user buffer address must be multiples of the logical block size. Offsets
and lengths are multiples of 4096 by construction, and transfers go through an
``mmap``-backed, page-aligned staging buffer. If the file system refuses
O_DIRECT, construction fails loudly: there is no silent buffered fallback.

Reads verify magic, version, length, key and CRC32C; a mismatch is reported as
``Status.IO_ERROR`` for that block only, never as loaded data. The index lives
in memory: after a restart this backend starts empty (use ``SegmentStorage``
for restart recovery).
"""
from __future__ import annotations

import errno
import heapq
import mmap
import os
import struct
import threading
from typing import Iterable, Sequence

import crc32c
import numpy as np
import torch

from ..errors import ConfigError, Status
from .storage import BlockStorage

ALIGN_BYTES = 4096
HEADER_BYTES = 128
_MAGIC = b"TSSLOT01"
_HDR = struct.Struct("<8sII32s32sI")  # 84 bytes, padded to HEADER_BYTES


def align_up(n: int, a: int = ALIGN_BYTES) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return (n + a - 1) // a * a


class SlotFileStorage(BlockStorage):
    """Fixed-slot O_DIRECT file storage.

    Parameters
    ----------
    path : str
        File to create (or reuse; it is truncated to size).
    capacity_bytes : int
        File size budget; ``capacity_bytes // slot_bytes`` slots.
    block_bytes : int
        Bytes per block.
    direct : bool
        Open with ``O_DIRECT`` (default). ``False`` is for file systems without it
        (tmpfs) and must be asked for explicitly.

    Raises
    ------
    ConfigError
        If the file cannot be opened with O_DIRECT when ``direct`` is true.
    """

    def __init__(self, path: str, capacity_bytes: int, block_bytes: int, direct: bool = True) -> None:
        self.block_bytes = block_bytes
        self.slot_bytes = align_up(HEADER_BYTES + block_bytes)
        self.num_slots = capacity_bytes // self.slot_bytes
        self.path = path
        flags = os.O_RDWR | os.O_CREAT
        if direct:
            flags |= os.O_DIRECT
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL and direct:
                raise ConfigError(f"nvme path={path!r}: the file system refuses O_DIRECT; "
                                  "use a file on ext4/xfs or pass direct=False explicitly") from e
            raise
        os.ftruncate(self._fd, self.num_slots * self.slot_bytes)
        self._free = list(range(self.num_slots))
        self._index: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._stage = mmap.mmap(-1, self.slot_bytes)  # page-aligned
        self._stage_np = np.frombuffer(self._stage, dtype=np.uint8)
        self.bytes_written = 0
        self.bytes_read = 0
        self.io_errors = 0

    def capacity_blocks(self) -> int:
        return self.num_slots

    def free_blocks(self) -> int:
        return len(self._free)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        return list(self._index)

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            placements: Sequence[int | None] | None = None,
            ns_digests: Sequence[bytes] | None = None) -> list[Status]:
        out: list[Status] = []
        with self._lock:
            for i, (key, blk) in enumerate(zip(keys, blocks)):
                if key in self._index:
                    out.append(Status.EXISTS)
                    continue
                if not self._free:
                    out.append(Status.NO_SPACE)
                    continue
                src = blk.detach().reshape(-1)
                if src.dtype != torch.uint8 or src.numel() != self.block_bytes:
                    raise ConfigError(f"block {i}: expected {self.block_bytes} uint8 bytes, "
                                      f"got {src.numel()} {src.dtype}")
                src_np = src.cpu().numpy()
                payload = self._stage_np[HEADER_BYTES:HEADER_BYTES + self.block_bytes]
                payload[:] = src_np
                ns = ns_digests[i] if ns_digests is not None else bytes(32)
                hdr = _HDR.pack(_MAGIC, 1, self.block_bytes, key, ns, crc32c.crc32c(payload))
                self._stage[:HEADER_BYTES] = hdr.ljust(HEADER_BYTES, b"\0")
                self._stage_np[HEADER_BYTES + self.block_bytes:] = 0
                slot = heapq.heappop(self._free)
                try:
                    n = os.pwritev(self._fd, [self._stage], slot * self.slot_bytes)
                except OSError as e:
                    heapq.heappush(self._free, slot)
                    out.append(Status.NO_SPACE if e.errno in (errno.ENOSPC, errno.EFBIG) else Status.IO_ERROR)
                    continue
                if n != self.slot_bytes:
                    heapq.heappush(self._free, slot)
                    out.append(Status.IO_ERROR)
                    continue
                self._index[key] = slot
                self.bytes_written += n
                out.append(Status.OK)
        return out

    def get(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        out: list[Status] = []
        with self._lock:
            for key, dst in zip(keys, dests):
                slot = self._index.get(key)
                if slot is None:
                    out.append(Status.MISS)
                    continue
                try:
                    n = os.preadv(self._fd, [self._stage], slot * self.slot_bytes)
                except OSError:
                    n = -1
                if n != self.slot_bytes or not self._valid(key):
                    self.io_errors += 1
                    out.append(Status.IO_ERROR)
                    continue
                payload = torch.from_numpy(self._stage_np[HEADER_BYTES:HEADER_BYTES + self.block_bytes])
                dst.reshape(-1).copy_(payload)
                self.bytes_read += n
                out.append(Status.OK)
        return out

    def _valid(self, key: bytes) -> bool:
        magic, ver, length, k, _ns, crc = _HDR.unpack_from(self._stage, 0)
        if magic != _MAGIC or ver != 1 or length != self.block_bytes or k != key:
            return False
        return crc32c.crc32c(self._stage_np[HEADER_BYTES:HEADER_BYTES + length]) == crc

    def delete(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                slot = self._index.pop(key, None)
                if slot is not None:
                    heapq.heappush(self._free, slot)

    def stats(self) -> dict:
        return {"bytes_written": self.bytes_written, "bytes_read": self.bytes_read,
                "io_errors": self.io_errors, "slot_bytes": self.slot_bytes}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            del self._stage_np  # drop the exported view before unmapping
            self._stage.close()
