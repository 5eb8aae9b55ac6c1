"""Bridges to other libraries. Each submodule imports its library itself; importing this package imports none.

- `kvcache.integrations.transformers`: kvcache caches inside unmodified Hugging Face transformers models
  (optional extra `kvcache[transformers]`).
"""
