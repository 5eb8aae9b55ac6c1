"""`kvcache generate PROMPT`: stream text from the bundled default model or a local transformers
directory (`--model DIR`), on any device, optionally speculative (`--draft-model`,
`--prompt-lookup`), saving or resuming from the prompt's cache.

Stdout carries only the generated text; what was reused and how fast it ran goes to stderr.

Exact resumption: floating-point results depend on how a prompt is split into forward calls, so
the prompt is always fed in blocks of `PREFILL_BLOCK` tokens aligned to absolute positions, then
the rest but its last token, then the last token as the first decoding step. `--save-cache`
stores the cache after the whole blocks (and the prompt's tokens as metadata), so a run resumed
with `--cache`, on the same prompt or one extending it, makes exactly the forward calls an
uninterrupted run makes from there on, and prints exactly the same text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import GenerationError
from .model_args import add_model_arguments, check_model_arguments, load_drafter, load_model

DEFAULT_MAX_NEW_TOKENS = 200
#: Draft tokens a step of `--prediction` without a speculation flag (the server's default width).
PREDICTION_DRAFT_TOKENS = 8
DEFAULT_TEMPERATURE = 0.8
DEFAULT_SEED = 0
DEFER_CHOICES = {"auto": None, "on": True, "off": False}
#: Prompt tokens per prefill forward call (and the granularity of a saved prompt cache).
PREFILL_BLOCK = 256


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream text from the bundled model or a local transformers model",
        description="Stream text from the bundled character-level model (or --model DIR, a local transformers "
        "model). Stdout: the generated text only.",
    )
    parser.add_argument("prompt", help="the text to continue ('-' reads it from standard input)")
    add_model_arguments(parser, draft_model=True, speculative_default=" (the default)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    model_says = "; for --model DIR, the directory's generation_config.json setting where it has one"
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens to generate (default {DEFAULT_MAX_NEW_TOKENS}{model_says}; 0 only builds the "
                        "prompt's cache)")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"sampling temperature (default {DEFAULT_TEMPERATURE}{model_says}; 0 means greedy)")
    parser.add_argument("--top-k", type=int, default=None,
                        help=f"sample from the k most likely tokens (default 0 = all{model_says})")
    parser.add_argument("--top-p", type=float, default=None,
                        help=f"nucleus sampling mass (default 1.0 = off{model_says})")
    parser.add_argument("--min-p", type=float, default=None,
                        help=f"sample from tokens at least this fraction as likely as the best one (default 0 = "
                        f"off{model_says})")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help=f"divide the logits of tokens already in the text by this, greedy or sampled, as "
                        f"transformers does (default 1 = off{model_says})")
    parser.add_argument("--prediction", metavar="FILE", default=None,
                        help="a text the answer is expected to largely repeat (a file being edited): drafted from "
                        "and verified, so the output is the same, sooner (OpenAI's predicted outputs; with a "
                        "speculation flag, its drafter takes over where the prediction has nothing)")
    parser.add_argument("--min-new-tokens", type=int, default=0, metavar="N",
                        help="no end token before N new tokens (default 0)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="decode past the model's end tokens, to --max-new-tokens (fixed-length runs)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    parser.add_argument("--defer-stop", choices=sorted(DEFER_CHOICES), default="auto",
                        help="read the stop decision one step late (auto: on asynchronous devices only)")
    parser.add_argument("--save-cache", metavar="FILE", help="save the prompt's cache (and its tokens) to FILE")
    parser.add_argument("--cache", metavar="FILE",
                        help="resume from a cache saved with --save-cache (the prompt must start with its prompt)")
    parser.add_argument("--prefix-store", metavar="DIR_OR_URL",
                        help="reuse prompt prefixes stored in this directory or Redis server (redis://host:port/db), "
                        "and store this prompt's")
    parser.add_argument("--prefix-store-key-file", metavar="FILE",
                        help=f"keep strangers out of the store: entries carry a MAC under the key in FILE (or in "
                        f"${KEY_ENV}); never pass a key on the command line")
    parser.add_argument("--prefix-store-bytes", type=int, default=1 << 30, metavar="N",
                        help="the store's byte budget (default 1 GiB); least recently used prefixes go first")
    parser.add_argument("--kv-bits", type=int, choices=(8, 4, 2), default=None,
                        help="quantize the attention cache to 8, 4 or 2 bits (keys and values per channel in "
                        "blocks of 16 tokens; the block being filled stays in full precision); default: full "
                        "precision")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's, one per core)")
    parser.set_defaults(func=run, flag_names=FLAG_NAMES)  # fmt: skip

    def one_line_error(message: str) -> None:  # argparse prints the whole usage block otherwise
        parser.exit(2, f"kvcache generate: error: {message} (see kvcache generate -h)\n")

    parser.error = one_line_error  # type: ignore[method-assign]


#: The library's parameter names that `kvcache generate` sets from flags of other names.
FLAG_NAMES = {"max_bytes": "--prefix-store-bytes"}
#: The environment variable a store key may come from (a flag would show it to `ps`).
KEY_ENV = "KVCACHE_PREFIX_STORE_KEY"


def sampling_settings(args: argparse.Namespace, model_says: dict[str, float | int]) -> dict[str, Any]:
    """`{"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}`: each flag given, else what
    the model recommends (`TextModel.sampling`), else the command's default; `GenerationError` for a
    flag out of range."""
    from ..generation.sampling import Sampling

    if args.temperature is not None and args.temperature < 0:
        raise GenerationError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    defaults = {"temperature": DEFAULT_TEMPERATURE, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else model_says.get(name, default)
              for name, default in defaults.items()}  # fmt: skip
    temperature = chosen["temperature"]
    Sampling(temperature > 0, temperature, chosen["top_k"], chosen["top_p"], chosen["min_p"],
             repetition_penalty=chosen["repetition_penalty"])  # raises for values out of range
    return {name: type(default)(chosen[name]) for name, default in defaults.items()}


def run(args: argparse.Namespace) -> int:
    import torch

    from ..devices import resolve_device
    from ..generation import TextStreamer, generate, speculative_generate
    from ..persistence import load_cache

    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise GenerationError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.min_new_tokens < 0:
        raise GenerationError(f"--min-new-tokens must be >= 0, got {args.min_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise GenerationError(f"--threads must be >= 1, got {args.threads}")
    if args.prefix_store and args.cache:
        raise GenerationError("--prefix-store and --cache are alternatives: give one")
    check_model_arguments(args)
    sampling_settings(args, {})  # the flags given, checked before any work
    if args.prediction is not None:
        try:
            args.prediction_text = Path(args.prediction).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GenerationError(f"--prediction {args.prediction}: not read ({exc})") from None
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise GenerationError("the prompt is empty")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # a device this machine lacks fails before anything loads
    store = _open_store(args) if args.prefix_store else None  # a bad location or budget too
    loaded = load_cache(args.cache, return_metadata=True, device=device) if args.cache else None  # a bad file too
    served = load_model(args, device)
    served.model.kv_bits = args.kv_bits  # new_cache() builds quantized attention layers (the store's too)
    settings = sampling_settings(args, served.sampling)
    if args.max_new_tokens is None:  # (as transformers' generate takes the file's max_new_tokens)
        args.max_new_tokens = int(served.sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    sampling = settings["temperature"] > 0
    drafter = _with_prediction(args, served, load_drafter(args, served))
    ids = _encode(served, text, args.chat)
    args.max_new_tokens = _within_context(served, len(ids), args.max_new_tokens)
    built = _prefill(args, served, ids, store, loaded)
    if args.max_new_tokens == 0:
        return 0

    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    eos = served.tokenizer.eos_token_id if served.kind == "bundled" else None  # None: the generation config's
    if args.ignore_eos:  # decode past the end tokens, to --max-new-tokens
        eos = []
    options = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.min_new_tokens, "eos_token_id": eos,
               "do_sample": sampling,
               **settings, "temperature": settings["temperature"] if sampling else 1.0,
               "generator": generator}  # fmt: skip
    started = time.perf_counter()
    skip = [] if args.ignore_eos else served.eos or ([eos] if isinstance(eos, int) else [])  # (end tokens: unprinted)
    if drafter is None:
        out = generate(served.model, prompt, cache=built, streamer=TextStreamer(served, skip_token_ids=skip),
                       defer_stop=DEFER_CHOICES[args.defer_stop], **options)  # fmt: skip
    else:  # no streamer: the whole text at the end
        out = speculative_generate(served.model, drafter[0], prompt, cache=built, num_draft_tokens=drafter[1],
                                   **options)  # fmt: skip
        print(served.decode([t for t in out.sequences[0, len(ids) :].tolist() if t not in skip]), flush=True)
    elapsed = time.perf_counter() - started
    new = out.sequences.shape[1] - len(ids)
    speculated = "" if drafter is None else f", {sum(out.accepted_per_step)} drafted tokens accepted"
    print(f"generated {new} tokens in {elapsed:.2f} s ({new / max(elapsed, 1e-9):.1f} tokens/s{speculated})",
          file=sys.stderr)  # fmt: skip
    return 0


def _with_prediction(args: argparse.Namespace, served: Any, drafter: tuple[Any, int] | None) -> tuple[Any, int] | None:
    """The speculation flags' drafter, behind `--prediction`'s text where one is given (prompt
    lookup behind it where no flag names another; `PREDICTION_DRAFT_TOKENS` a step)."""
    if args.prediction is None:
        return drafter
    from ..errors import CacheInputError
    from ..generation import PredictionDrafter, PromptLookupDrafter

    try:
        predicted = served.encode(args.prediction_text, add_special_tokens=False)
    except CacheInputError as exc:
        raise GenerationError(f"--prediction {args.prediction}: {exc}") from None
    fallback, tokens = drafter or (PromptLookupDrafter(), PREDICTION_DRAFT_TOKENS)
    return PredictionDrafter(predicted, fallback), tokens


def _within_context(served: Any, prompt: int, new: int) -> int:
    """The new tokens the model's context leaves room for after a prompt of `prompt` tokens (at
    most `new`, with a line on stderr when fewer); a `GenerationError` when the prompt alone fills it."""
    if served.context is None:
        return new
    length, field = served.context
    if prompt > length or (prompt == length and new > 0):
        raise GenerationError(f"the prompt has {prompt} tokens: {served.name} takes at most {length} positions "
                              f"(its config's {field}), the new tokens included")  # fmt: skip
    if prompt + new > length:
        print(f"kvcache generate: --max-new-tokens {new} cut to {length - prompt}: {served.name} takes at most "
              f"{length} positions (its config's {field})", file=sys.stderr)  # fmt: skip
    return min(new, length - prompt)


def _encode(served: Any, text: str, chat: bool) -> list[int]:
    """The prompt's ids: through the chat template with `--chat`; as the tokenizer encodes by
    default otherwise (a transformers tokenizer adds its BOS, as `tokenizer(prompt)` does). The
    bundled model reads characters outside its alphabet as its unknown character, with a warning."""
    if chat:
        text = served.chat_prompt([{"role": "user", "content": text}])
    if served.kind != "bundled":
        return served.encode(text, add_special_tokens=not chat)
    unknown = served.tokenizer.unknown_characters(text)
    if unknown:
        shown = "".join(unknown[:20]) + ("..." if len(unknown) > 20 else "")
        print(f"kvcache generate: warning: {len(unknown)} character(s) outside the model's alphabet are read as "
              f"{served.tokenizer.unknown!r}: {shown!r}", file=sys.stderr)  # fmt: skip
    return served.tokenizer.encode(text)


def _prefill(args: argparse.Namespace, served: Any, ids: list[int], store: Any, loaded: Any) -> Any:
    """The prompt's cache (all but its last token), built in `PREFILL_BLOCK`-token blocks from
    `--cache` (`loaded`) or the prefix store where they hold a prefix; saved with `--save-cache`
    after the whole blocks."""
    import torch

    from ..generation import generate
    from ..generation.blocks import prefill_blocks, whole_blocks
    from ..persistence import save_cache
    from ..progress import Progress

    model, this_model = served.model, served.cache_id()
    cache, reused = _resume(args, ids, this_model, served, loaded) if loaded else (model.new_cache(), 0)
    prompt = torch.tensor([ids], dtype=torch.long, device=served.device)
    started = time.perf_counter()
    whole = whole_blocks(len(ids), PREFILL_BLOCK)
    if store is not None:  # the store prefills in the same blocks, so the text is the same with or without it
        with Progress(whole, "prefill", unit="tok") as progress:
            reused, cache = store.prefill(model, ids, progress=progress)  # the cache holds every whole block
        print(f"prefix store {store.location}: {'hit' if reused else 'miss'}, {reused} token(s) reused; it holds "
              f"{len(store)} chunk(s), {store.nbytes:,} bytes", file=sys.stderr)  # fmt: skip
    with Progress(whole - cache.get_seq_length(), "prefill", unit="tok") as progress:
        prefill_blocks(model, prompt, cache, block=PREFILL_BLOCK, end=whole, progress=progress)
    if args.save_cache:
        metadata = {"model": this_model, "prompt_ids": ids, "cached_tokens": whole}
        save_cache(cache, args.save_cache, metadata=metadata)
        print(f"saved the cache of {whole} of the prompt's {len(ids)} tokens to {args.save_cache} (whole "
              f"{PREFILL_BLOCK}-token blocks; a resumed run prefills the rest)", file=sys.stderr)  # fmt: skip
    built = generate(model, prompt, cache=cache, max_new_tokens=0)  # the rest of the prompt but its last token
    print(f"prompt: {len(ids)} tokens, {reused} reused from the cache, {len(ids) - 1 - reused} prefilled "
          f"in {(time.perf_counter() - started) * 1e3:.1f} ms", file=sys.stderr)  # fmt: skip
    return built.cache


def _resume(args: argparse.Namespace, ids: list[int], this_model: str, served: Any, loaded: Any) -> tuple[Any, int]:
    """The `--cache` file's cache (`loaded` onto the model's device, with its metadata) and how many
    tokens it holds, after checking it is a prompt cache of this model whose prompt starts this one."""
    cache, metadata = loaded
    saved, reused = metadata.get("prompt_ids"), metadata.get("cached_tokens")
    if metadata.get("model") != this_model or not isinstance(saved, list) or not isinstance(reused, int):
        raise GenerationError(f"{args.cache} is not a prompt cache of this model (saved with --save-cache?)")
    if ids[: len(saved)] != saved:
        raise GenerationError(
            f"the prompt does not start with the prompt saved in {args.cache} ({_preview(served.decode(saved))})"
        )
    if reused % PREFILL_BLOCK:
        raise GenerationError(f"{args.cache} was saved in blocks other than this version's {PREFILL_BLOCK} "
                              "tokens: save it again with --save-cache")  # fmt: skip
    if cache.get_seq_length() != reused or reused >= len(saved):
        raise GenerationError(f"{args.cache}: the cache holds {cache.get_seq_length()} tokens, not {reused}")
    return cache, reused


def store_key(args: argparse.Namespace) -> bytes | None:
    """The store's MAC key: the bytes of `--prefix-store-key-file` (a trailing newline dropped),
    else those of $KVCACHE_PREFIX_STORE_KEY, else None. At least 16 bytes."""
    import os

    if args.prefix_store_key_file:
        key = Path(args.prefix_store_key_file).read_bytes().rstrip(b"\r\n")
        where = f"--prefix-store-key-file {args.prefix_store_key_file}"
    elif os.environ.get(KEY_ENV):
        key, where = os.environ[KEY_ENV].encode(), f"${KEY_ENV}"
    else:
        return None
    if len(key) < 16:
        raise GenerationError(f"{where}: a store key needs at least 16 bytes, got {len(key)}")
    return key


def _open_store(args: argparse.Namespace) -> Any:
    """The `--prefix-store` store, its budget checked under the flag's name. Its namespace is the
    bundled model's weights hash, or "transformers" for `--model` (the store's fingerprint covers
    the weights and config, not the directory's path, so the same model anywhere shares entries)."""
    from ..models.text_model import model_id
    from ..store import open_store

    return open_store(args.prefix_store, chunk_size=PREFILL_BLOCK, max_bytes=args.prefix_store_bytes,
                      namespace="transformers" if args.model else model_id(), key=store_key(args))  # fmt: skip


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
