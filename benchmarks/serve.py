"""`kvcache serve` under load: throughput of concurrent requests decoded together, and time to
first token on a prefix-store hit.

1. The bundled model served on 127.0.0.1 (one torch thread; the clients run on the other core).
   A set of greedy completions (distinct prompts, `max_tokens` each) is sent one at a time, then
   by 1, 4 and 16 concurrent clients; generated tokens per second of each, against one at a time.
   Target: >= 3x at 16. The same run counts the answers that differ from their prompt decoded
   alone (float32: batched and single-row kernels differ in the last bits, and a near tie can
   flip a token).
2. Time to first token (streamed, to the first text) of a question after a shared 1k-token system
   prompt: cold (a system prompt never seen), on a hit (the system prompt stored by an earlier
   request), and the question alone (the cost of the un-stored suffix, with nothing before it).
   Target: a hit within 1.5x of the question alone.
3. A cold 1,000-character prompt through the server's engine (in-process) with the memory,
   directory and Redis stores, against one forward of the same prompt with no store, on an
   otherwise idle server (every store's writer has finished the earlier samples' chunks before a
   sample starts; its own chunks are written while it runs). Target: <= 1.2x for every backend.
4. Quantized serving: the load of 1. at 8 clients on the server and on one started with
   `--kv-bits 4`, rounds alternated (no target: what int4 costs in speed on this machine).
5. Structured outputs: greedy chat answers from 8 clients, free and held to a JSON Schema (one
   string of at least 400 characters: every answer runs to `max_tokens`, so both write as many
   tokens), rounds alternated; the constrained answers checked to be the schema's start (no
   target: what the grammar's token masks cost per token).

    python benchmarks/serve.py [--quick]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

try:
    from .common import Section, Table, Target, Timing, client_pool, http_client, run_as_script
except ImportError:  # run as a script
    from common import Section, Table, Target, Timing, client_pool, http_client, run_as_script  # type: ignore[no-redef]

#: (requests, new tokens each, rounds, time-to-first-token samples) per mode
SIZES = {"smoke": (8, 16, 1, 2), "quick": (16, 24, 1, 2), "full": (48, 64, 3, 9)}
WORDS = ("value", "name", "object", "method", "class", "list", "module", "type", "key", "file", "string", "error")


def _server(tmp: Path, *extra: str) -> Any:
    """`kvcache serve` on the bundled model, one torch thread, started with `extra` arguments."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from serve_kit import ServeProcess  # the tests' server process: a free port, a bounded start

    log = tmp / f"stderr{len(list(tmp.glob('stderr*.log')))}.log"
    return ServeProcess("--threads", "1", "--max-prompt-tokens", "16384", *extra).start(log)


def _complete(url: str, prompt: str, new: int) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0}
    answer = http_client().post(f"{url}/v1/completions", json=body).json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def _ttft(url: str, prompt: str) -> float:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    client = http_client()  # kept alive: made before the clock starts
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:])["choices"][0]["text"]:
                return time.perf_counter() - start
    raise RuntimeError("no text came back")


def throughput_table(mode: str, url: str) -> tuple[Table, list[Target], dict[str, Any]]:
    count, new, rounds, _ = SIZES[mode]
    rng = random.Random(0)
    prompts = [f"The {rng.choice(WORDS)} of the {rng.choice(WORDS)} is {i} " for i in range(count)]
    samples: dict[str, list[float]] = {"one at a time": [], "1": [], "4": [], "16": []}
    answers: dict[str, str] = {}
    for _ in range(rounds):
        for name in samples:
            if name == "one at a time":
                http_client()  # this thread's client, made before the clock starts
                start = time.perf_counter()
                results = [_complete(url, p, new) for p in prompts]
            else:
                with client_pool(int(name)) as pool:  # every user's client made before the clock starts
                    start = time.perf_counter()
                    results = list(pool.map(lambda p: _complete(url, p, new), prompts))
            seconds = time.perf_counter() - start
            samples[name].append(sum(n for _, n in results) / seconds)
            if name == "16":
                answers = {p: text for p, (text, _) in zip(prompts, results, strict=True)}
    t = {k: Timing.of(v) for k, v in samples.items()}
    base = t["one at a time"].median
    table = Table(f"Generated tokens per second, {count} greedy requests of {new} tokens",
                  ["clients", ":tokens/s", ":/ one at a time"])  # fmt: skip
    for name, timing in t.items():
        table.add(name, timing.cell(scale=1, digits=0), f"{timing.median / base:.2f}x")
    at16 = t["16"].median / base
    from kvcache.generation import generate
    from kvcache.models import load_default_model

    model, tokenizer = load_default_model()
    differ = 0
    for p, text in answers.items():
        ids = torch.tensor([tokenizer.encode(p)])
        alone = tokenizer.decode(generate(model, ids, max_new_tokens=new).sequences[0, ids.shape[1]:].tolist())
        differ += alone != text
    table.add("answers at 16 that differ from the prompt alone (float32)", f"{differ} of {count}", "")
    targets = [Target("serve: throughput at 16 concurrent clients", ">= 3x one at a time", f"{at16:.2f}x", at16 >= 3,
                      "rows decode together in one forward; the model is small, so per-step overhead (HTTP, "
                      "Python, the joins' copies) is a large share, and the clients share the machine")]  # fmt: skip
    return table, targets, {"tokens_per_second": t, "differ_float32": differ}


