"""Wire format of the KV-block service (shared by the daemon and :mod:`tierstore.client`).

Binary bodies (``application/x-tierstore-blocks``) are a small JSON manifest
followed by raw block bytes, never JSON-encoded tensors::

    u32 little-endian  manifest_bytes
    manifest_bytes     UTF-8 JSON object (the manifest)
    payload            the blocks' raw bytes, concatenated, block_bytes each

* ``PUT /v1/blocks`` request manifest: ``{"namespace": hex64, "keys": [hex64, ...],
  "first_position": int, "lifetime": str|null}``; the payload holds
  ``len(keys) * block_bytes`` bytes in key order.
* ``POST /v1/blocks/get`` response manifest: ``{"statuses": [str, ...],
  "block_bytes": int}``; the payload holds the blocks whose status is ``"ok"``,
  in key order.

Every other request and response body is JSON (see ``openapi.yaml``).
"""

from __future__ import annotations

import json
import struct

BLOCKS_CONTENT_TYPE = "application/x-tierstore-blocks"
PREFIX = struct.Struct("<I")
API_PREFIX = "/v1"


def encode_prefix(manifest: dict) -> bytes:
    """``u32 length || JSON manifest`` (the part of a body before the payload)."""
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    return PREFIX.pack(len(raw)) + raw


def keys_to_hex(keys) -> list[str]:
    """32-byte keys as lower-case hex strings."""
    return [bytes(k).hex() for k in keys]
