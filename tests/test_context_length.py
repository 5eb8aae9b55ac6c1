"""A model's context length, as its config names it (`models.context_length`): `kvcache generate`
stops there and `kvcache serve` refuses what would need more (OpenAI's and vLLM's 400), where a
model with learned positions used to fail mid-answer with an IndexError. The tiny GPT-2 directory
has 64 learned positions; every answer is checked against transformers' own greedy `generate`."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest
import torch
from serve_kit import ServeProcess, tiny_model_dir

from kvcache.cli import main
from kvcache.models.context_length import context_length
from kvcache.serve.served import bundled

transformers = pytest.importorskip("transformers", minversion="5.24")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "The value of the cache is the sum "


def test_the_context_is_what_the_config_names() -> None:
    """The smallest length field present; YaRN extends it by its factor; a config without one (and
    the bundled model, rotary with no trained limit) has none."""
    assert context_length(transformers.GPT2Config(n_positions=64))[0] == 64
    assert context_length(transformers.LlamaConfig(max_position_embeddings=4096)) == (4096, "max_position_embeddings")
    yarn = transformers.Qwen2Config(max_position_embeddings=32768, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6})  # fmt: skip
    assert context_length(yarn)[0] == 131072 and "YaRN" in context_length(yarn)[1]
    linear = transformers.Gemma3TextConfig(max_position_embeddings=131072,
                                           rope_parameters={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    assert context_length(linear)[0] == 131072  # written extended already
    vision = transformers.Qwen2_5_VLConfig(text_config={"max_position_embeddings": 1000})
    assert context_length(vision) == (1000, "max_position_embeddings")  # the text model's
    assert context_length(transformers.T5Config()) is None
    assert bundled().context is None


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-gpt2", "gpt2")


def transformers_ids(where: Path, ids: list[int], new: int) -> list[int]:
    """transformers' greedy `generate` on the directory (float64): the new token ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64).eval()
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


def tokens(where: Path, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(where)(text).input_ids


def test_the_cli_stops_at_the_context_and_refuses_a_prompt_that_fills_it(gpt2, capsys) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2)
    prompt = (WORDS * 6).strip()
    ids = tokens(gpt2, prompt)
    assert 40 < len(ids) < 64
    room = 64 - len(ids)
    expected = tokenizer.decode(transformers_ids(gpt2, ids, room), skip_special_tokens=True)
    for extra in ((), ("--prompt-lookup", "4")):
        code = main(["generate", "--model", str(gpt2), prompt, "--temperature", "0", "--max-new-tokens", "40",
                     "--dtype", "float64", *extra])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        assert out == expected + "\n" and f"--max-new-tokens 40 cut to {room}" in err
        assert f"generated {room} tokens" in err
    long = (WORDS * 9).strip()
    code = main(["generate", "--model", str(gpt2), long, "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and "Traceback" not in err  # (above: transformers' loading bar)
    assert f"error: the prompt has {len(tokens(gpt2, long))} tokens: tiny-gpt2 takes at most 64 positions" in err


@pytest.fixture(scope="module")
def served(gpt2, tmp_path_factory):
    process = ServeProcess("--model", str(gpt2), "--dtype", "float64", "--threads", "1")
    process.start(tmp_path_factory.mktemp("serve") / "stderr.log")
    yield process
    assert process.terminate() == 0, process.log()


def test_the_server_refuses_what_the_context_cannot_hold_and_cuts_its_default(gpt2, served) -> None:
    """max_tokens past the context is a 400 naming both counts (context_length_exceeded); left out,
    the default is cut to the room left; a prompt that fills the context is a 400; the model card
    says the length (vLLM's `max_model_len`)."""
    c = served.client()
    prompt = (WORDS * 6).strip()
    ids = tokens(gpt2, prompt)
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is 64 tokens.*{len(ids) + 40} tokens"):
        c.completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=40, temperature=0)
    answer = c.completions.create(model="tiny-gpt2", prompt=prompt, temperature=0)
    want = transformers_ids(gpt2, ids, 64 - len(ids))
    assert answer.usage.completion_tokens == len(want) == 64 - len(ids) and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].text == transformers.AutoTokenizer.from_pretrained(gpt2).decode(
        want, skip_special_tokens=True)  # fmt: skip
    fits = c.completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=64 - len(ids), temperature=0)
    assert fits.choices[0].text == answer.choices[0].text
    for body in ({"prompt": (WORDS * 9).strip()}, {"prompt": ids + [5] * (64 - len(ids))},
                 {"prompt": prompt, "max_tokens": 40, "stream": True}):  # fmt: skip
        refused = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    chat = httpx.post(f"{served.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": WORDS * 9}]})  # fmt: skip
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert c.models.retrieve("tiny-gpt2").model_extra["max_model_len"] == 64
    body = {"prompt": prompt, "return_token_strs": True}
    counted = httpx.post(f"{served.url}/tokenize", json=body, timeout=30).json()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2)
    assert counted["tokens"] == ids and counted["max_model_len"] == 64  # the BOS included, as completions add it
    assert counted["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    bare = httpx.post(f"{served.url}/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=30)
    assert bare.json()["tokens"] == ids[1:]


