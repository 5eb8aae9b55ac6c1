"""Where `--model` is on disk: a local directory as given, a GGUF file (llama.cpp's format, which
transformers reads, dequantized), or a Hugging Face hub id (`org/name`) already downloaded into
the local Hugging Face cache, as transformers and vLLM take `--model`.

Only the local cache is read: nothing is downloaded (`hf download ID` does that), so a run never
reaches the network, and an id that is not there is a one-line error saying where it looked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheInputError


@dataclass(frozen=True)
class ModelLocation:
    """`directory`: the files; `name`: the model id answers show (a directory's or GGUF file's
    name, or the hub id as given); `hub_id`: the id for a model found in the cache, else None;
    `gguf_file`: the GGUF file's name in `directory` for one, else None."""

    directory: Path
    name: str
    hub_id: str | None = None
    gguf_file: str | None = None


def _is_hub_id(given: str) -> bool:
    """Whether `given` is spelled as a hub id (`name` or `org/name`), not as a path."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return False
    try:
        validate_repo_id(given)
    except HFValidationError:
        return False
    return True


def locate_model(given: str | Path, revision: str | None = None, flag: str = "--model") -> ModelLocation:
    """The model `given` names: a directory, else a hub id's snapshot in the local Hugging Face
    cache (`HF_HUB_CACHE`), at `revision` (a branch, tag or commit it was downloaded at; default
    the one `main` names). `flag` names the argument in errors."""
    where = Path(given)
    gguf = where.is_file() and where.suffix.lower() == ".gguf"
    if where.is_dir() or gguf:
        if revision is not None:
            raise CacheInputError(f"--revision picks a version of a Hugging Face hub model; {flag} {given} is a "
                                  f"{'file' if gguf else 'directory'} (give its hub id, or leave --revision out)")
        if gguf:
            return ModelLocation(where.parent, where.name, gguf_file=where.name)
        return ModelLocation(where, where.name)
    if where.is_file():
        raise CacheInputError(f"{flag} {given}: a file that is not a .gguf model (a model directory, a GGUF file "
                              "or a cached hub id is expected)")  # fmt: skip
    text = str(given)
    if not _is_hub_id(text):
        raise CacheInputError(f"{flag} {given}: not a directory (a local transformers model directory, or the "
                              "hub id of one in the local Hugging Face cache, is expected)")  # fmt: skip
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(text, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision is not None else ""
        raise CacheInputError(f"{flag} {given}: neither a directory nor a model in the local Hugging Face cache "
                              f"({constants.HF_HUB_CACHE}){at}; download it first (hf download {text}"
                              f"{f' --revision {revision}' if revision else ''}) or give its directory"
                              ) from None  # fmt: skip
    return ModelLocation(Path(snapshot), text, text)
