"""A small PromQL evaluator for exactly the forms kvgate's Grafana dashboard uses.

Supported: instant selectors with label matchers (`=`, `!=`, `=~`, `!~`); range selectors
under `rate`, `increase` and `max_over_time`; `sum`/`max`/`min`/`avg`/`count` with
`by (...)`; `histogram_quantile(q, ...)`; `/` and `*` between two vectors with identical
label sets (one-to-one, no `on`/`ignoring`) or a vector and a number; number literals.
Anything else raises `Unsupported`, so a panel is never drawn from a misread expression.

Semantics follow Prometheus: an instant selector takes each series' latest sample in the
5-minute lookback; a range `[d]` holds the samples in (t - d, t]; `rate`/`increase`
extrapolate as Prometheus does (counter resets included); `histogram_quantile`
interpolates linearly inside the bucket, as Prometheus does for classic histograms.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

LOOKBACK_S = 300.0

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]  # an instant vector: label set (no __name__) -> value


class Unsupported(ValueError):
    """The expression uses PromQL this evaluator does not implement."""


@dataclass
class Store:
    """Scraped series: (name, labels) -> samples in time order."""

    series: dict[tuple[str, Labels], tuple[list[float], list[float]]] = field(
        default_factory=dict)

    def add(self, name: str, labels: Mapping[str, str], t: float, value: float) -> None:
        ts, vs = self.series.setdefault((name, frozenset(labels.items())), ([], []))
        if ts and t <= ts[-1]:
            raise ValueError(f"{name}: samples must be added in time order")
        ts.append(t)
        vs.append(value)

    def matching(self, name: str, matchers: list[Matcher]
                 ) -> Iterable[tuple[Labels, list[float], list[float]]]:
        for (n, labels), (ts, vs) in self.series.items():
            if n == name and all(m.ok(dict(labels)) for m in matchers):
                yield labels, ts, vs


# --- syntax tree --------------------------------------------------------------------------

@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str

    def ok(self, labels: Mapping[str, str]) -> bool:
        have = labels.get(self.label, "")
        if self.op == "=":
            return have == self.value
        if self.op == "!=":
            return have != self.value
        full = re.fullmatch(self.value, have) is not None
        return full if self.op == "=~" else not full


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...]
    range_s: float | None = None


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Aggregate:
    op: str
    by: tuple[str, ...]
    expr: Node


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


Node = Selector | Number | Call | Aggregate | Binary

AGGREGATIONS = {"sum", "max", "min", "avg", "count"}
RANGE_FUNCTIONS = {"rate", "increase", "max_over_time"}
FUNCTIONS = RANGE_FUNCTIONS | {"histogram_quantile"}

_TOKEN = re.compile(r"""\s*(?:
    (?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
  | (?P<duration>\[\d+[smhd]\])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|=|[(){},/*])
)""", re.VERBOSE)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            raise Unsupported(f"cannot read {expr[pos:]!r} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = _tokens(expr)
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise Unsupported(f"expected {value!r}, found {tok[1]!r} in {self.expr!r}")
        if tok[0] == "end":
            raise Unsupported(f"unexpected end of {self.expr!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.binary()
        if self.peek()[0] != "end":
            raise Unsupported(f"unexpected {self.peek()[1]!r} in {self.expr!r}")
        return node

    def binary(self) -> Node:
        node = self.unary()
        while self.peek()[1] in ("/", "*"):
            op = self.take()[1]
            if self.peek()[1] in ("on", "ignoring", "group_left", "group_right", "bool"):
                raise Unsupported(f"vector matching modifiers in {self.expr!r}")
            node = Binary(op, node, self.unary())
        return node

    def unary(self) -> Node:
        kind, text = self.peek()
        if kind == "number":
            self.take()
            return Number(float(text))
        if text == "(":
            self.take("(")
            node = self.binary()
            self.take(")")
            return node
        if kind != "ident":
            raise Unsupported(f"unexpected {text!r} in {self.expr!r}")
        self.take()
        if text in AGGREGATIONS:
            by: tuple[str, ...] = ()
            if self.peek()[1] == "by":
                self.take()
                by = self.label_list()
            elif self.peek()[1] == "without":
                raise Unsupported(f"'without' in {self.expr!r}")
            self.take("(")
            inner = self.binary()
            self.take(")")
            if self.peek()[1] in ("by", "without"):
                raise Unsupported(f"trailing grouping clause in {self.expr!r}")
            return Aggregate(text, by, inner)
        if self.peek()[1] == "(":
            if text not in FUNCTIONS:
                raise Unsupported(f"function {text}() in {self.expr!r}")
            self.take("(")
            args = [self.binary()]
            while self.peek()[1] == ",":
                self.take(",")
                args.append(self.binary())
            self.take(")")
            return self.check_call(Call(text, tuple(args)))
        return self.selector(text)

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels = []
        while self.peek()[1] != ")":
            kind, text = self.take()
            if kind != "ident":
                raise Unsupported(f"label {text!r} in {self.expr!r}")
            labels.append(text)
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(labels)

    def selector(self, name: str) -> Selector:
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take()[1]
                op = self.take()[1]
                kind, value = self.take()
                if op not in ("=", "!=", "=~", "!~") or kind != "string":
                    raise Unsupported(f"matcher {label}{op}{value} in {self.expr!r}")
                matchers.append(Matcher(label, op, value[1:-1].encode().decode(
                    "unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        range_s = None
        if self.peek()[0] == "duration":
            text = self.take()[1][1:-1]
            range_s = float(text[:-1]) * _UNITS[text[-1]]
        return Selector(name, tuple(matchers), range_s)

    def check_call(self, call: Call) -> Call:
        if call.func in RANGE_FUNCTIONS:
            (arg,) = call.args if len(call.args) == 1 else (None,)
            if not isinstance(arg, Selector) or arg.range_s is None:
                raise Unsupported(f"{call.func}() needs one range selector in {self.expr!r}")
        else:  # histogram_quantile
            if len(call.args) != 2 or not isinstance(call.args[0], Number):
                raise Unsupported(f"histogram_quantile(number, vector) in {self.expr!r}")
        return call


def parse(expr: str) -> Node:
    """The expression's syntax tree; raises `Unsupported` for anything outside the subset."""
    return _Parser(expr).parse()


def _check_vector(node: Node, expr: str) -> None:
    """Range selectors only inside range functions; every node yields an instant vector."""
    if isinstance(node, Selector) and node.range_s is not None:
        raise Unsupported(f"a range selector outside rate/increase/max_over_time: {expr!r}")
    if isinstance(node, Aggregate):
        _check_vector(node.expr, expr)
    elif isinstance(node, Binary):
        _check_vector(node.left, expr)
        _check_vector(node.right, expr)
    elif isinstance(node, Call) and node.func == "histogram_quantile":
        _check_vector(node.args[1], expr)


# --- evaluation ---------------------------------------------------------------------------

def _window(ts: list[float], t: float, range_s: float) -> tuple[int, int]:
    """Indexes [lo, hi) of the samples in (t - range_s, t]."""
    return bisect.bisect_right(ts, t - range_s), bisect.bisect_right(ts, t)


def _extrapolated(ts: list[float], vs: list[float], t: float, range_s: float,
                  *, is_rate: bool) -> float | None:
    """Prometheus' extrapolatedRate for a counter: None with fewer than two samples."""
    lo, hi = _window(ts, t, range_s)
    if hi - lo < 2:
        return None
    first_t, last_t = ts[lo], ts[hi - 1]
    result = vs[hi - 1] - vs[lo]
    for i in range(lo + 1, hi):  # a counter reset: the count restarted from zero
        if vs[i] < vs[i - 1]:
            result += vs[i - 1]
    start = t - range_s
    to_start, to_end = first_t - start, t - last_t
    sampled = last_t - first_t
    average = sampled / (hi - lo - 1)
    if result > 0 and vs[lo] >= 0:
        to_start = min(to_start, sampled * (vs[lo] / result))
    threshold = average * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average / 2
    interval += to_end if to_end < threshold else average / 2
    result *= interval / sampled
    return result / range_s if is_rate else result


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' bucketQuantile over (upper bound, cumulative count) pairs."""
    if math.isnan(q) or not buckets:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if buckets[-1][0] != math.inf or len(buckets) < 2:
        return math.nan
    counts = [c for _, c in buckets]
    for i in range(1, len(counts)):  # repair non-monotonic counts as Prometheus does
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total == 0:
        return math.nan
    rank = q * total
    b = bisect.bisect_left(counts, rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end = (0.0, buckets[0][0]) if b == 0 else (buckets[b - 1][0], buckets[b][0])
    count = counts[b] - (counts[b - 1] if b > 0 else 0.0)
    rank -= counts[b - 1] if b > 0 else 0.0
    return start + (end - start) * (rank / count)


_AGGREGATE: dict[str, Callable[[list[float]], float]] = {
    "sum": math.fsum, "max": max, "min": min, "count": lambda v: float(len(v)),
    "avg": lambda v: math.fsum(v) / len(v),
}


def _drop(labels: Labels, *names: str) -> Labels:
    return frozenset((k, v) for k, v in labels if k not in names)


def _eval(node: Node, store: Store, t: float) -> Vector | float:
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Selector):
        if node.range_s is not None:
            raise Unsupported("a range selector outside rate/increase/max_over_time")
        out: Vector = {}
        for labels, ts, vs in store.matching(node.name, list(node.matchers)):
            i = bisect.bisect_right(ts, t) - 1
            if i >= 0 and t - ts[i] <= LOOKBACK_S:
                out[labels] = vs[i]
        return out
    if isinstance(node, Call):
        if node.func in RANGE_FUNCTIONS:
            sel = node.args[0]
            assert isinstance(sel, Selector) and sel.range_s is not None
            out = {}
            for labels, ts, vs in store.matching(sel.name, list(sel.matchers)):
                value: float | None
                if node.func == "max_over_time":
                    lo, hi = _window(ts, t, sel.range_s)
                    value = max(vs[lo:hi]) if hi > lo else None
                else:
                    value = _extrapolated(ts, vs, t, sel.range_s,
                                          is_rate=node.func == "rate")
                if value is not None:
                    out[labels] = value
            return out
        q = node.args[0]
        assert isinstance(q, Number)
        inner = _vector(node.args[1], store, t)
        groups: dict[Labels, list[tuple[float, float]]] = {}
        for labels, value in inner.items():
            le = dict(labels).get("le")
            if le is None:
                continue
            groups.setdefault(_drop(labels, "le"), []).append((float(le), value))
        return {labels: _quantile(q.value, b) for labels, b in groups.items()}
    if isinstance(node, Aggregate):
        inner = _vector(node.expr, store, t)
        grouped: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            key = frozenset((k, v) for k, v in labels if k in node.by)
            grouped.setdefault(key, []).append(value)
        return {k: _AGGREGATE[node.op](v) for k, v in grouped.items()}
    left, right = _eval(node.left, store, t), _eval(node.right, store, t)

    def apply(a: float, b: float) -> float:
        if node.op == "*":
            return a * b
        return a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))

    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(left, float):
        assert isinstance(right, dict)
        return {k: apply(left, v) for k, v in right.items()}
    if isinstance(right, float):
        return {k: apply(v, right) for k, v in left.items()}
    return {k: apply(v, right[k]) for k, v in left.items() if k in right}


def _vector(node: Node, store: Store, t: float) -> Vector:
    value = _eval(node, store, t)
    if isinstance(value, float):
        raise Unsupported("a number where a vector is needed")
    return value


class Query:
    """One parsed expression, evaluated as an instant query at any time."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.node = parse(expr)
        _check_vector(self.node, expr)

    def at(self, store: Store, t: float) -> Vector:
        value = _eval(self.node, store, t)
        return {frozenset(): value} if isinstance(value, float) else value

    def range(self, store: Store, times: Iterable[float]) -> dict[Labels, list[float]]:
        """A range query: each label set's value at each time (NaN where absent)."""
        times = list(times)
        out: dict[Labels, list[float]] = {}
        for i, t in enumerate(times):
            for labels, value in self.at(store, t).items():
                out.setdefault(labels, [math.nan] * len(times))[i] = value
        return out


def legend(fmt: str, labels: Labels) -> str:
    """Grafana's legendFormat: `{{label}}` replaced by the series' label value."""
    values = dict(labels)
    return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}",
                  lambda m: values.get(m.group(1), ""), fmt)
