"""End to end: tierstore's KV connector under a real vLLM engine (CPU backend, tiny local Llama).

One engine without the connector computes the reference outputs first (vLLM
keeps one KV connector per process, so it must not run after the connector
engine exists); then one connector engine serves every test of the module.
vLLM's own prefix cache is off in the connector engine, so every cached token
a request reports came from tierstore. The restart test runs two more engines
in fresh processes on one NVMe directory, which the in-process engine then
opens as its own NVMe tier.

Tiers of the connector engine: HBM stand-in 8 blocks, host 8 blocks, NVMe
64 MiB (a block is 32 KiB: 2 layers x 2 KV heads x 32 tokens x 2*32 x fp32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from tierstore.fdp.lifetime import LifetimeClass
from tierstore.index import Tier

from ._util import B, connector_config, engine_kwargs, make_tiny_llama, prompt, shutdown

pytestmark = pytest.mark.timeout(900)

BLOCK_BYTES = 2 * 2 * B * 64 * 4
HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- prompts (deterministic)
BOUNDARY = {n: prompt(n, seed=n) for n in (2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1)}
TIER_PREFIX = {t: prompt(3 * B, seed=100 + i) for i, t in enumerate(("hbm", "host", "nvme"))}
TIER_FIRST = {t: prompt(3 * B + 10, seed=110 + i, prefix=p) for i, (t, p) in enumerate(TIER_PREFIX.items())}
TIER_SECOND = {t: prompt(3 * B + 20, seed=120 + i, prefix=p) for i, (t, p) in enumerate(TIER_PREFIX.items())}
TENANT = prompt(2 * B + 5, seed=200)
CORRUPT = prompt(5 * B + 3, seed=300)
ABORT = {m: prompt(4 * B + 7, seed=400 + i) for i, m in enumerate(("sync", "async"))}
PREEMPT = [prompt(600, seed=500 + i) for i in range(3)]  # 3 x 19 blocks of 64: preempted at ~72 decode tokens
PERSIST = [prompt(3 * B + 5, seed=600)]
PERSIST.append(prompt(3 * B + 7, seed=601, prefix=PERSIST[0][: 2 * B]))
LIFETIME = {h: prompt(2 * B + 1, seed=700 + i) for i, h in enumerate(("conversation", "query", "bogus"))}
MAX_TOKENS = 8
PREEMPT_MAX_TOKENS = 130


def all_prompts() -> dict:
    out = {f"boundary{n}": p for n, p in BOUNDARY.items()}
    out.update({f"tier_first_{t}": p for t, p in TIER_FIRST.items()})
    out.update({f"tier_second_{t}": p for t, p in TIER_SECOND.items()})
    out.update({"tenant": TENANT, "corrupt": CORRUPT})
    out.update({f"abort_{m}": p for m, p in ABORT.items()})
    out.update({f"persist{i}": p for i, p in enumerate(PERSIST)})
    out.update({f"lifetime_{h}": p for h, p in LIFETIME.items()})
    return out


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def baseline(model_dir):
    """Greedy outputs (tokens, first-token logprob) of the engine without a connector."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(model_dir, num_gpu_blocks_override=None))
    prompts = all_prompts()
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()], sp, use_tqdm=False)
    res = {name: _summary(o) for name, o in zip(prompts, outs)}
    sp = SamplingParams(max_tokens=PREEMPT_MAX_TOKENS, temperature=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PREEMPT], sp, use_tqdm=False)
    res.update({f"preempt{i}": _summary(o) for i, o in enumerate(outs)})
    shutdown(llm)
    return res


def _run_engine_process(args: dict) -> dict:
    """The engine process's RESULT, plus ``log``: its output at vLLM's INFO level (what ``vllm serve``
    prints)."""
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO"
    )
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "_engine_proc.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"engine process failed (rc={r.returncode}):\n{r.stderr[-4000:]}"
    out, err = (t.partition(REFUSAL_MARK) for t in (r.stdout, r.stderr))
    # log: the engine's own output; refusal_log: then_refuse's attempt, after the mark
    return dict(json.loads(lines[-1][len("RESULT ") :]), log=out[0] + err[0], refusal_log=out[2] + err[2])


