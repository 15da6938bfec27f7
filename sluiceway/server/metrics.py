"""``GET /metrics``: Prometheus metrics, exposed from a ``prometheus-client``
registry of the app's own.

The metrics with a vLLM equivalent carry vLLM's name and meaning
(``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...):
the gauges are what the Gateway API Inference Extension's model-server
protocol asks of a model server (TotalRunningRequests, TotalQueuedRequests,
KVCacheUtilization), and its endpoint picker and smg read vLLM's names
without being told anything. What vLLM has no word for is ``sluiceway:``.
docs/deployment.md has the table.

The gauges are read from the scheduler's counters when Prometheus scrapes
(a collector), not kept up to date on every step; the histograms and
counters are fed once per request, when it ends, except the queue time
(observed at admission) and the inter-token gap (observed by the request's
record at each delta after the first: ``RequestRecord.on_gap``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluiceway.actors.prefix_cache import PrefixCacheStats
from sluiceway.server.record import RequestRecord

# The ``_created`` series double every counter for nothing a dashboard reads.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960, 1920)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSnapshot:
    """The scheduler's load at one moment, for /metrics, /v1/loads and /health."""

    running_requests: int
    running_sequences: int
    waiting_requests: int
    paused_requests: int
    cached_tokens: int
    #: Tokens the KV caches can hold at most (every row at full context).
    capacity_tokens: int
    max_num_seqs: int
    engine_available: bool

    @property
    def kv_usage(self) -> float:
        """KV cache utilisation, 0 to 1."""
        if self.capacity_tokens <= 0:
            return 0.0
        return min(1.0, self.cached_tokens / self.capacity_tokens)


class _LoadCollector:
    """The gauges, read from the scheduler when scraped."""

    def __init__(
        self,
        model_name: str,
        load: Callable[[], LoadSnapshot | None],
        prefix_cache: Callable[[], PrefixCacheStats | None],
    ) -> None:
        self._model = model_name
        self._load = load
        self._prefix_cache = prefix_cache

    def collect(self) -> Iterator[Metric]:
        snapshot = self._load()
        if snapshot is not None:
            yield from self._gauges(snapshot)
        stats = self._prefix_cache()
        if stats is not None:
            yield from self._prefix(stats)

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _gauges(self, load: LoadSnapshot) -> Iterator[Metric]:
        yield self._gauge(
            "vllm:num_requests_running",
            "Requests admitted to the batch (prefilling or decoding), not yet finished.",
            load.running_requests,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Requests submitted and waiting for a slot in the batch.",
            load.waiting_requests,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache utilisation, 0 to 1: tokens held over the most the batch can hold.",
            load.kv_usage,
        )
        yield self._gauge(
            "sluiceway:num_sequences_running",
            "Sequences (rows: a request's choices) in the running batch.",
            load.running_sequences,
        )
        yield self._gauge(
            "sluiceway:num_requests_paused",
            "Running requests paused because their client reads slower than they generate.",
            load.paused_requests,
        )
        yield self._gauge(
            "sluiceway:engine_available",
            "1 while the engine serves; 0 while it is lost or restarting.",
            float(load.engine_available),
        )

    def _prefix(self, stats: PrefixCacheStats) -> Iterator[Metric]:
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.looked_up_tokens,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not prefilled again).",
            stats.hit_tokens,
        )
        if not stats.capacity_bytes:
            return  # vLLM's own cache (--engine vllm): no evictions or bytes counted
        yield self._counter(
            "sluiceway:prefix_cache_evicted_tokens",
            "Tokens evicted from the prefix cache to make room.",
            stats.evicted_tokens,
        )
        yield self._gauge(
            "sluiceway:prefix_cache_bytes", "Bytes of KV held by the prefix cache.", stats.bytes
        )
        yield self._gauge(
            "sluiceway:prefix_cache_capacity_bytes",
            "Bytes the prefix cache may hold (--prefix-cache-bytes).",
            stats.capacity_bytes,
        )


class Metrics:
    """The server's metrics and the registry they are exposed from."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        model = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, model, registry=self.registry, buckets=(*buckets, math.inf))

        self.requests = Counter(
            "sluiceway:http_requests",
            "HTTP requests answered, by route (its path pattern), surface and status.",
            ["route", "surface", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests.",
            model,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Generated tokens of finished requests.",
            model,
            registry=self.registry,
        ).labels(model_name)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "From the request's arrival to its first delta going out.",
            TTFT_BUCKETS,
        ).labels(model_name)
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds",
            "Between two successive deltas of one request going out.",
            GAP_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "From the request's arrival to its last byte, for generation requests.",
            E2E_BUCKETS,
        ).labels(model_name)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "From submission to admission into the batch.",
            QUEUE_BUCKETS,
        ).labels(model_name)
        self._model_name = model_name

    def watch(
        self,
        load: Callable[[], LoadSnapshot | None],
        prefix_cache: Callable[[], PrefixCacheStats | None] = lambda: None,
    ) -> None:
        """Export the gauges of ``load`` (None while there is no scheduler)."""
        self.registry.register(_LoadCollector(self._model_name, load, prefix_cache))

    def finished(self, record: RequestRecord) -> None:
        """Count one answered request; time it, if it generated."""
        self.requests.labels(record.route, record.surface, str(record.status or 0)).inc()
        if not record.generated:
            return
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        if record.ttft is not None:
            self.ttft.observe(record.ttft)
        self.e2e.observe(record.duration())

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
