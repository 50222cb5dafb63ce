"""Parallel set-ups the embedded store cannot run are refused before vLLM starts a worker (issue 22,
item 10; issue 24: tensor parallel runs with the node service, ``store.url``, test_node.py).

vLLM 0.32 builds the scheduler-side connector after its workers have loaded the model, so the
refusal used to come from every worker's constructor: 102 s after ``LLM(...)`` with two workers
on this 2-core VM, the message printed 10 times. The engine runs in a fresh process
(tests/integrations/vllm/_parallel_proc.py) that does not import tierstore's connector itself,
as with ``vllm serve``; ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` is what a user sets to run two CPU
workers (without it they would not get that far).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ._util import make_tiny_llama

pytestmark = pytest.mark.timeout(900)
HERE = os.path.dirname(os.path.abspath(__file__))


def test_tensor_parallel_is_refused_in_seconds_with_one_message(tmp_path):
    model = make_tiny_llama(str(tmp_path / "llama"))
    args = {
        "model": model,
        "nvme_dir": str(tmp_path),
        "engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    }
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
    )
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_parallel_proc.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-4000:]
    m = re.search(r"^REFUSED (\w+) after ([0-9.]+) s: ", r.stdout, re.M)
    assert m, out[-4000:]
    assert float(m.group(2)) < 20.0, m.group(0)  # seconds after LLM(...), not minutes: no worker started
    msg = "TierstoreConnector's embedded store needs the scheduler and the worker in one process"
    assert out.count(msg) == 1, out[-4000:]
    assert "'tensor_parallel_size': 2" in out
    assert "store.url" in m.string  # the way to run TP > 1: the node service
    assert os.listdir(tmp_path) == ["llama"], "no store was opened (tiers.nvme.path is tmp_path)"


def test_the_cpu_backend_with_its_worker_in_another_process_is_refused_in_seconds(tmp_path):
    """On vLLM's CPU backend the worker runs in a process of its own unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0; the connector's scheduler side then found no worker side
    and the engine died on its first request (found by the new-user trial, README's LLM(...)
    form and `vllm serve` both). It is refused while vLLM validates the config, naming the fix."""
    model = make_tiny_llama(str(tmp_path / "llama"))
    args = {"model": model, "nvme_dir": str(tmp_path), "engine": {}}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_parallel_proc.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-4000:]
    m = re.search(r"^REFUSED (\w+) after ([0-9.]+) s: ", r.stdout, re.M)
    assert m, out[-4000:]
    assert float(m.group(2)) < 20.0, m.group(0)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in m.string
    assert os.listdir(tmp_path) == ["llama"], "no store was opened (tiers.nvme.path is tmp_path)"