#: tests/integrations/vllm/_engine_proc.py's line before its then_refuse attempt
REFUSAL_MARK = "=== then_refuse: a second engine on another NVMe path ==="

#: The victim of the refusal test: 4 MiB that tierstore did not write (written by ``persisted``).
VICTIM_BYTES = 4 << 20


@pytest.fixture(scope="module")
def persisted(model_dir, tmp_path_factory, baseline):
    """Two engine processes, one after the other, on one NVMe directory (NVMe is
    the only tier, so everything they store is on flash when they exit).

    The second also calls its store and connector after its shutdown (``mode="closed"``) and
    then tries an engine on a file tierstore did not write (``then_refuse``): two checks that each
    took an engine process of their own (~1 min each of CI's 2-core VM)."""
    import hashlib

    nvme_dir = str(tmp_path_factory.mktemp("nvme"))
    victim = tmp_path_factory.mktemp("victim") / "data.bin"
    victim.write_bytes(os.urandom(VICTIM_BYTES))
    digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    args = dict(model=model_dir, revision="rev-a", nvme_dir=nvme_dir, prompts=PERSIST, max_tokens=MAX_TOKENS)
    first = _run_engine_process(args)
    second = _run_engine_process(dict(args, mode="closed", then_refuse=str(victim)))
    second["victim"] = (victim, digest)
    return nvme_dir, first, second


@pytest.fixture(scope="module")
def engine(model_dir, baseline, persisted):
    """The connector engine (in process) and its store."""
    from vllm import LLM

    from tierstore.integrations.vllm import engine_ids, engine_store

    nvme_dir = persisted[0]
    extra = {
        "tiers": {
            "hbm": {"capacity_bytes": 8 * BLOCK_BYTES},
            "host": {"capacity_bytes": 8 * BLOCK_BYTES},
            "nvme": {"path": nvme_dir, "capacity_bytes": "64MiB"},
        }
    }
    llm = LLM(**engine_kwargs(model_dir), kv_transfer_config=connector_config(extra))
    eid = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    assert eid in engine_ids()
    store = engine_store(eid)
    # freeze the cost model's bandwidth learning: which hits are "useful" must not depend on
    # how busy the shared test machine is (a slow read must not turn NVMe hits into misses)
    store.cost_model.measured_window = 0
    yield llm, store, eid
    shutdown(llm)


def _summary(o) -> dict:
    c = o.outputs[0]
    lp = None
    if c.logprobs:
        lp = c.logprobs[0][c.token_ids[0]].logprob
    return {"tokens": list(c.token_ids), "cached": o.num_cached_tokens, "logprob0": lp}


def gen(llm, tokens, max_tokens=MAX_TOKENS, **prompt_kw) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra_args = prompt_kw.pop("extra_args", None)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, extra_args=extra_args)
    o = llm.generate([TokensPrompt(prompt_token_ids=tokens, **prompt_kw)], sp, use_tqdm=False)[0]
    return _summary(o)


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprob0"] == pytest.approx(want["logprob0"], abs=1e-4)


def keys_of(store, eid, tokens, cache_salt=None):
    from tierstore.integrations.vllm import engine_namespace

    return store.keys_for(engine_namespace(eid, cache_salt), tokens)


def wait_stored(llm, store, eid, tokens, cache_salt=None, timeout_s: float = 60.0) -> None:
    """Step the engine until tierstore holds every full block of ``tokens``: stores run on
    the connector's thread after the forward pass, so a request right after another may
    come before them (and then misses, correctly, but the test wants the hit)."""
    keys = keys_of(store, eid, tokens, cache_salt)
    deadline = time.monotonic() + timeout_s
    while store.exists(keys) < len(keys):
        assert time.monotonic() < deadline, f"{store.exists(keys)} of {len(keys)} blocks stored"
        llm.llm_engine.step()
        time.sleep(0.005)


def top_tiers(store, keys):
    return [min(store.tiers_of(k), default=None) for k in keys]


