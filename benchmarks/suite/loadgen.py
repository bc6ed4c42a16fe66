"""An async load generator: open-loop arrivals (trace or Poisson) or closed-loop workers.

Every request streams; the generator records status, contract code, queue wait (from
kvgate's header), time to first token, end-to-end latency and tokens out. A hard stop
bounds every run: requests still open then are cut and recorded as such.

A client with `give_up_s` abandons a request that has no first token by then and
closes its connection, so the engine frees whatever the request held.

With `hang_up_at_output` (real engines serving random weights, which never sample EOS)
the client closes a stream once it has read the request's recorded output length in
content chunks: the model's end, played by the client, so that neither kvgate nor the
engine is ever told the length. An engine error event mid-stream (llama-server's
`error:` line, kvgate's `event: error`, a `data:` line holding an `error`) is recorded
as `stream_error`.

With `retries` (kvgate targets), a client refused with a retryable status (429 or 503
carrying `Retry-After`) waits what it was told (`retry-after-ms` when given, as the
SDKs read it, else `Retry-After`; at most `retry_cap_s`) and sends the same body once
more with the `x-kvgate-ticket` it got. The retry's TTFT and latency are then counted
from the ORIGINAL send, so it meets the SLO only if the whole wait does; the refused
first try stays on the result as `first`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.suite.workloads import Behaviour, PromptBuilder, RequestSpec

CUT = "cut_at_benchmark_end"
ABANDONED = "abandoned"
STREAM_ERROR = "stream_error"
ENDED_EARLY = "ended_early"  # the stream ended before the length the client hangs up at
SAMPLE_EVERY_S = 0.2
RETRYABLE = (429, 503)
TICKET_HEADER = "x-kvgate-ticket"
RETRY_CAP_S = 10.0


@dataclass(slots=True)
class Result:
    spec: RequestSpec
    sent_s: float = 0.0
    status: int = 0
    code: str | None = None
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens_out: int = 0
    deadline_s: float | None = None
    backend: int = -1  # the target index it was sent to (a backend when direct)
    hung_up: bool = False  # the client closed the stream at the recorded output length
    model_ended: bool = False  # the engine ended it ("stop") before that length
    finish: str | None = None  # the last finish_reason streamed, if any
    last_line: bytes = b""  # the stream's last non-empty line (what an early end said)
    message: str = ""  # an error body's message (tells a predicted refusal from a wait)
    retry_after_s: float | None = None  # what a refusal said to wait (retry-after-ms first)
    ticket: str | None = None  # a refusal's x-kvgate-ticket
    first: Result | None = None  # the refused first try, when this is its retry
    retry_wait_s: float | None = None  # how long the client waited before the retry
    from_first_s: float = 0.0  # a retry: its send less the first try's (added to its times)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.code is None

    @property
    def refused_try(self) -> Result | None:
        """The refused try this request began with (the first of a retried one, or the
        request itself when refused and not retried); None when not refused at once."""
        if self.first is not None:
            return self.first
        return self if self.status in RETRYABLE else None

    @property
    def refusal_s(self) -> float | None:
        """From this try's send to its refusal, for a refused try (its own clock)."""
        if self.status not in RETRYABLE or self.latency_s is None:
            return None
        return self.latency_s - self.from_first_s


@dataclass(slots=True, kw_only=True)
class Sample:
    t: float
    kv_use: float  # the engines' vllm:kv_cache_usage_perc, 0..1 of the whole pool
    resident: int  # tokens the backends really hold (kv_use x capacity)
    reserved: int | None  # tokens kvgate has reserved (None when direct)
    capacity: int
    queued: int | None  # requests in kvgate's queue (None when direct)
    engine_waiting: int  # vllm:num_requests_waiting, summed over backends
    running: int  # vllm:num_requests_running, summed
    preemptions: int  # vllm:num_preemptions_total, summed (cumulative)
    kv_per_backend: tuple[float, ...] = ()  # each engine's vllm:kv_cache_usage_perc
    # prompt + tokens streamed so far, summed over the streams that have their first
    # token and are still open: what the engines hold, seen from the clients (None: not
    # tracked)
    client_held: int | None = None
    # kvgate's view per backend (empty when direct): reserved (resident_tokens) and the
    # admission target, in tokens, in the engines' order
    reserved_per_backend: tuple[int, ...] = ()
    target_per_backend: tuple[int, ...] = ()

    @property
    def saturated(self) -> bool:
        """Someone is waiting for KV room: in an engine's queue or in kvgate's."""
        return self.engine_waiting > 0 or bool(self.queued)


