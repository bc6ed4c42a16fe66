"""The PromQL evaluator behind docs/dashboard.png: known values for every form it supports,
refusal of everything else, and every panel of deploy/grafana/kvgate.json evaluated to data
over the pages kvgate and the simulator really export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.render_dashboard import Scrape, fmt_value, store_from
from benchmarks.suite.promql import Query, Store, Unsupported, _quantile, legend

ROOT = Path(__file__).resolve().parent.parent


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


def counter_store() -> Store:
    """A counter growing 2/s from 0, scraped every second for 120 s, on two instances."""
    store = Store()
    for t in range(121):
        store.add("reqs_total", {"instance": "a", "code": "ok"}, float(t), 2.0 * t)
        store.add("reqs_total", {"instance": "b", "code": "err"}, float(t), 0.5 * t)
    return store


def test_rate_and_increase_over_a_counter() -> None:
    store = counter_store()
    rate = Query("rate(reqs_total[1m])").at(store, 100.0)
    assert rate[labels(instance="a", code="ok")] == pytest.approx(2.0)
    assert rate[labels(instance="b", code="err")] == pytest.approx(0.5)
    inc = Query('increase(reqs_total{code="ok"}[1m])').at(store, 100.0)
    assert inc == {labels(instance="a", code="ok"): pytest.approx(120.0)}
    # sum by, and a sum with no grouping
    assert Query("sum by (code) (rate(reqs_total[1m]))").at(store, 100.0) == {
        labels(code="ok"): pytest.approx(2.0), labels(code="err"): pytest.approx(0.5)}
    assert Query("sum(rate(reqs_total[1m]))").at(store, 100.0) == {
        frozenset(): pytest.approx(2.5)}
    # one sample in the window is no rate at all
    assert Query("rate(reqs_total[1m])").at(store, 0.0) == {}


def test_rate_counts_through_a_counter_reset() -> None:
    store = Store()
    for t, v in enumerate([0, 10, 20, 30, 5, 15, 25]):  # restarted between t=3 and t=4
        store.add("c_total", {}, float(t), float(v))
    # (-1, 6] holds every sample: 30 before the reset and 25 after, and the first sample
    # is the counter's zero, so nothing is extrapolated
    assert Query("increase(c_total[7s])").at(store, 6.0)[frozenset()] == pytest.approx(55.0)
    # (0, 6] starts at 10: 20 + 25 over 5 s sampled, extrapolated by one interval to 6 s
    assert Query("increase(c_total[6s])").at(store, 6.0)[frozenset()] == pytest.approx(54.0)


def test_label_matchers_and_instant_selectors() -> None:
    store = counter_store()
    store.add("g", {"backend": "x"}, 0.0, 3.0)
    assert Query('reqs_total{code!="ok"}').at(store, 50.0) == {
        labels(instance="b", code="err"): 25.0}
    assert Query('reqs_total{code=~"o.*"}').at(store, 50.0) == {
        labels(instance="a", code="ok"): 100.0}
    assert Query('reqs_total{code!~"e|ok"}').at(store, 50.0) == {
        labels(instance="b", code="err"): 25.0}
    assert Query("g").at(store, 299.0) == {labels(backend="x"): 3.0}
    assert Query("g").at(store, 301.0) == {}  # stale after Prometheus' 5-minute lookback
    assert Query("g").at(store, -1.0) == {}  # nothing before its first sample


def test_aggregations_and_vector_division() -> None:
    store = Store()
    for instance, values in (("r1", (10.0, 40.0)), ("r2", (30.0, 20.0))):
        for backend, v in zip(("b0", "b1"), values, strict=True):
            store.add("resident", {"backend": backend, "instance": instance}, 0.0, v)
            store.add("capacity", {"backend": backend, "instance": instance}, 0.0, 100.0)
    store.add("capacity", {"backend": "b2", "instance": "r1"}, 0.0, 100.0)  # no partner
    assert Query("max by (backend) (resident)").at(store, 1.0) == {
        labels(backend="b0"): 30.0, labels(backend="b1"): 40.0}
    assert Query("min by (instance) (resident)").at(store, 1.0) == {
        labels(instance="r1"): 10.0, labels(instance="r2"): 20.0}
    assert Query("sum by (backend) (resident)").at(store, 1.0) == {
        labels(backend="b0"): 40.0, labels(backend="b1"): 60.0}
    # one-to-one on identical label sets; b2 has no left-hand side and drops out
    assert Query("max by (backend) (resident) / max by (backend) (capacity)").at(
        store, 1.0) == {labels(backend="b0"): 0.3, labels(backend="b1"): 0.4}
    assert Query("sum(resident) / 4").at(store, 1.0) == {frozenset(): 25.0}


def test_max_over_time() -> None:
    store = Store()
    for t, v in enumerate([1, 7, 3, 2, 2]):
        store.add("g", {}, float(t), float(v))
    assert Query("max_over_time(g[3s])").at(store, 4.0) == {frozenset(): 3.0}  # (1, 4]
    assert Query("max_over_time(g[2s])").at(store, 4.0) == {frozenset(): 2.0}  # (2, 4]
    assert Query("max_over_time(g[5s])").at(store, 4.0) == {frozenset(): 7.0}


def test_histogram_quantile_on_known_buckets() -> None:
    # 10 observations <= 1, 20 in (1, 2], 10 in (2, 4], none above: per second
    assert _quantile(0.5, [(1.0, 10), (2.0, 30), (4.0, 40), (math.inf, 40)]) == 1.5
    assert _quantile(0.9, [(1.0, 10), (2.0, 30), (4.0, 40), (math.inf, 40)]) == pytest.approx(3.2)
    assert _quantile(0.1, [(1.0, 10), (2.0, 30), (4.0, 40), (math.inf, 40)]) == pytest.approx(0.4)
    # a rank in the +Inf bucket answers the highest finite bound
    assert _quantile(0.99, [(1.0, 10), (2.0, 30), (math.inf, 40)]) == 2.0
    assert math.isnan(_quantile(0.5, [(1.0, 0), (math.inf, 0)]))  # no observations
    assert math.isnan(_quantile(0.5, [(1.0, 3), (2.0, 3)]))  # no +Inf bucket

    # the same through rate() over cumulative bucket counters, one histogram per model
    store = Store()
    per_s = {"1.0": 10.0, "2.0": 30.0, "4.0": 40.0, "+Inf": 40.0}
    for t in range(0, 301, 5):
        for model, scale in (("m", 1.0), ("n", 0.5)):
            for le, r in per_s.items():
                store.add("wait_bucket", {"le": le, "model": model, "instance": "i"},
                          float(t), r * scale * t)
    p50 = Query("histogram_quantile(0.5, sum by (le, model) (rate(wait_bucket[5m])))")
    assert p50.at(store, 300.0) == {labels(model="m"): pytest.approx(1.5),
                                    labels(model="n"): pytest.approx(1.5)}
    p90 = Query("histogram_quantile(0.9, sum by (le) (rate(wait_bucket[5m])))")
    assert p90.at(store, 300.0) == {frozenset(): pytest.approx(3.2)}


def test_range_query_fills_gaps_with_nan() -> None:
    store = Store()
    store.add("g", {"b": "x"}, 0.0, 1.0)
    store.add("g", {"b": "y"}, 2.0, 2.0)
    out = Query("g").range(store, [1.0, 2.0])
    assert out[labels(b="x")] == [1.0, 1.0]
    assert math.isnan(out[labels(b="y")][0]) and out[labels(b="y")][1] == 2.0


@pytest.mark.parametrize("expr", [
    "avg_over_time(g[5m])",  # a function outside the subset
    "g offset 5m",
    "sum without (a) (g)",
    "sum(g) by (a)",  # trailing grouping clause
    "g + h",
    "a / on (b) c",
    "rate(g)",  # no range
    "g[5m]",  # a bare range vector
    "max by (a) (g[5m])",
    "histogram_quantile(g, h)",
    "topk(3, g)",
    "g{a=b}",
    "sum by (a) (g",
])
def test_unsupported_expressions_fail_loudly(expr: str) -> None:
    with pytest.raises(Unsupported):
        Query(expr)


def test_legend_format() -> None:
    assert legend("reserved {{backend}}", labels(backend="sim-0")) == "reserved sim-0"
    assert legend("p99 {{ model }}", labels(model="m")) == "p99 m"
    assert legend("{{missing}}", frozenset()) == ""


def test_units_as_grafana_shows_them() -> None:
    assert fmt_value(16384, "short") == "16.4 K"
    assert fmt_value(15, "short") == "15"
    assert fmt_value(0.873, "percentunit") == "87.3%"
    assert fmt_value(0.25, "s") == "250 ms"
    assert fmt_value(1.5, "reqps") == "1.50 req/s"
    assert fmt_value(math.nan, "short") == "No data"


def exported_pages(t: float, step: int) -> list[Scrape]:
    """kvgate's and a simulated backend's real /metrics pages after `step` rounds of use."""
    from proxy.metrics import Metrics
    from proxy.sim.engine import EngineConfig, SimEngine
    from proxy.sim.server import metrics_text

    metrics = Metrics()
    for backend in ("sim-0", "sim-1"):
        metrics.backend_configured(backend, 1000)
    for i in range(step):
        for backend in ("sim-0", "sim-1"):
            metrics.backend_state(backend, resident=100 * i, capacity=1000, inflight=i)
            metrics.backend_view(backend, resident=100 * i, inflight=i, target=900,
                                 engine_estimate=80 * i, shortfall=0, shared_resident=30 * i)
            metrics.shared_prefix(backend, 50 * i)
            metrics.engine_reported(backend, usage_ratio=0.05 * i, preemptions=0)
        metrics.admitted("m", reserved_tokens=100, waited_s=0.01 * i)
        metrics.rejected("m", "queue_timeout")
        metrics.finished("m", "upstream_error")
        metrics.queue_depth("m", i)
    metrics.ledger_available(True)
    engine = SimEngine(EngineConfig(kv_tokens=1024))
    return [Scrape(t, "kvgate", "127.0.0.1:8080", metrics.render().decode()),
            Scrape(t, "engines", "127.0.0.1:8000", metrics_text(engine, "m"))]


def test_every_dashboard_expression_is_supported_and_gives_data() -> None:
    """No panel of the picture can be silently empty for want of an evaluator form: over
    the pages kvgate and the simulator export, every target yields a finite value."""
    dash = json.loads((ROOT / "deploy/grafana/kvgate.json").read_text())
    # each scrape is a fresh registry after `step` rounds: counters grow between scrapes
    store = store_from([p for step in range(1, 5) for p in exported_pages(10.0 * step, step)])
    targets = [(p["title"], t) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 15
    for title, target in targets:
        result = Query(target["expr"]).at(store, 40.0)
        assert result, (title, target["expr"])
        assert all(math.isfinite(v) for v in result.values()), (title, target["expr"], result)
        for key in result:
            assert "{{" not in legend(target["legendFormat"], key)