def push_down(llm, store, eid, keys, tier: Tier, seed: int) -> None:
    """Run 2-block filler requests, each stored before the next, until every key's
    fastest copy is in ``tier`` (LRU demotes 8 blocks at a time; tiers hold 8 blocks)."""
    for i in range(40):
        if all(t == tier for t in top_tiers(store, keys)):
            return
        filler = prompt(2 * B + 1, seed=10_000 + seed * 100 + i)
        gen(llm, filler, max_tokens=1)
        wait_stored(llm, store, eid, filler)
    raise AssertionError(f"blocks did not reach {tier}: {top_tiers(store, keys)}")


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def settle(llm, timeout_s: float = 60.0) -> None:
    """Step the engine (as its busy loop would) until no request is left and every vLLM
    block is free again: a finished request keeps its blocks until the worker reports
    its stores (finished_sending) or its asynchronous load (finished_recving) done."""
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            not llm.llm_engine.has_unfinished_requests()
            and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        ):
            return
        llm.llm_engine.step()
        time.sleep(0.005)


def assert_no_references(store) -> None:
    assert not store.references(), f"request references left: {store.references()}"
    store.check_invariants()


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("n", sorted(BOUNDARY))
def test_greedy_tokens_match_hf_and_the_engine_without_connector(engine, baseline, model_dir, n):
    """Cold (miss) and warm (hit) runs equal vLLM without the connector and HF transformers,
    at a block boundary, one token short of it and one past it."""
    from transformers import LlamaForCausalLM

    llm, store, eid = engine
    p = BOUNDARY[n]
    want = baseline[f"boundary{n}"]
    cold = gen(llm, p)
    wait_stored(llm, store, eid, p)
    warm = gen(llm, p)
    same_output(cold, want)
    same_output(warm, want)
    assert cold["cached"] == 0
    assert warm["cached"] == (n - 1) // B * B  # vLLM computes at least the last token
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, n:].tolist()
    assert ref == want["tokens"]


@pytest.mark.parametrize("tier", ["hbm", "host", "nvme"])
def test_shared_prefix_is_loaded_from_each_tier(engine, baseline, tier):
    """The second request of a shared 3-block prefix gets the prefix from tierstore's
    HBM stand-in, host or NVMe tier (forced by filler requests), with identical output."""
    llm, store, eid = engine
    first = gen(llm, TIER_FIRST[tier])
    same_output(first, baseline[f"tier_first_{tier}"])
    wait_stored(llm, store, eid, TIER_FIRST[tier])
    keys = keys_of(store, eid, TIER_PREFIX[tier])
    assert len(keys) == 3
    want_tier = Tier[tier.upper()]
    push_down(llm, store, eid, keys, want_tier, seed=list(TIER_PREFIX).index(tier))
    before = store.stats()
    second = gen(llm, TIER_SECOND[tier])
    after = store.stats()
    same_output(second, baseline[f"tier_second_{tier}"])
    assert second["cached"] == 3 * B
    loaded = after.get(f"load_bytes_{tier}", 0) - before.get(f"load_bytes_{tier}", 0)
    assert loaded >= 3 * BLOCK_BYTES
    assert after.get("io_errors", 0) == before.get("io_errors", 0)


def test_another_tenant_gets_no_reuse(engine, baseline):
    llm, store, eid = engine
    a1 = gen(llm, TENANT, cache_salt="tenant-a")
    wait_stored(llm, store, eid, TENANT, "tenant-a")
    b1 = gen(llm, TENANT, cache_salt="tenant-b")
    a2 = gen(llm, TENANT, cache_salt="tenant-a")
    for o in (a1, b1, a2):
        same_output(o, baseline["tenant"])
    assert (a1["cached"], b1["cached"], a2["cached"]) == (0, 0, 2 * B)
    assert keys_of(store, eid, TENANT, "tenant-a") != keys_of(store, eid, TENANT, "tenant-b")


def test_restart_persistence(persisted, baseline):
    """A new engine process on the same NVMe directory hits what the previous one stored."""
    _, first, second = persisted
    for i, (o1, o2) in enumerate(zip(first["outputs"], second["outputs"])):
        assert o1["tokens"] == baseline[f"persist{i}"]["tokens"]
        assert o2["tokens"] == baseline[f"persist{i}"]["tokens"]
    assert first["outputs"][0]["cached"] == 0
    assert first["outputs"][1]["cached"] == 2 * B  # shares two blocks with prompt 0, same process
    assert [o["cached"] for o in second["outputs"]] == [3 * B, 3 * B]
    assert first["stats"].get("store_bytes_nvme", 0) > 0
    assert second["stats"].get("load_bytes_nvme", 0) >= 6 * BLOCK_BYTES
    assert second["stats"].get("io_errors", 0) == 0


