"""Prefix caching for Hugging Face transformers causal LMs through tierstore.

:class:`HFPrefixCache` wraps a decoder-only ``PreTrainedModel`` (Llama, Qwen2,
Mistral, ... -- every model whose cache is a ``DynamicCache`` of full-attention
layers) and a :class:`~tierstore.api.KVStore`. For one request it

1. looks up the longest cached prefix of the prompt (full blocks only; only the
   cost model's *useful* hits are loaded, and of those only the leading run of
   ``Status.OK`` is used),
2. loads that KV straight into destination blocks on the model's device and
   turns them into a ``DynamicCache`` (per layer ``keys``/``values`` of shape
   ``(1, num_kv_heads, prefix_tokens, head_dim)``),
3. prefills only the suffix, with explicit ``position_ids`` (and
   ``cache_position`` on transformers versions that take it),
4. stores the prompt's new full blocks after prefill and every block that
   fills up during greedy decode.

Block conversion. tierstore keeps a block as ``[num_layers, 2, tokens_per_block,
num_kv_heads, head_dim]`` (:mod:`tierstore.layout`); a transformers cache layer
keeps ``(batch, num_kv_heads, seq, head_dim)``. Block ``b`` of layer ``l`` is
``keys[0, :, b*T:(b+1)*T, :].transpose(0, 1)`` (and the same for ``values``).
Both directions are pure copies/permutations, so the round trip is bit-exact.

Continued in ``docs/INTEGRATIONS.md`` (``tierstore/integrations/hf.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import json
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from ..api import KVStore, leading_ok
from ..errors import ConfigError, LayoutError, Status
from ..identity import Namespace, token_array
from ..layout import KVLayout, dtype_name

#: Elements sampled per tensor by the default (sampled) fingerprint.
DEFAULT_SAMPLE_ELEMENTS = 4096
#: Tensors up to this many elements are hashed completely by the sampled fingerprint.
FULL_HASH_MAX_ELEMENTS = 1 << 16

_FP_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()
_FP_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- identity
def _tensor_sample_bytes(t: torch.Tensor, full: bool, sample_elements: int) -> bytes:
    """Bytes of ``t`` (all of them, or a deterministic strided sample) on the CPU."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return b""
    if not full and n > max(FULL_HASH_MAX_ELEMENTS, sample_elements):
        # evenly strided indices, always including the first and the last element
        idx = torch.linspace(0, n - 1, steps=sample_elements, dtype=torch.float64).round().long()
        flat = flat[idx.to(flat.device)]
    flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def model_fingerprint(
    model: torch.nn.Module, full: bool = False, sample_elements: int = DEFAULT_SAMPLE_ELEMENTS
) -> str:
    """SHA-256 fingerprint of a model's config and weights (computed once per model object).

    Hashed, in this order: the model class name; the config as canonical JSON
    (``config.to_dict()``, sorted keys, non-JSON values via ``str``); then for every
    entry of ``state_dict()`` in sorted name order its name, dtype, shape and bytes.

    Parameters
    ----------
    model : torch.nn.Module
        The model (a transformers ``PreTrainedModel`` or any module; ``config`` is optional).
    full : bool
        ``True``: hash every byte of every tensor (exact; ~1-2 s per GB of weights
        on a CPU, plus the device-to-host copy). ``False`` (default): tensors of up to
        :data:`FULL_HASH_MAX_ELEMENTS` elements are hashed completely (norms,
        biases, small models), larger ones by ``sample_elements`` evenly strided
        elements including the first and last. This costs a few ms even for an 8B
        model and catches any other checkpoint, revision or fine-tune that touches
        a sampled element -- a fine-tune that changes only un-sampled elements (a
        sparse edit) is *not* detected, so put the checkpoint revision in
        ``model_id`` as well (the namespace carries both).
    sample_elements : int
        Elements sampled per large tensor when ``full`` is ``False``.

    Returns
    -------
    str
        64 hex digits.

    Notes
    -----
    The fingerprint is cached per model object and per ``(full, sample_elements)``;
    weights changed in place afterwards are not seen (call again on a new object or
    clear by re-creating the model). Tied weights appear under each of their names.
    """
    key = (bool(full), int(sample_elements))
    with _FP_LOCK:
        cached = _FP_CACHE.get(model, {}).get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256(b"tierstore/hf-model-fingerprint/v1")
    h.update(type(model).__name__.encode())
    cfg = getattr(model, "config", None)
    if cfg is not None:
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
        h.update(json.dumps(d, sort_keys=True, default=str, separators=(",", ":")).encode())
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name]
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_sample_bytes(t, full, sample_elements))
    fp = h.hexdigest()
    with _FP_LOCK:
        _FP_CACHE.setdefault(model, {})[key] = fp
    return fp


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layout_from_config(
    config, dtype: torch.dtype | str, tokens_per_block: int = 16, name: str | None = None
) -> KVLayout:
    """KV layout of a transformers decoder config.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        Uses ``num_hidden_layers``, ``num_key_value_heads`` (default
        ``num_attention_heads``: no GQA) and ``head_dim`` (default
        ``hidden_size // num_attention_heads``).
    dtype : torch.dtype or str
        KV element type (the model's compute dtype: bf16, fp16 or fp32).
    tokens_per_block : int
        Tokens per tierstore block.
    name : str, optional
        Layout name (informational); defaults to ``config.model_type``.

    Returns
    -------
    KVLayout

    Raises
    ------
    ConfigError
        If the config lacks the attention geometry or uses sliding-window layers
        (their cache keeps only a window of tokens, so prefixes cannot be restored).
    """
    c = _text_config(config)
    try:
        layers = int(c.num_hidden_layers)
        heads = int(c.num_attention_heads)
    except AttributeError as e:
        raise ConfigError(f"config lacks the attention geometry: {e}") from None
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    layer_types = getattr(c, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(
            f"layer_types={sorted(set(layer_types))}: only full-attention caches "
            "can be restored from prefix blocks"
        )
    return KVLayout(
        layers, int(kv_heads), int(head_dim), dtype, tokens_per_block, name or getattr(c, "model_type", "hf")
    )


def _rope_desc(config) -> str:
    c = _text_config(config)
    rope = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None)
    if not rope:
        return ""
    return json.dumps(rope, sort_keys=True, default=str, separators=(",", ":"))


