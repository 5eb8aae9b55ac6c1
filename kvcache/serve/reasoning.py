"""The reasoning a chat answer starts with, read apart from its content: what a model trained to
think first (Qwen 3, Qwen 3.5, Qwen3-Next, DeepSeek-R1's descendants) writes between `<think>` and
`</think>` before its answer, returned as the message's `reasoning_content` (as `transformers
serve` and vLLM return it), whole or streamed.

An answer is read so when the model's chat template writes those tags and its tokenizer decodes
them as text. Its reasoning starts at a `<think>` the answer opens with (after whitespace), or at
once where the prompt itself ends by opening `<think>` (a template that starts the assistant's
turn thinking), and ends at `</think>`; it is shown without the whitespace around it, and the content
after it without the whitespace that follows the tag (the template's layout). An answer that
ends while thinking (`max_tokens`) is reasoning alone. Without a `<think>` at its start the whole
answer is content, tags and all.
"""

from __future__ import annotations

from typing import Any

from .tags import until_tag

THINK, UNTHINK = "<think>", "</think>"


class Reasoning(str):
    """A piece of an answer's reasoning (text; the type says where it goes)."""


def reads_reasoning(served: Any) -> bool:
    """Whether `served`'s answers are read for reasoning: its chat template writes both tags and
    its tokenizer does not drop them from decoded text (special tokens)."""
    template = None if served.kind == "bundled" else getattr(served.tokenizer, "chat_template", None)
    special = set(getattr(served.tokenizer, "all_special_tokens", ()))
    return isinstance(template, str) and all(tag in template and tag not in special for tag in (THINK, UNTHINK))


def opened_in(prompt: str) -> bool:
    """Whether `prompt` (a rendered chat prompt) ends by opening `<think>` (a template that starts
    the assistant's turn thinking): the answer starts inside its reasoning. Only the end counts: a
    `<think>` a message wrote earlier in the conversation opens nothing."""
    return prompt.rstrip().endswith(THINK)


class ReasoningReader:
    """An answer's text, fed piece by piece, as `Reasoning` and content pieces in order: what it
    gives for any split of the text is what it gives for the whole. `thinking`: the prompt ended
    by opening `<think>` (`opened_in`)."""

    def __init__(self, thinking: bool = False) -> None:
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
                if not bare or (THINK.startswith(bare) and bare != THINK):  # may still open
                    return out
                if bare.startswith(THINK):
                    self._held, self._state, self.reasoned = bare[len(THINK) :], "inside", True
                    continue
                self._state = "content"
            if self._state == "inside":
                ready, self._held, closed = until_tag(self._held, UNTHINK)
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
