"""KV-cache geometry: how many bytes a token and a block take, and how an
engine fragments one block into per-layer K/V pieces.

A *block* holds the K and V of ``tokens_per_block`` consecutive tokens for every
layer. tierstore stores a block contiguously, layer-major::

    block[layer, kv, token, kv_head, head_dim]      # kv: 0 = K, 1 = V

which is the per-block slice of vLLM's paged layout
``[2, num_blocks, block_size, num_kv_heads, head_size]`` taken for each layer
(vllm/attention/backends/flash_attn.py ``get_kv_cache_shape``). An engine's KV
for one block is therefore ``2 * num_layers`` separate *fragments* of
``tokens_per_block * num_kv_heads * head_dim * itemsize`` bytes each: in vLLM
one per layer per K/V, in HF transformers one ``(batch, kv_heads, seq, head_dim)``
slice of each layer's ``keys``/``values``.

Bytes per token = ``2 * num_layers * num_kv_heads * head_dim * itemsize``.
For Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16; the model's
config.json) this is 131072 B = 128 KiB per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .errors import ConfigError, LayoutError

#: Block byte orders -> ``num_layers -> (outer, inner)`` fragment grid (see ``KVLayout.block_order``).
BLOCK_ORDERS = {"layer_kv": lambda n: (n, 2), "layer_fused": lambda n: (n, 1), "kv_layer": lambda n: (1, 2)}

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Map ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"``, ... to a ``torch.dtype``.

    Raises
    ------
    ConfigError
        For an unknown name; the message lists the accepted ones.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"dtype={name!r}: accepted values are {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical short name of a dtype (used in namespace digests and headers)."""
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV cache.

    Parameters
    ----------
    num_layers : int
        Transformer layers (each contributes one K and one V fragment per block).
    num_kv_heads : int
        KV heads per layer *on this rank* (after tensor-parallel sharding; GQA aware).
    head_dim : int
        Elements per head.
    dtype : torch.dtype
        Element type of the stored KV (bf16, fp16, fp32, fp8).
    tokens_per_block : int
        Tokens in one block (vLLM's ``block_size``, 16 by default there).
    name : str
        Preset name, informational.
    block_order : {"layer_kv", "layer_fused", "kv_layer"}
        The order of a block's bytes, which is the order of its fragments in
        the engine's memory:

        * ``"layer_kv"`` (default): ``2 * num_layers`` fragments, layer 0 K,
          layer 0 V, layer 1 K, ... (vLLM GPU backends, HF transformers,
          SGLang ``layer_first``); each ``(tokens, kv_heads, head_dim)``.
        * ``"layer_fused"``: ``num_layers`` fragments with K and V fused as the
          engine keeps them (vLLM's CPU backend: ``(kv_heads, tokens, 2 * head_dim)``).
        * ``"kv_layer"``: 2 fragments, all of K then all of V, each covering
          every layer (SGLang host pool ``page_first``/``page_first_direct``).

        Blocks of different orders have different bytes for the same KV, so
        the order is part of :meth:`fingerprint` and never matches across.

    Raises
    ------
    ConfigError
        If any dimension is not a positive integer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    tokens_per_block: int = 16
    name: str = "custom"
    block_order: str = "layer_kv"

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"KVLayout.{f}={v!r}: must be a positive integer")
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        if self.block_order not in BLOCK_ORDERS:
            raise ConfigError(
                f"KVLayout.block_order={self.block_order!r}: accepted values are {sorted(BLOCK_ORDERS)}"
            )

    def fingerprint(self) -> bytes:
        """32-byte SHA-256 of the geometry and dtype (``num_layers``,
        ``num_kv_heads``, ``head_dim``, dtype, ``tokens_per_block``; not ``name``).

        Stores mix it into every namespace digest (:class:`tierstore.api.KVStore`,
        the daemon's scopes), so KV stored under one layout is never served to
        a store opened with another, even when the namespace's own ``kv_dtype``
        field was left at its default.
        """
        import hashlib
        import json

        fields = [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype_name(self.dtype),
            self.tokens_per_block,
        ]
        if (
            self.block_order != "layer_kv"
        ):  # the default keeps the fingerprints of stores written before it existed
            fields.append(self.block_order)
        desc = json.dumps(fields, separators=(",", ":"))
        return hashlib.sha256(b"tierstore/kv-layout/v1\0" + desc.encode()).digest()

    # --- sizes ---------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """``2 * num_layers * num_kv_heads * head_dim * itemsize`` bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """``bytes_per_token * tokens_per_block`` bytes."""
        return self.bytes_per_token * self.tokens_per_block

    @property
    def fragment_grid(self) -> tuple[int, int]:
        """``(outer, inner)`` fragment counts of a block in :attr:`block_order`:
        ``(num_layers, 2)``, ``(num_layers, 1)`` or ``(1, 2)``."""
        return BLOCK_ORDERS[self.block_order](self.num_layers)

    @property
    def num_fragments(self) -> int:
        """Fragments an engine keeps per block: ``2 * num_layers`` (K and V per
        layer), ``num_layers`` (fused) or 2 (``kv_layer``)."""
        a, b = self.fragment_grid
        return a * b

    @property
    def fragment_shape(self) -> tuple[int, int, int]:
        """Shape of one fragment: ``(tokens_per_block, num_kv_heads, head_dim)``."""
        return (self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def fragment_bytes(self) -> int:
        """Bytes of one fragment: ``bytes_per_block / num_fragments``
        (``tokens_per_block * num_kv_heads * head_dim * itemsize`` in the default order)."""
        return self.bytes_per_block // self.num_fragments

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one contiguous block: ``(num_layers, 2, tokens_per_block, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    # --- views ----------------------------------------------------------------
    def block_view(self, raw: torch.Tensor) -> torch.Tensor:
        """View a raw ``uint8`` buffer of ``bytes_per_block`` bytes as a typed block.

        Parameters
        ----------
        raw : torch.Tensor
            1-D contiguous ``uint8`` tensor of exactly ``bytes_per_block`` bytes.

        Returns
        -------
        torch.Tensor
            Shape :attr:`block_shape`, dtype :attr:`dtype`, sharing storage with ``raw``.

        Raises
        ------
        LayoutError
            If ``raw`` has the wrong dtype, size or is not contiguous.
        """
        if raw.dtype != torch.uint8 or raw.numel() != self.bytes_per_block or not raw.is_contiguous():
            raise LayoutError(
                f"expected a contiguous uint8 tensor of {self.bytes_per_block} bytes, "
                f"got dtype={raw.dtype} numel={raw.numel()} contiguous={raw.is_contiguous()}"
            )
        return raw.view(self.dtype).view(self.block_shape)

    def as_bytes(self, block: torch.Tensor) -> torch.Tensor:
        """Flatten a typed block (shape :attr:`block_shape`, dtype :attr:`dtype`) to ``uint8``.

        Raises
        ------
        LayoutError
            On a shape or dtype mismatch.
        """
        if block.dtype == torch.uint8 and block.numel() == self.bytes_per_block:
            return block.reshape(-1)
        if block.dtype != self.dtype or tuple(block.shape) != self.block_shape:
            raise LayoutError(
                f"expected a block of shape {self.block_shape} and dtype {self.dtype}, "
                f"got {tuple(block.shape)} {block.dtype}"
            )
        return block.contiguous().view(torch.uint8).reshape(-1)

    def fragments(self, block: torch.Tensor) -> list[torch.Tensor]:
        """Split a typed block into its ``2 * num_layers`` fragment views, in
        (layer 0 K, layer 0 V, layer 1 K, ...) order. Views share storage."""
        if tuple(block.shape) != self.block_shape:
            raise LayoutError(f"expected block shape {self.block_shape}, got {tuple(block.shape)}")
        return [block[layer, kv] for layer in range(self.num_layers) for kv in (0, 1)]

    def check_fragments(self, frags: Sequence[torch.Tensor]) -> None:
        """Check a fragment list (``2 * num_layers`` tensors of :attr:`fragment_bytes`
        each, of the layout's dtype or ``uint8`` raw bytes).

        Raises
        ------
        LayoutError
            On a wrong count, type, dtype or size.
        """
        if len(frags) != self.num_fragments:
            raise LayoutError(f"expected {self.num_fragments} fragments, got {len(frags)}")
        for i, f in enumerate(frags):
            if not isinstance(f, torch.Tensor):
                raise LayoutError(f"fragment {i}: expected a torch.Tensor, got {type(f).__name__}")
            if f.dtype != self.dtype and f.dtype != torch.uint8:
                raise LayoutError(
                    f"fragment {i}: dtype {f.dtype}; the layout's is {self.dtype} (or uint8 for raw bytes)"
                )
            if f.numel() * f.element_size() != self.fragment_bytes:
                raise LayoutError(
                    f"fragment {i}: expected {self.fragment_bytes} bytes, got {f.numel() * f.element_size()}"
                )

    def with_tokens_per_block(self, tokens_per_block: int) -> KVLayout:
        """Same model, other block size."""
        return dataclasses.replace(self, tokens_per_block=tokens_per_block)

    def to_dict(self) -> dict:
        """JSON-serialisable description."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
            "tokens_per_block": self.tokens_per_block,
            "block_order": self.block_order,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
        }


#: Presets. Sources: each model's Hugging Face ``config.json``.
PRESETS: dict[str, KVLayout] = {
    # meta-llama/Llama-3.1-8B: 32 layers, 8 KV heads (GQA), head_dim 128 -> 128 KiB/token in bf16.
    "llama-3.1-8b": KVLayout(32, 8, 128, torch.bfloat16, 16, "llama-3.1-8b"),
    # Qwen/Qwen2.5-7B-Instruct: 28 layers, 4 KV heads (GQA 7:1), head_dim 128 -> 56 KiB/token in bf16.
    "qwen2.5-7b": KVLayout(28, 4, 128, torch.bfloat16, 16, "qwen2.5-7b"),
    # Tiny test model (matches tests' randomly initialised LlamaConfig): 2 layers, 2 KV heads, dim 16, fp32.
    "tiny": KVLayout(2, 2, 16, torch.float32, 16, "tiny"),
}


def get_layout(name: str) -> KVLayout:
    """Look up a preset by name.

    Raises
    ------
    ConfigError
        For an unknown name; the message lists the presets.
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"layout={name!r}: accepted values are {sorted(PRESETS)}") from None