def ttft_table(mode: str, url: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, _, _, reps = SIZES[mode]
    rng = random.Random(1)
    length = 256 if mode == "smoke" else 1000

    def system() -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(length)) + "\n"

    def question() -> str:
        return f"Question {rng.randrange(10**6)}: what is the "

    shared = system()
    _complete(url, shared + question(), 1)  # the shared system prompt is stored now
    samples: dict[str, list[float]] = {"cold": [], "hit": [], "question alone": []}
    for _ in range(reps):
        samples["cold"].append(_ttft(url, system() + question()))
        samples["hit"].append(_ttft(url, shared + question()))
        samples["question alone"].append(_ttft(url, question()))
    t = {k: Timing.of(v) for k, v in samples.items()}
    ratio = t["hit"].median / t["question alone"].median
    table = Table(f"Time to first token (ms) after a shared {length}-character system prompt",
                  ["prompt", ":ms", ":/ question alone"])  # fmt: skip
    for name, timing in t.items():
        table.add(name, timing.cell(scale=1e3), f"{timing.median / t['question alone'].median:.2f}x")
    targets = [Target("serve: time to first token on a prefix-store hit", "<= 1.5x the question alone",
                      f"{ratio:.2f}x", ratio <= 1.5,
                      "a hit also looks the prompt's chunks up, checks and rebuilds them, and its question attends "
                      "over the system prompt; the question alone attends over nothing")]  # fmt: skip
    return table, targets, {"ttft": t}


def cold_store_table(mode: str, url: str = "") -> tuple[Table, list[Target], dict[str, Any]]:
    """A cold 1,000-character prompt through the server's engine with each store backend, against
    the same prompt's prefill (one forward, its first token) with no store at all (in-process:
    `url`, the running server's, is not used)."""
    import threading

    from kvcache.generation.sampling import Sampling
    from kvcache.models import load_default_model
    from kvcache.serve.engine import Engine, Request
    from kvcache.store import PrefixStore, open_store

    try:
        from .store_scale import redis_url
    except ImportError:
        from store_scale import redis_url  # type: ignore[no-redef]

    model, tokenizer = load_default_model()
    reps = 3 if mode == "smoke" else 9
    rng = random.Random(3)

    def prompt() -> list[int]:
        return tokenizer.encode("".join(rng.choice("abcdefghij klmnop") for _ in range(1000)))

    def bare() -> float:
        ids = torch.tensor([prompt()])
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, cache=model.new_cache(), position_ids=torch.arange(ids.shape[1])[None])[:, -1].argmax(-1)
        return time.perf_counter() - start

    def through(engine: Engine) -> float:
        for other in engines.values():  # no writer still busy with an earlier sample's chunks
            if other.store.writer is not None:
                other.store.writer.flush(60)
        done = threading.Event()
        request = Request(prompt=prompt(), max_tokens=1, sampling=Sampling(False))
        request.on_event = lambda event: done.set() if event[0] in ("done", "error") else None
        start = time.perf_counter()
        engine.submit(request)
        done.wait(120)
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {"no store (one forward)": []}
    with tempfile.TemporaryDirectory() as tmp, redis_url() as url:
        stores = {"memory": lambda: PrefixStore(chunk_size=16),
                  "directory": lambda: open_store(str(Path(tmp) / "store"), chunk_size=16)}  # fmt: skip
        if url is not None:
            stores["redis"] = lambda: open_store(url, chunk_size=16)
        engines = {name: Engine(model, make(), eos=[]) for name, make in stores.items()}
        for engine in engines.values():
            engine.start()
        try:
            for _ in range(reps):  # interleaved, so drift hits every row alike
                for engine in engines.values():
                    if engine.store.writer is not None:
                        engine.store.writer.flush(60)
                samples["no store (one forward)"].append(bare())
                for name, engine in engines.items():
                    samples.setdefault(name, []).append(through(engine))
        finally:
            for engine in engines.values():
                engine.stop()
    t = {k: Timing.of(v) for k, v in samples.items()}
    base = t["no store (one forward)"].median
    table = Table("A cold 1,000-character prompt through the server's engine and its prefix store: time to first "
                  "token (ms)", ["store", ":ms", ":/ no store"])  # fmt: skip
    for name, timing in t.items():
        table.add(name, timing.cell(scale=1e3), f"{timing.median / base:.2f}x")
    worst = max(t[name].median / base for name in engines)
    targets = [Target("serve: a cold prompt through every store backend", "<= 1.2x its prefill without a store",
                      f"{worst:.2f}x", worst <= 1.2, "the engine copies each chunk's keys/values (the capture, a copy "
                      "per chunk and layer); the writer, paused while prompts prefill, "
                      "writes after the first token")]  # fmt: skip
    return table, targets, {"cold_prompt_s": t}


