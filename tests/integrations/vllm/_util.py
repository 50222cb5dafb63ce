"""Shared by the vLLM tests and the engine subprocess: the tiny model, engine
arguments, prompts. Importing this module does not import vLLM."""

from __future__ import annotations

import random

#: Tokens per vLLM block (the CPU backend needs a multiple of 32).
B = 32
VOCAB = 1000


def make_tiny_llama(path: str, seed: int = 0) -> str:
    """A seeded random Llama saved to ``path`` (no hub): 2 layers, 2 KV heads,
    head dim 32, vocab 1000, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def engine_kwargs(model: str, **over) -> dict:
    """``LLM(...)`` arguments: token-id prompts, eager CPU, fp32, 64 blocks of 32 tokens."""
    kw = dict(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        block_size=B,
        dtype="float32",
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        seed=0,
    )
    kw.update(over)
    return kw


def connector_config(extra: dict, **over):
    from vllm.config import KVTransferConfig

    kw = dict(
        kv_connector="TierstoreConnector",
        kv_connector_module_path="tierstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    kw.update(over)
    return KVTransferConfig(**kw)


def prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    """``n`` token ids in [1, VOCAB), seeded; starting with ``prefix`` if given."""
    rng = random.Random(seed)
    head = list(prefix or [])
    return head + [rng.randrange(1, VOCAB) for _ in range(n - len(head))]


def shutdown(llm) -> None:
    """Stop an in-process engine (closes the connector's store)."""
    llm.llm_engine.engine_core.shutdown()
