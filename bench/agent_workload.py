"""Synthetic agent workload in the Mooncake trace format (JSONL, 512-token blocks).

Models an agent serving fleet (tool-calling LLM agents):

* every request starts with a long **shared system prompt** of
  ``system_blocks`` blocks, followed by one of ``tool_sets`` **tool-definition
  prefixes** of ``tool_blocks`` blocks (agents with different tool sets);
* **sessions** arrive as a Poisson process (``session_rate_per_s``); each runs
  ``turns`` turns (geometric, mean ``mean_turns``); a turn appends
  ``1..max_turn_blocks`` new blocks (tool output + model output) to the
  session's context, and the next turn arrives after a **tool wait**
  (log-normal, median ``tool_wait_median_s``, sigma ``tool_wait_sigma``);
* with probability ``branch_prob`` a turn fans out into ``branches``
  **parallel branches** (e.g. parallel tool calls / sub-agents) that share the
  session context and add their own ``1..max_turn_blocks`` blocks; only the
  first branch's blocks continue the session.

Output: one JSON object per request, ``{"timestamp": ms, "input_length":
tokens, "output_length": tokens, "hash_ids": [...]}``; equal ids at equal
positions are the same prefix block (as in the Mooncake trace). Generation is
deterministic for a given ``seed``.

Run::

    python bench/agent_workload.py --out /tmp/agent.jsonl --sessions 600 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

BLOCK_TOKENS = 512


@dataclasses.dataclass
class AgentWorkload:
    """Parameters (see module doc)."""

    sessions: int = 600
    session_rate_per_s: float = 0.5
    system_blocks: int = 8
    tool_sets: int = 4
    tool_blocks: int = 6
    mean_turns: float = 6.0
    max_turn_blocks: int = 3
    tool_wait_median_s: float = 20.0
    tool_wait_sigma: float = 1.0
    branch_prob: float = 0.2
    branches: int = 3
    max_context_blocks: int = 120
    seed: int = 0

    def generate(self) -> list[dict]:
        """Requests sorted by timestamp."""
        rng = np.random.default_rng(self.seed)
        next_id = [0]

        def fresh(n: int) -> list[int]:
            out = list(range(next_id[0], next_id[0] + n))
            next_id[0] += n
            return out

        system = fresh(self.system_blocks)
        tools = [fresh(self.tool_blocks) for _ in range(self.tool_sets)]
        events: list[tuple[float, int, list[int]]] = []  # (time_s, seq, hash_ids)
        seq = 0
        t = 0.0
        for _ in range(self.sessions):
            t += rng.exponential(1.0 / self.session_rate_per_s)
            ctx = (
                system
                + tools[int(rng.integers(self.tool_sets))]
                + fresh(int(rng.integers(1, self.max_turn_blocks + 1)))
            )
            now = t
            turns = int(rng.geometric(1.0 / self.mean_turns))
            for _ in range(turns):
                if len(ctx) >= self.max_context_blocks:
                    break
                nb = self.branches if rng.random() < self.branch_prob else 1
                heads = [ctx + fresh(int(rng.integers(1, self.max_turn_blocks + 1))) for _ in range(nb)]
                for b, h in enumerate(heads):  # parallel branches issued 1 ms apart
                    events.append((now + 0.001 * b, seq, h))
                    seq += 1
                ctx = heads[0]
                now += float(rng.lognormal(np.log(self.tool_wait_median_s), self.tool_wait_sigma))
        events.sort()
        out = []
        for ts, _, ids in events:
            tail = int(rng.integers(1, BLOCK_TOKENS + 1))  # the last block is partial
            out.append(
                {
                    "timestamp": int(ts * 1000),
                    "input_length": (len(ids) - 1) * BLOCK_TOKENS + tail,
                    "output_length": int(rng.integers(16, 512)),
                    "hash_ids": ids,
                }
            )
        return out

    def write(self, path: str) -> int:
        """Write the JSONL trace; returns the request count."""
        reqs = self.generate()
        with open(path, "w") as f:
            for r in reqs:
                f.write(json.dumps(r) + "\n")
        return len(reqs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    for fld in dataclasses.fields(AgentWorkload):
        ap.add_argument("--" + fld.name.replace("_", "-"), type=type(fld.default), default=fld.default)
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    n = AgentWorkload(**a).write(out)
    print(f"{n} requests -> {out}")


if __name__ == "__main__":
    main()