@dataclass(slots=True)
class Run:
    label: str
    results: list[Result]
    samples: list[Sample] = field(default_factory=list)
    preemptions: int = 0
    duration_s: float = 0.0
    # the engines' (and kvgate's) counters at the end: Cluster.engine_totals
    totals: dict[str, float] = field(default_factory=dict)


def client_held(results: Sequence[Result]) -> int:
    """Tokens the open streams hold (prompt + tokens so far), from the clients' side."""
    return sum(r.spec.prompt_tokens + r.tokens_out for r in results
               if r.ttft_s is not None and r.latency_s is None and r.code is None)


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str], result: Result, t0: float,
               give_up_s: float | None = None, hang_up_at: int | None = None,
               model_may_end: bool = False) -> None:
    start = time.perf_counter()
    result.sent_s = start - t0
    first_token = asyncio.timeout(give_up_s)  # disarmed when the first token arrives
    try:
        async with first_token:
            await _exchange(session, url, body, headers, result, start, first_token,
                            hang_up_at, model_may_end)
    except TimeoutError:
        if not first_token.expired():
            raise
        # the connection is closed on the way out: the engine aborts the request
        result.code = ABANDONED
        result.latency_s = time.perf_counter() - start


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    headers: dict[str, str], result: Result, start: float,
                    first_token: asyncio.Timeout, hang_up_at: int | None = None,
                    model_may_end: bool = False) -> None:
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers=headers) as resp:
        result.status = resp.status
        wait = resp.headers.get("x-kvgate-queue-wait-ms")
        result.queue_wait_s = float(wait) / 1000 if wait is not None else None
        if resp.status != 200:
            result.latency_s = time.perf_counter() - start  # the refusal's arrival
            data = await resp.json(content_type=None)
            error = data.get("error", {}) if isinstance(data, dict) else {}
            result.code = str(error.get("code"))
            result.message = str(error.get("message") or "")[:300]
            result.retry_after_s = _retry_after(resp.headers)
            result.ticket = resp.headers.get(TICKET_HEADER)
            return
        if not body.get("stream"):
            data = await resp.json()
            first_token.reschedule(None)
            result.ttft_s = result.latency_s = time.perf_counter() - start
            result.tokens_out = int(data["usage"]["completion_tokens"])
            return
        async for line in resp.content:
            if line.strip():
                result.last_line = line[:300]
            if b'"finish_reason":"' in line:
                result.finish = line.split(b'"finish_reason":"', 1)[1].split(b'"', 1)[0].decode()
            if not line.startswith(b"data: "):
                if line.startswith((b"event: error", b"error:")):
                    result.code = STREAM_ERROR
                continue
            if line.startswith(b'data: {"error"'):
                result.code = STREAM_ERROR
                continue
            if b'"delta":{"content":"' in line:
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                    first_token.reschedule(None)
                result.tokens_out += 1
                if hang_up_at is not None and result.tokens_out >= hang_up_at:
                    resp.close()  # the connection goes: the engine stops this request
                    result.hung_up = True
                    break
            elif b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                result.tokens_out = int(usage.get("completion_tokens", result.tokens_out))
        if hang_up_at is not None and not result.hung_up and result.code is None:
            if model_may_end and result.finish == "stop" and result.tokens_out > 0:
                result.model_ended = True  # the model's own end, before the recorded one
                result.latency_s = time.perf_counter() - start
                return
            result.code = ENDED_EARLY  # the engine stopped the answer short of its length
        result.latency_s = time.perf_counter() - start


def _retry_after(headers: Any) -> float | None:
    """What a refusal says to wait: `retry-after-ms` (as the SDKs read it first), else
    `Retry-After` in seconds; None when neither parses."""
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue
    return None


