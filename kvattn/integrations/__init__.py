"""Adapters that put kvattn under serving engines. Each lives in its own module and imports its engine
only when used: :mod:`kvattn.integrations.transformers` (Hugging Face continuous batching)."""
