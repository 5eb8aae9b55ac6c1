"""Cache layer kinds: one model layer's keys/values or conv/recurrent states."""

from .base import LAYER_REGISTRY, CacheLayer, register_layer
from .dynamic import DynamicLayer
from .empty import EmptyLayer
from .hybrid import HybridLayer
from .quantized import QuantizedLayer
from .quantized_rows import QuantizedRows
from .quantized_sliding import QuantizedSlidingWindowLayer
from .recurrent import RecurrentLayer
from .sliding import SlidingWindowLayer
from .static import StaticLayer
from .static_recurrent import StaticRecurrentLayer
from .static_sliding import StaticSlidingWindowLayer

__all__ = [
    "LAYER_REGISTRY",
    "CacheLayer",
    "DynamicLayer",
    "EmptyLayer",
    "HybridLayer",
    "QuantizedLayer",
    "QuantizedRows",
    "QuantizedSlidingWindowLayer",
    "RecurrentLayer",
    "SlidingWindowLayer",
    "StaticLayer",
    "StaticRecurrentLayer",
    "StaticSlidingWindowLayer",
    "register_layer",
]