def quantized_table(mode: str, url: str, quantized_url: str) -> tuple[Table, list[Target], dict[str, Any]]:
    """The same 8-client load on the server and on one started with `--kv-bits 4`, alternated."""
    count, new, rounds, _ = SIZES[mode]
    rng = random.Random(2)
    prompts = [f"The {rng.choice(WORDS)} of the {rng.choice(WORDS)} is {i} " for i in range(count)]
    samples: dict[str, list[float]] = {"full precision": [], "--kv-bits 4": []}
    for _ in range(rounds):
        for name, at in (("full precision", url), ("--kv-bits 4", quantized_url)):
            with client_pool(8) as pool:
                start = time.perf_counter()
                results = list(pool.map(lambda p, at=at: _complete(at, p, new), prompts))
            samples[name].append(sum(n for _, n in results) / (time.perf_counter() - start))
    t = {k: Timing.of(v) for k, v in samples.items()}
    base = t["full precision"].median
    table = Table(f"Quantized serving: {count} greedy requests of {new} tokens, 8 clients", ["server", ":tokens/s",
                  ":/ full precision"])  # fmt: skip
    for name, timing in t.items():
        table.add(name, timing.cell(scale=1, digits=0), f"{timing.median / base:.2f}x")
    return table, [], {"quantized_tokens_per_second": t}


def structured_table(mode: str, url: str) -> tuple[Table, list[Target], dict[str, Any]]:
    """8 clients' chat answers, free and under `response_format`, alternated on one server."""
    count, new, rounds, _ = SIZES[mode]
    rng = random.Random(3)
    asks = [f"Tell me about the {rng.choice(WORDS)} of the {rng.choice(WORDS)} {i}." for i in range(count)]
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"]}
    formats = {"free text": None, "response_format json_schema": {"type": "json_schema", "json_schema": {
        "name": "story", "schema": schema}}}  # fmt: skip

    def chat(ask: str, form: Any) -> tuple[str, int]:
        body = {"messages": [{"role": "user", "content": ask}], "max_tokens": new, "temperature": 0}
        answer = http_client().post(f"{url}/v1/chat/completions", json=body | ({"response_format": form} if form
                                                                              else {})).json()  # fmt: skip
        return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]

    samples: dict[str, list[float]] = {name: [] for name in formats}
    held = 0
    for _ in range(rounds):
        for name, form in formats.items():
            with client_pool(8) as pool:
                start = time.perf_counter()
                results = list(pool.map(lambda a, form=form: chat(a, form), asks))
            samples[name].append(sum(n for _, n in results) / (time.perf_counter() - start))
            if form is not None:
                held += sum(text.startswith('{"story"') or text.startswith("{") for text, _ in results)
    t = {k: Timing.of(v) for k, v in samples.items()}
    base = t["free text"].median
    table = Table(f"Structured outputs: {count} greedy chat answers of {new} tokens, 8 clients ({held} of "
                  f"{count * rounds} held answers start as the schema's document)", ["answers", ":tokens/s",
                  ":/ free text"])  # fmt: skip
    for name, timing in t.items():
        table.add(name, timing.cell(scale=1, digits=0), f"{timing.median / base:.2f}x")
    return table, [], {"structured_tokens_per_second": t}


def serve_scenario(mode: str) -> Section:
    section = Section("serve", "11. kvcache serve: concurrent requests and prefix-store hits",
                      (__doc__ or "").split("\n\n")[1])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        server = _server(Path(tmp))
        try:
            for build in (throughput_table, ttft_table, cold_store_table, structured_table):
                table, targets, figures = build(mode, server.url)
                section.tables.append(table)
                section.targets += targets
                section.figures[build.__name__] = figures
            quantized = _server(Path(tmp), "--kv-bits", "4")
            try:
                table, targets, figures = quantized_table(mode, server.url, quantized.url)
                section.tables.append(table)
                section.figures["quantized_table"] = figures
            finally:
                quantized.terminate()
        finally:
            server.terminate()
    return section


if __name__ == "__main__":
    run_as_script(serve_scenario, __doc__)