async def run_open_loop(
    targets: Sequence[str], specs: Sequence[RequestSpec], builder: PromptBuilder, *,
    hard_stop_s: float, behaviour: Behaviour, deadline_s: float | None = None,
    label: str = "", sampler: Callable[[float], Any] | None = None,
    give_up_s: float | None = None, route: Callable[[dict[str, Any]], int] | None = None,
    hang_up_at_output: bool = False, watch: Callable[[list[Result]], Any] | None = None,
    body_extra: dict[str, Any] | None = None, sim_fields: bool = True,
    fresh_connections: bool = False, retries: int = 0, retry_cap_s: float = RETRY_CAP_S,
    model_may_end: bool = False,
) -> Run:
    """Send each spec at its arrival time, round-robin over `targets`, or to
    `targets[route(body)]` when `route` is given.

    `behaviour` is what the client sends as `max_tokens`; it has no default because
    `recorded` tells kvgate what no real client knows.

    `deadline_s` is kvgate's queue deadline (recorded to check its answers); `give_up_s`
    makes the client itself abandon a request without a first token by then.

    `hang_up_at_output`: the client closes each stream at its recorded output length
    (see the module's note); `sim_fields` False leaves `sim_output_tokens` out of the
    bodies; `body_extra` is merged into every body; `watch` is handed the live results
    before the first request (for sampling what the open streams hold).
    `fresh_connections`: one connection per request (llama-server closes the connection
    after every streamed answer, so a pooled one may be stale when reused).
    `retries` (0 or 1): a refused request waits its Retry-After (at most `retry_cap_s`)
    and tries once more with its ticket (see the module's note).
    `model_may_end`: with `hang_up_at_output`, an answer the engine ends with
    `finish_reason "stop"` before its length is completed (`model_ended`).
    """
    if retries not in (0, 1):
        raise ValueError("retries: 0 or 1")
    results = [Result(spec=s, deadline_s=deadline_s) for s in specs]
    bodies = [builder.body(s, behaviour=behaviour, sim_fields=sim_fields) | (body_extra or {})
              for s in specs]
    if watch is not None:
        watch(results)
    picks = ([route(b) for b in bodies] if route is not None
             else [i % len(targets) for i in range(len(specs))])
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=hard_stop_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        bar = tqdm(total=len(specs), desc=label, unit="req", leave=False, mininterval=0.5)

        async def send(i: int) -> None:
            spec = specs[i]
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
            headers = {"x-kvgate-priority": spec.priority} if spec.priority else {}
            results[i].backend = picks[i]
            hang_up_at = spec.output_tokens if hang_up_at_output else None
            try:
                await _one(session, targets[picks[i]], bodies[i], headers,
                           results[i], t0, give_up_s, hang_up_at, model_may_end)
                first = results[i]
                if retries and first.status in RETRYABLE and first.retry_after_s is not None:
                    # the retry stands in the live list while it waits: open, not refused
                    retry = Result(spec=spec, deadline_s=deadline_s, backend=picks[i],
                                   first=first)
                    results[i] = retry
                    retry.retry_wait_s = min(retry_cap_s, first.retry_after_s)
                    await asyncio.sleep(retry.retry_wait_s)
                    again = headers | ({TICKET_HEADER: first.ticket} if first.ticket else {})
                    await _one(session, targets[picks[i]], bodies[i], again, retry, t0,
                               give_up_s, hang_up_at, model_may_end)
                    _from_first_send(retry, first)
            except (aiohttp.ClientError, TimeoutError) as exc:
                results[i].code = f"client_error:{type(exc).__name__}"
            finally:
                bar.update(1)

        sampling = asyncio.create_task(_sample_loop(sampler, t0)) if sampler else None
        tasks = [asyncio.create_task(send(i)) for i in range(len(specs))]
        _done, pending = await asyncio.wait(tasks, timeout=hard_stop_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for r in results:
            if r.latency_s is None and r.code is None:
                r.code = CUT
        duration = time.perf_counter() - t0
        if sampling is not None:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
        bar.close()
    return Run(label=label, results=results, duration_s=duration)


def _from_first_send(retry: Result, first: Result) -> None:
    """A retry's TTFT and latency counted from the first try's send: what the user
    waited, refusal and Retry-After included."""
    shift = retry.from_first_s = retry.sent_s - first.sent_s
    if retry.ttft_s is not None:
        retry.ttft_s += shift
    if retry.latency_s is not None:
        retry.latency_s += shift


async def _sample_loop(sampler: Callable[[float], Any], t0: float) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await sampler(time.perf_counter() - t0)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def run_closed_loop(
    target: str, specs: Sequence[RequestSpec], builder: PromptBuilder, *,
    concurrency: int, hard_stop_s: float, behaviour: Behaviour, stream: bool = True,
    label: str = "",
) -> Run:
    """`concurrency` workers, each sending its next request when the last one ends;
    `behaviour` as in `run_open_loop`."""
    results = [Result(spec=s) for s in specs]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                await _one(session, target,
                           builder.body(specs[i], behaviour=behaviour, stream=stream), {},
                           results[i], t0)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(hard_stop_s):
                await asyncio.gather(*(worker() for _ in range(concurrency)))
        for r in results:
            if r.latency_s is None and r.code is None:
                r.code = CUT
        return Run(label=label, results=results, duration_s=time.perf_counter() - t0)
