"""Every kvgate metric, in one place, behind verbs. Labels are model and backend names
from the config and codes from the error contract, never raw request strings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.body_budget import BodyBudget
from proxy.tokenize.cache import CacheStats

__all__ = ["CONTENT_TYPE", "Metrics", "Outcome"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 3, 5, 10, 30, 60, 120)


class Outcome(StrEnum):
    """How a request ended; rejections use their error code as the outcome."""

    COMPLETED = "completed"
    UPSTREAM_ERROR = "upstream_error"
    # the engine answered 4xx itself (relayed unchanged): not a completion, not kvgate's
    UPSTREAM_REFUSED = "upstream_refused"
    CLIENT_DISCONNECT = "client_disconnect"
    REJECTED = "rejected"


class Metrics:
    """One registry per proxy instance, so several can live in one process (tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._requests = Counter("kvgate_requests", "Requests by outcome",
                                 ["model", "outcome"], registry=r)
        self._rejections = Counter("kvgate_rejections", "Rejections by contract code",
                                   ["model", "reason"], registry=r)
        self._queue_wait = Histogram("kvgate_queue_wait_seconds", "Time waiting for capacity",
                                     ["model"], buckets=_WAIT_BUCKETS, registry=r)
        self._queue_depth = Gauge("kvgate_queue_depth", "Requests waiting", ["model"], registry=r)
        self._resident = Gauge("kvgate_resident_tokens", "Tokens reserved now",
                               ["backend"], registry=r)
        self._capacity = Gauge("kvgate_capacity_tokens", "KV token capacity",
                               ["backend"], registry=r)
        self._resident_seen = Histogram(
            "kvgate_resident_tokens_observed", "Resident tokens seen at each admit and release",
            ["backend"], buckets=_TOKEN_BUCKETS, registry=r)
        self._prompt = Histogram("kvgate_prompt_tokens", "Prompt tokens per request",
                                 ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self._reserved = Histogram("kvgate_reserved_tokens", "Reserved tokens per request",
                                   ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self._on_bound = Counter(
            "kvgate_bound_admissions", "Requests admitted on an upper bound of their prompt "
            "while nothing waited (exact count after)", ["model"], registry=r)
        self._tokenize = Histogram("kvgate_tokenize_seconds", "Time to count prompt tokens",
                                   buckets=_WAIT_BUCKETS, registry=r)
        self._count_failures = Counter(
            "kvgate_count_failures", "Prompts no tokenizer could count exactly (CountFailed): "
            "refused with 500 when counted first, kept on their bound when admitted on one",
            ["model"], registry=r)
        self._worker_exits = Counter("kvgate_count_worker_exits",
                                     "Count worker processes that died while in use",
                                     registry=r)
        self._worker_restarts = Counter("kvgate_count_worker_restarts",
                                        "Count worker processes started again after one died",
                                        registry=r)
        self._first_byte = Histogram("kvgate_upstream_first_byte_seconds",
                                     "Upstream time to first byte", ["backend"],
                                     buckets=_WAIT_BUCKETS, registry=r)
        self._inflight = Gauge("kvgate_inflight_requests", "Requests holding a lease",
                               ["backend"], registry=r)
        self._inflight_peak = Gauge("kvgate_inflight_requests_peak",
                                    "Peak concurrent requests since start", ["backend"],
                                    registry=r)
        self._headroom_min = Gauge("kvgate_headroom_tokens_min",
                                   "Least free capacity seen since start", ["backend"],
                                   registry=r)
        self._ledger_up = Gauge("kvgate_ledger_available",
                                "1 while the ledger can be reached, 0 while admission is refused",
                                registry=r)
        # Adaptive reservation, per backend: what the engine says next to what kvgate holds.
        self._engine_usage = Gauge("kvgate_engine_kv_usage_ratio",
                                   "KV cache use the engine reports (vllm:kv_cache_usage_perc)",
                                   ["backend"], registry=r)
        self._engine_preemptions = Gauge("kvgate_engine_preemptions_reported",
                                         "Preemptions the engine reports since it started "
                                         "(vllm:num_preemptions_total)", ["backend"], registry=r)
        self._engine_estimate = Gauge("kvgate_engine_estimate_tokens",
                                      "Tokens this replica's requests hold in the engine now "
                                      "(prompt + output so far, estimated)", ["backend"],
                                      registry=r)
        self._target = Gauge("kvgate_admission_target_tokens",
                             "Reserved tokens up to which new requests are admitted",
                             ["backend"], registry=r)
        self._shortfall = Gauge("kvgate_lease_shortfall_tokens",
                                "Tokens live leases wanted to grow by but found no room for",
                                ["backend"], registry=r)
        # Shared prefix blocks, per backend: charged once, next to the engine's own hits.
        self._shared_held = Gauge("kvgate_shared_prefix_resident_tokens",
                                  "Tokens of resident held in shared prefix blocks (each "
                                  "block counted once)", ["backend"], registry=r)
        self._shared_covered = Counter(
            "kvgate_shared_prefix_tokens", "Tokens of admitted requests that blocks already "
            "held there covered: kvgate's predicted prefix-cache hits", ["backend"], registry=r)
        self._engine_hits = Gauge("kvgate_engine_prefix_hit_tokens_reported",
                                  "Prefix-cache hit tokens the engine reports since it started "
                                  "(vllm:prefix_cache_hits_total)", ["backend"], registry=r)
        # Tickets (`proxy.tickets`): given with retryable 429s, and brought back in time.
        self._tickets_issued = Counter("kvgate_tickets_issued", "429s that carried a ticket",
                                       ["model"], registry=r)
        self._tickets_redeemed = Counter(
            "kvgate_tickets_redeemed", "Requests that brought a good ticket back and were "
            "ordered ahead of those holding none", ["model"], registry=r)
        # A labelled child per label values, looked up once: `labels()` takes a lock and
        # validates its arguments on every call, and these run several times a request.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._peaks: dict[str, int] = {}
        self._headroom: dict[str, int] = {}
        self._count_cache: _CountCacheCollector | None = None
        self._body_budget: _BodyBudgetCollector | None = None

    def _child(self, metric: _Labelled, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def backend_configured(self, backend: str, capacity_tokens: int) -> None:
        self._child(self._capacity, backend).set(capacity_tokens)
        self._child(self._resident, backend).set(0)
        self._child(self._inflight, backend).set(0)
        self._child(self._inflight_peak, backend).set(0)
        self._headroom.setdefault(backend, capacity_tokens)
        self._child(self._headroom_min, backend).set(self._headroom[backend])

    def capacity_changed(self, backend: str, capacity_tokens: int) -> None:
        self._child(self._capacity, backend).set(capacity_tokens)

    def backend_state(self, backend: str, *, resident: int, capacity: int, inflight: int) -> None:
        """What only the lease events see: the distribution, the peak, the least headroom.
        The current resident and in-flight gauges are set at scrape time (`backend_view`)."""
        self._child(self._resident_seen, backend).observe(resident)
        if inflight > self._peaks.get(backend, 0):
            self._peaks[backend] = inflight
            self._child(self._inflight_peak, backend).set(inflight)
        headroom = capacity - resident
        if headroom < self._headroom.get(backend, capacity):
            self._headroom[backend] = headroom
            self._child(self._headroom_min, backend).set(headroom)

    def backend_view(
        self, backend: str, *, resident: int, inflight: int, target: int,
        engine_estimate: int, shortfall: int, shared_resident: int = 0,
    ) -> None:
        """Gauges of shared and live state, set from the current view at scrape time."""
        self._child(self._resident, backend).set(resident)
        self._child(self._shared_held, backend).set(shared_resident)
        self._child(self._inflight, backend).set(inflight)
        self._child(self._target, backend).set(target)
        self._child(self._engine_estimate, backend).set(engine_estimate)
        self._child(self._shortfall, backend).set(shortfall)

    def ticket_issued(self, model: str) -> None:
        self._child(self._tickets_issued, model).inc()

    def ticket_redeemed(self, model: str) -> None:
        self._child(self._tickets_redeemed, model).inc()

    def shared_prefix(self, backend: str, tokens: int) -> None:
        self._child(self._shared_covered, backend).inc(tokens)

    def engine_prefix_hits(self, backend: str, tokens: int) -> None:
        self._child(self._engine_hits, backend).set(tokens)

    def engine_reported(
        self, backend: str, *, usage_ratio: float | None, preemptions: int | None
    ) -> None:
        if usage_ratio is not None:
            self._child(self._engine_usage, backend).set(usage_ratio)
        if preemptions is not None:
            self._child(self._engine_preemptions, backend).set(preemptions)

    def ledger_available(self, available: bool) -> None:
        self._ledger_up.set(1 if available else 0)

    def queue_depth(self, model: str, depth: int) -> None:
        self._child(self._queue_depth, model).set(depth)

    def counted(self, model: str, *, prompt_tokens: int, seconds: float) -> None:
        self._child(self._prompt, model).observe(prompt_tokens)
        self._tokenize.observe(seconds)

    def count_failed(self, model: str) -> None:
        self._child(self._count_failures, model).inc()

    def count_worker_exited(self) -> None:
        self._worker_exits.inc()

    def count_worker_restarted(self) -> None:
        self._worker_restarts.inc()

    def admitted(self, model: str, *, reserved_tokens: int, waited_s: float) -> None:
        self._child(self._reserved, model).observe(reserved_tokens)
        self._child(self._queue_wait, model).observe(waited_s)

    def admitted_on_bound(self, model: str) -> None:
        self._child(self._on_bound, model).inc()

    def first_byte(self, backend: str, seconds: float) -> None:
        self._child(self._first_byte, backend).observe(seconds)

    def finished(self, model: str, outcome: str) -> None:
        self._child(self._requests, model, outcome).inc()

    def rejected(self, model: str, reason: str) -> None:
        self._child(self._rejections, model, reason).inc()
        self._child(self._requests, model, Outcome.REJECTED).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- count cache (proxy.tokenize.cache): read at scrape time, per model
    def watch_count_cache(self, model: str, stats: Callable[[], CacheStats | None]) -> None:
        """Export `kvgate_count_cache_{hits,misses}_total` and `_bytes` for one model."""
        if self._count_cache is None:
            self._count_cache = _CountCacheCollector()
            self.registry.register(self._count_cache)
        self._count_cache.sources[model] = stats


    # --- body budget (proxy.body_budget): read at scrape time
    def watch_body_budget(self, budget: BodyBudget) -> None:
        """Export `kvgate_body_budget_held_bytes`, `kvgate_body_budget_model_held_bytes`
        and `kvgate_body_budget_refusals_total` from `budget` (one per registry)."""
        if self._body_budget is None:
            self._body_budget = _BodyBudgetCollector(budget)
            self.registry.register(self._body_budget)
        self._body_budget.budget = budget


class _Labelled(Protocol):
    def labels(self, *labelvalues: str) -> Any: ...


class _CountCacheCollector(Collector):
    """The cache keeps its own counters (it lives in the counting threads); a collector
    reads them at scrape time instead of paying a metric update per lookup."""

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], CacheStats | None]] = {}

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("kvgate_count_cache_hits",
                                   "Prompt segments whose count came from the cache",
                                   labels=["model"])
        misses = CounterMetricFamily("kvgate_count_cache_misses",
                                     "Prompt segments encoded because they were not cached",
                                     labels=["model"])
        size = GaugeMetricFamily("kvgate_count_cache_bytes",
                                 "Memory held by the count cache (approximate)",
                                 labels=["model"])
        for model, source in self.sources.items():
            stats = source()
            if stats is None:
                continue
            hits.add_metric([model], stats.hits)
            misses.add_metric([model], stats.misses)
            size.add_metric([model], stats.size_bytes)
        yield from (hits, misses, size)


class _BodyBudgetCollector(Collector):
    """The budget counts on the event loop as bodies arrive and leave; its figures are
    read at scrape time rather than paying a metric update per chunk."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        budget = self.budget
        held = GaugeMetricFamily("kvgate_body_budget_held_bytes",
                                 "Bytes of request bodies being read, counted or waiting "
                                 "for admission", value=budget.held)
        by_model = GaugeMetricFamily("kvgate_body_budget_model_held_bytes",
                                     "Bytes of a model's request bodies being counted or "
                                     "waiting for admission", labels=["model"])
        for model, held_bytes in budget.held_by_model.items():
            by_model.add_metric([model], held_bytes)
        refusals = CounterMetricFamily(
            "kvgate_body_budget_refusals", "Requests refused with 503 memory_budget, by the "
            "budget they would have passed (total, or model) and model (\"\" while unknown)",
            labels=["budget", "model"])
        for (which, model), count in sorted(budget.refusals.items()):
            refusals.add_metric([which, model], count)
        yield from (held, by_model, refusals)