# ----------------------------------------------------------------------------- cache <-> blocks
def cache_to_blocks(cache, layout: KVLayout, start_block: int, end_block: int) -> torch.Tensor:
    """Copy full blocks ``[start_block, end_block)`` out of a transformers cache.

    Parameters
    ----------
    cache : transformers.Cache
        A ``DynamicCache`` whose layers hold ``keys``/``values`` of shape
        ``(1, num_kv_heads, seq, head_dim)`` with ``seq >= end_block * tokens_per_block``.
    layout : KVLayout
        The store's layout (must match the cache's geometry and dtype).
    start_block, end_block : int
        Block range.

    Returns
    -------
    torch.Tensor
        Shape ``(end_block - start_block, *layout.block_shape)``, dtype
        ``layout.dtype``, on the cache's device, contiguous.

    Raises
    ------
    LayoutError
        On a geometry, dtype or batch-size mismatch.
    """
    n = end_block - start_block
    T, L, H, D = layout.tokens_per_block, layout.num_layers, layout.num_kv_heads, layout.head_dim
    if len(cache.layers) != L:
        raise LayoutError(f"cache has {len(cache.layers)} layers, layout {L}")
    k0 = cache.layers[0].keys
    out = torch.empty((n, L, 2, T, H, D), dtype=layout.dtype, device=k0.device)
    lo, hi = start_block * T, end_block * T
    for li, layer in enumerate(cache.layers):
        for kv, t in ((0, layer.keys), (1, layer.values)):
            if (
                t.dim() != 4
                or t.shape[0] != 1
                or t.shape[1] != H
                or t.shape[3] != D
                or t.dtype != layout.dtype
            ):
                raise LayoutError(
                    f"layer {li}: cache tensor {tuple(t.shape)} {t.dtype} does not match "
                    f"(1, {H}, seq, {D}) {layout.dtype}"
                )
            if t.shape[2] < hi:
                raise LayoutError(f"layer {li}: cache holds {t.shape[2]} tokens, need {hi}")
            # (H, n*T, D) -> (H, n, T, D) -> (n, T, H, D)
            out[:, li, kv] = t[0, :, lo:hi, :].reshape(H, n, T, D).permute(1, 2, 0, 3)
    return out


