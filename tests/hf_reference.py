"""What a transformers user gets from a model and its tokenizer: the independent reference the
command-line and server tests compare against."""

from __future__ import annotations

from typing import Any

import torch


def greedy_text(model: Any, tokenizer: Any, prompt: str, new: int, chat: bool = False) -> str:
    """Greedy `generate` on `tokenizer(prompt)` (or, with `chat`, on the chat template's ids of the
    prompt as a user message), the new tokens decoded without special tokens."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
