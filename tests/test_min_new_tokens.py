"""`min_new_tokens` (transformers' `generate` argument; `kvcache generate --min-new-tokens`): no
end token before a row has that many new tokens. Checked against greedy decoding step by step
with the end tokens banned by hand (`test_serve_end_tokens.ended_greedy`), in `generate` (one row
and a left-padded batch), in `speculative_generate` (one row and a batch, drafts verified at
positions on both sides of the limit), seeded sampling against plain sampling, and transformers'
own `generate(min_new_tokens=)` on a model directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_serve_end_tokens import ended_greedy

from kvcache.cli import main
from kvcache.errors import GenerationError
from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
from kvcache.models import load_default_model

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ("The value of the value of the value of the ", "A list is a list is a ")


@pytest.fixture(scope="module")
def bundled():
    return load_default_model(dtype=torch.float64)


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


def until_end(tokens: list[int], end: int) -> list[int]:
    return tokens[: tokens.index(end) + 1] if end in tokens else tokens


def test_no_end_token_before_min_new_tokens_plain_and_speculative(bundled) -> None:
    model, tokenizer = bundled
    prompts = [tokenizer.encode(t) for t in TEXTS]
    end = generate(model, torch.tensor([prompts[0]]), max_new_tokens=4, eos_token_id=[]).sequences[0, -2].item()
    expected = [ended_greedy(model, p, 30, {end}, min_tokens=8) for p in prompts]
    early = [ended_greedy(model, p, 30, {end}) for p in prompts]
    assert expected != early and all(len(e) > 8 and end not in e[:8] for e in expected)
    for p, want in zip(prompts, expected, strict=True):
        out = generate(model, torch.tensor([p]), max_new_tokens=30, min_new_tokens=8, eos_token_id=end)
        assert out.sequences[0, len(p) :].tolist() == want
        for schedule in ("constant", "adaptive"):
            drafted = speculative_generate(model, PromptLookupDrafter(), torch.tensor([p]), max_new_tokens=30,
                                           min_new_tokens=8, eos_token_id=end, draft_schedule=schedule)  # fmt: skip
            assert drafted.sequences[0, len(p) :].tolist() == want
    ids, mask = padded(prompts)
    batch = generate(model, ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=8, eos_token_id=end)
    assert [until_end(row, end) for row in batch.sequences[:, ids.shape[1] :].tolist()] == expected
    drafted = speculative_generate(model, PromptLookupDrafter(), ids, attention_mask=mask, max_new_tokens=30,
                                   min_new_tokens=8, eos_token_id=end, draft_schedule="constant")  # fmt: skip
    assert [until_end(row, end) for row in drafted.new_tokens] == expected
    with pytest.raises(GenerationError, match="min_new_tokens"):
        generate(model, ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=-1)


def test_seeded_sampling_under_min_new_tokens_is_what_plain_sampling_draws(bundled) -> None:
    """Point-mass drafts are verified by the target's own draws: a seeded sampled run with prompt
    lookup draws plain sampling's tokens, end tokens banned alike before the limit."""
    model, tokenizer = bundled
    ids = torch.tensor([tokenizer.encode(TEXTS[0])])
    ends = sorted(set(generate(model, ids, max_new_tokens=12).sequences[0, ids.shape[1] :].tolist()))[:5]

    def run(speculate: bool) -> list[int]:
        options = {"max_new_tokens": 24, "min_new_tokens": 16, "eos_token_id": ends, "do_sample": True,
                   "temperature": 1.3, "generator": torch.Generator().manual_seed(3)}  # fmt: skip
        out = (speculative_generate(model, PromptLookupDrafter(), ids, draft_schedule="constant", **options)
               if speculate else generate(model, ids, **options))  # fmt: skip
        return out.sequences[0, ids.shape[1] :].tolist()

    plain = run(False)
    assert len(plain) >= 16 and not set(plain[:16]) & set(ends)
    assert run(True) == plain


def test_a_model_directory_ends_as_transformers_generate_with_min_new_tokens(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    from serve_kit import tiny_model_dir

    from kvcache.integrations.transformers import wrap_model

    where = tiny_model_dir(tmp_path / "tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(where).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    ids = tokenizer("The value of the cache", return_tensors="pt").input_ids
    ones = torch.ones_like(ids)
    free = hf.generate(ids, attention_mask=ones, max_new_tokens=20, do_sample=False, eos_token_id=None)
    end = free[0, ids.shape[1] + 2].item()  # the third token: an end token there
    assert end not in free[0, ids.shape[1] : ids.shape[1] + 2].tolist()
    want = hf.generate(ids, attention_mask=ones, max_new_tokens=20, min_new_tokens=10, do_sample=False,
                       eos_token_id=end)[0, ids.shape[1] :].tolist()  # fmt: skip
    assert len(want) > 3  # the limit moved the end
    ours = generate(wrap_model(hf), ids, max_new_tokens=20, min_new_tokens=10, eos_token_id=end)
    assert until_end(ours.sequences[0, ids.shape[1] :].tolist(), end) == until_end(want, end)
    config = (where / "generation_config.json").read_text().replace('"eos_token_id": 2', f'"eos_token_id": {end}')
    assert f'"eos_token_id": {end}' in config
    (where / "generation_config.json").write_text(config)
    code = main(["generate", "--model", str(where), "The value of the cache", "--temperature", "0",
                 "--max-new-tokens", "20", "--min-new-tokens", "10"])  # fmt: skip
    out, err = capsys.readouterr()
    shown = [t for t in until_end(want, end) if t != end]
    assert code == 0 and out == tokenizer.decode(shown, skip_special_tokens=True) + "\n", err
