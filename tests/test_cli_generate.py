"""`kvcache generate`: through a subprocess with the bundled model (text on stdout only, resuming
from a saved prompt cache prints exactly what an uninterrupted run prints, one-line errors), and
in-process with a small random model standing in for the bundled one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvcache.cli import main
from kvcache.cli.generate import PREFILL_BLOCK
from kvcache.generation import generate
from kvcache.models import DecoderConfig, DecoderLM, default

PROMPT = "The cache holds every token but the last one, so" + " the cache holds every token, so" * 15
LONGER = PROMPT + " a later call feeds only what is new," * 7


def whole(text: str) -> int:
    """How many of a prompt's tokens the CLI prefills in whole blocks (and so saves or stores)."""
    return (len(text) - 1) // PREFILL_BLOCK * PREFILL_BLOCK


assert whole(PROMPT) >= 2 * PREFILL_BLOCK and whole(LONGER) > whole(PROMPT)  # the tests need whole blocks


def kvcache(*args: str, runner: tuple[str, ...] = (sys.executable, "-m", "kvcache")) -> subprocess.CompletedProcess:
    return subprocess.run([*runner, "generate", *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcache generate: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


# ------------------------------------------------------------- subprocess, no model needed
def test_bad_files_and_arguments_are_one_line_errors(tmp_path: Path) -> None:
    assert_one_line_error(kvcache(PROMPT, "--cache", str(tmp_path / "missing.kvcache")), "missing.kvcache")
    corrupt = tmp_path / "corrupt.kvcache"
    corrupt.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{not json" + bytes(100))
    assert_one_line_error(kvcache(PROMPT, "--cache", str(corrupt)), "corrupt.kvcache")
    assert_one_line_error(kvcache(PROMPT, "--defer-stop", "maybe"), "defer-stop")


# ------------------------------------------------------------------ subprocess, bundled model
bundled = pytest.mark.skipif(
    not (default.WEIGHTS_DIR / "default.safetensors").exists(), reason="bundled default weights not built yet"
)


@bundled
def test_a_prediction_prints_the_same_text_from_drafts(tmp_path: Path) -> None:
    """`--prediction FILE`: the text the run prints without it, most of it from accepted drafts
    when the file holds that text; a file with other text changes nothing either."""
    args = ("The value of the ", "--temperature", "0", "--max-new-tokens", "80")
    plain = kvcache(*args)
    assert plain.returncode == 0, plain.stderr
    predicted = tmp_path / "predicted.txt"
    for text, most in ((plain.stdout, True), ("lorem ipsum dolor sit amet " * 4, False)):
        predicted.write_text(text)
        run = kvcache(*args, "--prediction", str(predicted))
        assert run.returncode == 0 and run.stdout == plain.stdout, run.stderr
        accepted = int(run.stderr.split(" drafted tokens accepted")[0].rsplit(", ", 1)[1])
        assert accepted >= 40 or not most, run.stderr
    assert_one_line_error(kvcache(*args, "--prediction", str(tmp_path / "absent.txt")), "--prediction", "absent.txt")
    predicted.write_text("\u2603 snow")  # a character outside the bundled model's alphabet
    assert_one_line_error(kvcache(*args, "--prediction", str(predicted)), "--prediction", "alphabet")


@bundled
def test_generate_streams_the_same_text_as_the_library_and_entry_points_agree(tmp_path: Path) -> None:
    result = kvcache(PROMPT, "--max-new-tokens", "30", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    model, tokenizer = default.load_default_model()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    out = generate(model, ids, max_new_tokens=30)
    assert result.stdout == tokenizer.decode(out.sequences[0, ids.shape[1] :].tolist()) + "\n"
    assert "tokens/s" in result.stderr and "prompt:" in result.stderr
    script = shutil.which("kvcache")
    if script is not None:
        assert kvcache(PROMPT, "--max-new-tokens", "30", "--temperature", "0", runner=(script,)).stdout == result.stdout


@pytest.fixture(scope="module")
def saved_prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PROMPT's cache, saved by `kvcache generate --max-new-tokens 0 --save-cache`."""
    saved = tmp_path_factory.mktemp("cli") / "prompt.kvcache"
    built = kvcache(PROMPT, "--max-new-tokens", "0", "--save-cache", str(saved))
    assert built.returncode == 0 and built.stdout == "" and saved.exists(), built.stderr
    return saved


@bundled
def test_save_then_resume_prints_exactly_the_uninterrupted_text(saved_prompt: Path) -> None:
    saved = saved_prompt
    for prompt in (PROMPT, LONGER):
        uninterrupted = kvcache(prompt, "--max-new-tokens", "40", "--seed", "7")
        defer = "on" if prompt == LONGER else "auto"  # the deferred stop check changes nothing either
        resumed = kvcache(prompt, "--max-new-tokens", "40", "--seed", "7", "--cache", str(saved), "--defer-stop", defer)
        assert uninterrupted.returncode == resumed.returncode == 0, resumed.stderr
        assert len(uninterrupted.stdout) > 10
        assert resumed.stdout == uninterrupted.stdout
        assert f"{whole(PROMPT)} reused" in resumed.stderr and "0 reused" in uninterrupted.stderr


@bundled
def test_a_prompt_not_extending_the_saved_one_is_a_one_line_error(saved_prompt: Path, tmp_path: Path) -> None:
    saved = saved_prompt
    assert_one_line_error(kvcache("Another prompt", "--cache", str(saved)), "does not start with")
    truncated = tmp_path / "truncated.kvcache"
    truncated.write_bytes(saved.read_bytes()[:-100])
    assert_one_line_error(kvcache(PROMPT, "--cache", str(truncated)), "truncated.kvcache")


# --------------------------------------------------------- in process, a stand-in default model
ALPHABET = "\n !',.:;?abcdefghijklmnopqrstuvwxyzT"


@pytest.fixture
def stand_in_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DecoderLM, object]]:
    """A random character model written as the bundled weights, in a temporary directory."""
    weights = tmp_path / "weights"
    weights.mkdir()
    layer_types = ["full_attention", "sliding_attention"]
    config = DecoderConfig(vocab_size=len(ALPHABET), layer_types=layer_types, sliding_window=12)
    torch.manual_seed(0)
    model = DecoderLM(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(weights / "default.safetensors"))
    (weights / "default.json").write_text(json.dumps({"config": config.to_dict(), "alphabet": ALPHABET}))
    monkeypatch.setattr(default, "WEIGHTS_DIR", weights)
    threads = torch.get_num_threads()  # the command sets it for its process: restore ours
    yield default.load_default_model(weights_dir=weights)
    torch.set_num_threads(threads)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_resume_is_exact_with_a_stand_in_model(stand_in_model, capsys, tmp_path: Path) -> None:
    model, tokenizer = stand_in_model
    saved = tmp_path / "p.kvcache"
    assert _cli(capsys, PROMPT, "--max-new-tokens", "0", "--save-cache", str(saved))[:2] == (0, "")
    for prompt in (PROMPT, LONGER):
        code, plain, _ = _cli(capsys, prompt, "--max-new-tokens", "25", "--seed", "3", "--top-k", "9")
        args = (prompt, "--max-new-tokens", "25", "--seed", "3", "--top-k", "9")
        code2, resumed, err = _cli(capsys, *args, "--cache", str(saved))
        assert code == code2 == 0 and resumed == plain and len(plain) == 26
        assert f"{whole(PROMPT)} reused" in err
    code, greedy, _ = _cli(capsys, PROMPT, "--max-new-tokens", "12", "--temperature", "0", "--defer-stop", "on")
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    expected = generate(model, ids, max_new_tokens=12).sequences[0, ids.shape[1] :].tolist()
    assert code == 0 and greedy == tokenizer.decode(expected) + "\n"
    code, _, err = _cli(capsys, "elsewhere", "--cache", str(saved))
    assert code == 2 and "does not start with" in err and err.count("\n") == 1
    for args, word in ((("--max-new-tokens", "-1"), "max-new-tokens"), (("--temperature", "-1"), "temperature")):
        code, out, err = _cli(capsys, PROMPT, *args)
        assert (code, out) == (2, "") and word in err and err.count("\n") == 1
    code, out, err = _cli(capsys, "")
    assert (code, out) == (2, "") and "empty" in err


def test_a_cache_saved_with_other_weights_is_refused(stand_in_model, capsys, tmp_path: Path) -> None:
    saved = tmp_path / "p.kvcache"
    assert _cli(capsys, PROMPT, "--max-new-tokens", "0", "--save-cache", str(saved))[0] == 0
    weights = default.WEIGHTS_DIR / "default.safetensors"
    torch.manual_seed(1)
    config = json.loads((default.WEIGHTS_DIR / "default.json").read_text())["config"]
    other = DecoderLM(DecoderConfig.from_dict(config))
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}, str(weights))
    code, out, err = _cli(capsys, PROMPT, "--cache", str(saved))
    assert code == 2 and out == "" and "not a prompt cache of this model" in err


