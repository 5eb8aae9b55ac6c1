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


@pytest.mark.parametrize(("settings", "field"), [({"temperature": "hot"}, "temperature"),
                                                 ({"temperature": 3.5}, "temperature"),
                                                 ({"temperature": True}, "temperature"),
                                                 ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                                 ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"),
                                                 ({"min_p": 2}, "min_p"),
                                                 ({"repetition_penalty": 0}, "repetition_penalty"),
                                                 ({"repetition_penalty": 2.5}, "repetition_penalty")])  # fmt: skip
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
    # the one setting the command line does not apply is said, not dropped in silence
    says = "the directory's repetition_penalty 1.3 is not applied here" in captured.err
    assert says == (where.name == "recommending" and "none" not in flags), captured.err
    return captured.out


def test_generate_takes_the_directory_settings_unless_a_flag_names_one(dirs, capsys) -> None:
    plain, recommending = dirs
    greedy = run_cli(capsys, plain, "--temperature", "0")
    sampled = run_cli(capsys, plain)  # the command's own defaults (temperature 0.8, no cut)
    assert sampled != greedy  # else this test could not tell the settings apart
    assert run_cli(capsys, recommending) == greedy  # top-k 1 from the file: the argmax each step
    # a flag wins over the file; --generation-config none ignores it
    assert run_cli(capsys, recommending, "--top-k", "0", "--temperature", "0.8", "--top-p", "1") == sampled
    assert run_cli(capsys, recommending, "--generation-config", "none") == sampled


def test_a_flag_out_of_range_is_refused_whatever_the_file_says(dirs, capsys) -> None:
    _, recommending = dirs
    assert main(["generate", "--model", str(recommending), PROMPT, "--top-p", "0"]) != 0
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the server
def transformers_greedy(where: Path, **options) -> str:
    """transformers' greedy `generate` on `tokenizer(PROMPT)` (float64, as the server runs here)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the file's sampling settings, unused by greedy decoding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             **options)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_serve_takes_the_directory_settings_unless_a_request_names_one(dirs, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    _, recommending = dirs
    server = ServeProcess("--model", str(recommending), "--threads", "1", "--dtype", "float64").start(
        tmp_path / "serve.log")
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        name = recommending.name

        def complete(**options) -> str:
            return c.completions.create(model=name, prompt=PROMPT, max_tokens=16, seed=3, **options).choices[0].text

        greedy = complete(temperature=0)  # with the file's repetition penalty
        assert greedy == transformers_greedy(recommending, repetition_penalty=1.3)
        unpenalized = complete(temperature=0, extra_body={"repetition_penalty": 1})
        assert unpenalized != greedy and unpenalized == transformers_greedy(recommending, repetition_penalty=1.0)
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
    assert "sampling defaults from its generation_config.json: temperature 0.7, top_p 0.9, top_k 1, " \
           "repetition_penalty 1.3" in (
        (tmp_path / "serve.log").read_text())
