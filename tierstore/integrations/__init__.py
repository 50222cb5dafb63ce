"""Engine integrations.

* :mod:`tierstore.integrations.hf` -- Hugging Face transformers causal LMs (``DynamicCache``):
  prefix lookup, KV load into the cache, suffix prefill, block stores during prefill and decode.
"""
