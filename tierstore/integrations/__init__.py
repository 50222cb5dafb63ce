"""Engine integrations.

* :mod:`tierstore.integrations.hf` -- Hugging Face transformers causal LMs (``DynamicCache``):
  prefix lookup, KV load into the cache, suffix prefill, block stores during prefill and decode.
* :mod:`tierstore.integrations.vllm` -- a vLLM KV connector (``KVConnectorBase_V1``); imports
  vLLM, so it is imported only by vLLM (``kv_connector_module_path``), never by this package.
* :mod:`tierstore.integrations._common` -- engine-independent helpers of the connectors: model
  identity (weights fingerprint) and the engine's extra-config dict split into typed configs.
* :mod:`tierstore.integrations.sglang` -- SGLang HiCache L3 storage backend (``HiCacheTierStore``,
  loaded by SGLang's ``dynamic`` storage backend); needs SGLang installed (``nox -s sglang``).
"""