def test_the_connector_says_one_line_at_start_and_one_at_shutdown(persisted):
    """Issue 22, item 13: inside vLLM (its logger, its INFO level) one line when the store opens
    (tiers, NVMe path, blocks recovered, remote tier) and one when it closes (blocks written down)."""
    nvme_dir, first, second = persisted
    for run, _recovered in ((first, 0), (second, None)):
        opened = [ln for ln in run["log"].splitlines() if "tierstore opened for vLLM engine" in ln]
        closed = [ln for ln in run["log"].splitlines() if "tierstore closed for vLLM engine" in ln]
        assert len(opened) == 1 and len(closed) == 1, run["log"][-4000:]
        assert "INFO" in opened[0] and "INFO" in closed[0]
        assert re.search(rf"tiers nvme [0-9.]+MiB at {re.escape(nvme_dir)}/\S+ \(", opened[0]), opened[0]
        assert "remote tier off" in opened[0], opened[0]
        assert "blocks written down to NVMe" in closed[0], closed[0]
    kept = int(
        re.search(
            r"(\d+) blocks on NVMe for a restart",
            [ln for ln in first["log"].splitlines() if "tierstore closed" in ln][0],
        ).group(1)
    )
    assert kept >= 4  # PERSIST's 4 distinct full blocks (two prompts share 2): NVMe is the only tier
    assert "(0 blocks recovered" in [ln for ln in first["log"].splitlines() if "tierstore opened" in ln][0]
    assert (
        f"({kept} blocks recovered"
        in [ln for ln in second["log"].splitlines() if "tierstore opened" in ln][0]
    )


def test_another_model_revision_gets_no_reuse(engine, persisted, baseline):
    """The directory holds PERSIST's blocks under revision 'rev-a'; this engine runs the same
    weights without a revision (keyed by a weights fingerprint): zero reuse."""
    llm, store, eid = engine
    assert store.stats()["bytes_per_tier"]["nvme"] > 0  # the restarted store adopted them
    out = gen(llm, PERSIST[0])
    same_output(out, baseline["persist0"])
    assert out["cached"] == 0
    wait_stored(llm, store, eid, PERSIST[0])
    assert gen(llm, PERSIST[0])["cached"] == 3 * B  # its own blocks hit