def blocks_to_cache(blocks: torch.Tensor, layout: KVLayout, config=None, num_tokens: int | None = None):
    """Build a ``DynamicCache`` holding the KV of consecutive blocks.

    Parameters
    ----------
    blocks : torch.Tensor
        Shape ``(n, *layout.block_shape)``, dtype ``layout.dtype``; the device of the
        cache tensors.
    layout : KVLayout
        The store's layout.
    config : transformers.PretrainedConfig, optional
        Passed to ``DynamicCache(config=...)``.
    num_tokens : int, optional
        Keep only the first ``num_tokens`` tokens (default all ``n * tokens_per_block``).

    Returns
    -------
    transformers.DynamicCache
        Per layer ``keys``/``values`` of shape ``(1, num_kv_heads, num_tokens, head_dim)``,
        contiguous.
    """
    from transformers import DynamicCache

    n = blocks.shape[0]
    T, H, D = layout.tokens_per_block, layout.num_kv_heads, layout.head_dim
    m = n * T if num_tokens is None else num_tokens
    if not 0 < m <= n * T:
        raise LayoutError(f"num_tokens={num_tokens}: must be in [1, {n * T}]")
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for li in range(layout.num_layers):
        kv = []
        for j in (0, 1):
            # (n, T, H, D) -> (H, n, T, D) -> (1, H, n*T, D)
            kv.append(blocks[:, li, j].permute(2, 0, 1, 3).reshape(1, H, n * T, D)[:, :, :m].contiguous())
        cache.update(kv[0], kv[1], li)
    return cache


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass
class PrefillResult:
    """Outcome of :meth:`HFPrefixCache.prefill`.

    Attributes
    ----------
    logits : torch.Tensor
        Logits of the last prompt position, shape ``(vocab,)``, the model's dtype and device.
    cache : transformers.DynamicCache
        KV of the whole prompt (``prompt_tokens`` tokens), ready for decode.
    prompt_tokens : int
        Prompt length.
    resident_blocks : int
        Leading prompt blocks resident in the store and referenced by the request
        (matched, minus any from a failed load on): they need no store.
    reused_tokens : int
        Tokens whose KV was loaded from tierstore instead of recomputed.
    hit_tiers : list of str
        Tier each loaded block came from (``"hbm"``, ``"host"``, ``"nvme"``).
    lookup_s, load_s, prefill_s : float
        Wall-clock seconds of the lookup, the load (including the block-to-cache
        copy) and the suffix prefill.
    """

    logits: torch.Tensor
    cache: object
    prompt_tokens: int
    resident_blocks: int
    reused_tokens: int
    hit_tiers: list
    lookup_s: float
    load_s: float
    prefill_s: float


