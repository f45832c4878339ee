"""Adapters that put kvattn under serving engines. Each lives in its own module and imports its engine
only when used: :mod:`kvattn.integrations.transformers` (Hugging Face continuous batching),
:mod:`kvattn.integrations.vllm` (vLLM's V1 engine, a plugin; its attention backend in
:mod:`~kvattn.integrations.vllm_backend`, the checked KV-connector receiver in
:mod:`~kvattn.integrations.vllm_connector`), :mod:`kvattn.integrations.sglang` (SGLang, an
attention backend registered by a plugin; the backend class in
:mod:`~kvattn.integrations.sglang_backend`)."""
