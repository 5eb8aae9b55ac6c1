"""`kvcache generate --model DIR`: any local transformers directory from the command line, checked
against transformers' own greedy `generate` on the same directory (full attention, sliding window
and a conv/attention hybrid), speculation from the command line (`--prompt-lookup`,
`--draft-model`) giving the same text, `--chat`, saved prompt caches, and the device flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import greedy_text
from serve_kit import tiny_model_dir

from kvcache.cli import main
from kvcache.cli.generate import PREFILL_BLOCK

transformers = pytest.importorskip("transformers", minversion="5.24")

PROMPT = "The value of the cache is the sum"
NEW = 24
KINDS = ["llama", "gemma3", "lfm2", "jamba"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_model_dir(root / kind, kind) for kind in KINDS}


def transformers_text(where: Path, prompt: str, new: int = NEW, chat: bool = False) -> str:
    """What a transformers user gets from the directory (`hf_reference.greedy_text`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(where)
    return greedy_text(model, transformers.AutoTokenizer.from_pretrained(where), prompt, new, chat)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def greedy(where: Path, *extra: str, prompt: str = PROMPT, new: int = NEW) -> list[str]:
    return ["--model", str(where), prompt, "--temperature", "0", "--max-new-tokens", str(new), "--device", "cpu",
            *extra]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_directory_prints_what_transformers_generate_gives(dirs, capsys, kind: str) -> None:
    """Plain, prompt-lookup, suffix and draft-model decoding all print transformers' greedy text."""
    expected = transformers_text(dirs[kind], PROMPT)
    assert expected.strip()  # a test on an empty answer would prove little
    for extra in ((), ("--prompt-lookup", "3"), ("--suffix-draft", "4"),
                  ("--draft-model", str(dirs["llama"]), "--draft-tokens", "3")):
        code, out, err = cli(capsys, *greedy(dirs[kind], *extra))
        assert code == 0, err
        assert out == expected + "\n", (extra, out, expected)


@pytest.mark.parametrize("kind", ["mistral3", "qwen2_5_vl"])
def test_an_image_text_checkpoint_runs_on_text(tmp_path: Path, capsys, kind: str) -> None:
    """A directory no causal-LM class takes (Mistral 3, Qwen2.5-VL: a vision tower and a decoder) is
    loaded with its image-text-to-text class and prints, plain and with prompt lookup, what that
    class's greedy `generate` gives on the prompt's text alone."""
    where = tiny_model_dir(tmp_path / kind, kind)
    model = transformers.AutoModelForImageTextToText.from_pretrained(where).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 3  # an answer that does not just repeat one token
    for extra in ((), ("--prompt-lookup", "3")):
        code, printed, err = cli(capsys, *greedy(where, *extra))
        assert code == 0, err
        assert printed == expected + "\n", (extra, printed, expected)


TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_a_chat_template_of_ones_own_for_a_directory_without_one(dirs, capsys, tmp_path: Path) -> None:
    """`--chat-template` (a file, or the template itself, as vLLM takes it) gives a directory
    without a template one, and `--chat` then prints transformers' greedy `generate` on what that
    template renders; a template that does not parse is a one-line error before anything loads."""
    import shutil

    bare = tmp_path / "no-template"
    shutil.copytree(dirs["llama"], bare)
    (bare / "chat_template.jinja").unlink()
    code, out, err = cli(capsys, *greedy(bare, "--chat", prompt="Say the value"))
    assert code == 2 and "has no chat template" in err
    tokenizer = transformers.AutoTokenizer.from_pretrained(bare)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say the value"}], chat_template=TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert text == "[USER] Say the value\n[ASSISTANT]"
    model = transformers.AutoModelForCausalLM.from_pretrained(bare).eval()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    expected = tokenizer.decode(out_ids[0, ids.shape[1] :], skip_special_tokens=True)
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    for given in (str(tmp_path / "template.jinja"), TEMPLATE):
        code, out, err = cli(capsys, *greedy(bare, "--chat", "--chat-template", given, prompt="Say the value"))
        assert code == 0 and out == expected + "\n", err
    for given, words in (("{% for m in messages %}", "not a valid Jinja template"),
                         (str(tmp_path / "missing.jinja"), "neither a file nor a Jinja template")):  # fmt: skip
        code, out, err = cli(capsys, *greedy(bare, "--chat", "--chat-template", given))
        assert (code, out) == (2, "") and err.count("\n") == 1 and words in err, err
    code, out, err = cli(capsys, "hello", "--chat-template", TEMPLATE)
    assert code == 2 and "--chat-template is for --model DIR" in err


def transformers_tokens(where: Path, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(where)(text, add_special_tokens=False).input_ids


def test_chat_applies_the_model_chat_template(dirs, capsys) -> None:
    expected = transformers_text(dirs["llama"], "Say the value", chat=True)
    code, out, err = cli(capsys, *greedy(dirs["llama"], "--chat", prompt="Say the value"))
    assert code == 0, err
    assert out == expected + "\n"


def test_a_saved_prompt_cache_of_a_model_directory_resumes_exactly(dirs, capsys, tmp_path: Path) -> None:
    """A prompt longer than one prefill block: saved, then resumed on the same and on a longer
    prompt, each printing what an uninterrupted run prints; another model's file is refused."""
    prompt = ("The value of the cache is the sum of its tokens. " * 40).rstrip()  # ends a word: a prefix in tokens too
    assert len(transformers_tokens(dirs["llama"], prompt)) > PREFILL_BLOCK
    saved = tmp_path / "prompt.kvcache"
    code, first, err = cli(capsys, *greedy(dirs["llama"], "--save-cache", str(saved), prompt=prompt, new=8))
    assert code == 0 and saved.exists(), err
    code, resumed, err = cli(capsys, *greedy(dirs["llama"], "--cache", str(saved), prompt=prompt, new=8))
    assert code == 0 and resumed == first, err
    assert f", {PREFILL_BLOCK} reused from the cache" in err  # the file's whole block, not prefilled again
    longer = prompt + " The sum"
    code, plain, _ = cli(capsys, *greedy(dirs["llama"], prompt=longer, new=8))
    code, resumed, err = cli(capsys, *greedy(dirs["llama"], "--cache", str(saved), prompt=longer, new=8))
    assert code == 0 and resumed == plain, err
    code, out, err = cli(capsys, *greedy(dirs["gemma3"], "--cache", str(saved), prompt=prompt, new=8))
    assert code == 2 and out == "" and "not a prompt cache of this model" in err


def _seq2seq_dir(where: Path) -> Path:
    """A T5 directory (its config is enough): transformers' causal-LM loader would take its decoder."""
    transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2).save_pretrained(where)
    return where


def _headless_dir(where: Path, llama: Path) -> Path:
    """A Llama base model without its LM head, and the tokenizer: loaded as a causal LM, transformers
    fills the head with random numbers and only warns."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    model.model.save_pretrained(where)
    transformers.AutoTokenizer.from_pretrained(llama).save_pretrained(where)
    return where


def _cacheless_dir(where: Path, llama: Path, kind: str) -> Path:
    """A model whose forward takes no cache (RWKV keeps its state in `state`; GPT-1 keeps no past):
    fed only its new tokens, each step would see nothing before them; or one that keeps part of
    its past on its modules (RecurrentGemma), which no cache can roll back or keep apart per row."""
    if kind == "rwkv":
        config = transformers.RwkvConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32)
        transformers.RwkvForCausalLM(config).save_pretrained(where)
    elif kind == "recurrent_gemma":  # takes a cache, but keeps its recurrent states on its modules
        config = transformers.RecurrentGemmaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=4, num_hidden_layers=3, lru_width=32,
                                                   attention_window_size=8, head_dim=8)  # fmt: skip
        transformers.RecurrentGemmaForCausalLM(config).save_pretrained(where)
    else:
        config = transformers.OpenAIGPTConfig(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        transformers.OpenAIGPTLMHeadModel(config).save_pretrained(where)
    transformers.AutoTokenizer.from_pretrained(llama).save_pretrained(where)
    return where


def test_flags_a_user_gets_wrong_are_one_line_errors(dirs, capsys, tmp_path: Path) -> None:
    seq2seq, headless = _seq2seq_dir(tmp_path / "t5"), _headless_dir(tmp_path / "headless", dirs["llama"])
    rwkv, gpt1, griffin = (_cacheless_dir(tmp_path / kind, dirs["llama"], kind)
                           for kind in ("rwkv", "openai-gpt", "recurrent_gemma"))  # fmt: skip
    capsys.readouterr()  # (transformers' progress bars while they were saved)
    cases = [
        (["--prompt-lookup", "0"], "--prompt-lookup"),
        (["--draft-model", str(dirs["llama"])], "--draft-model"),  # no --model: the bundled model has no draft
        (["--model", str(dirs["llama"]), "--draft-model", str(dirs["llama"]), "--prompt-lookup", "2"], "alternatives"),
        (["--model", str(tmp_path / "missing")], "not a directory"),
        (["--model", str(tmp_path)], "not a transformers causal LM directory"),
        (["--model", str(seq2seq)], "T5Config is an encoder-decoder model"),
        (["--model", str(headless)], "parameters unset (lm_head.weight)"),
        (["--model", str(rwkv)], "RwkvForCausalLM's forward takes no cache"),
        (["--model", str(gpt1)], "OpenAIGPTLMHeadModel's forward takes no cache"),
        (["--model", str(griffin)], "keep their states on the modules, not in the cache"),
        (["--device", "tpu"], "--device"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    for args, words in cases:
        code, out, err = cli(capsys, "hello", "--max-new-tokens", "2", *args)
        lines = [line for line in err.strip().splitlines() if not line.startswith("Loading weights")]  # transformers'
        assert code == 2 and out == "" and len(lines) == 1, (args, err)
        assert lines[0].startswith("kvcache generate: error:") and words in lines[0], (args, err)


def test_ignore_eos_decodes_past_the_end_token_to_the_limit(dirs, capsys, tmp_path: Path) -> None:
    """A directory whose generation config ends answers at the token greedy decoding writes fourth:
    the CLI stops there (plain and with prompt lookup); with `--ignore-eos` it prints the whole
    greedy answer of `--max-new-tokens` tokens, as transformers' `generate` with no end token."""
    import json
    import shutil

    ended = tmp_path / "ends-early"
    shutil.copytree(dirs["llama"], ended)
    model = transformers.AutoModelForCausalLM.from_pretrained(ended).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(ended)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None)  # fmt: skip
    answer = out[0, ids.shape[1] :].tolist()
    assert len(answer) == NEW and answer[3] not in answer[:3]
    config = json.loads((ended / "generation_config.json").read_text())
    (ended / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": answer[3]}))
    for extra in ((), ("--prompt-lookup", "3")):
        code, printed, err = cli(capsys, *greedy(ended, *extra))
        assert code == 0 and printed == tokenizer.decode(answer[:3], skip_special_tokens=True) + "\n", err
        code, printed, err = cli(capsys, *greedy(ended, "--ignore-eos", *extra))
        assert code == 0 and printed == tokenizer.decode(answer, skip_special_tokens=True) + "\n", err
        assert f"generated {NEW} tokens" in err


def test_end_tokens_are_the_generation_configs(dirs, tmp_path: Path) -> None:
    """The tokens that end an answer (the CLI's and the server's) are the ones transformers'
    `generate` and `transformers serve` stop at: the generation config's. A directory whose
    generation config names none runs to the token limit, although its tokenizer has an end token."""
    import json
    import shutil

    from kvcache.models.text_model import from_directory

    plain = tmp_path / "no-eos"
    shutil.copytree(dirs["llama"], plain)
    config = json.loads((plain / "generation_config.json").read_text())
    config.pop("eos_token_id", None)
    (plain / "generation_config.json").write_text(json.dumps(config))
    for where, expected in ((dirs["llama"], [2]), (plain, [])):
        served = from_directory(where)
        hf = transformers.AutoModelForCausalLM.from_pretrained(where)
        named = hf.generation_config.eos_token_id
        assert served.eos == expected == ([] if named is None else [named])
        assert served.tokenizer.eos_token_id == 2  # the tokenizer's is there either way
