"""Text generation with kvcache caches: `generate`, its stop checks, sampling and streamers, and
speculative decoding (`speculative_generate` with a draft model, prompt lookup, suffix drafting or a
predicted output)."""

from .draft_schedule import DraftGate
from .drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from .driver import GenerationOutput, generate
from .prediction import PredictionDrafter
from .sampling import Sampling
from .speculative import SpeculativeOutput, speculative_generate
from .speculative_batch import BatchSpeculativeOutput
from .stop import DeferredStopCheck, StopCheck, is_async_device
from .streamers import Streamer, TextStreamer, TokenCollector
from .suffix import SuffixCorpus, SuffixDrafter

__all__ = [
    "DeferredStopCheck",
    "Draft",
    "DraftGate",
    "Drafter",
    "GenerationOutput",
    "ModelDrafter",
    "PredictionDrafter",
    "PromptLookupDrafter",
    "Sampling",
    "BatchSpeculativeOutput",
    "SpeculativeOutput",
    "StopCheck",
    "SuffixCorpus",
    "SuffixDrafter",
    "Streamer",
    "TextStreamer",
    "TokenCollector",
    "generate",
    "is_async_device",
    "speculative_generate",
]
