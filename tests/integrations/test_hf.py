"""End-to-end tests of the transformers integration (CPU, tiny random Llama, no downloads).

The model is a seeded, randomly initialised ``LlamaForCausalLM`` (2 layers, 2 KV
heads, head dim 16, fp32: the ``tiny`` layout preset). KV round trips must be
bit-exact; model outputs with reuse must match full recompute (tokens exactly,
first-token logits within 1e-5) and the engine's own in-memory prefix reuse
with the same split (bitwise).
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

from tierstore import KVStore
from tierstore.errors import ConfigError
from tierstore.integrations.hf import (
    HFPrefixCache,
    blocks_to_cache,
    cache_to_blocks,
    layout_from_config,
    model_fingerprint,
)
from tierstore.policies.cost import CostModel

VOCAB = 512
T = 16
LOGIT_TOL = 1e-5


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Seeded random tiny Llama (fp32, eval mode)."""
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture
def new_store(tmp_path):
    stores = []

    def _make(layout, hbm=64, host=64, nvme=256, backend="memory", **kw):
        """``backend``: the NVMe segment store on a file (``"file"``) or in memory."""
        from tierstore.io import format as fmt
        from tierstore.io.segments import SegmentStorage

        bb = layout.bytes_per_block
        nv = None
        if nvme and backend == "memory":
            seg = fmt.extent_bytes_for(1, bb)
            nv = SegmentStorage(
                None,
                (nvme + 1) * seg,
                bb,
                segment_size_bytes=seg,
                engine="memory",
                extent_size_bytes=seg,
                owns_engine=True,
            )
        # frozen cost model (no bandwidth learning): which hits are "useful" must not depend
        # on how busy the shared test machine is
        kw.setdefault("cost", CostModel(measured_window=0))
        s = KVStore(
            layout,
            hbm_bytes=hbm * bb,
            host_bytes=host * bb,
            nvme=nv,
            nvme_path=str(tmp_path / f"seg{len(stores)}") if backend == "file" else None,
            nvme_bytes=max(nvme * bb, 8 << 20) if backend == "file" else 0,
            **kw,
        )
        stores.append(s)
        return s

    yield _make
    for s in stores:
        s.close()


def rand_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int64)


def engine_reuse_generate(ref: HFPrefixCache, prefix_cache, ids: np.ndarray, split: int, n_new: int):
    """The engine's own in-memory prefix reuse: prefill ``ids[split:]`` from a deep copy
    of ``prefix_cache`` (KV of ``ids[:split]``), then greedy decode."""
    cache = copy.deepcopy(prefix_cache)
    logits = ref.forward(ids[split:], cache, split)
    first = logits.clone()
    out = [int(torch.argmax(logits))]
    pos = ids.size
    while len(out) < n_new:
        logits = ref.forward([out[-1]], cache, pos)
        pos += 1
        out.append(int(torch.argmax(logits)))
    return out, first


# ----------------------------------------------------------------------------- geometry / identity
def test_layout_from_config_and_store_mismatch(model, new_store):
    lay = HFPrefixCache.layout_for(model)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.tokens_per_block) == (
        2,
        2,
        16,
        torch.float32,
        16,
    )
    assert layout_from_config(model.config, torch.bfloat16, 32).bytes_per_block == 2 * 2 * 2 * 16 * 2 * 32
    wrong = new_store(dataclasses.replace(lay, num_kv_heads=4), nvme=0)
    with pytest.raises(ConfigError):
        HFPrefixCache(model, wrong)


