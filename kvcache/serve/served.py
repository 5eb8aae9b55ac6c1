"""The model a server serves: `kvcache.models.text_model` (shared with `kvcache generate`)."""

from ..models.text_model import ServedModel, TextModel, bundled, from_directory

__all__ = ["ServedModel", "TextModel", "bundled", "from_directory"]
