"""A model with its tokenizer and chat template, as the command line and the server use it: the
bundled default model, or a transformers model from a local directory (`wrap_model` inside), on
the device and in the dtype asked for.

The bundled model's chat template is plain text, one line per message:

    System: <content>\\n       User: <content>\\n       Assistant:<content>\\n

and the prompt ends with `Assistant:`, where the model continues. The assistant line has no space
after the colon: the model writes what follows, so a client that sends an answer back as the
next turn's assistant message (unchanged) makes a prompt that starts with the previous prompt and
answer token for token, and the prefix store reuses both.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..errors import CacheInputError
from ..generation.token_bytes import TokenBytes, byte_reader
from . import default
from .locate import locate_model
from .sampling_defaults import read_sampling_defaults

ROLES = ("system", "user", "assistant")
#: Special tokens decoded text keeps (every other special token is dropped): Gemma 4's tool-call
#: tags and string quote, which the server reads calls out of (`serve.gemma_calls`), and the tags
#: of its thinking channel (`serve.reasoning`); LFM2's tool-call tags (`serve.pythonic_calls`);
#: Mistral's (`serve.mistral_calls`) and its reasoning's
KEPT_SPECIAL = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<|tool_call_start|>",
                "<|tool_call_end|>", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")  # fmt: skip


@dataclass
class TextModel:
    """`model` (kvcache protocol), `name` (the API's model id), `identity` (the prefix store's
    namespace; the store's fingerprint names the weights and config), `eos` ids, and text <-> ids."""

    model: Any
    name: str
    eos: list[int]
    tokenizer: Any
    kind: str  # "bundled" or "transformers"
    identity: str = ""
    #: the sampling settings the directory recommends (`sampling_defaults`), which requests and flags
    #: that leave a setting out get; empty for the bundled model
    sampling: dict[str, float | int] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Where the weights are (the first parameter's device)."""
        return self._first_parameter().device

    @property
    def dtype(self) -> torch.dtype:
        return self._first_parameter().dtype

    def _first_parameter(self) -> torch.Tensor:
        module = self.model.model if self.kind == "transformers" else self.model
        return next(iter(module.parameters()))

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def context(self) -> tuple[int, str] | None:
        """`(positions, field)`: the most positions the model takes and the config field that says
        so (`context_length`); None where nothing limits it (the bundled model: rotary, no limit)."""
        return getattr(self.model, "context_length", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `CacheInputError` for characters the model cannot read. A
        transformers tokenizer adds its special tokens (a BOS) as it does by default, so a
        completion's prompt is what `model.generate(**tokenizer(prompt))` sees; a chat prompt,
        whose template writes them already, is encoded without (`add_special_tokens=False`), as
        `apply_chat_template(tokenize=True)` does."""
        if self.kind == "bundled":
            unknown = self.tokenizer.unknown_characters(text)
            if unknown:
                shown = "".join(unknown[:20])
                raise CacheInputError(f"{len(unknown)} character(s) outside the model's alphabet: {shown!r}")
            return self.tokenizer.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        if self.kind == "bundled":
            return self.tokenizer.decode(ids)
        if not self._kept:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the one token whose text is `text` (a control token such as Mistral's
        `[ARGS]`), or None where the tokenizer has no such token."""
        if self.kind == "bundled":
            return None
        found = self.tokenizer.convert_tokens_to_ids(text)
        return int(found) if isinstance(found, int) and self.tokenizer.convert_ids_to_tokens(found) == text else None

    @cached_property
    def _kept(self) -> frozenset[int]:
        """The ids of the tokenizer's `KEPT_SPECIAL` tokens (special or not: kept either way)."""
        # (a tokenizer without an unknown token, as Qwen's, answers None for a token it lacks)
        ids = {self.tokenizer.convert_tokens_to_ids(token) for token in KEPT_SPECIAL} - {None}
        return frozenset(int(i) for i in ids if self.tokenizer.convert_ids_to_tokens(int(i)) in KEPT_SPECIAL)

    @cached_property
    def _dropped(self) -> frozenset[int]:
        """The special tokens `decode` drops: every one but the kept ones."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        special = set(self.tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
        return frozenset(special - self._kept)

    @cached_property
    def token_bytes(self) -> TokenBytes | None:
        """What bytes the tokens stand for, as `decode` reads them (a stream then holds back exactly
        the characters that later bytes can change), or None where the tokenizer does not say."""
        if self.kind == "bundled":
            return None
        return byte_reader(self.tokenizer, skip_special_tokens=True, keep=self._kept)

    def cache_id(self) -> str:
        """What a saved prompt cache names its model by, so that a cache of other weights is
        refused: the bundled model's weights hash, or for a transformers model the digest of its
        class, config (not its path), dtype and weights."""
        if self.kind == "bundled":
            return self.identity
        from ..store.identity import fingerprint

        root = fingerprint(self.model, [], namespace="saved-cache", chunk_size=0, key=None)
        return f"transformers-{root.hex()[:32]}"

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: dict[str, Any] | None = None, *, generation_prompt: bool = True,
                    continue_final: bool = False) -> str:  # fmt: skip
        """The prompt text of a conversation (see the module docstring for the bundled template; a
        transformers tokenizer's own chat template otherwise, given the function `tools` the model
        may call and the template's own variables `options`, e.g. Qwen 3's `enable_thinking`).
        It ends with the start of the assistant's answer (`generation_prompt`), or inside the last
        message, an assistant's, which the answer then continues (`continue_final`: a prefilled
        answer, transformers' `continue_final_message`)."""
        if continue_final and (generation_prompt or not messages or messages[-1]["role"] != "assistant"):
            raise CacheInputError("continue_final_message needs the last message to be the assistant's, and "
                                  "add_generation_prompt false")  # fmt: skip
        if self.kind == "bundled":
            if options:
                raise CacheInputError(f"{self.name}'s prompt format has no variables: chat_template_kwargs must be "
                                      "empty")  # fmt: skip
            lines = []
            for message in messages:
                role, content = message["role"], message["content"]
                lines.append(f"Assistant:{content}\n" if role == "assistant" else f"{role.capitalize()}: {content}\n")
            if continue_final:
                lines[-1] = lines[-1][:-1]  # (the assistant's line left open)
            return "".join(lines) + ("Assistant:" if generation_prompt else "")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise CacheInputError(f"the tokenizer of {self.name} has no chat template: use /v1/completions")
        from jinja2 import TemplateError  # (transformers' templates run on jinja2)

        extra = {**(options or {}), **({} if tools is None else {"tools": tools})}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      continue_final_message=continue_final, **extra)  # fmt: skip
        except TemplateError as exc:  # the template refused the conversation (`raise_exception`): the client's to fix
            raise CacheInputError(f"the chat template of {self.name} refused the conversation: {exc}") from None
        except ValueError as exc:  # (continue_final: the template does not write the last message as it was sent)
            raise CacheInputError(f"the chat template of {self.name} cannot continue the last message: {exc}") from None


#: What `kvcache.serve` called it.
ServedModel = TextModel


def model_id(weights_dir: Path | None = None) -> str:
    """Names the bundled model by the hash of its weights and config (in `weights_dir`, default
    the bundled directory), so a cache saved with other weights is refused."""
    weights_dir = weights_dir or default.WEIGHTS_DIR
    digest = hashlib.sha256()
    for name in ("default.json", "default.safetensors"):
        digest.update((weights_dir / name).read_bytes())
    return f"kvcache-default-{digest.hexdigest()[:16]}"


def bundled(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> TextModel:
    """The bundled character-level model (`kvcache generate`'s)."""
    model, tokenizer = default.load_default_model(dtype=dtype, device=device, weights_dir=default.WEIGHTS_DIR)
    return TextModel(model, "kvcache-default", [], tokenizer, "bundled", model_id())


def _not_a_model(path: str | Path, exc: Exception, flag: str = "--model") -> CacheInputError:
    """The error for a directory transformers cannot load as a causal LM: its message's first line
    (an unknown configuration class is followed by the list of every known one)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "custom code" in first:  # transformers' refusal of a directory's own modeling code
        return CacheInputError(f"{flag} {path}: its config names modeling code of its own (config.json's "
                               "auto_map), which runs only with --trust-remote-code: give it for a model you trust")
    return CacheInputError(f"{flag} {path}: not a transformers causal LM directory ({first[:300]})")


def from_directory(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                   revision: str | None = None, flag: str = "--model", trust_remote_code: bool = False,
                   tokenizer: str | Path | None = None) -> TextModel:  # fmt: skip
    """A transformers causal LM and its tokenizer saved in `path`, or downloaded into the local
    Hugging Face cache as the hub id `path` names (at `revision`; `locate.locate_model`: local
    files only), on `device` (default: the CPU) in `dtype` (default: the dtype the directory names,
    as transformers' `dtype="auto"`). An image-text-to-text checkpoint that no causal-LM class takes (Mistral 3,
    Qwen2.5-VL, Qwen3-VL) is loaded whole with its own class and runs on text alone, as vLLM serves
    such a model to a text request. A directory whose config names modeling code of its own loads
    only with `trust_remote_code` (transformers' flag: that code runs here); without it, transformers'
    interactive question is never asked. `tokenizer`: another directory, GGUF file or cached hub id
    whose tokenizer (and chat template) to use (vLLM's `--tokenizer`), its ids within the model's."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING,
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        )
    except ImportError as exc:
        raise CacheInputError('--model needs transformers: pip install "kvcache[transformers]"') from exc
    from ..integrations.transformers import wrap_model

    location = locate_model(path, revision, flag)
    where = location.directory
    local = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if location.gguf_file is not None:  # (read, and its weights dequantized, by transformers)
        lacking = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if lacking:  # (transformers' GGUF loader needs both)
            raise CacheInputError(f"{flag} {path}: reading a GGUF file needs the {' and '.join(lacking)} "
                                  'package(s): pip install "kvcache[gguf]"')  # fmt: skip
        local["gguf_file"] = location.gguf_file
    try:
        config = AutoConfig.from_pretrained(where, **local)
    except (OSError, ValueError, KeyError) as exc:  # no config, an unknown model type
        raise _not_a_model(path, exc, flag) from exc
    if getattr(config, "is_encoder_decoder", False):  # transformers would load its decoder alone
        raise CacheInputError(f"{flag} {path}: {type(config).__name__} is an encoder-decoder model; the CLI and "
                              "the server run causal LMs (from Python, wrap it with "
                              "kvcache.integrations.transformers.wrap_model)")  # fmt: skip
    # a configuration the causal-LM classes do not map: its image-text-to-text class, if it has one
    kind = type(config)
    image_text = kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    if tokenizer is not None:  # (checked before the weights load)
        words = _tokenizer(tokenizer, trust_remote_code, int(config.get_text_config(decoder=True).vocab_size))
    try:
        hf, loading = auto.from_pretrained(where, dtype=dtype or "auto", output_loading_info=True, **local)
        if tokenizer is None:
            words = AutoTokenizer.from_pretrained(where, **local)
    except (OSError, ValueError, KeyError) as exc:  # no weights, a type with no causal LM
        raise _not_a_model(path, exc, flag) from exc
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers fills them with random numbers and only warns
        raise CacheInputError(f"{flag} {path}: the directory's weights leave {len(missing)} of "
                              f"{type(hf).__name__}'s parameters unset ({', '.join(missing[:3])}): a checkpoint of "
                              "another kind of model?")  # fmt: skip
    hf = hf.eval()
    if device is not None:
        hf = hf.to(device)
    wrapped = wrap_model(hf)
    # the end tokens are the generation config's, as transformers' generate and serve take them: a
    # config that names none runs every answer to its token limit (the tokenizer's own is not used)
    eos = wrapped.eos_token_id or []
    # the store's namespace: the fingerprint already covers the config and weights (not the path),
    # so servers loading the same model from anywhere share one store
    # (a GGUF file's directory may hold anything: its generation_config.json is not the file's)
    sampling = read_sampling_defaults(where) if location.gguf_file is None else {}
    return TextModel(wrapped, location.name, list(eos), words, "transformers", "transformers", sampling)


def _tokenizer(given: str | Path, trust_remote_code: bool, vocab_size: int) -> Any:
    """`--tokenizer`'s tokenizer (a directory, GGUF file or cached hub id), its ids checked to be
    the model's (an id past the embedding would fail a forward)."""
    from transformers import AutoTokenizer

    location = locate_model(given, flag="--tokenizer")
    local: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if location.gguf_file is not None:
        local["gguf_file"] = location.gguf_file
    try:
        words = AutoTokenizer.from_pretrained(location.directory, **local)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CacheInputError(f"--tokenizer {given}: no tokenizer read there ({first[:300]})") from exc
    most = max(words.get_vocab().values(), default=-1)
    if most >= vocab_size:
        raise CacheInputError(f"--tokenizer {given}: its ids run to {most}, past the {vocab_size} tokens the "
                              "model reads: the tokenizer of another model?")  # fmt: skip
    return words
