"""The flags that say which model runs where, shared by `kvcache generate` and `kvcache serve`:
`--model DIR` (a local transformers directory; default the bundled model), `--device`, `--dtype`,
`--generation-config` (whether its recommended sampling settings are the defaults), and
speculation (`--prompt-lookup K`, `--suffix-draft K` or `--draft-model DIR`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..devices import DEVICE_CHOICES
from ..errors import GenerationError

DTYPES = ("float32", "float64", "bfloat16", "float16")
#: Draft tokens per step of `--draft-model` (`--draft-tokens`).
DEFAULT_DRAFT_TOKENS = 4
#: The most tokens a suffix draft proposes when `kvcache serve --speculative suffix` gives no K.
DEFAULT_SUFFIX_TOKENS = 8
#: `kvcache serve` without a speculation flag: prompt lookup of up to this many tokens a step,
#: drafted while at most `AUTO_DRAFT_ROWS` requests run. Measured on 2 cores (tiny Llama- and
#: LFM2-shaped directories, `benchmarks/serve_anchor.py`'s load, this default against
#: `--speculative 0`): 1.45x-1.55x and 2.3x-2.5x the tokens/s at 1 client; with drafting at up to
#: 4 rows, 0.93x-0.95x (Llama) at 8 and 32 clients, where a forward's arithmetic, not its fixed
#: cost, sets its time; at most 1 row keeps those within the runs' noise. 8 tokens rather than 4:
#: 1.0x-1.1x (Llama) and 1.3x-1.4x (LFM2) at one request (docs/serve.md); the gate keeps text with
#: nothing to find at plain speed whatever the cap.
AUTO_DRAFT_TOKENS = 8
AUTO_DRAFT_ROWS = 1


def _speculative(text: str) -> int | str:
    """`--speculative`'s value: a number of draft tokens (0: none), or "suffix"."""
    if text == "suffix":
        return text
    try:
        value = int(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens or 'suffix', got {shown!r} (a bare "
                                         "--speculative takes the argument after it: put the prompt first, or "
                                         "give --speculative 4)") from None  # fmt: skip
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens >= 0 or 'suffix', got {text!r}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, *, draft_model: bool, speculative_default: str = "") -> None:
    """Add `--model`, `--device`, `--dtype`, the speculation flags (`--prompt-lookup`,
    `--suffix-draft`, `--speculative`: the one that names either; with `draft_model`, `--draft-model`
    and `--draft-tokens`) to `parser`; `speculative_default` ends `--speculative`'s help."""
    parser.add_argument("--model", metavar="DIR|ID", help="a local transformers model directory and its tokenizer, "
                        "or the hub id (org/name) of one downloaded into the local Hugging Face cache "
                        "(default: the bundled character-level model)")
    parser.add_argument("--revision", metavar="REV", default=None,
                        help="for a hub id --model: the branch, tag or commit of it to load, one the local cache "
                        "holds (default: main)")
    parser.add_argument("--tokenizer", metavar="DIR|ID", default=None,
                        help="another directory, GGUF file or cached hub id whose tokenizer and chat template "
                        "--model runs with (vLLM's flag; e.g. the original model's for a GGUF file; default: "
                        "--model's own)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let --model (and --draft-model) run modeling code of their own that their config "
                        "names (transformers' and vLLM's flag: that code runs in this process; for models you "
                        "trust)")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help=f"where the model runs: {', '.join(DEVICE_CHOICES)} or cuda:N (default auto: CUDA, "
                        "then MPS, then the CPU)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the model's dtype (default: float32 for the bundled model, the directory's own "
                        "for --model)")
    parser.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                        help="auto: sampling settings a request or flag leaves out (temperature, top_p, top_k, "
                        "min_p) are the ones --model DIR's generation_config.json recommends, as transformers "
                        "and vLLM take them; none: ignore that file (default auto)")
    parser.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                        help="the Jinja chat template --model DIR's tokenizer uses instead of its own (a file, or "
                        "the template itself, as vLLM takes it): for a directory that has none, or to replace it")
    parser.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                        help="speculative decoding that drafts up to K tokens per step from the text so far "
                        "(no draft model); the output is the same, sampled too (seed for seed)")
    parser.add_argument("--suffix-draft", type=int, default=None, metavar="K",
                        help="speculative decoding that drafts up to K tokens from what most often followed the "
                        "current context before: in this text and, in a server, in earlier requests' prompts and "
                        "answers (no draft model); the output is the same, sampled too (seed for seed)")
    parser.add_argument("--speculative", type=_speculative, nargs="?", const=4, default=None, metavar="K|suffix",
                        help=f"K: the same as --prompt-lookup K (K=4 when left out); suffix: the same as "
                        f"--suffix-draft {DEFAULT_SUFFIX_TOKENS}; 0: no speculation{speculative_default}")
    if draft_model:
        parser.add_argument("--draft-model", metavar="DIR|ID",
                            help="speculative decoding with this transformers directory (or cached hub id) as the "
                            "draft model (same "
                            "tokenizer as --model); greedy output is the same, sampled output follows the same "
                            "distribution")
        parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                            help=f"draft tokens per step of --draft-model (default {DEFAULT_DRAFT_TOKENS})")


