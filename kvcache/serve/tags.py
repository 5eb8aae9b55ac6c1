"""Text held back while an answer streams: what a tag that has not fully arrived may yet make
markup (a tool call's, a reasoning block's)."""

from __future__ import annotations


def held_tail(text: str, tag: str) -> int:
    """How many of `text`'s last characters to hold back until more text comes: a beginning of
    `tag`, and the whitespace before it (which the tag would make layout)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return len(text) - len(text[: len(text) - n].rstrip())
    return len(text) - len(text.rstrip())


def until_tag(held: str, tag: str) -> tuple[str, str, bool]:
    """`held` cut at `tag`: the text that can go out now, the text still held, and whether the tag
    came. Before it comes, all but `held_tail` goes out; once it has, the text before it (less the
    whitespace next to it, which the tag makes layout) goes out and the text after it is held."""
    at = held.find(tag)
    if at < 0:
        keep = len(held) - held_tail(held, tag)
        return held[:keep], held[keep:], False
    return held[:at].rstrip(), held[at + len(tag) :], True
