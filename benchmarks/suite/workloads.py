"""Workloads: real trace replay and a synthetic mix, as lists of timed request specs.

Prompts are built with the bundled Qwen3 tokenizer and chat template so that each
request's prompt is exactly its recorded token count after the template: the content
is " the" repeated (one token each in Qwen3's vocabulary), and every body is checked
with the real counter when built.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from proxy.tokenize import ChatRequest, TokenCounter

DATA = Path(__file__).resolve().parent.parent / "data"
MODEL = "qwen3-14b"


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    kind: str = "normal"  # "short" / "long" in the head-of-line mix
    priority: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRow:
    offset_s: float
    prompt_tokens: int
    output_tokens: int


def load_azure(name: str) -> list[TraceRow]:
    """Arrival offsets from the first row, prompt and output token counts."""
    rows: list[TraceRow] = []
    with (DATA / name).open(newline="") as f:
        first: datetime | None = None
        for rec in csv.DictReader(f):
            stamp = datetime.strptime(rec["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            first = first or stamp
            rows.append(TraceRow(offset_s=(stamp - first).total_seconds(),
                                 prompt_tokens=int(rec["ContextTokens"]),
                                 output_tokens=int(rec["GeneratedTokens"])))
    return rows


def replay(rows: list[TraceRow], *, rate_per_s: float, duration_s: float,
           max_prompt: int, max_output: int, start: int = 0) -> list[RequestSpec]:
    """The trace's own burst shape, time-compressed to a mean `rate_per_s`.

    Lengths are kept, clipped to the model's context (documented in the report).
    """
    window = rows[start:]
    native_rate = len(window) / max(1e-9, window[-1].offset_s - window[0].offset_s)
    speedup = rate_per_s / native_rate
    t0 = window[0].offset_s
    out = []
    for row in window:
        t = (row.offset_s - t0) / speedup
        if t >= duration_s:
            break
        out.append(RequestSpec(arrival_s=t, prompt_tokens=min(row.prompt_tokens, max_prompt),
                               max_tokens=max(1, min(row.output_tokens, max_output))))
    return out


def _poisson(rng: random.Random, rate_per_s: float, duration_s: float) -> Iterator[float]:
    """Arrival times, drawn lazily so the caller's draws interleave (seeded runs stay as
    they were)."""
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        yield t
        t += rng.expovariate(rate_per_s)


def synthetic_mix(*, rate_per_s: float, duration_s: float, seed: int,
                  max_prompt: int, max_output: int) -> list[RequestSpec]:
    """Poisson arrivals; lognormal prompts (median 800, long tail), 2% very long requests."""
    rng = random.Random(seed)
    out = []
    for t in _poisson(rng, rate_per_s, duration_s):
        if rng.random() < 0.02:
            prompt, output = max_prompt, max_output
        else:
            prompt = int(min(max_prompt, rng.lognormvariate(math.log(800), 0.9)))
            output = int(min(max_output, rng.lognormvariate(math.log(150), 0.7)))
        out.append(RequestSpec(arrival_s=t, prompt_tokens=max(16, prompt),
                               max_tokens=max(1, output)))
    return out


def burst(base: list[RequestSpec], extra: list[RequestSpec]) -> list[RequestSpec]:
    return sorted(base + extra, key=lambda s: s.arrival_s)


def hol_mix(*, rate_per_s: float, duration_s: float, seed: int) -> list[RequestSpec]:
    """Short chats with a few very long requests: the head-of-line blocking case."""
    rng = random.Random(seed)
    out = []
    for t in _poisson(rng, rate_per_s, duration_s):
        if rng.random() < 0.15:
            out.append(RequestSpec(arrival_s=t, prompt_tokens=5000, max_tokens=1200,
                                   kind="long", priority="low"))
        else:
            out.append(RequestSpec(arrival_s=t, prompt_tokens=rng.randint(100, 400),
                                   max_tokens=rng.randint(30, 80), kind="short",
                                   priority="high"))
    return out


class PromptBuilder:
    """Chat bodies whose prompt is exactly N tokens after the chat template."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        empty = ChatRequest(messages=[{"role": "user", "content": ""}])
        self._overhead = counter.count_chat(empty)
        self._checked: set[int] = set()

    def body(self, spec: RequestSpec, *, stream: bool = True) -> dict[str, Any]:
        n = max(spec.prompt_tokens, self._overhead + 1)
        messages = [{"role": "user", "content": " the" * (n - self._overhead)}]
        if n not in self._checked and len(self._checked) < 64:
            counted = self._counter.count_chat(ChatRequest(messages=messages))
            if counted != n:
                raise AssertionError(f"prompt built for {n} tokens counts {counted}")
            self._checked.add(n)
        body: dict[str, Any] = {"model": MODEL, "messages": messages,
                                "max_tokens": spec.max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body
