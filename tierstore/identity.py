"""Namespace identity and chained prefix-block hashes.

Two requests may share KV only when *everything that changes the KV bytes* is
equal: model weights, tokenizer and chat template, adapter, RoPE scaling, KV
dtype and quantisation scales, layout version, parallel rank, and tenant scope.
:class:`Namespace` collects these; its :meth:`Namespace.digest` (SHA-256 of a
canonical JSON encoding) seeds the hash chain, so equal tokens under another
namespace hash differently and never hit.

Block hashes are chained as in vLLM's prefix caching
(``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``: the hash of block *i*
covers the hash of block *i-1* and the token ids of block *i*)::

    h[-1] = namespace.digest()
    h[i]  = SHA-256(b"tierstore/block/v1" || h[i-1] || int64_le(tokens[i*B:(i+1)*B]))

SHA-256 (FIPS 180-4) gives 256-bit keys that are deterministic across processes
and restarts: there is no random seed and no use of Python's ``hash()``.

**Exact-hit rule.** Only *full* blocks of ``tokens_per_block`` tokens are hashed,
stored or shared. A partial tail block is always recomputed by the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import ConfigError, LayoutError

#: The largest chain position a block may have: the index keeps positions as at most ``int32``
#: (:mod:`tierstore.index.rows`: an ``int16`` column widened by the first position past 32767).
POSITION_MAX = 2**31 - 1


def check_chain_positions(first_position: int, n: int) -> None:
    """Refuse the chain positions ``first_position .. first_position + n - 1`` of a store of ``n``
    blocks unless ``first_position`` is an int and all lie in ``[0, POSITION_MAX]``.

    Raises
    ------
    LayoutError
        ``first_position`` is not an int (``bool`` included), is negative, or puts a block past
        :data:`POSITION_MAX`. Every store checks this before anything is stored or sent.
    """
    if isinstance(first_position, bool) or not isinstance(first_position, (int, np.integer)):
        raise LayoutError(f"first_position={first_position!r}: must be an int (a block's chain position)")
    if not 0 <= first_position <= POSITION_MAX - max(n - 1, 0):
        raise LayoutError(
            f"first_position={first_position}: the chain positions of {n} blocks must lie in "
            f"[0, {POSITION_MAX}] (the index keeps a block's position as at most an int32)"
        )


BlockKey = bytes  #: 32-byte chained block hash.
_BLOCK_DOMAIN = b"tierstore/block/v1"
_NS_DOMAIN = "tierstore/namespace/v1"
LAYOUT_VERSION = 1


#: Namespace fields checked for their type at construction (a wrong type would hash to a scope
#: of its own: a silent miss for every engine that spells it right).
_NS_STR_FIELDS = ("tokenizer", "chat_template", "adapter", "rope_scaling", "kv_dtype")
_NS_INT_FIELDS = ("layout_version", "tp_rank", "tp_size", "pp_rank", "pp_size")


@dataclasses.dataclass(frozen=True)
class Namespace:
    """The identity that scopes every block hash.

    Parameters
    ----------
    model : str
        Model id and weights revision (e.g. ``"meta-llama/Llama-3.1-8B@<sha>"``) or a
        fingerprint of the weights.
    tokenizer : str
        Tokenizer id and revision.
    chat_template : str
        Chat template text or its digest.
    adapter : str
        LoRA/adapter id and revision; ``""`` for the base model.
    rope_scaling : str
        RoPE scaling policy (type and factor), e.g. ``"yarn:4.0"``; ``""`` for none.
    kv_dtype : str
        KV element type and quantisation, e.g. ``"bf16"`` or ``"fp8_e4m3:<scales digest>"``.
    layout_version : int
        Version of the stored block layout (:mod:`tierstore.layout`).
    tp_rank, tp_size, pp_rank, pp_size : int
        Tensor- and pipeline-parallel rank and size of the KV shard.
    tenant : str
        Tenant scope, non-empty. Different tenants never share KV unless a prefix is
        explicitly declared public (daemon config).

    Raises
    ------
    ConfigError
        An empty ``model`` or ``tenant``, a field of the wrong type (a string field given
        ``None`` or a number, an integer field given a string or a bool), or a rank outside
        its size.
    """

    model: str
    tokenizer: str = ""
    chat_template: str = ""
    adapter: str = ""
    rope_scaling: str = ""
    kv_dtype: str = "bf16"
    layout_version: int = LAYOUT_VERSION
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"Namespace.model={self.model!r}: a non-empty string is required")
        if not isinstance(self.tenant, str) or not self.tenant:
            # None, 5 or "" would each scope keys of their own, silently apart from "default"
            raise ConfigError(f"Namespace.tenant={self.tenant!r}: a non-empty string is required")
        for f in _NS_STR_FIELDS:
            if not isinstance(getattr(self, f), str):
                raise ConfigError(f"Namespace.{f}={getattr(self, f)!r}: a string is required")
        for f in _NS_INT_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"Namespace.{f}={v!r}: an integer is required")
        for f in ("tp_rank", "pp_rank"):
            if getattr(self, f) < 0:
                raise ConfigError(f"Namespace.{f}={getattr(self, f)}: must be >= 0")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"Namespace.tp_rank={self.tp_rank}: must be in [0, tp_size={self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"Namespace.pp_rank={self.pp_rank}: must be in [0, pp_size={self.pp_size})")

    def digest(self) -> bytes:
        """32-byte SHA-256 of the canonical JSON encoding (sorted keys, no spaces)."""
        d = dataclasses.asdict(self)
        blob = json.dumps([_NS_DOMAIN, d], sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()

    def with_tenant(self, tenant: str) -> Namespace:
        """The same namespace under another tenant scope."""
        return dataclasses.replace(self, tenant=tenant)


class DigestCache:
    """Memoised :meth:`Namespace.digest` (a digest is SHA-256 over JSON: cheap, but on every call).

    Parameters
    ----------
    scope : bytes, optional
        When given (a store's :meth:`KVLayout.fingerprint`), every digest, also
        a ready 32-byte one, becomes ``SHA-256("tierstore/scoped-ns/v1" 0x00
        digest scope)``: namespaces of stores with different layouts never meet.
    """

    #: Entries kept before the cache starts over (a digest costs ~2 us to recompute).
    MAX_ENTRIES = 4096

    def __init__(self, scope: bytes | None = None) -> None:
        self._digests: dict[Namespace | bytes, bytes] = {}
        self._scope = scope

    def _scoped(self, d: bytes) -> bytes:
        if self._scope is None:
            return d
        return hashlib.sha256(b"tierstore/scoped-ns/v1\0" + d + self._scope).digest()

    def __call__(self, ns: Namespace | bytes) -> bytes:
        """The 32-byte digest of ``ns`` (a ready digest is checked and returned).

        Raises
        ------
        ConfigError
            If a raw digest is not 32 bytes, or ``ns`` is neither a digest nor a
            :class:`Namespace`.
        """
        if isinstance(ns, bytes):
            if len(ns) != 32:
                raise ConfigError(f"a namespace digest must be 32 bytes, got {len(ns)}")
            if self._scope is None:
                return ns
        elif not hasattr(ns, "digest"):
            raise ConfigError(
                f"a namespace must be a tierstore.Namespace or a 32-byte digest, got {type(ns).__name__}"
            )
        d = self._digests.get(ns)
        if d is None:
            if len(self._digests) >= self.MAX_ENTRIES:  # bounded: per-request namespaces must not grow it
                self._digests.clear()
            d = self._digests[ns] = self._scoped(ns if isinstance(ns, bytes) else ns.digest())
        return d


class NamespaceIds:
    """Small integer ids of namespace digests, for per-row ``int32`` arrays.

    Id 0 is the all-zero digest (no namespace); a new digest gets the next id
    and keeps it. The block index and the NVMe locator each keep one.

    Attributes
    ----------
    digests : list of bytes
        The 32-byte digest of each id (``digests[nid]``).
    ids : dict
        ``digest -> id`` of every digest seen.
    """

    __slots__ = ("digests", "ids")

    def __init__(self) -> None:
        self.digests: list[bytes] = [bytes(32)]
        self.ids: dict[bytes, int] = {bytes(32): 0}

    def intern(self, ns: bytes) -> int:
        """The id of digest ``ns`` (a new one for a new digest)."""
        nid = self.ids.get(ns)
        if nid is None:
            nid = self.ids[ns] = len(self.digests)
            self.digests.append(ns)
        return nid


def hash_block(parent: bytes, content: bytes) -> BlockKey:
    """One link of the chain: ``SHA-256(domain || parent || content)``.

    Parameters
    ----------
    parent : bytes
        32-byte hash of the previous block, or the namespace digest for block 0.
    content : bytes
        The block's token ids as int64 little-endian bytes (or, for traces that
        carry block ids instead of tokens, those ids encoded the same way).
    """
    h = hashlib.sha256(_BLOCK_DOMAIN)
    h.update(parent)
    h.update(content)
    return h.digest()


def token_array(token_ids) -> np.ndarray:
    """Validate token ids: a 1-D sequence of non-negative integers -> int64 array.

    Raises
    ------
    ConfigError
        For floats, strings, other shapes or negative ids (a silent cast could
        make two different prompts hash alike).
    """
    try:
        raw = np.asarray(token_ids)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"token_ids: expected a 1-D sequence of non-negative integers ({e})") from None
    if raw.ndim != 1:
        raise ConfigError(f"token_ids must be 1-D, got shape {raw.shape}")
    if raw.size == 0:
        return raw.astype("<i8")
    if raw.dtype.kind not in "iu":
        raise ConfigError(f"token_ids must be integers, got dtype {raw.dtype}")
    if raw.dtype.kind == "i" and np.minimum.reduce(raw) < 0:  # the ufunc: no Python wrapper
        raise ConfigError("token_ids must be non-negative")
    return raw.astype("<i8", copy=False)


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as int64 little-endian bytes (the hashed encoding)."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_hashes(
    ns_digest: bytes, token_ids: Sequence[int] | np.ndarray, tokens_per_block: int
) -> list[BlockKey]:
    """Chained hashes of the *full* blocks of ``token_ids``.

    Parameters
    ----------
    ns_digest : bytes
        :meth:`Namespace.digest` of the request's namespace (32 bytes).
    token_ids : sequence of int
        Prompt token ids, shape ``(num_tokens,)``.
    tokens_per_block : int
        Block size in tokens.

    Returns
    -------
    list of bytes
        ``num_tokens // tokens_per_block`` 32-byte keys; the partial tail is not hashed
        (exact-hit rule).
    """
    arr = token_array(token_ids)
    n = arr.size // tokens_per_block
    if n == 0:
        return []
    # One hasher with the domain absorbed, copied per link (saves a constructor and
    # an update per block), and one bytes buffer sliced through a memoryview (no
    # per-block numpy slice + tobytes): the digests are the same as hash_block's
    # (tests/test_identity.py pins them); 1.4-2.7x the per-block calls here.
    base = hashlib.sha256(_BLOCK_DOMAIN)
    step = tokens_per_block * 8
    buf = memoryview(arr[: n * tokens_per_block].tobytes())
    out: list[BlockKey] = []
    append = out.append
    parent = ns_digest
    for off in range(0, n * step, step):
        h = base.copy()
        h.update(parent)
        h.update(buf[off : off + step])
        parent = h.digest()
        append(parent)
    return out


def chain_ids(ns_digest: bytes, block_ids: Iterable[int]) -> list[BlockKey]:
    """Chained hashes for traces that identify each block by an integer id
    (Mooncake's ``hash_ids``) instead of its tokens: each id hashed as int64
    little-endian, as :func:`block_hashes` hashes a token block."""
    base = hashlib.sha256(_BLOCK_DOMAIN)
    out: list[BlockKey] = []
    parent = ns_digest
    for b in block_ids:
        h = base.copy()
        h.update(parent)
        h.update(int(b).to_bytes(8, "little", signed=True))
        parent = h.digest()
        out.append(parent)
    return out


_EXTERNAL_DOMAIN = b"tierstore/external/v1"


def scoped_key(ns_digest: bytes, external_key: bytes | str) -> BlockKey:
    """A tierstore block key for a key an engine computed itself.

    Engines that hash their own pages (SGLang HiCache page hashes, vLLM block
    hashes, Mooncake object keys) pass that key here with the namespace
    digest: ``SHA-256(b"tierstore/external/v1" || ns_digest || key)``. The
    engine key already covers the prefix chain; the namespace makes equal
    engine keys of another model, layout, rank or tenant distinct, so they
    never hit.

    Parameters
    ----------
    ns_digest : bytes
        32-byte namespace digest (:meth:`tierstore.api.KVStore.digest`).
    external_key : bytes or str
        The engine's key; a ``str`` is encoded as UTF-8.

    Raises
    ------
    ConfigError
        If ``ns_digest`` is not 32 bytes or the key is empty.
    """
    if not isinstance(ns_digest, (bytes, bytearray)) or len(ns_digest) != 32:
        raise ConfigError("ns_digest must be a 32-byte namespace digest")
    raw = external_key.encode("utf-8") if isinstance(external_key, str) else bytes(external_key)
    if not raw:
        raise ConfigError("external_key is empty")
    h = hashlib.sha256(_EXTERNAL_DOMAIN)
    h.update(ns_digest)
    h.update(raw)
    return h.digest()


def scoped_keys(ns_digest: bytes, external_keys: Sequence[bytes | str]) -> list[BlockKey]:
    """:func:`scoped_key` of every key of a batch, in one pass (the same digests): the keys'
    types and emptiness checked once for the batch, one ``sha256(prefix + key)`` a key.

    Raises
    ------
    ConfigError
        As :func:`scoped_key`, for the namespace or any key.
    """
    if not isinstance(ns_digest, (bytes, bytearray)) or len(ns_digest) != 32:
        raise ConfigError("ns_digest must be a 32-byte namespace digest")
    add = (_EXTERNAL_DOMAIN + bytes(ns_digest)).__add__
    kinds = set(map(type, external_keys))
    raws: Iterable[bytes]
    if kinds <= {str}:  # an engine's keys (SGLang's are str): encoded (UTF-8) in C
        raws = map(str.encode, external_keys)  # type: ignore[arg-type]  # all str
    elif kinds <= {bytes}:
        raws = external_keys  # type: ignore[assignment]  # all bytes
    else:
        raws = [k.encode("utf-8") if isinstance(k, str) else bytes(k) for k in external_keys]
    if not all(raws if isinstance(raws, list) else external_keys):  # str/bytes: empty iff encoded empty
        raise ConfigError("external_key is empty")
    # domain and namespace are 53 bytes, less than SHA-256's 64-byte block: hashing them again per
    # key costs no compression that copying a started hash would save; one C call a key
    sha = hashlib.sha256
    return [sha(add(r)).digest() for r in raws]