@dataclasses.dataclass
class GenerationResult:
    """Outcome of :meth:`HFPrefixCache.generate`.

    Attributes
    ----------
    tokens : list of int
        Greedily generated token ids (``max_new_tokens`` of them).
    first_logits : torch.Tensor
        Logits that produced the first token, shape ``(vocab,)``.
    reused_tokens : int
        Prompt tokens whose KV came from tierstore.
    hit_tiers : list of str
        Tier of each loaded block.
    ttft_s : float
        Seconds from the call to the first token (lookup + load + suffix prefill + argmax).
    stored_blocks : int
        Blocks newly stored (``Status.OK``) by this request.
    store_s : float
        Seconds spent extracting and storing blocks (off the TTFT path).
    """

    tokens: list
    first_logits: torch.Tensor
    reused_tokens: int
    hit_tiers: list
    ttft_s: float
    stored_blocks: int
    store_s: float

    def __repr__(self) -> str:
        """One line: the counts and timings, the first tokens, and the logits' shape and
        dtype (never their values: a vocabulary of logits is ~100k numbers)."""
        toks = self.tokens[:8]
        more = f", ... ({len(self.tokens)} tokens)" if len(self.tokens) > 8 else ""
        tiers = dict(collections.Counter(self.hit_tiers))
        logits = self.first_logits
        lg = (
            f"Tensor(shape={tuple(logits.shape)}, dtype={logits.dtype}, device={logits.device})"
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        return (
            f"GenerationResult(tokens={toks}{more}, reused_tokens={self.reused_tokens}, hit_tiers={tiers}, "
            f"ttft_s={self.ttft_s:.4f}, stored_blocks={self.stored_blocks}, store_s={self.store_s:.4f}, "
            f"first_logits={lg})"
        )


# ----------------------------------------------------------------------------- adapter
class HFPrefixCache:
    """tierstore prefix caching for a transformers causal LM.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model in eval mode (batch size 1 per request; any device/dtype).
    store : KVStore or None
        The store; its layout must equal :meth:`layout_for` of this model. ``None``
        turns offload off (every request is a full prefill; the reference path).
    model_id : str
        Model id and revision put in front of the fingerprint in the namespace.
    tokenizer, chat_template, adapter, tenant : str
        Namespace fields (see :class:`~tierstore.identity.Namespace`).
    fingerprint : str, optional
        Precomputed :func:`model_fingerprint` (skips hashing).
    store_decode : bool
        Also store blocks that fill up during decode.
    lifetime : str, optional
        Placement hint passed to :meth:`KVStore.store`.

    Raises
    ------
    ConfigError
        If the store's layout does not match the model.
    """

    def __init__(
        self,
        model,
        store: KVStore | None,
        model_id: str = "hf",
        tokenizer: str = "",
        chat_template: str = "",
        adapter: str = "",
        tenant: str = "default",
        fingerprint: str | None = None,
        store_decode: bool = True,
        lifetime: str | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.store_decode = store_decode
        self.lifetime = lifetime
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if store is not None:
            want = self.layout_for(model, store.layout.tokens_per_block)
            got = store.layout
            if (got.num_layers, got.num_kv_heads, got.head_dim, got.dtype) != (
                want.num_layers,
                want.num_kv_heads,
                want.head_dim,
                want.dtype,
            ):
                raise ConfigError(f"store layout {got.to_dict()} does not match the model's {want.to_dict()}")
            self.layout = got
        else:
            self.layout = self.layout_for(model)
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.namespace = Namespace(
            model=f"{model_id}@sha256:{self.fingerprint}",
            tokenizer=tokenizer,
            chat_template=chat_template,
            adapter=adapter,
            rope_scaling=_rope_desc(model.config),
            kv_dtype=dtype_name(self.layout.dtype),
            tenant=tenant,
        )
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.x names it ``cache``; 4.x ``past_key_values``
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache_position = "cache_position" in params
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    @staticmethod
    def layout_for(model, tokens_per_block: int = 16) -> KVLayout:
        """The :class:`KVLayout` a store must use for ``model`` (dtype = the model's)."""
        return layout_from_config(model.config, next(model.parameters()).dtype, tokens_per_block)

    # ------------------------------------------------------------------ model calls
    @torch.no_grad()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, cache, start: int) -> torch.Tensor:
        """Run the model on ``token_ids`` at positions ``start, start + 1, ...`` appending to ``cache``.

        Parameters
        ----------
        token_ids : sequence of int or torch.Tensor
            Shape ``(n,)``, ``n >= 1``.
        cache : transformers.DynamicCache
            Holds exactly ``start`` tokens; extended in place by ``n``.
        start : int
            Position of the first token.

        Returns
        -------
        torch.Tensor
            Logits of the last position, shape ``(vocab,)``.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        pos = torch.arange(start, start + n, dtype=torch.long, device=self.device)
        kw = {self._cache_kw: cache, "position_ids": pos.unsqueeze(0), "use_cache": True}
        if self._cache_position:
            kw["cache_position"] = pos
        if self._logits_kw is not None:
            kw[self._logits_kw] = 1
        out = self.model(input_ids=ids, **kw)
        return out.logits[0, -1]

    def new_cache(self):
        """An empty ``DynamicCache`` for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    # ------------------------------------------------------------------ tierstore steps
    def _load_prefix(self, token_ids: np.ndarray, rid) -> tuple[object, int, int, list, float, float]:
        """Lookup + load. Returns (cache, resident_blocks, reused_tokens, tiers, lookup_s, load_s)."""
        t0 = time.perf_counter()
        n = token_ids.size
        hit = self.store.lookup(self.namespace, token_ids, request_id=rid)
        t1 = time.perf_counter()
        keys = hit.useful_keys
        if not keys:
            return self.new_cache(), hit.matched_blocks, 0, [], t1 - t0, 0.0
        dest = torch.empty((len(keys), *self.layout.block_shape), dtype=self.layout.dtype, device=self.device)
        statuses, _ = self.store.load(keys, dests=list(dest.unbind(0)))
        k = leading_ok(statuses)
        # the last prompt token must be fed to the model for its logits: a prompt fully
        # covered by blocks reuses all of them but its last token's KV
        reused = min(k * self.layout.tokens_per_block, n - 1)
        cache = (
            blocks_to_cache(dest[:k], self.layout, self.model.config, reused) if reused else self.new_cache()
        )
        t2 = time.perf_counter()
        tiers = [t.label for t in hit.tiers[:k]]
        # a failed load drops its block: blocks from the first failure on must be stored again
        resident = hit.matched_blocks if k == len(keys) else k
        return cache, resident, reused, tiers, t1 - t0, t2 - t1

    def store_blocks(self, token_ids: np.ndarray, cache, start_block: int) -> tuple[int, int]:
        """Store the full blocks of ``cache`` from ``start_block`` on.

        Parameters
        ----------
        token_ids : numpy.ndarray
            int64, shape ``(n,)``: the tokens whose KV ``cache`` holds (at least its full blocks).
        cache : transformers.DynamicCache
            KV of ``token_ids`` (``(1, num_kv_heads, seq, head_dim)`` per layer).
        start_block : int
            First block to store (earlier ones are already resident).

        Returns
        -------
        next_block : int
            Block index to start from next time (the number of full blocks covered).
        stored_ok : int
            Blocks newly stored (``Status.OK``; ``EXISTS`` and ``NO_SPACE`` are not counted).
        """
        T = self.layout.tokens_per_block
        end = min(cache.get_seq_length(), token_ids.size) // T
        if self.store is None or end <= start_block:
            return max(start_block, end), 0
        blocks = cache_to_blocks(cache, self.layout, start_block, end)
        st = self.store.store(
            self.namespace, token_ids[: end * T], blocks, start_block=start_block, lifetime=self.lifetime
        )
        return end, sum(1 for s in st if s is Status.OK)

    def _prompt_ids(self, token_ids, new_tokens: int) -> np.ndarray:
        """One prompt's ids as int64, shape ``(n,)``, checked against the model before any work.

        Raises
        ------
        ConfigError
            An empty prompt; not one 1-D sequence of non-negative integers (floats were truncated
            and a 2-D batch flattened into one prompt before, trial 5a); an id past the model's
            ``vocab_size``; ``n + new_tokens`` past ``max_position_embeddings`` (the model's own
            ``IndexError`` before).
        """
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        ids = token_array(token_ids)
        if ids.size == 0:
            raise ConfigError("an empty prompt cannot be prefilled")
        cfg = self.model.config
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is not None and int(ids.max()) >= vocab:
            raise ConfigError(f"token id {int(ids.max())}: the model's vocab_size is {vocab}")
        most = getattr(cfg, "max_position_embeddings", None)
        if most is not None and ids.size + new_tokens > most:
            raise ConfigError(
                f"a prompt of {ids.size} tokens + {new_tokens} new ones: the model's "
                f"max_position_embeddings is {most}"
            )
        return ids

    # ------------------------------------------------------------------ public
    def prefill(self, token_ids: Sequence[int] | np.ndarray, request_id=None) -> PrefillResult:
        """Prefill a prompt, reusing its longest cached prefix.

        Parameters
        ----------
        token_ids : sequence of int
            Prompt token ids, shape ``(n,)``, ``n >= 1``.
        request_id : object, optional
            A :meth:`KVStore.request` id holding the matched blocks; required with a store.

        Returns
        -------
        PrefillResult
        """
        ids = self._prompt_ids(token_ids, 0)
        if self.store is not None:
            cache, resident, reused, tiers, lk, ld = self._load_prefix(ids, request_id)
        else:
            cache, resident, reused, tiers, lk, ld = self.new_cache(), 0, 0, [], 0.0, 0.0
        t0 = time.perf_counter()
        logits = self.forward(ids[reused:], cache, reused)
        return PrefillResult(
            logits, cache, int(ids.size), resident, reused, tiers, lk, ld, time.perf_counter() - t0
        )

    @torch.no_grad()
    def generate(self, token_ids: Sequence[int] | np.ndarray, max_new_tokens: int = 8) -> GenerationResult:
        """Greedy generation with tierstore prefix reuse.

        Parameters
        ----------
        token_ids : sequence of int
            Prompt token ids, shape ``(n,)``.
        max_new_tokens : int
            Tokens to generate (>= 1).

        Returns
        -------
        GenerationResult
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        ids = self._prompt_ids(token_ids, max_new_tokens)
        if self.store is None:
            return self._generate(ids, max_new_tokens, None)
        with self.store.request() as rid:
            return self._generate(ids, max_new_tokens, rid)

    def _generate(self, ids: np.ndarray, max_new_tokens: int, rid) -> GenerationResult:
        t0 = time.perf_counter()
        pr = self.prefill(ids, rid)
        first = int(torch.argmax(pr.logits))
        ttft = time.perf_counter() - t0
        # blocks already resident (matched, referenced by this request) need no store
        start_block = pr.resident_blocks
        seq = list(ids)
        out = [first]
        t_store = time.perf_counter()
        next_block, stored = self.store_blocks(ids, pr.cache, start_block)
        store_s = time.perf_counter() - t_store
        for _ in range(max_new_tokens - 1):
            seq.append(out[-1])
            logits = self.forward([out[-1]], pr.cache, len(seq) - 1)
            out.append(int(torch.argmax(logits)))
            if self.store_decode and self.store is not None:
                t_store = time.perf_counter()
                next_block, n_ok = self.store_blocks(np.asarray(seq, dtype=np.int64), pr.cache, next_block)
                stored += n_ok
                store_s += time.perf_counter() - t_store
        return GenerationResult(out, pr.logits, pr.reused_tokens, pr.hit_tiers, ttft, stored, store_s)


__all__ = [
    "HFPrefixCache",
    "PrefillResult",
    "GenerationResult",
    "model_fingerprint",
    "layout_from_config",
    "cache_to_blocks",
    "blocks_to_cache",
]