def test_fingerprint_is_stable_and_sensitive(model):
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(tiny_model(0)) == model_fingerprint(model)
    assert fp != model_fingerprint(tiny_model(1))  # other weights
    assert fp != model_fingerprint(tiny_model(0, rope_theta=5e5))  # other config
    assert model_fingerprint(model, full=True) == fp  # every tensor is small: hashed in full either way
    edited = tiny_model(0)
    with torch.no_grad():
        edited.model.norm.weight[3] += 1.0  # one element of a small (fully hashed) tensor
    assert model_fingerprint(edited) != fp
    # big tensors (here the 2048 x 64 embedding) are sampled; first and last element always are
    big = tiny_model(0, vocab_size=2048)
    edited = tiny_model(0, vocab_size=2048)
    with torch.no_grad():
        edited.model.embed_tokens.weight[-1, -1] += 1.0
    assert model_fingerprint(edited, sample_elements=64) != model_fingerprint(big, sample_elements=64)
    assert model_fingerprint(big, full=True) != model_fingerprint(big)  # sampled != full for big tensors


def test_cache_block_conversion_is_exact(model):
    ref = HFPrefixCache(model, None)
    ids = rand_tokens(np.random.default_rng(1), 3 * T + 5)
    cache = ref.new_cache()
    ref.forward(ids, cache, 0)
    blocks = cache_to_blocks(cache, ref.layout, 0, 3)
    assert blocks.shape == (3, *ref.layout.block_shape)
    back = blocks_to_cache(blocks, ref.layout, model.config)
    for a, b in zip(cache.layers, back.layers):
        assert torch.equal(a.keys[:, :, : 3 * T], b.keys) and torch.equal(a.values[:, :, : 3 * T], b.values)
    # a middle range lands at the right offset
    assert torch.equal(cache_to_blocks(cache, ref.layout, 1, 3), blocks[1:])


# ----------------------------------------------------------------------------- tiers
@pytest.mark.parametrize("backend", ["memory", "file"])
def test_kv_roundtrip_bit_exact_through_every_tier(model, new_store, backend):
    """HBM stand-in -> host -> NVMe -> back, under eviction pressure (2+2 memory blocks)."""
    lay = HFPrefixCache.layout_for(model)
    s = new_store(lay, hbm=2, host=2, nvme=64, backend=backend, promotion="top")
    a = HFPrefixCache(model, s, store_decode=False)
    rng = np.random.default_rng(7)
    prompts = [rand_tokens(rng, 4 * T + 3) for _ in range(3)]
    stored = {}
    for p in prompts:  # cold: store 4 blocks each; later prompts push earlier blocks down
        with s.request() as rid:
            pr = a.prefill(p, rid)
            assert pr.reused_tokens == 0
            stored[p.tobytes()] = cache_to_blocks(pr.cache, lay, 0, 4)
            a.store_blocks(p, pr.cache, 0)
    seen_tiers: set = set()
    for rnd in range(3):
        for p in prompts + prompts[::-1]:  # a repeat right after finds its promoted blocks in HBM
            with s.request() as rid:
                pr = a.prefill(p, rid)
            assert pr.reused_tokens == 4 * T
            seen_tiers.update(pr.hit_tiers)
            ref = stored[p.tobytes()]
            got = cache_to_blocks(pr.cache, lay, 0, 4)
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (rnd, pr.hit_tiers)
    st = s.stats()
    assert seen_tiers == {"hbm", "host", "nvme"}
    for c in (
        "hit_blocks_hbm",
        "hit_blocks_host",
        "hit_blocks_nvme",
        "demotions_hbm_host",
        "demotions_host_nvme",
        "evictions_hbm",
        "evictions_host",
    ):
        assert st.get(c, 0) > 0, (c, st)
    assert sum(v for k, v in st.items() if k.startswith("promotions_")) > 0
    assert st["nvme_read_bytes"] > 0 and st["loaded_blocks"] == st["hit_blocks"]
    s.check_invariants(quiescent=True)


# ----------------------------------------------------------------------------- outputs
def _prompt_set(rng: np.random.Generator):
    """>= 50 prompts sharing prefixes whose lengths sit on, just below and just above
    block boundaries; suffixes of varied length."""
    prefix_lens = [5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65]
    suffix_lens = [1, 2, 9, 16, 23]
    groups = []
    for pl in prefix_lens:
        prefix = rand_tokens(rng, pl)
        groups.append((prefix, [np.concatenate([prefix, rand_tokens(rng, sl)]) for sl in suffix_lens]))
    return groups


