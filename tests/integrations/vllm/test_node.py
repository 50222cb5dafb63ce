"""vLLM engines on one node service (issue 24): ``kv_connector_extra_config: {"store": {"url":
...}}``, every engine process a client of its own (the engine core and the CPU worker in processes
of their own: vLLM's default multiprocessing).

The service (a ``NodeCore`` on a ``NodeServer``) runs in this test's process; each engine runs in
a fresh process (tests/integrations/vllm/_node_proc.py). The greedy reference of a TP=1 engine is
HF transformers' ``generate`` in this process (test_engine.py checks that vLLM without the
connector gives the same tokens); a TP=2 or PP=2 engine's process first computes its own
reference without the connector. vLLM's own prefix cache is off, so every cached token an engine
reports came from the service. A block of the tiny Llama is 2 layers x 2 (K, V) x KV heads x 32 tokens x
32 x fp32: 32 KiB with both KV heads, 16 KiB per rank at TP=2 (one KV head) or at PP=2 (one
layer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from tierstore.layout import KVLayout
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer
from tierstore.server.config import NodeConfig

from ._util import B, make_tiny_llama, prompt

pytestmark = pytest.mark.timeout(1200)
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 8
FIRST = prompt(3 * B + 5, seed=800)
SECOND = prompt(3 * B + 7, seed=801, prefix=FIRST[: 2 * B])  # shares FIRST's first two blocks


def rank_layout(tp_size: int, pp_size: int = 1) -> dict:
    """One rank's block layout: its KV heads (of 2) of its pipeline stage's layers (of 2)."""
    return dict(
        num_layers=2 // pp_size, num_kv_heads=2 // tp_size, head_dim=32, dtype="float32", tokens_per_block=B
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "llama"))


def start_service(tmp_path, tp_size: int, pp_size: int = 1):
    lay = rank_layout(tp_size, pp_size)
    layout = KVLayout(**dict(lay, dtype=torch.float32))
    core = NodeCore(
        f"v{uuid.uuid4().hex[:8]}",
        {
            "tiers": {
                "host": {"capacity_bytes": 16 * layout.bytes_per_block},
                "nvme": {"path": str(tmp_path) + "/", "capacity_bytes": "8m", "segment_size_bytes": "256k"},
            }
        },
        layout,
        staging_blocks=32,
    )
    server = NodeServer(core, NodeConfig(socket=str(tmp_path / "node.sock"), lease_s=30)).start()
    return core, server, "unix://" + server.path


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """HF transformers' greedy tokens of FIRST and SECOND (fp32, CPU): the reference of every
    TP=1 engine here, about a second instead of an engine start (~1 min on this 2-core VM)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, p in (("FIRST", FIRST), ("SECOND", SECOND)):
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
            out[name] = ids[0, len(p) :].tolist()
    return out


