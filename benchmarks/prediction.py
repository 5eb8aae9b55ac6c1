"""Predicted outputs (OpenAI's `prediction`): drafting an answer from the text it is expected to repeat.

An edit workload with the bundled model, greedy: each request asks for a paragraph rewritten;
its answer is first decoded plainly, and predictions are made from it as a client would have them:
the answer itself ("exact": a file the edit leaves as it is), the answer with every eighth word
changed ("edited": the file before an edit of a few words), and text that has nothing to do with it
("unrelated"). (1) In process: plain `generate`, prompt lookup (the server's default drafter) and
`PredictionDrafter` (falling back to prompt lookup) on each prediction, at most 16 draft tokens a
step (each contender's adaptive schedule carried across its requests as one `DraftGate`, as a
server's is), the contenders interleaved request by request in rotating order; tokens per second
and tokens checked against plain decoding. (2) (`--quick` and full runs) `kvcache serve` with its
defaults, chat requests from 1 and from 8 concurrent clients: without a prediction, which is what
any other server makes of such a request (neither vLLM nor `transformers serve` drafts from it),
and with each prediction; tokens per second, answers compared, predicted tokens accepted.

    python benchmarks/prediction.py [--quick]
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from kvcache.generation import DraftGate, PredictionDrafter, PromptLookupDrafter, generate, speculative_generate

try:
    from .common import Section, Table, Target, client_pool, http_client, run_as_script, section_of
except ImportError:  # run as a script
    from common import Section, Table, Target, client_pool, http_client, run_as_script, section_of  # type: ignore[no-redef]

#: (requests, new tokens per request); rounds of the served table (each contender once a round)
SIZES = {"smoke": (3, 48), "quick": (8, 160), "full": (16, 256)}
ROUNDS = {"smoke": 1, "quick": 3, "full": 5}
K = 16
WORDS = ("cache", "value", "token", "layer", "state", "model", "window", "prefix", "store", "answer")
KINDS = ("exact", "edited", "unrelated")


def edit_prompts(count: int) -> list[str]:
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(count)]
    return [f"Rewrite this paragraph.\n{p}\nRewritten:\n" for p in paragraphs]


def predictions(answer: str) -> dict[str, str]:
    """The three predictions of an answer's text."""
    words = answer.split(" ")
    edited = " ".join("edit" if i % 8 == 7 else w for i, w in enumerate(words))
    return {"exact": answer, "edited": edited, "unrelated": "lorem ipsum dolor sit amet " * (len(answer) // 27 + 1)}


def process_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    from kvcache.models import load_default_model

    count, new = SIZES[mode]
    model, tokenizer = load_default_model()
    prompts = [tokenizer.encode(p) for p in edit_prompts(count)]
    options: dict[str, Any] = {"max_new_tokens": new, "eos_token_id": []}
    answers = [generate(model, torch.tensor([ids]), **options).sequences[0, len(ids) :].tolist() for ids in prompts]
    texts = [predictions(tokenizer.decode(a)) for a in answers]
    contenders = ["plain", "prompt lookup", *(f"prediction, {k}" for k in KINDS)]
    seconds, same, accepted = dict.fromkeys(contenders, 0.0), dict.fromkeys(contenders, True), {}
    gates = {how: DraftGate(K) for how in contenders}
    for i, ids in enumerate(prompts):
        for how in contenders[i % len(contenders) :] + contenders[: i % len(contenders)]:
            start = time.perf_counter()
            if how == "plain":
                out = generate(model, torch.tensor([ids]), **options).sequences
            else:
                drafter = PromptLookupDrafter()
                if how.startswith("prediction"):
                    drafter = PredictionDrafter(tokenizer.encode(texts[i][how.split(", ")[1]]), drafter)
                result = speculative_generate(model, drafter, torch.tensor([ids]), num_draft_tokens=K,
                                              draft_schedule=gates[how], **options)  # fmt: skip
                out = result.sequences
                accepted[how] = accepted.get(how, 0) + sum(result.accepted_per_step)
            seconds[how] += time.perf_counter() - start
            same[how] &= out[0, len(ids) :].tolist() == answers[i]
    table = Table(f"in process, {count} requests of {new} new tokens in sequence, greedy",
                  ["decoding", ":tokens/s", ":x plain", ":x prompt lookup", ":draft tokens accepted",
                   "same tokens"])  # fmt: skip
    for how in contenders:
        table.add(how, f"{count * new / seconds[how]:,.0f}", f"{seconds['plain'] / seconds[how]:.2f}x",
                  f"{seconds['prompt lookup'] / seconds[how]:.2f}x",
                  f"{accepted[how] / (count * new):.0%}" if how in accepted else "-", "yes" if same[how] else "NO")
    exact = seconds["prompt lookup"] / seconds["prediction, exact"]
    unrelated = seconds["prompt lookup"] / seconds["prediction, unrelated"]
    targets = [Target("prediction drafting, the exact answer predicted (in process)", ">= 2x prompt lookup",
                      f"{exact:.2f}x", exact >= 2.0, "a one-row forward of the small bundled model costs little "
                      "more than the drafting around it"),
               Target("prediction drafting, an unrelated prediction (in process)", ">= 0.9x prompt lookup",
                      f"{unrelated:.2f}x", unrelated >= 0.9, "the schedule pays for a few rejected drafts before "
                      "it judges the prediction's"),
               Target("prediction drafting: tokens", "= plain greedy", "identical" if all(same.values()) else "DIFFER",
                      all(same.values()), "a bug: drafts must not change the answer")]  # fmt: skip
    return table, targets, {"seconds": seconds, "same": same}


def serve_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from serve_kit import ServeProcess  # the tests' server process: a free port, a bounded start

    count, new = SIZES[mode]
    prompts = edit_prompts(count)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess("--threads", "1").start(Path(tmp) / "serve.log")
        try:
            def chat(prompt: str, predicted: str | None) -> tuple[str, int, int]:
                body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": new,
                                        "temperature": 0}  # fmt: skip
                if predicted is not None:
                    body["prediction"] = {"type": "content", "content": predicted}
                answer = http_client().post(f"{server.url}/v1/chat/completions", json=body).json()
                details = answer["usage"].get("completion_tokens_details") or {}
                return (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"],
                        details.get("accepted_prediction_tokens", 0))  # fmt: skip

            answers = [chat(p, None)[0] for p in prompts]  # (also fills the prefix store: every run reuses it)
            texts = [predictions(a) for a in answers]
            table = Table(f"kvcache serve (defaults), {count} chat requests of up to {new} tokens, greedy",
                          ["clients", "prediction", ":tokens/s", ":x none", ":predicted tokens accepted",
                           "same answers"])  # fmt: skip
            figures: dict[str, Any] = {}
            targets = []
            names = ("none", *KINDS)
            for clients in (1, 8):
                spent, made, same, took = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {}, {}
                for r in range(ROUNDS[mode]):  # each round in another order: the machine's drift falls on all
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        jobs = [(p, None if name == "none" else texts[i][name]) for i, p in enumerate(prompts)]
                        with client_pool(clients) as pool:
                            start = time.perf_counter()
                            done = list(pool.map(lambda job: chat(*job), jobs))
                            spent[name] += time.perf_counter() - start
                        made[name] += sum(n for _, n, _ in done)
                        same[name] = same.get(name, True) and [text for text, _, _ in done] == answers
                        took[name] = took.get(name, 0) + sum(a for _, _, a in done)
                rates = {name: made[name] / spent[name] for name in names}
                taken = {name: took[name] / max(made[name], 1) for name in names}
                for name, rate in rates.items():
                    table.add(clients, name, f"{rate:,.0f}", f"{rate / rates['none']:.2f}x",
                              "-" if name == "none" else f"{taken[name]:.0%}", "yes" if same[name] else "NO")
                figures[clients] = {"rates": rates, "same": same, "accepted": taken}
                gain = rates["exact"] / rates["none"]
                targets.append(Target(f"serve, {clients} client(s), the exact answer predicted",
                                      ">= 1.5x no prediction",
                                      f"{gain:.2f}x", gain >= 1.5, "drafts stop at the store's chunk boundaries (16 "
                                      "tokens) and at 8 tokens a step; at 8 clients a batch already shares a forward"))
                loss = rates["unrelated"] / rates["none"]
                targets.append(Target(f"serve, {clients} client(s), an unrelated prediction", ">= 0.85x no prediction",
                                      f"{loss:.2f}x", loss >= 0.85, "rejected drafts cost verify forwards until the "
                                      "schedule judges them"))  # fmt: skip
                alike = all(same.values())
                targets.append(Target(f"serve, {clients} client(s), answers with a prediction", "= without one",
                                      "identical" if alike else "DIFFER", alike, "a bug: drafts must not change an "
                                      "answer"))  # fmt: skip
        finally:
            server.terminate()
    return table, targets, figures


def prediction_scenario(mode: str) -> Section:
    builders = (process_table,) + ((serve_table,) if mode != "smoke" else ())  # servers: not in smoke
    return section_of("prediction", "16. Predicted outputs: drafting from the expected answer", __doc__, builders,
                      mode)  # fmt: skip


if __name__ == "__main__":
    run_as_script(prediction_scenario, __doc__)