def test_greedy_and_logits_match_recompute_and_engine_reuse(model, new_store, record_property):
    lay = HFPrefixCache.layout_for(model)
    s = new_store(lay, hbm=2, host=12, nvme=256)  # small memory tiers: hits from host and NVMe
    a = HFPrefixCache(model, s)
    ref = HFPrefixCache(model, None)
    n_new = 4
    max_diff, n_prompts, n_reused, boundary_hits = 0.0, 0, 0, 0
    groups = _prompt_set(np.random.default_rng(11))
    for prefix, _ in groups:  # each shared prefix is seen first (its full blocks get stored)
        a.generate(np.concatenate([prefix, rand_tokens(np.random.default_rng(len(prefix)), 3)]), 2)
    # round robin over the groups: each group's blocks are pushed down by the others
    for x, prefix in [(g[1][i], g[0]) for i in range(len(groups[0][1])) for g in groups]:
        got = a.generate(x, n_new)
        full = ref.generate(x, n_new)
        assert got.tokens == full.tokens, (len(prefix), x.size)
        diff = float((got.first_logits - full.first_logits).abs().max())
        assert diff <= LOGIT_TOL, diff
        max_diff = max(max_diff, diff)
        r = got.reused_tokens
        if r:
            n_reused += 1
            boundary_hits += int(len(prefix) % T == 0 and r == len(prefix))
            # engine's in-memory reuse with the same split: bitwise equal
            pcache = ref.new_cache()
            ref.forward(x[:r], pcache, 0)
            toks, first = engine_reuse_generate(ref, pcache, x, r, n_new)
            assert toks == got.tokens
            assert torch.equal(first, got.first_logits), float((first - got.first_logits).abs().max())
        n_prompts += 1
    assert n_prompts >= 50
    assert n_reused >= 40 and boundary_hits >= 4
    st = s.stats()
    assert st.get("hit_blocks_nvme", 0) > 0 and st.get("hit_blocks_host", 0) > 0
    record_property("max_first_logit_abs_diff", max_diff)
    print(f"\nmax |first-token logit diff| over {n_prompts} prompts ({n_reused} with reuse): {max_diff:.3e}")


def test_concurrent_generation_matches_offload_off(model, new_store):
    lay = HFPrefixCache.layout_for(model)
    s = new_store(lay, hbm=6, host=6, nvme=256)
    a = HFPrefixCache(model, s)
    ref = HFPrefixCache(model, None)
    rng = np.random.default_rng(5)
    shared = [rand_tokens(rng, n) for n in (16, 33, 48, 70)]
    work = [
        [np.concatenate([shared[(t + i) % 4], rand_tokens(rng, 1 + (3 * i + t) % 20)]) for i in range(8)]
        for t in range(4)
    ]
    expect = [[ref.generate(x, 4) for x in w] for w in work]
    results: list = [None] * len(work)
    errors: list = []

    def run(t: int) -> None:
        try:
            results[t] = [a.generate(x, 4) for x in work[t]]
        except BaseException as e:  # surfaced below: a thread's failure fails the test
            errors.append(e)
            raise

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(work))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    reused = 0
    for got_w, exp_w in zip(results, expect):
        for got, exp in zip(got_w, exp_w):
            assert got.tokens == exp.tokens
            assert float((got.first_logits - exp.first_logits).abs().max()) <= LOGIT_TOL
            reused += got.reused_tokens > 0
    assert reused > 0
    s.check_invariants(quiescent=True)


