"""kvcache caches inside unmodified Hugging Face transformers models (SPEC sections 1 and 9).

    from kvcache.integrations.transformers import as_transformers_cache, cache_from_config, wrap_model

    cache = cache_from_config(model.config)                  # a kvcache cache for this architecture
    out = model(input_ids, cache=as_transformers_cache(cache))  # transformers' own forward
    cache.activate_past_recording(); ...; cache.crop(-3)      # exact rollback, even of Mamba layers

    result = kvcache.generation.generate(wrap_model(model), input_ids, max_new_tokens=20)

Needs the optional extra `kvcache[transformers]` (transformers 5.24.x, the tested range; other 5.x
versions import with a warning). Nothing else in kvcache imports transformers.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

from .hf_cache import TransformersCache, TransformersEncoderDecoderCache, as_transformers_cache, unwrap_cache
from .hf_config import cache_from_config, layer_for
from .hf_models import TransformersCausalLM, TransformersEncoderDecoderLM, wrap_model

#: transformers versions this integration is tested with, [low, high): the `kvcache[transformers]` pin.
TESTED_TRANSFORMERS = (Version("5.24"), Version("5.25"))

_found = Version(transformers.__version__)
if not TESTED_TRANSFORMERS[0] <= _found < Version("6"):
    raise ImportError(
        f"kvcache.integrations.transformers needs transformers >={TESTED_TRANSFORMERS[0]},<6 (tested: "
        f'{TESTED_TRANSFORMERS[0]}.x), found {transformers.__version__}: pip install "kvcache[transformers]"'
    )
if _found >= TESTED_TRANSFORMERS[1]:
    warnings.warn(
        f"kvcache.integrations.transformers is tested with transformers {TESTED_TRANSFORMERS[0]}.x, found "
        f"{transformers.__version__}; transformers changes its cache protocol between minor versions",
        stacklevel=2,
    )

__all__ = [
    "TransformersCache",
    "TransformersCausalLM",
    "TransformersEncoderDecoderCache",
    "TransformersEncoderDecoderLM",
    "as_transformers_cache",
    "cache_from_config",
    "layer_for",
    "unwrap_cache",
    "wrap_model",
]
