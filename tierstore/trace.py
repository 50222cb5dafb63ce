"""Request traces: the Mooncake FAST'25 JSONL format.

Each line is one request (Mooncake, ``FAST25-release/traces``)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

* ``timestamp``: arrival time in ms from the start of the trace.
* ``input_length`` / ``output_length``: prompt and generated tokens.
* ``hash_ids``: one remapped prefix-block id per 512-token block,
  ``len(hash_ids) == ceil(input_length / 512)``. Equal ids at equal positions are
  the same prefix block.

The packaged default is an excerpt (first 1,000 requests; see
``tierstore/data/NOTICE.md`` for attribution, Apache-2.0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from importlib import resources

from .errors import TraceFormatError

#: Tokens per ``hash_ids`` entry in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes
    ----------
    timestamp_s : float
        Arrival time in seconds from the start of the trace.
    input_length, output_length : int
        Prompt and output tokens.
    hash_ids : tuple of int
        Prefix-block ids, one per ``block_tokens`` tokens (the last may be partial).
    """

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple

    def full_blocks(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
        """Blocks that are full (the exact-hit rule: only these are shareable)."""
        return min(self.input_length // block_tokens, len(self.hash_ids))


def default_trace_path() -> str:
    """Path of the packaged excerpt."""
    return str(resources.files("tierstore").joinpath("data/mooncake_excerpt.jsonl"))


def read_mooncake(path: str | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace.

    Parameters
    ----------
    path : str, optional
        The trace; the packaged excerpt when ``None``.
    limit : int, optional
        Read at most this many requests.

    Raises
    ------
    TraceFormatError
        On a malformed line (names the file and line number), a line whose ``hash_ids``
        contradict its ``input_length`` (``len(hash_ids) != ceil(input_length / 512)``: one id
        per 512-token block, the rule stated with Mooncake's FAST'25 traces,
        ``FAST25-release/traces``), or an empty trace.
    FileNotFoundError
        If ``path`` does not exist.
    """
    path = path or default_trace_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace {path!r} does not exist")
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                ts, il, ol, ids = d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TraceFormatError(
                    f"{path}:{lineno}: not a Mooncake request "
                    f"(need timestamp, input_length, output_length, hash_ids): {e}"
                ) from None
            if (
                not (
                    isinstance(ts, (int, float))
                    and isinstance(il, int)
                    and isinstance(ol, int)
                    and isinstance(ids, list)
                    and all(isinstance(x, int) for x in ids)
                )
                or il < 0
                or ts < 0
            ):
                raise TraceFormatError(f"{path}:{lineno}: bad field types or negative values")
            if len(ids) != -(-il // MOONCAKE_BLOCK_TOKENS):
                raise TraceFormatError(
                    f"{path}:{lineno}: {len(ids)} hash_ids for input_length {il}: a Mooncake trace has "
                    f"one id per {MOONCAKE_BLOCK_TOKENS}-token block, ceil({il} / {MOONCAKE_BLOCK_TOKENS}) = "
                    f"{-(-il // MOONCAKE_BLOCK_TOKENS)}"
                )
            out.append(TraceRequest(ts / 1000.0, il, ol, tuple(ids)))
    if not out:
        raise TraceFormatError(f"{path}: no requests")
    return out


def ideal_hit_ratio(
    requests: list[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS, full_blocks_only: bool = True
) -> float:
    """Hit ratio (blocks) of an infinite cache.

    With ``full_blocks_only`` the exact-hit rule applies (partial tails are never
    stored or matched), which is the ratio a tierstore replay can reach at most;
    otherwise every ``hash_ids`` entry counts, as the trace's README figure (36.6%) does.
    """
    seen: set = set()
    hit = total = 0
    for r in requests:
        ids = r.hash_ids[: r.full_blocks(block_tokens)] if full_blocks_only else r.hash_ids
        k = 0
        for h in ids:
            if h in seen:
                k += 1
            else:
                break
        hit += k
        total += len(ids)
        seen.update(ids)
    return hit / total if total else 0.0


def iter_chunks(requests: list[TraceRequest], n: int) -> Iterator[list[TraceRequest]]:
    """Split into chunks of ``n`` requests."""
    for i in range(0, len(requests), n):
        yield requests[i : i + n]
