"""A `kvcache serve` process of the test's own on a free loopback port: started with a bounded wait
for `/health`, stopped with SIGTERM (and its exit status checked), its memory read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from servers import free_port

START_TIMEOUT_S = 60.0


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Poll `url`/health until it answers 200 (True), the process exits or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)


class ServeProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.stderr_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "unused", timeout: float = 60) -> Any:
        """The official `openai` client of this server (no retries: a failure shows at once)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout)

    def start(self, log: Path) -> ServeProcess:
        return self.launch(log).wait_started()

    def launch(self, log: Path) -> ServeProcess:
        """Start the process without waiting for it (several servers start side by side)."""
        self.stderr_path = log
        argv = [sys.executable, "-m", "kvcache", "serve", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=self.env, text=True)
        return self

    def wait_started(self) -> ServeProcess:
        """The bounded wait for `/health` of a launched process."""
        assert self.proc is not None and self.stderr_path is not None
        log = self.stderr_path
        if not wait_healthy(self.url, self.proc, START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"kvcache serve did not start: {log.read_text()[-2000:]}")
        return self

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def rss_bytes(self) -> int:
        """Resident bytes of the server and its processes (the engine runs in a child)."""
        assert self.proc is not None
        return sum(_rss(pid) for pid in [self.proc.pid, *self.children()])

    def children(self) -> list[int]:
        """The server's child processes (its engine process), from /proc."""
        assert self.proc is not None
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    kids = [int(k) for k in (task / "children").read_text().split()]
                    found += kids
                    todo += kids
        return found

    def engine_pid(self) -> int:
        """The engine process (multiprocessing also starts its resource tracker beside it)."""
        engines = [pid for pid in self.children() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, engines
        return engines[0]

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit status (SIGKILL after `timeout`)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return -9

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()

    def log(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path else ""


def module_server(tmp_path_factory, *args: str) -> Iterator[ServeProcess]:
    """A module's server (the body of a module-scoped fixture): the bundled model in float64 on
    one thread (batched and single-row kernels then agree far below any logit gap), `args` more;
    its exit status checked when the module is done."""
    process = ServeProcess("--dtype", "float64", "--threads", "1", *args)
    process.start(tmp_path_factory.mktemp("serve") / "stderr.log")
    yield process
    assert process.terminate() == 0, process.log()


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def byte_level_bpe(corpus: list[str], vocab_size: int, special: list[str]) -> Any:
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`, as GPT-2's and Llama 3's) trained on
    `corpus`, the `special` tokens first (`special[0]` the unknown token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=special[0]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(corpus, trainer)
    return bpe


def tiny_model_dir(path: Path, kind: str = "llama") -> Path:
    """A tiny random transformers model (`kind`: "llama"; "gemma3": sliding-window and full
    attention; "lfm2": short convolutions and attention; "jamba": Mamba1 mixers and attention;
    "mistral3" and "qwen2_5_vl": image-text-to-text checkpoints, a tiny vision tower included; "gpt2":
    64 learned positions) and
    a byte-level BPE tokenizer that adds
    a BOS, with a chat template, saved as a local transformers model directory (what `--model DIR`
    loads)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import processors

    bpe = byte_level_bpe(["The value of the cache is the sum of its tokens. " * 5, "user assistant system"], 300,
                         ["<unk>", "<s>", "</s>"])  # fmt: skip
    bos = bpe.token_to_id("<s>")  # the tokenizer adds a BOS, as Llama's does
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")  # fmt: skip
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    torch.manual_seed(0)
    common = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
    if kind == "lfm2":
        config = transformers.Lfm2Config(**common, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
        transformers.Lfm2ForCausalLM(config).save_pretrained(path)
    elif kind == "jamba":  # one expert: its MoE kernel takes no float64; initializer_range: at the default
        # a random state hardly moves a greedy choice
        config = transformers.JambaConfig(**common, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                          expert_layer_period=2, num_experts=1, mamba_d_state=8,
                                          initializer_range=0.2)  # fmt: skip
        transformers.JambaForCausalLM(config).save_pretrained(path)
    elif kind == "mistral3":  # Mistral Small 3.x's kind: a Pixtral vision tower and a Mistral decoder
        text = {**common, "model_type": "mistral", "num_hidden_layers": 2, "head_dim": 8, "initializer_range": 0.2}
        vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "head_dim": 8, "image_size": 28, "patch_size": 14}  # fmt: skip
        config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=299)
        transformers.Mistral3ForConditionalGeneration(config).save_pretrained(path)
    elif kind == "qwen2_5_vl":  # multimodal rotary positions (mrope), text-only here
        text = {**common, "num_hidden_layers": 2, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=299,
                                               video_token_id=298, vision_start_token_id=297, eos_token_id=2,
                                               bos_token_id=1)  # fmt: skip
        transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    elif kind == "gpt2":  # learned positions: 64 of them, and no computing past them
        config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=1, eos_token_id=2)  # fmt: skip
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common, num_hidden_layers=3, head_dim=8, sliding_window=6,
                                               layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention"])  # fmt: skip
        transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    else:
        config = transformers.LlamaConfig(**common, num_hidden_layers=2)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