@pytest.mark.parametrize("what", ["fingerprint", "tenant", "adapter"])
def test_identity_isolation_zero_reuse_both_directions(model, new_store, what):
    lay = HFPrefixCache.layout_for(model)
    s = new_store(lay)
    a = HFPrefixCache(model, s, model_id="tiny", tenant="A")
    if what == "fingerprint":
        other = tiny_model(1)
        b = HFPrefixCache(other, s, model_id="tiny", tenant="A")
        assert b.fingerprint != a.fingerprint
    elif what == "tenant":
        b = HFPrefixCache(model, s, model_id="tiny", tenant="B")
    else:
        b = HFPrefixCache(model, s, model_id="tiny", tenant="A", adapter="lora-x@1")
    rng = np.random.default_rng(3)
    x1, x2 = rand_tokens(rng, 3 * T + 2), rand_tokens(rng, 3 * T + 2)
    assert a.generate(x1, 2).stored_blocks == 3
    assert b.generate(x1, 2).reused_tokens == 0  # a -> b
    assert b.generate(x2, 2).stored_blocks == 3
    assert a.generate(x2, 2).reused_tokens == 0  # b -> a
    assert a.generate(x1, 2).reused_tokens == 3 * T  # positive control
    assert b.generate(x2, 2).reused_tokens == 3 * T
    assert s.probe(a.namespace, x1) == 3 * T and s.probe(b.namespace, x1) == 3 * T  # each stored its own


def test_ttft_bench_smoke(tmp_path):
    """The TTFT benchmark runs end to end on a tiny model (correctness asserts inside)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "ttft_bench.py"
    spec = importlib.util.spec_from_file_location("ttft_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    assert (
        mod.main(
            [
                "--layers",
                "2",
                "--hidden",
                "64",
                "--intermediate",
                "128",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--vocab",
                "512",
                "--lengths",
                "48,80",
                "--break-even",
                "16",
                "--runs",
                "1",
                "--suffix",
                "8",
                "--nvme-dir",
                str(tmp_path / "nv"),
                "--out",
                str(out),
                "--cost-prefill-tok-s",
                "1",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert [r["prefix"] for r in res["lengths"]] == [32, 64]
    for r in res["lengths"]:
        assert set(r["warm"]) == {"hbm", "host", "nvme"}
        assert r["max_first_logit_abs_diff"] <= LOGIT_TOL
    assert mod.main(["--render", str(out)]) == 0


def test_generation_result_repr_is_short():
    """Printing a GenerationResult dumped the whole logits tensor (issue 19, item 16)."""
    from tierstore.integrations.hf import GenerationResult

    logits = torch.linspace(-3.0, 3.0, 128_256)  # a Llama-3 vocabulary
    res = GenerationResult(
        tokens=list(range(40)),
        first_logits=logits,
        reused_tokens=64,
        hit_tiers=["hbm", "host", "host", "nvme"],
        ttft_s=0.0123456,
        stored_blocks=3,
        store_s=0.5,
    )
    text = repr(res)
    assert len(text) < 400 and "\n" not in text
    assert "shape=(128256,)" in text and "torch.float32" in text and "40 tokens" in text
    assert "reused_tokens=64" in text and "'host': 2" in text and "ttft_s=0.0123" in text
    assert "-3.0" not in text and "tensor(" not in text


def test_a_prompt_that_is_not_one_sequence_of_the_models_token_ids_is_refused(model, new_store):
    """Float ids were truncated, a 2-D batch flattened into one prompt, and an id past the
    vocabulary or a prompt past the positions reached the model's bare IndexError (trial 5a)."""
    lay = HFPrefixCache.layout_for(model)
    pc = HFPrefixCache(model, new_store(lay, nvme=0))
    for bad, said in [
        ([1.9] * 40, "integers"),
        (torch.tensor([[5] * 20, [7] * 20]), "1-D"),
        ([VOCAB] * 20, "vocab_size"),
        ([-1] * 20, "non-negative"),
        ([3] * 1020, "max_position_embeddings"),
    ]:
        with pytest.raises(ConfigError, match=said):
            pc.generate(bad, max_new_tokens=8)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        pc.prefill([3] * 1025)
    assert pc.generate(torch.tensor([5] * 20), max_new_tokens=2).tokens  # a 1-D tensor of ids is fine
