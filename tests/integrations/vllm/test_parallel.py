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


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> list[tuple[str, str]]:
    """Both refusals below, tried one after the other in one fresh process (one import of vLLM
    instead of two): ``[(stdout, stderr)]`` of each attempt, and each attempt's NVMe directory."""
    root = tmp_path_factory.mktemp("parallel")
    model = make_tiny_llama(str(root / "llama"))
    dirs = [root / "tp2", root / "cpu-mp"]
    for d in dirs:
        d.mkdir()
    args = {
        "model": model,
        "attempts": [
            {  # tensor parallel, what a user sets to run two CPU workers
                "nvme_dir": str(dirs[0]),
                "engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            },
            {  # vLLM's default: the engine core (and the worker) in a process of its own
                "nvme_dir": str(dirs[1]),
                "engine": {},
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": None, "VLLM_CPU_OMP_THREADS_BIND": None},
            },
        ],
    }
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_parallel_proc.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 3, (r.stdout + r.stderr)[-4000:]
    outs = [re.split(r"^=== attempt \d+ ===$", t, flags=re.M)[1:] for t in (r.stdout, r.stderr)]
    assert len(outs[0]) == len(outs[1]) == 2, (r.stdout + r.stderr)[-4000:]
    return [(o, e, str(d)) for o, e, d in zip(outs[0], outs[1], dirs)]


def test_tensor_parallel_is_refused_in_seconds_with_one_message(refusals):
    stdout, stderr, nvme_dir = refusals[0]
    out = stdout + stderr
    m = re.search(r"^REFUSED (\w+) after ([0-9.]+) s: ", stdout, re.M)
    assert m, out[-4000:]
    assert float(m.group(2)) < 20.0, m.group(0)  # seconds after LLM(...), not minutes: no worker started
    msg = "TierstoreConnector's embedded store needs the scheduler and the worker in one process"
    assert out.count(msg) == 1, out[-4000:]
    assert "'tensor_parallel_size': 2" in out
    assert "store.url" in m.string  # the way to run TP > 1: the node service
    assert os.listdir(nvme_dir) == [], "no store was opened (tiers.nvme.path is this directory)"


def test_the_cpu_backend_with_its_worker_in_another_process_is_refused_in_seconds(refusals):
    """On vLLM's CPU backend the worker runs in a process of its own unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0; the connector's scheduler side then found no worker side
    and the engine died on its first request (found by the new-user trial, README's LLM(...)
    form and `vllm serve` both). It is refused while vLLM validates the config, naming the fix."""
    stdout, stderr, nvme_dir = refusals[1]
    m = re.search(r"^REFUSED (\w+) after ([0-9.]+) s: ", stdout, re.M)
    assert m, (stdout + stderr)[-4000:]
    assert float(m.group(2)) < 20.0, m.group(0)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in m.string
    assert os.listdir(nvme_dir) == [], "no store was opened (tiers.nvme.path is this directory)"
