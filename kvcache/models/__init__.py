"""Small, readable reference models that use the caches exactly as real model code does.

* `DecoderLM`: decoder-only transformer (rotary positions, grouped-query attention, a pattern of
  full and sliding-window layers).
* `HybridLM`: attention layers, gated-linear-recurrence layers (causal conv + matrix state) and
  parallel-hybrid layers holding both (a `HybridLayer` in the cache).
* `EncoderDecoderLM`: encoder-decoder with cross-attention and an `EncoderDecoderCache`.
* `load_default_model()`: the bundled character-level `DecoderLM` and its tokenizer.

All implement the protocols of `kvcache.protocol`.
"""

from .decoder import DecoderConfig, DecoderLM
from .default import default_model_info, load_default_model
from .encoder_decoder import EncoderDecoderConfig, EncoderDecoderLM
from .hybrid import HybridConfig, HybridLM
from .tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "DecoderConfig",
    "DecoderLM",
    "EncoderDecoderConfig",
    "EncoderDecoderLM",
    "HybridConfig",
    "HybridLM",
    "default_model_info",
    "load_default_model",
]
