"""What `GET /metrics` reports, in Prometheus' text format (`prometheus_client`, a registry of the
server's own): requests by endpoint and status, prompt and generated tokens, prefix-store lookups,
hits and tokens reused, the batch size, time to first token, and draft tokens verified and
accepted (their ratio is speculation's acceptance rate, as vLLM's spec-decode counters give it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Time-to-first-token buckets (seconds): a CPU server answers in milliseconds to seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcache_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("kvcache_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("kvcache_generated_tokens", "tokens generated", registry=r)
        self.prefix_lookups = Counter("kvcache_prefix_lookups", "prefix-store lookups", registry=r)
        self.prefix_hits = Counter("kvcache_prefix_hits", "lookups that reused at least one chunk", registry=r)
        self.tokens_reused = Counter("kvcache_tokens_reused", "prompt tokens taken from the prefix store", registry=r)
        self.batch_size = Gauge("kvcache_batch_size", "requests decoded together now", registry=r)
        self.draft_tokens = Counter("kvcache_draft_tokens", "draft tokens verified (speculative decoding)",
                                    registry=r)  # fmt: skip
        self.draft_tokens_accepted = Counter("kvcache_draft_tokens_accepted", "draft tokens the model accepted",
                                             registry=r)  # fmt: skip
        self.time_to_first_token = Histogram("kvcache_time_to_first_token_seconds", "from arrival to first token",
                                             buckets=TTFT_BUCKETS, registry=r)  # fmt: skip

    def add_drafts(self, verified: int, accepted: int) -> None:
        self.draft_tokens.inc(verified)
        self.draft_tokens_accepted.inc(accepted)

    def text(self) -> bytes:
        return generate_latest(self.registry)
