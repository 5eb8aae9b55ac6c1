"""A model directory's recommended sampling settings (`generation_config.json`) as the defaults of
`kvcache generate --model DIR` and `kvcache serve --model DIR`, as transformers' `generate`, its
server and vLLM take them: what the file writes is what a request or a flag that leaves a setting
out gets, an explicit one wins, `--generation-config none` ignores the file.

The observable: a file that recommends `top_k: 1` makes sampling pick the argmax, so a request or
run that names no top-k gives the greedy text; one that names `top_k` 0 samples again."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from serve_kit import ServeProcess, tiny_model_dir

from kvcache.cli import main
from kvcache.models.sampling_defaults import read_sampling_defaults
from kvcache.serve.responses import ResponseShape
from kvcache.serve.schema import ApiError, Limits, chat_params, completion_params

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The value of the cache is the sum"
RECOMMENDED = {"do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.9, "repetition_penalty": 1.3}


def written(where: Path, settings: dict | str) -> Path:
    (where / "generation_config.json").write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return where


# ----------------------------------------------------------------------------------------- the file
def test_the_file_settings_are_read_as_written(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == {}  # no file: the caller's own defaults
    written(tmp_path, {**RECOMMENDED, "min_p": 0.05, "bos_token_id": 1, "no_repeat_ngram_size": 3})
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": 1, "top_p": 0.9, "min_p": 0.05,
                                                "repetition_penalty": 1.3}  # fmt: skip
    written(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})  # what save_pretrained writes of a plain model
    assert read_sampling_defaults(tmp_path) == {}
    written(tmp_path, {"do_sample": False, "top_p": 0.8})  # the model says greedy, as transformers reads it
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.0, "top_p": 0.8}
    written(tmp_path, {"temperature": None, "top_k": 5})
    assert read_sampling_defaults(tmp_path) == {"top_k": 5}
    written(tmp_path, {"max_new_tokens": 512, "max_length": 20})  # the answer's length (max_length is not)
    assert read_sampling_defaults(tmp_path) == {"max_new_tokens": 512}


@pytest.mark.parametrize(("settings", "field"), [({"temperature": "hot"}, "temperature"),
                                                 ({"temperature": 3.5}, "temperature"),
                                                 ({"temperature": True}, "temperature"),
                                                 ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                                 ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"),
                                                 ({"min_p": 2}, "min_p"),
                                                 ({"repetition_penalty": 0}, "repetition_penalty"),
                                                 ({"repetition_penalty": 2.5}, "repetition_penalty"),
                                                 ({"max_new_tokens": 0}, "max_new_tokens"),
                                                 ({"max_new_tokens": 2.5}, "max_new_tokens")])  # fmt: skip
def test_a_setting_out_of_range_is_left_out_with_a_warning(tmp_path: Path, settings: dict, field: str) -> None:
    written(tmp_path, {**settings, "top_p": settings.get("top_p", 0.5)} if field != "top_p" else settings)
    with pytest.warns(UserWarning, match=field):
        read = read_sampling_defaults(tmp_path)
    assert field not in read
    if field != "top_p":
        assert read == {"top_p": 0.5}  # the valid ones are still taken


@pytest.mark.parametrize("text", ["{not json", "[0.7]", '{"temperature": NaN}'])
def test_an_unreadable_file_gives_no_defaults_and_says_so(tmp_path: Path, text: str) -> None:
    written(tmp_path, text)
    with pytest.warns(UserWarning, match="generation_config.json"):
        assert read_sampling_defaults(tmp_path) == {}


# ------------------------------------------------------------------------------- the request's view
def test_a_request_gets_the_defaults_for_what_it_leaves_out() -> None:
    limits = Limits(sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1})
    left_out = completion_params({"prompt": "x"}, "m", limits)
    assert (left_out.temperature, left_out.top_k, left_out.top_p, left_out.min_p, left_out.repetition_penalty) == (
        0.7, 20, 0.9, 0.05, 1.1)
    given = chat_params({"messages": [{"role": "user", "content": "x"}], "temperature": 0, "top_k": -1,
                         "top_p": 1.0, "min_p": 0, "repetition_penalty": 1}, "m", limits)  # fmt: skip
    assert (given.temperature, given.top_k, given.top_p, given.min_p, given.repetition_penalty) == (0.0, 0, 1.0, 0.0, 1)
    nulls = completion_params({"prompt": "x", "temperature": None, "top_k": None}, "m", limits)
    assert (nulls.temperature, nulls.top_k) == (0.7, 20)  # null reads as left out
    plain = completion_params({"prompt": "x"}, "m", Limits())  # no file: OpenAI's defaults
    assert (plain.temperature, plain.top_k, plain.top_p, plain.min_p, plain.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "1", True])
def test_a_repetition_penalty_out_of_range_is_a_400(bad) -> None:
    with pytest.raises(ApiError, match="repetition_penalty must be") as caught:
        completion_params({"prompt": "x", "repetition_penalty": bad}, "m", Limits())
    assert caught.value.status == 400


def test_a_response_reports_the_settings_it_ran_with() -> None:
    shape = ResponseShape({"input": "x"}, "m", {"temperature": 0.6, "top_k": 20})
    assert (shape.reported["temperature"], shape.reported["top_p"]) == (0.6, 1.0)
    shape = ResponseShape({"input": "x", "temperature": 0.2, "top_p": 0.5}, "m", {"temperature": 0.6})
    assert (shape.reported["temperature"], shape.reported["top_p"]) == (0.2, 0.5)


# ---------------------------------------------------------------------------------------- the CLI
def transformers_greedy(where: Path, dtype: torch.dtype, **options) -> str:
    """transformers' greedy `generate` on `tokenizer(PROMPT)` in `dtype` (16 tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the file's sampling settings, unused by greedy decoding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             **options)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny transformers directory as saved (no sampling settings), and a copy recommending top-k 1."""
    pytest.importorskip("transformers", minversion="5.24")
    root = tmp_path_factory.mktemp("gc")
    plain = tiny_model_dir(root / "plain")
    recommending = written(Path(shutil.copytree(plain, root / "recommending")), {"bos_token_id": 1, **RECOMMENDED})
    return plain, recommending


def run_cli(capsys: pytest.CaptureFixture[str], where: Path, *flags: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes on a tiny model
        code = main(["generate", "--model", str(where), PROMPT, "--max-new-tokens", "16", "--device", "cpu",
                     "--seed", "3", *flags])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_generate_takes_the_directory_settings_unless_a_flag_names_one(dirs, capsys) -> None:
    plain, recommending = dirs
    greedy = run_cli(capsys, plain, "--temperature", "0")
    assert greedy == transformers_greedy(plain, torch.float32) + "\n"
    sampled = run_cli(capsys, plain)  # the command's own defaults (temperature 0.8, no cut)
    assert sampled != greedy  # else this test could not tell the settings apart
    # top-k 1 from the file: the argmax each step, of the logits under the file's repetition penalty,
    # what transformers' greedy generate gives with that penalty; so do the speculative paths
    penalized = transformers_greedy(recommending, torch.float32, repetition_penalty=1.3) + "\n"
    assert penalized != greedy
    assert run_cli(capsys, recommending) == penalized
    for flags in (("--temperature", "0"), ("--prompt-lookup", "3"), ("--suffix-draft", "4")):
        assert run_cli(capsys, recommending, *flags) == penalized, flags
    # a flag wins over the file; --generation-config none ignores it
    assert run_cli(capsys, recommending, "--top-k", "0", "--temperature", "0.8", "--top-p", "1",
                   "--repetition-penalty", "1") == sampled  # fmt: skip
    assert run_cli(capsys, recommending, "--generation-config", "none") == sampled


def test_a_flag_out_of_range_is_refused_whatever_the_file_says(dirs, capsys) -> None:
    _, recommending = dirs
    assert main(["generate", "--model", str(recommending), PROMPT, "--top-p", "0"]) != 0
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err
    assert main(["generate", "--model", str(recommending), PROMPT, "--repetition-penalty", "0"]) != 0
    assert "repetition-penalty must be a finite number > 0, got 0.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the server
def test_serve_takes_the_directory_settings_unless_a_request_names_one(dirs, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    _, recommending = dirs
    server = ServeProcess("--model", str(recommending), "--threads", "1", "--dtype", "float64").start(
        tmp_path / "serve.log")
    try:
        c = server.client()
        name = recommending.name

        def complete(**options) -> str:
            return c.completions.create(model=name, prompt=PROMPT, max_tokens=16, seed=3, **options).choices[0].text

        greedy = complete(temperature=0)  # with the file's repetition penalty
        assert greedy == transformers_greedy(recommending, torch.float64, repetition_penalty=1.3)
        unpenalized = complete(temperature=0, extra_body={"repetition_penalty": 1})
        assert unpenalized != greedy
        assert unpenalized == transformers_greedy(recommending, torch.float64, repetition_penalty=1.0)
        assert complete() == greedy  # top-k 1 from the file
        sampled = complete(extra_body={"top_k": 0})  # the request names top-k: sampling at the file's 0.7
        assert sampled != greedy and complete(extra_body={"top_k": 0}) == sampled
        messages = [{"role": "user", "content": "Say the value"}]
        chat = lambda **o: c.chat.completions.create(model=name, messages=messages, max_tokens=12, seed=3, **o)  # noqa: E731
        assert chat().choices[0].message.content == chat(temperature=0).choices[0].message.content
        reported = c.responses.create(model=name, input="x", max_output_tokens=4)
        assert (reported.temperature, reported.top_p) == (0.7, 0.9)
    finally:
        server.stop()
    assert "defaults from its generation_config.json: temperature 0.7, top_p 0.9, top_k 1, " \
           "repetition_penalty 1.3" in (
        (tmp_path / "serve.log").read_text())


# ------------------------------------------------------------------ the library's repetition penalty
@pytest.fixture(scope="module")
def bundled():
    from kvcache.models import load_default_model

    return load_default_model()


def _penalized_reference(model, prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy decoding with no cache at all, each step's logits penalized by hand over the row's
    tokens so far (the reference for `generate(repetition_penalty=...)`)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]), cache=model.new_cache(),
                           position_ids=torch.arange(len(tokens))[None])[0, -1].float()  # fmt: skip
            for token in set(tokens):
                logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def test_generate_applies_the_repetition_penalty_to_each_row_alone(bundled) -> None:
    """Greedy `generate(repetition_penalty=)` gives what a cache-free recomputation penalized by
    hand gives; rows of a left-padded batch give what each gives alone (padding is no token of
    theirs); the answers differ from unpenalized ones."""
    from kvcache.generation import generate

    model, tokenizer = bundled
    prompts = [tokenizer.encode(text) for text in ("The value of the value of the ", "A list is a list ")]
    alone = [generate(model, torch.tensor([p]), max_new_tokens=12, repetition_penalty=1.5).sequences[0, len(p) :]
             .tolist() for p in prompts]  # fmt: skip
    assert alone == [_penalized_reference(model, p, 12, 1.5) for p in prompts]
    assert alone != [generate(model, torch.tensor([p]), max_new_tokens=12).sequences[0, len(p) :].tolist()
                     for p in prompts]  # fmt: skip
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = generate(model, ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=1.5)
    assert batched.sequences[:, width:].tolist() == alone


def test_speculation_with_a_repetition_penalty_gives_plain_decoding_tokens(bundled) -> None:
    """Prompt lookup under a repetition penalty: greedy, the tokens of greedy `generate`; sampled,
    the very tokens plain sampling draws from the same seed (and not those drawn without it)."""
    from kvcache.generation import PromptLookupDrafter, generate, speculative_generate

    model, tokenizer = bundled
    ids = torch.tensor([tokenizer.encode("The value of the value of the value of the ")])
    for options in ({}, {"do_sample": True, "temperature": 0.9}):
        def plain(penalty: float, options=options) -> list[int]:
            return generate(model, ids, max_new_tokens=20, repetition_penalty=penalty,
                            generator=torch.Generator().manual_seed(4), **options).sequences[0].tolist()  # fmt: skip

        drafted = speculative_generate(model, PromptLookupDrafter(), ids, max_new_tokens=20, num_draft_tokens=4,
                                       repetition_penalty=2.0, draft_schedule="constant",
                                       generator=torch.Generator().manual_seed(4), **options)  # fmt: skip
        assert drafted.sequences[0].tolist() == plain(2.0) != plain(1.0), options


def test_batched_speculation_penalizes_each_row_for_its_own_tokens(bundled) -> None:
    """A left-padded batch under speculation (drafts of 4 that foresee each row's penalized answer,
    every fifth token wrong, so rows keep different counts) with a repetition penalty: each row's
    greedy tokens are what the cache-free recomputation penalized by hand gives for that prompt
    alone (a draft's own earlier tokens count at each position it is verified at)."""
    from kvcache.generation import speculative_generate
    from kvcache.generation.drafters import Draft, Drafter

    model, tokenizer = bundled
    prompts = [tokenizer.encode(t) for t in ("The value of the value of the value of the ", "A list is a list ",
                                             "class A: pass\nclass B: pass\nclass ")]  # fmt: skip
    expected = [_penalized_reference(model, p, 16, 1.5) for p in prompts]

    class Foreseeing(Drafter):
        def propose(self, sequence, num_tokens, pick):
            full = next(p + e for p, e in zip(prompts, expected, strict=True) if list(sequence[: len(p)]) == p)
            n = len(sequence)
            return Draft([(t + 1) % 100 if (n + i) % 5 == 0 else t for i, t in enumerate(full[n : n + num_tokens])])

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = speculative_generate(model, Foreseeing(), ids, attention_mask=mask, max_new_tokens=16, num_draft_tokens=4,
                               repetition_penalty=1.5, draft_schedule="constant")  # fmt: skip
    assert [row[:16] for row in out.new_tokens] == expected
    accepted = [sum(row) for row in out.accepted_per_step]
    assert min(accepted) > 0 and len(set(map(tuple, out.accepted_per_step))) > 1  # rows kept different counts
    unpenalized = speculative_generate(model, Foreseeing(), ids, attention_mask=mask, max_new_tokens=16,
                                       num_draft_tokens=4, draft_schedule="constant")  # fmt: skip
    assert [row[:16] for row in unpenalized.new_tokens] != expected


def test_the_files_max_new_tokens_is_the_default_length(dirs, capsys, tmp_path: Path) -> None:
    """As transformers' `generate` and vLLM take it: `kvcache generate` without `--max-new-tokens`, a
    request without `max_tokens`; a flag or the request's own still wins."""
    plain, _ = dirs
    limited = written(Path(shutil.copytree(plain, tmp_path / "limited")), {"bos_token_id": 1, "max_new_tokens": 5})
    args = ["generate", "--model", str(limited), PROMPT, "--temperature", "0", "--ignore-eos", "--device", "cpu"]
    for extra, count in (((), 5), (("--max-new-tokens", "9"), 9)):
        assert main([*args, *extra]) == 0
        assert f"generated {count} tokens" in capsys.readouterr().err
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    for flags, count in (((), 5), (("--default-max-tokens", "3"), 3)):
        server = ServeProcess("--model", str(limited), "--threads", "1", *flags).start(tmp_path / "serve.log")
        try:
            c = server.client()
            answer = c.completions.create(model=limited.name, prompt=PROMPT, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            assert answer.usage.completion_tokens == count, flags
            asked = c.completions.create(model=limited.name, prompt=PROMPT, max_tokens=7,
                                         extra_body={"ignore_eos": True})  # fmt: skip
            assert asked.usage.completion_tokens == 7
        finally:
            server.stop()
