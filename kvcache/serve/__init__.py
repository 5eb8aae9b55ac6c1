"""`kvcache serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn; the `serve` extra)
that decodes concurrent requests together and sends every request through the prefix store."""

from .engine import Engine, Request
from .served import ServedModel, bundled, from_directory

__all__ = ["Engine", "Request", "ServedModel", "bundled", "create_app", "from_directory"]


def create_app(*args, **kwargs):  # type: ignore[no-untyped-def]  (Starlette is imported only here)
    """See `kvcache.serve.api.create_app`."""
    from .api import create_app as make

    return make(*args, **kwargs)