def test_corrupt_nvme_block_is_recomputed(engine, baseline):
    """Flip bytes of one NVMe block: vLLM recomputes from it, the output is identical,
    the error is counted, and the block is never served."""
    llm, store, eid = engine
    same_output(gen(llm, CORRUPT), baseline["corrupt"])
    wait_stored(llm, store, eid, CORRUPT)
    keys = keys_of(store, eid, CORRUPT)
    assert len(keys) == 5
    push_down(llm, store, eid, keys, Tier.NVME, seed=7)
    nvme = store.nvme
    _, off = nvme.locate(keys[2])
    fd = os.open(nvme.engine.path, os.O_RDWR)
    try:
        data = bytearray(os.pread(fd, 64, off + 128))
        os.pwrite(fd, bytes(b ^ 0xFF for b in data), off + 128)
        os.fsync(fd)
    finally:
        os.close(fd)
    before = store.stats()
    out = gen(llm, CORRUPT)
    after = store.stats()
    same_output(out, baseline["corrupt"])
    assert after.get("io_errors", 0) == before.get("io_errors", 0) + 1
    assert after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0) >= 2  # blocks 0-1 still loaded
    assert store.exists(keys) == 2  # the corrupt block left the index
    assert_no_references(store)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_abort_releases_references_and_blocks(engine, baseline, mode):
    """Abort a request that holds tierstore references (a memory-tier hit loads
    synchronously, an NVMe hit asynchronously): references and vLLM blocks all come back."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, store, eid = engine
    p = ABORT[mode]
    gen(llm, p)
    wait_stored(llm, store, eid, p)
    keys = keys_of(store, eid, p)
    if mode == "async":
        push_down(llm, store, eid, keys, Tier.NVME, seed=8)
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    all_free = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    settle(llm)
    assert pool.get_num_free_blocks() == all_free
    aborts0 = store.stats().get("aborted_requests", 0)
    eng = llm.llm_engine
    eng.add_request(
        f"abort-{mode}", TokensPrompt(prompt_token_ids=p), SamplingParams(max_tokens=200, temperature=0)
    )
    eng.step()
    assert len(store.references()) == 1  # the lookup's references are held
    eng.abort_request([f"abort-{mode}"])
    settle(llm)
    assert not eng.has_unfinished_requests()
    assert pool.get_num_free_blocks() == all_free
    assert_no_references(store)
    assert store.stats().get("aborted_requests", 0) == aborts0 + 1


def test_preemption_reloads_from_tierstore(engine, baseline, monkeypatch):
    """Three long requests outgrow the engine's 64 blocks: vLLM preempts; the connector
    fences the preempted request's stores, releases its references, and on resume the
    request reloads its prompt and decode blocks from tierstore. Outputs are identical."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tierstore.integrations.vllm import TierstoreConnector

    llm, store, eid = engine
    preempted, offered = [], []
    real_meta = TierstoreConnector.build_connector_meta
    real_match = TierstoreConnector.get_num_new_matched_tokens

    def spy_meta(self, so):
        meta = real_meta(self, so)
        preempted.extend(meta.preempted)
        return meta

    def spy_match(self, request, num_computed_tokens):
        out = real_match(self, request, num_computed_tokens)
        if request.num_preemptions:
            offered.append(out[0])
        return out

    monkeypatch.setattr(TierstoreConnector, "build_connector_meta", spy_meta)
    monkeypatch.setattr(TierstoreConnector, "get_num_new_matched_tokens", spy_match)
    sp = SamplingParams(max_tokens=PREEMPT_MAX_TOKENS, temperature=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PREEMPT], sp, use_tqdm=False)
    assert preempted, "no request was preempted: the test no longer exercises preemption"
    assert any(n > 0 for n in offered), "a resumed request got nothing from tierstore"
    for i, o in enumerate(outs):
        assert list(o.outputs[0].token_ids) == baseline[f"preempt{i}"]["tokens"]
    assert_no_references(store)


def test_lifetime_hints(engine, baseline):
    """Default blocks are stored as 'conversation' (MEDIUM); a request's
    kv_transfer_params hint 'query' makes them SHORT; an unknown hint falls back."""
    llm, store, eid = engine
    want = {"conversation": LifetimeClass.MEDIUM, "query": LifetimeClass.SHORT, "bogus": LifetimeClass.MEDIUM}
    for hint, p in LIFETIME.items():
        extra = None if hint == "conversation" else {"kv_transfer_params": {"tierstore_lifetime": hint}}
        same_output(gen(llm, p, extra_args=extra), baseline[f"lifetime_{hint}"])
        wait_stored(llm, store, eid, p)
        lifetimes = {store.block_info(k)["lifetime"] for k in keys_of(store, eid, p)}
        assert lifetimes == {want[hint]}, hint


# ---------------------------------------------------------------- issue 22: data safety
def test_an_engine_refuses_an_nvme_path_holding_data_tierstore_did_not_write(persisted):
    """Item 1: the connector builds its store through build.assemble, which refuses a non-empty file
    without tierstore's label before anything is written; the file is unchanged (the attempt is
    ``persisted``'s second engine process's last step)."""
    import hashlib

    second = persisted[2]
    victim, before = second["victim"]
    res = second["refusal"]
    assert not res["started"]
    assert any(e.startswith("ForeignDataError") and "first bytes" in e for e in res["errors"]), res["errors"]
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == before
    assert victim.stat().st_size == VICTIM_BYTES


def test_the_store_and_the_connector_refuse_calls_after_shutdown(persisted):
    """Item 2: after the engine shut down, the connector's store and its scheduler side raise
    StoreClosedError instead of acknowledging or answering (``persisted``'s second process)."""
    after = persisted[2]["after_shutdown"]
    assert set(after) == {
        "store.lookup",
        "store.store_keys",
        "connector.get_num_new_matched_tokens",
        "connector.request_finished",
    }
    assert all(v.startswith("StoreClosedError") for v in after.values()), after
