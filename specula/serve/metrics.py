"""Prometheus metrics of one server, in a registry of its own (two apps in one process do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# τ = tokens per target forward: 1 for vanilla, rarely above 6 for any method on small trees.
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class ServerMetrics:
    """The counters, gauges and histograms `/metrics` exposes (all prefixed ``specula_``)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specula_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("specula_generations", "Generations ended, by finish reason "
                                   "(stop, length, cancelled, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("specula_prompt_tokens", "Prompt tokens of served generations", registry=r)
        self.generated_tokens = Counter("specula_generated_tokens", "Tokens generated", registry=r)
        self.tau = Histogram("specula_tau", "Tokens per target forward of each generation", buckets=TAU_BUCKETS,
                             registry=r)
        self.time_to_first_token = Histogram("specula_time_to_first_token_seconds",
                                             "From submission (queueing included) to the first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("specula_queue_length", "Requests waiting for the decoding worker", registry=r)
        self.batch_size = Gauge("specula_batch_size", "Sequences being decoded right now", registry=r)

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
