"""The reasoning a chat answer starts with, read apart from its content: what a model trained to
think first (Qwen 3, Qwen 3.5, Qwen3-Next, DeepSeek-R1's descendants) writes between `<think>` and
`</think>` before its answer, returned as the message's `reasoning_content` (as `transformers
serve` and vLLM return it), whole or streamed.

An answer is read so when the model's chat template writes those tags and its tokenizer decodes
them as text; or, for Gemma 4, whose template writes its thinking channel between the special
tokens `<|channel>` and `<channel|>` (the channel named `thought` after the first), with those
tags (`CHANNEL`, `UNCHANNEL`: decoded text keeps both tokens, `TextModel.decode`); or, for
Mistral's reasoning models (Magistral), between its control tokens `[THINK]` and `[/THINK]`
(kept the same way). Its reasoning
starts at an opening tag the answer starts with (after whitespace), or at once where the prompt
itself ends by opening one (a template that starts the assistant's turn thinking), and ends at
the closing tag; it is shown without the whitespace around it, and the content after it without
the whitespace that follows the tag (the template's layout). An answer that ends while thinking
(`max_tokens`) is reasoning alone. Without an opening tag at its start the whole answer is
content, tags and all.
"""

from __future__ import annotations

from typing import Any

from .api_error import ApiError
from .tags import until_tag

THINK, UNTHINK = "<think>", "</think>"
#: Gemma 4's thinking channel (its tags are special tokens of its tokenizer)
CHANNEL, UNCHANNEL = "<|channel>thought", "<channel|>"
#: Mistral's (Magistral's) reasoning, between two control tokens
BRACKET_THINK, BRACKET_UNTHINK = "[THINK]", "[/THINK]"


class Reasoning(str):
    """A piece of an answer's reasoning (text; the type says where it goes)."""


def reasoning_tags(served: Any) -> tuple[str, str] | None:
    """The tags `served`'s answers are read for reasoning with, None when they are not read: Gemma
    4's channel or Mistral's `[THINK]` where its chat template writes them, else `<think>` and
    `</think>` where the template writes both and the tokenizer does not drop them from decoded
    text (special tokens)."""
    template = None if served.kind == "bundled" else getattr(served.tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if "<|channel>" in template and UNCHANNEL in template:
        return CHANNEL, UNCHANNEL
    if BRACKET_THINK in template and BRACKET_UNTHINK in template:
        return BRACKET_THINK, BRACKET_UNTHINK
    special = set(getattr(served.tokenizer, "all_special_tokens", ()))
    return (THINK, UNTHINK) if all(tag in template and tag not in special for tag in (THINK, UNTHINK)) else None


#: vLLM's `--reasoning-parser` names of the reasoning formats this server reads, by their opening tag.
REASONING_PARSERS = {"deepseek_r1": THINK, "qwen3": THINK, "granite": THINK, "glm45": THINK, "seed_oss": THINK,
                     "minimax_m2": THINK, "ernie45": THINK, "mistral": BRACKET_THINK, "gemma4": CHANNEL}  # fmt: skip


def reasoning_parser_refused(served: Any, parser: str) -> str | None:
    """Why vLLM's `--reasoning-parser parser` does not fit `served` (None: it does): answers are
    read for reasoning in the tags the model's template writes; the flag, taken so that vLLM's
    command lines run, must name those tags."""
    if parser not in REASONING_PARSERS:
        return (f"--reasoning-parser {parser}: not a reasoning format this server reads (it reads "
                f"{', '.join(sorted(REASONING_PARSERS))})")  # fmt: skip
    tags = reasoning_tags(served)
    if tags is None:
        return (f"--reasoning-parser {parser}: the model's chat template writes no reasoning tags this server "
                "reads, so its answers are not read for reasoning")  # fmt: skip
    if REASONING_PARSERS[parser] != tags[0]:
        return (f"--reasoning-parser {parser}: the model's chat template writes its reasoning between {tags[0]} "
                f"and {tags[1]}, which the server reads; leave the flag out or name a parser of those tags")
    return None


#: OpenAI's `reasoning_effort` values.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def reasoning_effort(value: Any) -> str | None:
    """A chat's `reasoning_effort` (null: none), checked: the chat template's `reasoning_effort`
    variable, as vLLM passes it (gpt-oss's template reads it; a template that does not, ignores it)."""
    if value is not None and value not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}"[:300],
                       param="reasoning_effort")  # fmt: skip
    return value


def opened_in(prompt: str, tags: tuple[str, str] = (THINK, UNTHINK)) -> bool:
    """Whether `prompt` (a rendered chat prompt) ends by opening the reasoning (`tags[0]`: a
    template that starts the assistant's turn thinking): the answer starts inside it. Only the end
    counts: a tag a message wrote earlier in the conversation opens nothing."""
    return prompt.rstrip().endswith(tags[0])


def closing(tags: tuple[str, str]) -> str:
    """What closes a reasoning block the prompt opened, empty, as the templates close one when
    thinking is switched off (Qwen's `\n</think>\n\n`; Gemma 4's and Mistral's, a closing token)."""
    return f"\n{tags[1]}\n\n" if tags[1] == UNTHINK else tags[1]


class ReasoningReader:
    """An answer's text, fed piece by piece, as `Reasoning` and content pieces in order: what it
    gives for any split of the text is what it gives for the whole. `thinking`: the prompt ended
    by opening the reasoning (`opened_in`); `tags`: the reasoning's opening and closing tags."""

    def __init__(self, thinking: bool = False, tags: tuple[str, str] = (THINK, UNTHINK)) -> None:
        self.open, self.close = tags
        self._state = "inside" if thinking else "start"
        self._held = ""
        self._leading = True  # the reasoning's first text is still to come: whitespace before it is layout
        self.reasoned = thinking  # the answer has a reasoning block (opened by the prompt or by itself)

    def feed(self, text: str) -> list[str]:
        self._held += text
        out: list[str] = []
        while True:
            if self._state == "start":
                bare = self._held.lstrip()
                if not bare or (self.open.startswith(bare) and bare != self.open):  # may still open
                    return out
                if bare.startswith(self.open):
                    self._held, self._state, self.reasoned = bare[len(self.open) :], "inside", True
                    continue
                self._state = "content"
            if self._state == "inside":
                ready, self._held, closed = until_tag(self._held, self.close)
                self._reason(out, ready)
                if not closed:
                    return out
                self._state = "after"
            if self._state == "after":  # the whitespace after the closing tag is layout
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._state = "content"
            if self._held:
                out.append(self._held)
            self._held = ""
            return out

    def finish(self) -> list[str]:
        """What is still held once the answer ended: reasoning never closed, or content."""
        out: list[str] = []
        if self._state == "inside":
            self._reason(out, self._held.rstrip())
        elif self._state in ("start", "content") and self._held:
            out.append(self._held)
        self._held = ""
        return out

    def _reason(self, out: list[str], text: str) -> None:
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        if text:
            out.append(Reasoning(text))
