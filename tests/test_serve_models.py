"""`kvcache serve` on local transformers model directories as users deploy them: LFM2 (short
convolutions and attention) served with its chat turns reused and with prompt-lookup
speculation; the same weights at another path sharing one store; two servers sharing a 3-node
Redis Cluster, a chat alternating between them. Every greedy answer equals the prompt decoded
alone (float64: see tests/test_serve.py for why)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

from serve_kit import ServeProcess, tiny_model_dir  # noqa: E402

from kvcache.generation import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(where: Path):
    """`alone(ids, n)`: the greedy continuation of token ids decoded by themselves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcache.integrations.transformers import wrap_model

    try:
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64)
    except ValueError:  # an image-text-to-text checkpoint (no causal-LM class takes its configuration)
        from transformers import AutoModelForImageTextToText

        hf = AutoModelForImageTextToText.from_pretrained(where, dtype=torch.float64)
    model = wrap_model(hf.eval())
    tokenizer = AutoTokenizer.from_pretrained(where)

    def ids(prompt: list[int], n: int) -> list[int]:
        return generate(model, torch.tensor([prompt]), max_new_tokens=n).sequences[0, len(prompt) :].tolist()

    def alone(text: str, n: int, special: bool = True) -> str:
        return tokenizer.decode(ids(tokenizer.encode(text, add_special_tokens=special), n), skip_special_tokens=True)

    alone.ids = ids  # type: ignore[attr-defined]
    return alone, tokenizer



def settled(process: ServeProcess) -> None:
    """Wait (bounded) until the server's store writer has written what it was handed."""
    deadline = time.monotonic() + 10
    while process.health()["store_writes_pending"] and time.monotonic() < deadline:
        time.sleep(0.01)


def chat(c: openai.OpenAI, name: str, messages: list[dict], n: int):
    return c.chat.completions.create(model=name, messages=messages, max_tokens=n, temperature=0)


# without speculation with KVCACHE_SLOW=1: the speculative variants check the same answers and reused turns
@pytest.mark.parametrize(("kind", "speculative"), [pytest.param("lfm2", "none", marks=pytest.mark.slow),
                                                   ("lfm2", "prompt lookup"), ("lfm2", "draft model"),
                                                   ("jamba", "prompt lookup")])  # fmt: skip
def test_hybrids_are_served_their_turns_reused_with_and_without_speculation(tmp_path: Path, kind: str,
                                                                             speculative: str) -> None:  # fmt: skip
    """Plain, prompt-lookup (`--speculative 4`) and draft-model (`--draft-model`, a Llama with the
    same tokenizer, each request drafting on a cache of its own) serving answer alike. Jamba's Mamba1
    mixers scan a multi-token forward from zero unless the cache asks for every token's state: its
    prompts continuing stored prefixes and its verify forwards answered otherwise before."""
    where = tiny_model_dir(tmp_path / "tiny-lfm2", kind)
    alone, tokenizer = reference(where)
    ids_alone = alone.ids
    flags = {"none": [], "prompt lookup": ["--speculative", "4"],
             "draft model": ["--draft-model", str(tiny_model_dir(tmp_path / "draft", "llama")), "--draft-tokens", "3"]}
    flags = flags[speculative]
    process = ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1", *flags)
    process.start(tmp_path / "stderr.log")
    try:
        c = process.client()
        prompts = ["The value of the cache is the", "the sum of its tokens. " * 3, "The cache is", "tokens. The"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="tiny-lfm2", prompt=p, max_tokens=24,
                                                               temperature=0).choices[0].text, prompts))  # fmt: skip
        assert got == [alone(p, 24) for p in prompts]
        # a second turn: the first prompt and its answer, as token ids, then more; the chunks
        # stored while the answer was decoded are taken (all but the tail of the last one)
        first_ids = tokenizer.encode("The value of the cache is the sum of its tokens.")
        first = c.completions.create(model="tiny-lfm2", prompt=first_ids, max_tokens=40, temperature=0)
        answer_ids = ids_alone(first_ids, 40)
        assert first.choices[0].text == tokenizer.decode(answer_ids, skip_special_tokens=True)
        settled(process)
        second_ids = first_ids + answer_ids + tokenizer.encode(" The sum?", add_special_tokens=False)
        second = c.completions.create(model="tiny-lfm2", prompt=second_ids, max_tokens=8, temperature=0)
        assert second.choices[0].text == tokenizer.decode(ids_alone(second_ids, 8), skip_special_tokens=True)
        assert second.usage.prompt_tokens_details.cached_tokens == (len(first_ids) + len(answer_ids) - 1) // 16 * 16
    finally:
        assert process.terminate() == 0
    assert "dropped" not in process.log() and "Traceback" not in process.log()