def check_model_arguments(args: argparse.Namespace) -> None:
    """The speculation flags' values, before anything loads; `--speculative` becomes the flag it
    names (`--prompt-lookup K` or `--suffix-draft K`), and is 0 after; `--chat-template` becomes
    the template's text."""
    if getattr(args, "revision", None) is not None and not args.model:
        raise GenerationError("--revision picks a version of a hub id --model (the bundled model has one)")
    from ..models.locate import locate_model

    if getattr(args, "tokenizer", None) is not None:
        if not args.model:
            raise GenerationError("--tokenizer is for --model DIR (the bundled model's tokenizer is its own)")
        locate_model(args.tokenizer, flag="--tokenizer")
    if args.model:  # where the models are, before anything loads
        locate_model(args.model, getattr(args, "revision", None))
    if getattr(args, "draft_model", None):
        locate_model(args.draft_model, flag="--draft-model")
    if getattr(args, "chat_template", None) is not None:
        args.chat_template = chat_template_text(args.chat_template, args.model)
    chosen = getattr(args, "speculative", None)
    if chosen == "suffix":
        args.suffix_draft = args.suffix_draft if args.suffix_draft is not None else DEFAULT_SUFFIX_TOKENS
    elif chosen:
        if (args.prompt_lookup, args.suffix_draft, getattr(args, "draft_model", None)) != (None, None, None):
            raise GenerationError("--speculative K is --prompt-lookup K: give one speculation flag")
        args.prompt_lookup = chosen
    args.speculative = 0
    for name in ("prompt_lookup", "suffix_draft"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise GenerationError(f"--{name.replace('_', '-')} must be >= 1 draft token, got {value}")
    given = [flag for flag, on in (("--prompt-lookup", args.prompt_lookup is not None),
                                   ("--suffix-draft", args.suffix_draft is not None),
                                   ("--draft-model", bool(getattr(args, "draft_model", None)))) if on]  # fmt: skip
    if len(given) > 1:
        raise GenerationError(f"{' and '.join(given)} are alternatives: give one")
    if getattr(args, "draft_tokens", None) is not None and not getattr(args, "draft_model", None):
        raise GenerationError("--draft-tokens sets the draft length of --draft-model: give --draft-model DIR too "
                              "(--prompt-lookup K and --suffix-draft K take their own)")  # fmt: skip
    if getattr(args, "draft_model", None):
        if not args.model:
            raise GenerationError("--draft-model drafts for a --model DIR (the bundled model has no draft model)")
        if args.draft_tokens is None:
            args.draft_tokens = DEFAULT_DRAFT_TOKENS
        if args.draft_tokens < 1:
            raise GenerationError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")


def chat_template_text(given: str, model: str | None) -> str:
    """`--chat-template`'s template: the file it names, else the text itself where it reads as a
    Jinja template; checked to parse, so a bad one is a one-line error before anything loads."""
    if not model:
        raise GenerationError("--chat-template is for --model DIR (the bundled model's prompt format is fixed)")
    path = Path(given)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else given
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationError(f"--chat-template {given}: not read ({exc})") from None
    if not path.is_file() and not ("{{" in text or "{%" in text):
        raise GenerationError(f"--chat-template {given[:80]!r}: neither a file nor a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise GenerationError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})"
                              ) from None  # fmt: skip
    return text


def load_model(args: argparse.Namespace, device: Any) -> Any:
    """The `TextModel` the flags name, on `device` (`kvcache.devices.resolve_device(args.device)`)."""
    import torch

    from ..models.text_model import bundled, from_directory

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if not args.model:
        return bundled(dtype or torch.float32, device)
    served = from_directory(args.model, dtype, device, revision=getattr(args, "revision", None),
                            trust_remote_code=getattr(args, "trust_remote_code", False),
                            tokenizer=getattr(args, "tokenizer", None))  # fmt: skip
    if getattr(args, "generation_config", "auto") == "none":
        served.sampling = {}
    if getattr(args, "chat_template", None) is not None:  # (its text: `check_model_arguments`)
        served.tokenizer.chat_template = args.chat_template
    return served


def load_drafter(args: argparse.Namespace, target: Any) -> tuple[Any, int] | None:
    """`(drafter, draft tokens per step)` of the speculation flags, or None without them. A draft
    model runs where the target does, in its dtype, and must read the target's tokens: the same
    vocabulary, token for token."""
    from ..generation import PromptLookupDrafter, SuffixDrafter
    from ..models.text_model import from_directory

    if args.prompt_lookup is not None:
        return PromptLookupDrafter(), args.prompt_lookup
    if args.suffix_draft is not None:
        return SuffixDrafter(), args.suffix_draft
    if not getattr(args, "draft_model", None):
        return None
    draft = from_directory(args.draft_model, target.dtype, target.device, flag="--draft-model",
                           trust_remote_code=getattr(args, "trust_remote_code", False))  # fmt: skip
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise GenerationError(f"--draft-model {args.draft_model}: its tokenizer's vocabulary differs from "
                              f"--model {args.model}'s: a draft model must share the target's tokens")  # fmt: skip
    return draft.model, args.draft_tokens