def test_small_things_a_user_hits(stand_in_model, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling options fail before any work; '-' reads the prompt from stdin; characters outside the
    alphabet are a warning; --save-cache says how many tokens it kept; --version."""
    import io

    from kvcache import __version__
    from kvcache.models.decoder import DecoderLM as Model

    calls = []
    real_forward = Model.forward
    monkeypatch.setattr(Model, "forward", lambda self, *a, **k: calls.append(1) or real_forward(self, *a, **k))
    for args in (("--top-p", "1.5"), ("--top-k", "-2"), ("--temperature", "nan"), ("--min-p", "2")):
        code, out, err = _cli(capsys, PROMPT, *args)  # errors name the flag the user typed, not the parameter
        assert (code, out) == (2, "") and err.count("\n") == 1
        assert err.startswith(f"kvcache generate: error: {args[0]} must")
    assert calls == []  # refused before the model ran (or was even loaded)

    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    from_stdin = _cli(capsys, "-", "--max-new-tokens", "8", "--temperature", "0")
    assert from_stdin[:2] == _cli(capsys, PROMPT, "--max-new-tokens", "8", "--temperature", "0")[:2]

    code, _, err = _cli(capsys, "The ©afé is", "--max-new-tokens", "1")
    assert code == 0 and "warning" in err and "©" in err and "é" in err

    saved = tmp_path / "p.kvcache"
    code, _, err = _cli(capsys, PROMPT, "--max-new-tokens", "0", "--save-cache", str(saved))
    assert code == 0 and f"{whole(PROMPT)} of the prompt's {len(PROMPT)} tokens" in err

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"kvcache {__version__}"


def test_prefix_store_reuses_the_prompt_and_prints_the_same_text(stand_in_model, capsys, tmp_path: Path) -> None:
    """--prefix-store DIR: the second run reuses the prompt's whole blocks from the directory and
    prints exactly the text of a run without a store; `kvcache store DIR` reports it."""
    store = tmp_path / "store"
    args = ("--max-new-tokens", "20", "--seed", "2")
    code, plain, _ = _cli(capsys, LONGER, *args)
    runs = [_cli(capsys, LONGER, *args, "--prefix-store", str(store)) for _ in range(2)]
    assert [r[0] for r in runs] == [0, 0] and runs[0][1] == runs[1][1] == plain
    assert "miss, 0 token(s) reused" in runs[0][2] and f"hit, {whole(LONGER)} token(s) reused" in runs[1][2]
    code, _, err = _cli(capsys, PROMPT, *args, "--prefix-store", str(store))  # a prefix of LONGER's blocks
    assert code == 0 and f"hit, {whole(PROMPT)} token(s) reused" in err
    assert main(["store", str(store)]) == 0
    report = capsys.readouterr().out
    assert f"chunks:        {whole(LONGER) // PREFILL_BLOCK}" in report and "hits:          2 (hit rate 67%)" in report
    code, out, err = _cli(capsys, PROMPT, "--prefix-store", str(store), "--cache", str(tmp_path / "x"))
    assert (code, out) == (2, "") and "alternatives" in err


def test_store_locations_a_user_gets_wrong_are_one_line_errors(stand_in_model, capsys, tmp_path: Path) -> None:
    """A file given as a store directory, a URL of an unknown scheme (no directory named `http:` is
    made), `kvcache store` on a path that does not exist (none is made) or on a directory that is
    not a store (nothing is written into it), `--draft-tokens` without the draft model it is for
    (it would be ignored), a budget of 0 named by its
    flag; `--clear` says what it removed."""
    afile = tmp_path / "sys.txt"
    afile.write_text("not a directory")
    cases = [
        (("generate", PROMPT, "--prefix-store", str(afile)), "is a file, not a directory"),
        (("generate", PROMPT, "--prefix-store", "http://host/0"), "unknown prefix store URL scheme 'http'"),
        (("generate", PROMPT, "--prefix-store", "mem://"), "unknown prefix store URL scheme 'mem'"),
        (("generate", PROMPT, "--prefix-store", str(tmp_path / "s"), "--prefix-store-bytes", "0"),
         "--prefix-store-bytes must be a positive int"),
        (("store", str(tmp_path / "missing")), "does not exist"),
        (("store", str(tmp_path)), "holds no index.sqlite"),
        (("store", str(afile)), "is a file, not a directory"),
        (("store", "http://host/0"), "unknown prefix store URL scheme"),
        (("generate", PROMPT, "--draft-tokens", "4"), "--draft-tokens sets the draft length of --draft-model"),
    ]
    for argv, words in cases:
        code = main(list(argv))
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), argv
        assert err.count("\n") == 1 and words in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sys.txt", "weights"]
    assert not Path("http:").exists() and not Path("mem:").exists()
    store = tmp_path / "store"
    assert _cli(capsys, LONGER, "--max-new-tokens", "2", "--prefix-store", str(store))[0] == 0
    assert main(["store", str(store), "--clear"]) == 0
    assert f"cleared {whole(LONGER) // PREFILL_BLOCK} chunk(s)" in capsys.readouterr().out
    assert main(["store", str(store)]) == 0 and "chunks:        0" in capsys.readouterr().out


def test_a_redis_password_is_never_printed(capsys) -> None:
    """An unreachable Redis given with a password: one line on stderr, the password redacted."""
    code = main(["store", "redis://:s3cret@127.0.0.1:1/0"])
    out, err = capsys.readouterr()
    assert code == 2 and "s3cret" not in out + err and "***@127.0.0.1:1" in err and err.count("\n") == 1


def test_a_long_prefill_shows_progress_when_stderr_is_not_a_terminal(stand_in_model, capsys, monkeypatch) -> None:
    """Not a terminal: a plain progress line now and then (here every line, the period set to 0),
    never on stdout; the text is the same as without it."""
    from kvcache import progress

    plain = _cli(capsys, LONGER * 4, "--max-new-tokens", "5", "--temperature", "0")
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    code, out, err = _cli(capsys, LONGER * 4, "--max-new-tokens", "5", "--temperature", "0")
    lines = [line for line in err.splitlines() if line.startswith("prefill:")]
    assert code == 0 and out == plain[1] and "prefill" not in out
    assert len(lines) >= 10 and lines[-1].startswith(f"prefill: {whole(LONGER * 4):,}/")


def test_a_store_key_comes_from_a_file_or_the_environment(stand_in_model, capsys, tmp_path: Path, monkeypatch) -> None:
    """`--prefix-store-key-file` or $KVCACHE_PREFIX_STORE_KEY: a keyed store hits only with its key
    (no key, or another: a miss, since keyed entries have names only the key gives); a short key is
    a one-line error."""
    store, key_file = tmp_path / "store", tmp_path / "key"
    key_file.write_bytes(b"0123456789abcdef-secret\n")
    args = (LONGER, "--max-new-tokens", "4", "--prefix-store", str(store))
    assert _cli(capsys, *args, "--prefix-store-key-file", str(key_file))[0] == 0
    assert f"hit, {whole(LONGER)} token(s)" in _cli(capsys, *args, "--prefix-store-key-file", str(key_file))[2]
    assert "miss, 0 token(s)" in _cli(capsys, *args)[2]
    monkeypatch.setenv("KVCACHE_PREFIX_STORE_KEY", "0123456789abcdef-secret")
    code, out, err = _cli(capsys, *args)
    assert code == 0 and f"hit, {whole(LONGER)} token(s)" in err and "secret" not in out + err
    monkeypatch.setenv("KVCACHE_PREFIX_STORE_KEY", "short")
    code, out, err = _cli(capsys, *args)
    assert (code, out) == (2, "") and "at least 16 bytes" in err and err.count("\n") == 1


def test_speculative_names_the_same_drafting_as_in_serve(stand_in_model, capsys, monkeypatch) -> None:
    """`--speculative suffix` is `--suffix-draft 8` and `--speculative K` is `--prompt-lookup K`, as
    `kvcache serve` reads them: the same drafter and draft length reach `speculative_generate`,
    and the text is plain decoding's; `--speculative 0` decodes plainly; a second flag is refused."""
    import kvcache.generation as generation
    from kvcache.cli.model_args import DEFAULT_SUFFIX_TOKENS

    used: list[tuple[str, int]] = []
    real = generation.speculative_generate

    def spy(model, drafter, *args, **kwargs):
        used.append((type(drafter).__name__, kwargs["num_draft_tokens"]))
        return real(model, drafter, *args, **kwargs)

    monkeypatch.setattr(generation, "speculative_generate", spy)
    base = [PROMPT, "--temperature", "0", "--max-new-tokens", "12"]
    code, plain, err = _cli(capsys, *base)
    assert code == 0 and not used, err
    runs = {("--speculative", "suffix"): ("SuffixDrafter", DEFAULT_SUFFIX_TOKENS),
            ("--suffix-draft", str(DEFAULT_SUFFIX_TOKENS)): ("SuffixDrafter", DEFAULT_SUFFIX_TOKENS),
            ("--speculative", "3"): ("PromptLookupDrafter", 3), ("--prompt-lookup", "3"): ("PromptLookupDrafter", 3)}
    for flags, expected in runs.items():
        code, out, err = _cli(capsys, *base, *flags)
        assert code == 0 and out == plain and "drafted tokens accepted" in err, (flags, err)
        assert used.pop() == expected, flags
    code, out, err = _cli(capsys, *base, "--speculative", "0")
    assert code == 0 and out == plain and not used and "drafted" not in err
    code, out, err = _cli(capsys, *base, "--speculative", "3", "--suffix-draft", "4")
    assert code == 2 and out == "" and "give one speculation flag" in err
    # a bare flag before the prompt takes the prompt as its value: the error says so
    with pytest.raises(SystemExit) as exited:
        main(["generate", *base[1:], "--speculative", PROMPT])
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == "" and "put the prompt first" in captured.err and not used