@pytest.mark.parametrize("kind", ["mistral3", "qwen2_5_vl"])
def test_an_image_text_checkpoint_is_served_text(tmp_path: Path, kind: str) -> None:
    """Mistral 3 and Qwen2.5-VL directories served on text: concurrent greedy completions (rows of
    one batch) and a chat each equal the prompt decoded alone."""
    where = tiny_model_dir(tmp_path / kind, kind)
    alone, tokenizer = reference(where)
    process = ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1")
    process.start(tmp_path / "stderr.log")
    try:
        c = process.client()
        prompts = ["The value of the cache is the", "the sum of its tokens. " * 3, "The cache is", "tokens. The"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: c.completions.create(model=kind, prompt=p, max_tokens=16,
                                                               temperature=0).choices[0].text, prompts))  # fmt: skip
        assert got == [alone(p, 16) for p in prompts]
        messages = [{"role": "user", "content": "The value?"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat(c, kind, messages, 12).choices[0].message.content == alone(text, 12, special=False)
    finally:
        assert process.terminate() == 0
    assert "Traceback" not in process.log()


def test_the_same_weights_at_another_path_share_a_store(tmp_path: Path) -> None:
    where = tiny_model_dir(tmp_path / "a" / "tiny-llama")
    copy = tmp_path / "b" / "tiny-llama"
    shutil.copytree(where, copy)
    store = str(tmp_path / "store")
    prompt = "The value of the cache is the sum of its tokens. " * 4
    answers, cached = [], []
    processes = [ServeProcess("--model", str(model_dir), "--dtype", "float64", "--threads", "1",
                              "--prefix-store", store).launch(tmp_path / f"{model_dir.parent.name}.log")
                 for model_dir in (where, copy)]  # fmt: skip
    try:
        for process in processes:
            process.wait_started()
        for process in processes:  # one after the other: the second asks once the first's writes are done
            answer = process.client().completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
            answers.append(answer.choices[0].text)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            settled(process)
    finally:
        for process in processes:
            assert process.terminate() == 0
    assert answers[0] == answers[1] and cached[0] == 0
    assert cached[1] == (answer.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_a_model_answers_to_the_ids_vllm_gives_it_or_to_the_names_it_is_told(tmp_path: Path) -> None:
    """By default the served id is the directory's name, and the `--model` path as given (vLLM's
    default id, which clients written for it send) or in full is taken too; `--served-model-name`
    replaces them all, its first name the one answers, the model list and the startup line show."""
    where = tiny_model_dir(tmp_path / "tiny-llama")
    relative = os.path.relpath(where)
    common = ("--dtype", "float64", "--threads", "1")
    default = ServeProcess("--model", relative, *common).launch(tmp_path / "default.log")
    named = ServeProcess("--model", str(where), *common, "--served-model-name", "team/llama", "alias",
                         "alias").launch(tmp_path / "named.log")  # fmt: skip
    try:
        for process in (default, named):
            process.wait_started()
        for process, shown, taken, refused in ((default, "tiny-llama", ("tiny-llama", relative, str(where)), "alias"),
                                               (named, "team/llama", ("team/llama", "alias"), "tiny-llama")):
            c = process.client()
            assert [m.id for m in c.models.list().data] == [shown]
            for name in taken:
                answer = c.completions.create(model=name, prompt="The value", max_tokens=2, temperature=0)
                assert answer.model == shown and c.models.retrieve(name).id == shown
                assert chat(c, name, [{"role": "user", "content": "hi"}], 2).model == shown
            with pytest.raises(openai.NotFoundError, match=f"this server serves '{shown}'"):
                c.completions.create(model=refused, prompt="The value", max_tokens=2)
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve(refused)
            assert f"kvcache serve: {shown} on " in process.log()
    finally:
        for process in (default, named):
            assert process.terminate() == 0


def test_a_prefilled_answer_is_continued_as_transformers_continues_it(tmp_path: Path) -> None:
    """`continue_final_message` on a model directory: the template's own rendering with
    transformers' `continue_final_message=True` (the prompt ends inside the assistant's message),
    and the answer is transformers' greedy continuation of those ids."""
    where = tiny_model_dir(tmp_path / "tiny-llama")
    alone, tokenizer = reference(where)
    messages = [{"role": "user", "content": "The value"}, {"role": "assistant", "content": "The cache is"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<|assistant|>The cache is")
    want = alone(text, 12, special=False)
    process = ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1").start(tmp_path / "log")
    try:
        answer = process.client().chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=12, temperature=0,
            extra_body={"add_generation_prompt": False, "continue_final_message": True})  # fmt: skip
        assert answer.choices[0].message.content == want
        assert answer.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    finally:
        assert process.terminate() == 0


def test_a_chat_template_given_to_the_server_renders_its_chats(tmp_path: Path) -> None:
    """`kvcache serve --chat-template FILE` on a directory without one: chats are rendered by it
    (in the server process and the engine's alike), and answered as transformers' greedy `generate`
    answers the rendered text; without the flag such a chat is a 400."""
    where = tiny_model_dir(tmp_path / "tiny-llama")
    (where / "chat_template.jinja").unlink()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")  # fmt: skip
    alone, _ = reference(where)
    want = alone("[user] The value\n[assistant]", 10, special=False)
    processes = [ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1", *extra).launch(
        tmp_path / f"{len(extra)}.log") for extra in ((), ("--chat-template", str(template)))]  # fmt: skip
    try:
        for process in processes:
            process.wait_started()
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            chat(processes[0].client(), "tiny-llama", [{"role": "user", "content": "The value"}], 10)
        answer = chat(processes[1].client(), "tiny-llama", [{"role": "user", "content": "The value"}], 10)
        assert answer.choices[0].message.content == want
    finally:
        for process in processes:
            assert process.terminate() == 0


def test_two_servers_on_a_redis_cluster_share_a_chat(tmp_path: Path, redis_cluster) -> None:
    """Scale-out: two servers on one 3-node Redis Cluster; a chat whose turns alternate between
    them reuses the previous turns on either, and every answer is what one server alone gives."""
    where = tiny_model_dir(tmp_path / "tiny-llama")
    alone, tokenizer = reference(where)
    url = redis_cluster.url
    servers = [ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1", "--prefix-store", url)
               for _ in range(2)]  # fmt: skip
    single = ServeProcess("--model", str(where), "--dtype", "float64", "--threads", "1")  # a memory store
    for i, process in enumerate([*servers, single]):
        process.launch(tmp_path / f"serve{i}.log")
    for process in [*servers, single]:
        process.wait_started()
    try:
        runs = []
        for chosen in ([single] * 4, [servers[turn % 2] for turn in range(4)]):
            messages = [{"role": "system", "content": "The value of the cache is the sum of its tokens. " * 3}]
            run = []
            for turn, process in enumerate(chosen):
                messages.append({"role": "user", "content": f"The sum of the tokens {turn}?"})
                answer = chat(process.client(), "tiny-llama", messages, 20)
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                assert answer.choices[0].message.content == alone(text, 20, special=False)
                run.append((answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens))
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
                settled(process)
            runs.append(run)
    finally:
        for process in [*servers, single]:
            assert process.terminate() == 0
    # the alternating servers reuse what one server alone reuses, turn by turn: at least every
    # whole chunk of the previous turn's prompt (an answer re-encoded from its text may split
    # into other tokens than were decoded, so the answer's own chunks are not promised)
    assert runs[1] == runs[0]
    for (before, _), (_, cached) in zip(runs[1], runs[1][1:], strict=False):
        assert cached >= before // 16 * 16 > 0