def run_engine(args: dict, **env_over) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core and worker apart
    env.update(env_over)
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_node_proc.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"engine process failed (rc={r.returncode}):\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_two_engine_processes_share_one_node_service(model_dir, reference, tmp_path):
    """Engine B, started after engine A exited, gets A's prefix from the service on its first
    request, with the greedy tokens of an engine without the connector. Each engine's core and
    worker run in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the TP=2 test covers
    vLLM's default (engine core apart), and two engine-core start-ups less (~20 s each on CI's
    2-core VM) keep the suite inside CI's budget."""
    core, server, url = start_service(tmp_path, 1)
    try:
        common = dict(model=model_dir, url=url, max_tokens=MAX_TOKENS, engine={}, layout=rank_layout(1))
        a = run_engine(
            dict(common, prompts=[FIRST, SECOND], wait_blocks=[3, 0]), VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
        assert [o["cached"] for o in a["outputs"]] == [0, 2 * B]  # SECOND shares FIRST's 2 blocks
        before = core.store.stats()
        b = run_engine(
            dict(common, prompts=[FIRST, SECOND], wait_blocks=[0, 0]), VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
        after = core.store.stats()
    finally:
        server.close()
    want = [reference["FIRST"], reference["SECOND"]]
    assert [o["tokens"] for o in a["outputs"]] == want
    assert [o["tokens"] for o in b["outputs"]] == want
    assert [o["cached"] for o in b["outputs"]] == [3 * B, 3 * B]  # B's first request: A's 3 blocks
    block_bytes = KVLayout(**dict(rank_layout(1), dtype=torch.float32)).bytes_per_block
    loaded = sum(after.get(f"load_bytes_{t}", 0) - before.get(f"load_bytes_{t}", 0) for t in ("host", "nvme"))
    assert loaded >= 6 * block_bytes, (before, after)
    core.check_invariants(quiescent=True)  # every engine's references and tickets ended with it
    assert not core.store.references()
    core.close()


def _repeat_on_a_parallel_engine(
    tmp_path, model_dir, reference, tp_size: int, pp_size: int, engine: dict, **env_over: str
) -> None:
    """FIRST twice on a ``tp_size`` x ``pp_size`` engine (``mp`` executor, two CPU workers) on a fresh
    service: greedy tokens equal HF transformers' (the ``reference``; until stop 38 the same parallel
    engine without the connector, a second parallel start-up, ~1 min of CI's 2-core VM each), the
    repeat gets every full block from the service, and each rank keeps its own 3 blocks under its
    own namespace."""
    core, server, url = start_service(tmp_path, tp_size, pp_size)
    try:
        res = run_engine(
            dict(
                model=model_dir,
                url=url,
                max_tokens=MAX_TOKENS,
                engine=dict(engine, distributed_executor_backend="mp"),
                layout=rank_layout(tp_size, pp_size),
                prompts=[FIRST, FIRST],
                wait_blocks=[tp_size * pp_size * 3, 0],
            ),
            VLLM_CPU_OMP_THREADS_BIND="0|1",
            **env_over,
        )
        per_ns = sorted(core.store.namespaces().values())
    finally:
        server.close()
    assert [o["tokens"] for o in res["outputs"]] == [reference["FIRST"]] * 2
    assert [o["cached"] for o in res["outputs"]] == [0, 3 * B]
    assert per_ns == [3] * (tp_size * pp_size)  # one namespace per rank, each its own 3 blocks
    core.check_invariants(quiescent=True)
    core.close()


def test_tensor_parallel_2_on_the_node_service(model_dir, reference, tmp_path):
    """TP=2 (two CPU workers, ``mp`` executor): each rank stores its own shard under its own
    namespace, a repeated prompt gets every full block from the service, greedy tokens equal
    HF transformers' on one process."""
    _repeat_on_a_parallel_engine(tmp_path, model_dir, reference, 2, 1, {"tensor_parallel_size": 2})


def test_pipeline_parallel_2_on_the_node_service(model_dir, reference, tmp_path):
    """PP=2 (two CPU workers, one layer each, ``mp`` executor): each stage stores its own layer
    under its own namespace, a repeated prompt gets every full block from the service, greedy
    tokens equal HF transformers' on one process.

    vLLM 0.32's CPU backend runs PP only with compilation on: with ``enforce_eager`` (compilation
    mode NONE) ``CPUModelRunner.warming_up_model`` skips the profile run that allocates the
    intermediate tensors, and stage 1 fails ``assert self.intermediate_tensors is not None``
    (gpu_model_runner.py, ``sync_and_gather_intermediate_tensors``). Dynamo tracing with the
    ``eager`` backend compiles nothing and allocates them. The engine core runs in the test
    engine's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the two workers in processes of their
    own): the TP=2 test covers the default, and each start-up of a separate engine core costs
    ~20 s of imports on this 2-core VM."""
    _repeat_on_a_parallel_engine(
        tmp_path,
        model_dir,
        reference,
        1,
        2,
        {
            "pipeline_parallel_size": 2,
            "enforce_eager": False,
            "compilation_config": {"mode": "DYNAMO_TRACE_ONCE", "backend": "eager"},
        },
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )


def test_an_engine_whose_node_service_is_down_recomputes(model_dir, reference, tmp_path):
    """No service at store.url: the engine starts (a warning, no error), every request misses
    (nothing cached) and is recomputed, with the reference tokens. The engine core and the worker
    run in the engine's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the connector opens the
    same client either way, and two process start-ups less keep the suite inside CI's budget."""
    res = run_engine(
        dict(
            model=model_dir,
            url="unix://" + str(tmp_path / "nobody.sock"),
            max_tokens=MAX_TOKENS,
            engine={},
            layout=rank_layout(1),
            prompts=[FIRST, FIRST],
            wait_blocks=[0, 0],
        ),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    assert [o["tokens"] for o in res["outputs"]] == [reference["FIRST"]] * 2
    assert [o["cached"] for o in res["outputs"]] == [0, 0]
