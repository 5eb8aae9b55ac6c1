"""kvcache caches inside unmodified Hugging Face transformers models (docs/transformers.md).

    from kvcache.integrations.transformers import as_transformers_cache, cache_from_config, wrap_model

    cache = cache_from_config(model.config)                  # a kvcache cache for this architecture
    out = model(input_ids, cache=as_transformers_cache(cache))  # transformers' own forward
    cache.activate_past_recording(); ...; cache.crop(-3)      # exact rollback, even of Mamba layers

    result = kvcache.generation.generate(wrap_model(model), input_ids, max_new_tokens=20)

Needs the optional extra `kvcache[transformers]`: transformers >=5.24,<6 (the supported range; the
extra asks for the same, so an installed transformers inside it is kept). Versions outside it are
refused at import; versions inside it other than the tested 5.24.x and 5.25.x import with a warning, since
transformers changes its cache protocol between minor versions. Nothing else in kvcache imports
transformers.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

from .hf_cache import TransformersCache, TransformersEncoderDecoderCache, as_transformers_cache, unwrap_cache
from .hf_config import cache_from_config, layer_for
from .hf_models import TransformersCausalLM, TransformersEncoderDecoderLM, wrap_model

#: transformers versions this integration supports, [low, high): the `kvcache[transformers]` extra's range.
SUPPORTED_TRANSFORMERS = (Version("5.24"), Version("6"))
#: The minor versions it is tested with; others in the supported range warn.
TESTED_TRANSFORMERS = (Version("5.24"), Version("5.25"))
_TESTED = " and ".join(f"{v}.x" for v in TESTED_TRANSFORMERS)

_found = Version(transformers.__version__)
if not SUPPORTED_TRANSFORMERS[0] <= _found < SUPPORTED_TRANSFORMERS[1]:
    raise ImportError(
        f"kvcache.integrations.transformers needs transformers >={SUPPORTED_TRANSFORMERS[0]},"
        f"<{SUPPORTED_TRANSFORMERS[1]} (tested: {_TESTED}), found {transformers.__version__}: "
        'pip install "kvcache[transformers]"'
    )
if _found.release[:2] not in {v.release[:2] for v in TESTED_TRANSFORMERS}:
    warnings.warn(
        f"kvcache.integrations.transformers is tested with transformers {_TESTED}, found "
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
