"""Predicted outputs on `kvcache serve` (OpenAI's `prediction`, sent with the official client): an
answer with a prediction is the answer without one (greedy, and sampled seed for seed; one
request, and eight at once, past the rows the server drafts for otherwise), its usage counts the
predicted tokens it took as `PredictionTrack` follows them (all of them for a prediction that is
the answer), `/metrics` shows the accepted drafts that made it faster, and a malformed
prediction is a 400."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from serve_kit import module_server

from kvcache.generation.prediction import prediction_usage
from kvcache.serve.served import bundled

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Tell me about the value of the cache", "What is the sum of its tokens?", "Say the list again"]
NEW = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory)


def chat(client, prompt: str, predicted: str | None = None, **options) -> tuple[str, dict]:
    extra = {} if predicted is None else {"prediction": {"type": "content", "content": predicted}}
    answer = client.chat.completions.create(model="kvcache-default", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=NEW, **extra, **options)  # fmt: skip
    details = answer.usage.completion_tokens_details
    return answer.choices[0].message.content, ({} if details is None else details.model_dump(exclude_none=True))


def drafts_accepted(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(r"^kvcache_draft_tokens_accepted_total (\S+)$", text, re.M).group(1))


def edited(text: str) -> str:
    return " ".join("edit" if i % 5 == 4 else word for i, word in enumerate(text.split(" ")))


def test_a_prediction_changes_no_answer_and_usage_counts_what_it_took(server) -> None:
    client, encode = server.client(), bundled().encode
    for prompt in PROMPTS:
        plain, details = chat(client, prompt, temperature=0)
        assert "accepted_prediction_tokens" not in details
        before = drafts_accepted(server)
        text, details = chat(client, prompt, plain, temperature=0)
        assert text == plain
        assert details == {"accepted_prediction_tokens": len(encode(plain)), "rejected_prediction_tokens": 0}
        assert drafts_accepted(server) - before >= NEW // 2  # most tokens came from verified drafts
        for predicted in (edited(plain), "lorem ipsum dolor sit amet " * 3):
            text, details = chat(client, prompt, predicted, temperature=0)
            assert text == plain
            assert details == prediction_usage(encode(predicted), encode(plain))


def test_a_sampled_answer_is_the_same_seed_for_seed(server) -> None:
    client = server.client()
    plain, _ = chat(client, PROMPTS[0], temperature=0.9, seed=7)
    for predicted in (plain, edited(plain)):
        assert chat(client, PROMPTS[0], predicted, temperature=0.9, seed=7)[0] == plain


def test_eight_predicted_requests_at_once_answer_as_alone(server) -> None:
    """Eight rows are past the rows the server drafts for without a prediction: rows with one draft."""
    client = server.client()
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS][:8]
    alone = [chat(client, p, temperature=0)[0] for p in prompts]
    jobs = [(p, a if i % 2 else edited(a)) for i, (p, a) in enumerate(zip(prompts, alone, strict=True))]
    before = drafts_accepted(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: chat(client, *job, temperature=0)[0], jobs))
    assert together == alone
    assert drafts_accepted(server) - before >= len(jobs) * NEW // 4  # (they drafted, from their predictions)


def test_a_malformed_prediction_is_a_400(server) -> None:
    chat_body = {"model": "kvcache-default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [({**chat_body, "prediction": {"type": "text", "content": "x"}}, "/v1/chat/completions"),
             ({**chat_body, "prediction": {"type": "content", "content": 5}}, "/v1/chat/completions"),
             ({**chat_body, "prediction": {"type": "content", "content": [{"type": "image_url"}]}},
              "/v1/chat/completions"),
             ({**chat_body, "prediction": {"type": "content", "content": "x" * 9000}}, "/v1/chat/completions"),
             ({"prompt": "Hi", "max_tokens": 4, "prediction": {"type": "content", "content": "x"}},
              "/v1/completions")]  # fmt: skip
    for body, path in cases:
        answer = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prediction", answer.text
    # null is no prediction
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={**chat_body, "prediction": None}, timeout=30)
    assert answer.status_code == 200 and "completion_tokens_details" not in answer.json()["usage"]