def test_rows_at_the_end_of_the_context_beside_drafting_rows_get_their_own_answers(gpt2, served) -> None:
    """Rows that reach the last position while others verify drafts (the server drafts by prompt
    lookup by default): a short row's fillers in a wide verify forward must not be fed past the
    model's last position. Each answer equals transformers' greedy `generate` of that prompt."""
    prompts = [tokens(gpt2, (WORDS * k).strip())[:n] for k, n in ((2, 12), (6, 48), (6, 56), (3, 20), (6, 60))]
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2)

    def ask(ids: list[int]) -> str:
        body = {"prompt": ids, "max_tokens": 64 - len(ids), "temperature": 0}
        return httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    for _ in range(2):
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(ask, prompts))
        for ids, text in zip(prompts, texts, strict=True):
            assert text == tokenizer.decode(transformers_ids(gpt2, ids, 64 - len(ids)), skip_special_tokens=True)
    assert "Traceback" not in served.log()


def test_an_engine_row_at_the_last_position_beside_drafting_rows(gpt2) -> None:
    """In the engine, with drafts of 6 tokens every step: a row one token short of the context runs
    in the same verify forwards as rows that draft (its fillers would be fed at positions 64 and
    on), and every row gets transformers' greedy answer."""
    from test_serve_engine import run_requests

    from kvcache.generation.sampling import Sampling
    from kvcache.serve.engine import Engine, Request
    from kvcache.serve.served import from_directory
    from kvcache.store import PrefixStore

    served = from_directory(gpt2, dtype=torch.float64)
    prompts = [tokens(gpt2, (WORDS * 6).strip())[:n] for n in (20, 30, 61)]
    engine = Engine(served.model, PrefixStore(chunk_size=16), eos=served.eos, speculative=6,
                    draft_schedule="constant")  # fmt: skip
    requests = [Request(prompt=p, max_tokens=64 - len(p), sampling=Sampling(False)) for p in prompts]
    engine.start()
    try:
        run_requests(engine, requests)
    finally:
        engine.stop()
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.finish_reason in ("length", "stop")
        assert request.tokens == transformers_ids(gpt2, prompt, 64 - len(prompt))


def test_max_model_len_lowers_the_context_and_may_not_raise_it(gpt2, tmp_path: Path, capsys) -> None:
    code = main(["serve", "--model", str(gpt2), "--max-model-len", "100", "--engine", "thread"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and "--max-model-len 100: tiny-gpt2 takes at most 64 positions" in err
    process = ServeProcess("--model", str(gpt2), "--max-model-len", "24", "--threads", "1").start(tmp_path / "log")
    try:
        c = process.client()
        ids = tokens(gpt2, "The value of the cache")
        answer = c.completions.create(model="tiny-gpt2", prompt=ids, temperature=0)
        assert answer.usage.completion_tokens == 24 - len(ids)
        assert c.models.retrieve("tiny-gpt2").model_extra["max_model_len"] == 24
    finally:
        assert process.terminate() == 0
