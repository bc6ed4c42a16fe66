"""Workloads: real trace replay and a synthetic mix, as lists of timed request specs.

Prompts are built with the bundled Qwen3 tokenizer and chat template so that each
request's prompt is exactly its recorded token count after the template: the content
is " the" repeated (one token each in Qwen3's vocabulary), and every body is checked
with the real counter when built.

The recorded output length travels only as `sim_output_tokens`, which the simulated
engine treats as the point where the model samples EOS. What the client puts in
`max_tokens` is the client behaviour under test: real clients do not know the answer's
length in advance, so only `recorded` hands it over.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from hashlib import blake2b
from pathlib import Path
from typing import Any

from proxy.tokenize import ChatRequest, TokenCounter

DATA = Path(__file__).resolve().parent.parent / "data"
MODEL = "qwen3-14b"


class Behaviour(StrEnum):
    """What the client sends as `max_tokens`."""

    RECORDED = "recorded"  # the recorded output length: the gate is told the truth
    CAP_2048 = "cap-2048"  # a fixed cap, as most SDK defaults and UIs send
    NONE = "none"  # no max_tokens: the engine may run to the context limit

    def max_tokens(self, output_tokens: int) -> int | None:
        if self is Behaviour.RECORDED:
            return output_tokens
        if self is Behaviour.CAP_2048:
            return 2048
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # recorded length: where the simulated model stops (EOS)
    kind: str = "normal"  # "short" / "long" in the head-of-line mix
    priority: str = ""
    # Shared-prefix workloads (`group_prompts`): a system prompt of `system_tokens`
    # content tokens, the same text for every request of `group`, then a question of
    # its own (`uid`). Group -1: the one-word prompt of the other workloads.
    group: int = -1
    system_tokens: int = 0
    uid: int = 0
    # Trace-prefix workloads (`mooncake_conversations`): the prompt's content is one text
    # block per id, `block_tokens` tokens each (the last cut to what is left), the same
    # text for the same id: equal leading ids, byte-identical prefixes.
    blocks: tuple[int, ...] = ()
    block_tokens: int = 0


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
                               output_tokens=max(1, min(row.output_tokens, max_output))))
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
                               output_tokens=max(1, output)))
    return out


def burst(base: list[RequestSpec], extra: list[RequestSpec]) -> list[RequestSpec]:
    return sorted(base + extra, key=lambda s: s.arrival_s)


def hol_mix(*, rate_per_s: float, duration_s: float, seed: int) -> list[RequestSpec]:
    """Short chats with a few very long requests: the head-of-line blocking case."""
    rng = random.Random(seed)
    out = []
    for t in _poisson(rng, rate_per_s, duration_s):
        if rng.random() < 0.15:
            out.append(RequestSpec(arrival_s=t, prompt_tokens=5000, output_tokens=1200,
                                   kind="long", priority="low"))
        else:
            out.append(RequestSpec(arrival_s=t, prompt_tokens=rng.randint(100, 400),
                                   output_tokens=rng.randint(30, 80), kind="short",
                                   priority="high"))
    return out


# Words that are one token each in Qwen3's vocabulary with a leading space, and stay
# one pre-token each when joined by spaces: text of n such words is exactly n tokens
# (checked when a body is built). Random sequences of them give distinct text that a
# prefix cache shares only where it is byte-identical.
WORDS = tuple("""the of and to in is that for it as with was on be by at this have from or an
they which one you had not but all were when we there can been has more if will would so no
what up out about who get them some could into time only other new than then its also two
like over first these way may people any most after very made well where years make just
know back good long much work such even because here see through before many our great
three how own under down last between same want world day come take help year place house
while home small large need every think state again part right both group end still fact
point case number thing night water side hand head high line order eye life city""".split())


MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeRow:
    offset_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def load_mooncake(name: str) -> list[MooncakeRow]:
    """Arrival offsets (the trace's milliseconds), lengths and prefix block ids."""
    rows = []
    with (DATA / name).open() as f:
        for line in f:
            rec = json.loads(line)
            rows.append(MooncakeRow(offset_s=rec["timestamp"] / 1000,
                                    prompt_tokens=int(rec["input_length"]),
                                    output_tokens=int(rec["output_length"]),
                                    hash_ids=tuple(rec["hash_ids"])))
    return rows


def _conversation(row: MooncakeRow, i: int) -> str:
    """A request's conversation, as far as the trace shows it: its second block id
    (every request opens with the shared block 0; a later turn repeats the earlier
    turns' blocks, so equal second ids mean the same opening). A one-block prompt is
    its own."""
    return f"c{row.hash_ids[1]}" if len(row.hash_ids) > 1 else f"r{i}"


def mooncake_conversations(rows: list[MooncakeRow], *, count: int, window_s: float,
                           duration_s: float, block_tokens: int, prompt_overhead: int,
                           max_prompt: int, max_output: int) -> list[RequestSpec]:
    """Whole conversations of the trace's first `window_s`, about `count` requests.

    Conversations are taken in a fixed pseudo-random order (BLAKE2b of their key) until
    `count` requests are in, so every turn of a conversation taken comes with it and the
    prefix reuse between turns is kept; time is compressed by `window_s / duration_s`.
    Lengths are scaled by `block_tokens / MOONCAKE_BLOCK` (one trace block becomes
    `block_tokens` tokens of text), prompts clipped to `max_prompt` after the chat
    template (`prompt_overhead` tokens), outputs to `max_output` (not scaled).
    """
    window = [(i, r) for i, r in enumerate(rows) if r.offset_s < window_s]
    by_key: dict[str, list[tuple[int, MooncakeRow]]] = {}
    for i, r in window:
        by_key.setdefault(_conversation(r, i), []).append((i, r))
    order = sorted(by_key, key=lambda k: blake2b(k.encode(), digest_size=8).digest())
    taken: list[tuple[int, MooncakeRow]] = []
    for k in order:
        if len(taken) >= count:
            break
        taken += by_key[k]
    taken.sort()
    content_max = max_prompt - prompt_overhead
    out = []
    for i, r in taken:
        content = max(1, min(r.prompt_tokens * block_tokens // MOONCAKE_BLOCK, content_max))
        n_blocks = -(-content // block_tokens)
        out.append(RequestSpec(arrival_s=r.offset_s * duration_s / window_s, uid=i,
                               prompt_tokens=content + prompt_overhead,
                               output_tokens=max(1, min(r.output_tokens, max_output)),
                               blocks=r.hash_ids[:n_blocks], block_tokens=block_tokens))
    return out


def words_text(seed: str, n: int) -> str:
    """n one-token words, each after a space, drawn from a generator seeded by `seed`."""
    rng = random.Random(seed)
    return "".join(" " + w for w in rng.choices(WORDS, k=n))


def group_text(group: int, tokens: int) -> str:
    """The system prompt of `group`: byte-identical within the group, distinct across."""
    return words_text(f"system-prompt-{group}", tokens)


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of n groups, rank k (from 1) in proportion to 1 / k**s; s = 0 uniform."""
    raw = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def group_prompts(*, rate_per_s: float, duration_s: float, seed: int, outputs: list[int],
                  prompt_overhead: int, groups: int = 8, system_tokens: int = 2048,
                  question_tokens: int = 256, zipf_s: float = 0.0) -> list[RequestSpec]:
    """Groups of users sharing a system prompt (llm-d's shape, scaled).

    Poisson arrivals; each request's group drawn by `zipf_weights(groups, zipf_s)`, its
    output length from `outputs` (a trace's recorded lengths). `prompt_tokens` is the
    whole templated prompt: `system_tokens` + `question_tokens` + `prompt_overhead`, the
    chat template's own tokens for a system and a user message
    (`PromptBuilder.group_overhead`).
    """
    rng = random.Random(seed)
    weights = zipf_weights(groups, zipf_s)
    out = []
    for i, t in enumerate(_poisson(rng, rate_per_s, duration_s)):
        group = rng.choices(range(groups), weights=weights)[0]
        out.append(RequestSpec(arrival_s=t, group=group, system_tokens=system_tokens, uid=i,
                               prompt_tokens=system_tokens + question_tokens + prompt_overhead,
                               output_tokens=max(1, rng.choice(outputs))))
    return out


class PromptBuilder:
    """Chat bodies whose prompt is exactly N tokens after the chat template."""

    def __init__(self, counter: TokenCounter) -> None:
        self._counter = counter
        empty = ChatRequest(messages=[{"role": "user", "content": ""}])
        self._overhead = counter.count_chat(empty)
        pair = ChatRequest(messages=[{"role": "system", "content": ""},
                                     {"role": "user", "content": ""}])
        self.group_overhead = counter.count_chat(pair)
        self._checked: set[int] = set()

    def body(self, spec: RequestSpec, *, behaviour: Behaviour,
             stream: bool = True, sim_fields: bool = True) -> dict[str, Any]:
        """One request's body; `behaviour` (required: `recorded` hands kvgate the answer's
        length, which no real client knows) decides its `max_tokens`. `sim_fields` False:
        no `sim_output_tokens` (a real engine, where the client ends the answer)."""
        if spec.group >= 0:
            messages = self.group_messages(spec)
        elif spec.blocks:
            messages = self.block_messages(spec)
        else:
            messages = self._one_word(spec.prompt_tokens)
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": stream}
        if sim_fields:
            body["sim_output_tokens"] = spec.output_tokens
        max_tokens = behaviour.max_tokens(spec.output_tokens)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def group_messages(self, spec: RequestSpec) -> list[dict[str, str]]:
        """The group's system prompt and a question of the request's own, exactly
        `spec.prompt_tokens` after the template (every one checked: they differ)."""
        question = spec.prompt_tokens - spec.system_tokens - self.group_overhead
        if question < 1:
            raise ValueError(f"prompt of {spec.prompt_tokens} tokens leaves no question")
        messages = [{"role": "system", "content": group_text(spec.group, spec.system_tokens)},
                    {"role": "user", "content": words_text(f"question-{spec.uid}", question)}]
        counted = self._counter.count_chat(ChatRequest(messages=messages))
        if counted != spec.prompt_tokens:
            raise AssertionError(f"prompt built for {spec.prompt_tokens} tokens counts {counted}")
        return messages

    @property
    def user_overhead(self) -> int:
        """The chat template's own tokens around one user message."""
        return self._overhead

    def block_messages(self, spec: RequestSpec) -> list[dict[str, str]]:
        """One user message of the spec's blocks' texts (`RequestSpec.blocks`), exactly
        `spec.prompt_tokens` after the template (every one checked)."""
        content = spec.prompt_tokens - self._overhead
        parts = []
        for block in spec.blocks:
            n = min(spec.block_tokens, content)
            parts.append(words_text(f"mooncake-block-{block}", n))
            content -= n
        if content:
            raise ValueError(f"{len(spec.blocks)} blocks leave {content} tokens of the "
                             f"prompt of {spec.prompt_tokens}")
        messages = [{"role": "user", "content": "".join(parts)}]
        counted = self._counter.count_chat(ChatRequest(messages=messages))
        if counted != spec.prompt_tokens:
            raise AssertionError(f"prompt built for {spec.prompt_tokens} tokens counts {counted}")
        return messages

    def _one_word(self, tokens: int) -> list[dict[str, str]]:
        n = max(tokens, self._overhead + 1)
        messages = [{"role": "user", "content": " the" * (n - self._overhead)}]
        if n not in self._checked and len(self._checked) < 64:
            counted = self._counter.count_chat(ChatRequest(messages=messages))
            if counted != n:
                raise AssertionError(f"prompt built for {n} tokens counts {counted}")
            self._checked.add(n)
        return messages


def bursty_long_prompts(*, rate_per_s: float, duration_s: float, seed: int,
                        max_prompt: int, max_output: int, on_s: tuple[float, float] = (1.0, 4.0),
                        off_s: tuple[float, float] = (1.0, 4.0)) -> list[RequestSpec]:
    """Shaped like a code-completion service: long prompts (lognormal, median 3,000
    tokens), short answers (lognormal, median 60, 8 to `max_output`), arriving in on-off
    bursts: Poisson at `rate_per_s` during an on-phase, nothing during an off-phase, each
    phase's length drawn uniformly from its range (seeded, not periodic). The mean rate
    over the window is about `rate_per_s` x the on share (a half on average); the caller
    calibrates it on a long draw."""
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    t = 0.0
    on = True
    while t < duration_s:
        span = rng.uniform(*(on_s if on else off_s))
        if on:
            for dt in _poisson(rng, rate_per_s, min(span, duration_s - t)):
                prompt = int(min(max_prompt, rng.lognormvariate(math.log(3000), 0.5)))
                output = int(min(max_output, rng.lognormvariate(math.log(60), 0.8)))
                out.append(RequestSpec(arrival_s=t + dt, prompt_tokens=max(256, prompt),
                                       output_tokens=max(8, output)))
        t += span
        on = not on
    return out
