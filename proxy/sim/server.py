"""OpenAI-compatible HTTP front of the simulated engine, with vLLM's metric names.

Token text is synthetic; `usage` is exact: prompt tokens come from the model's real
tokenizer and chat template when a model directory is given (else an estimate of
one token per 4 characters plus 4 per message), and completion tokens equal the
tokens streamed. With prefix caching on (the default), the prompt's token ids (or the
estimate's synthetic ones, `proxy.sim.prompts`) name its KV blocks, and
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens the engine
found cached when it first scheduled the request (for `n` > 1, the first choice's).
Without `max_tokens` a chat request may run to the context limit and a completion
request stops at 16, as vLLM does.

Where a sequence stops: vLLM's `ignore_eos` and `min_tokens` are honoured, and the
simulator-only field `sim_output_tokens` places the "EOS" exactly, so a benchmark can
replay a recorded output length while the client sends whatever `max_tokens` a real
client would (a fixed cap, or none). Without it, `--output-len` decides as before.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.errors import InvalidRequest, KvgateError
from proxy.sim.engine import EngineConfig, FinishReason, Sequence, SimEngine
from proxy.sim.prompts import Prompt, prompts_of
from proxy.tokenize import PromptCounter, TemplateError, load_counter
from proxy.tokenize.cpu_lane import LARGE_BODY_BYTES
from proxy.validation import Endpoint, ValidRequest, validate

__all__ = ["SimSettings", "build_app", "run_sim"]

_WORDS = (" the", " cache", " holds", " every", " token", " of", " a", " long", " answer", ".")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings:
    engine: EngineConfig
    model: str = "sim-model"
    model_dir: str | None = None
    max_model_len: int = 32768


ENGINE_KEY = web.AppKey("engine", SimEngine)
SETTINGS_KEY = web.AppKey("settings", SimSettings)
COUNTER_KEY = web.AppKey("counter", PromptCounter)


def _error(exc: KvgateError) -> web.Response:
    return web.json_response(exc.to_body(), status=exc.status)


def _prompts(app: web.Application, req: ValidRequest) -> list[Prompt]:
    """Counts, and the token ids prefix caching keys on when it is on."""
    return prompts_of(app.get(COUNTER_KEY), req,
                      token_ids=app[SETTINGS_KEY].engine.prefix_caching)


@dataclass(frozen=True, slots=True)
class _Stopping:
    """The request's stop controls, type-checked (vLLM answers 400 on wrong types)."""

    eos_after: int | None
    ignore_eos: bool
    min_tokens: int


def _stopping(body: Mapping[str, Any]) -> _Stopping:
    def integer(key: str, minimum: int) -> int | None:
        value = body.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidRequest(
                f"`{key}` must be an integer >= {minimum}. Given: {json.dumps(value)}",
                param=key)
        return value

    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest(
            f"`ignore_eos` must be a boolean. Given: {json.dumps(ignore_eos)}",
            param="ignore_eos")
    return _Stopping(eos_after=integer("sim_output_tokens", 1), ignore_eos=ignore_eos,
                     min_tokens=integer("min_tokens", 0) or 0)


def _max_tokens(req: ValidRequest, prompt_tokens: int, settings: SimSettings) -> int:
    """What the engine may generate: as asked, else vLLM's defaults."""
    if req.max_tokens is not None:
        return req.max_tokens
    if req.endpoint is Endpoint.CHAT:
        return settings.max_model_len - prompt_tokens
    return _COMPLETIONS_DEFAULT_MAX_TOKENS


def _text(start: int, end: int) -> str:
    """Synthetic text for tokens start+1..end (1-based)."""
    return "".join(_WORDS[(i - 1) % len(_WORDS)] for i in range(start + 1, end + 1))


async def _handle(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    engine, settings = app[ENGINE_KEY], app[SETTINGS_KEY]
    raw = await request.read()

    def parse() -> tuple[ValidRequest, _Stopping, list[Prompt]]:
        req = validate(raw, endpoint)
        return req, _stopping(req.body), _prompts(app, req)

    try:
        # A large body is parsed and counted in a thread, as an engine's frontend does
        # off its serving loop: counting 4 MB of one prompt inline took seconds in
        # which this server answered no health probe and streamed no token.
        req, stopping, prompts = (await asyncio.to_thread(parse)
                                  if len(raw) >= LARGE_BODY_BYTES else parse())
    except KvgateError as exc:
        return _error(exc)
    except TemplateError as exc:
        return _error(InvalidRequest(str(exc), param="messages"))
    if req.model != settings.model:
        return web.json_response(
            {"error": {"message": f"The model `{req.model}` does not exist.",
                       "type": "NotFoundError", "code": 404, "param": None}},
            status=404,
        )
    seqs: list[Sequence] = []
    out: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
    for prompt in prompts:
        p_tokens = prompt.tokens
        max_tokens = _max_tokens(req, p_tokens, settings)
        room = settings.max_model_len - p_tokens
        if room < 1 or max_tokens < 1:  # vLLM refuses only a prompt that fills the context
            return _error(InvalidRequest(
                f"This model's maximum context length is {settings.max_model_len} tokens. "
                f"However, you requested {p_tokens + max_tokens} tokens ({p_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", param="messages"))
        max_tokens = min(max_tokens, room)  # ... and stops the rest at the context's end
        if stopping.min_tokens > max_tokens:
            return _error(InvalidRequest(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {stopping.min_tokens}.", param="min_tokens"))
        if not engine.fits_ever(p_tokens, max_tokens):
            return _error(InvalidRequest(
                f"{p_tokens} prompt + {max_tokens} output tokens can never fit the KV cache "
                f"of {engine.config.num_blocks * engine.config.block_size} tokens",
                param="max_tokens"))
    try:
        for i, prompt in enumerate(prompts):
            max_tokens = _max_tokens(req, prompt.tokens, settings)
            # hashed once, shared by its n choices (which then share its cached blocks)
            hashes = (None if prompt.token_ids is None
                      else engine.prompt_block_hashes(prompt.token_ids))
            for j in range(req.n):
                seqs.append(engine.submit(
                    prompt_tokens=prompt.tokens, max_tokens=max_tokens, out=out,
                    index=i * req.n + j, eos_after=stopping.eos_after,
                    ignore_eos=stopping.ignore_eos, min_tokens=stopping.min_tokens,
                    block_hashes=hashes))
        rid = f"{'chatcmpl' if endpoint is Endpoint.CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        usage = _Usage(sum(p.tokens for p in prompts), seqs[::req.n],
                       details=engine.config.prefix_caching)
        if req.stream:
            return await _stream(request, req, seqs, out, rid, usage)
        return await _collect(req, seqs, out, rid, usage)
    finally:
        for seq in seqs:
            engine.abort(seq)  # no-op for finished ones; frees blocks on disconnect


@dataclass(frozen=True, slots=True)
class _Usage:
    prompt_tokens: int
    firsts: list[Sequence]  # each prompt's first choice: its cached tokens are the prompt's
    details: bool  # prompt_tokens_details (prefix caching on)

    def body(self, seqs: list[Sequence]) -> dict[str, Any]:
        completion = sum(s.generated for s in seqs)
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens,
                               "completion_tokens": completion,
                               "total_tokens": self.prompt_tokens + completion}
        if self.details:
            cached = sum(s.cached_tokens or 0 for s in self.firsts)
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out


async def _drain(
    seqs: list[Sequence], out: asyncio.Queue[tuple[int, int | None]]
) -> AsyncIterator[tuple[int, int | None]]:
    open_seqs = len(seqs)
    while open_seqs:
        item = await out.get()
        if item[1] is None:
            open_seqs -= 1
        yield item


async def _collect(
    req: ValidRequest, seqs: list[Sequence], out: asyncio.Queue[tuple[int, int | None]],
    rid: str, usage: _Usage,
) -> web.Response:
    async for _ in _drain(seqs, out):
        pass
    choices: list[dict[str, Any]] = []
    for seq in seqs:
        text = _text(0, seq.generated)
        reason = str(seq.finish_reason or FinishReason.STOP)
        if req.endpoint is Endpoint.CHAT:
            choices.append({"index": seq.index, "logprobs": None, "finish_reason": reason,
                            "message": {"role": "assistant", "content": text}})
        else:
            choices.append({"index": seq.index, "logprobs": None, "finish_reason": reason,
                            "text": text})
    return web.json_response({
        "id": rid,
        "object": "chat.completion" if req.endpoint is Endpoint.CHAT else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage.body(seqs),
    })


async def _stream(
    request: web.Request, req: ValidRequest, seqs: list[Sequence],
    out: asyncio.Queue[tuple[int, int | None]], rid: str, usage: _Usage,
) -> web.StreamResponse:
    """vLLM's stream: its headers go at once (Starlette's StreamingResponse sends them
    before it asks the generator for a chunk), its body with the first engine output:
    the role chunk waits for the first token and leaves with it, so nothing of the body
    reaches a client while the request waits in the engine or prefills."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chat = req.endpoint is Endpoint.CHAT
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": rid, "object": obj, "created": created, "model": req.model,
                "choices": choices, **extra}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    # written in front of the first event, in the same write
    first = chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None} for s in seqs]) if chat else b""
    sent = dict.fromkeys((s.index for s in seqs), 0)
    by_index = {s.index: s for s in seqs}
    async for index, generated in _drain(seqs, out):
        if generated is None:
            seq = by_index[index]
            reason = str(seq.finish_reason or FinishReason.STOP)
            piece: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            event = chunk([{"index": index, **piece, "logprobs": None,
                            "finish_reason": reason}])
        else:
            text = _text(sent[index], generated)
            sent[index] = generated
            piece = {"delta": {"content": text}} if chat else {"text": text}
            event = chunk([{"index": index, **piece, "logprobs": None,
                            "finish_reason": None}])
        await resp.write(first + event)
        first = b""
    options = req.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        await resp.write(chunk([], usage=usage.body(seqs)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Endpoint.CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Endpoint.COMPLETIONS)


async def _models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    return web.json_response({"object": "list", "data": [{
        "id": settings.model, "object": "model", "created": 0, "owned_by": "kvgate-sim",
        "max_model_len": settings.max_model_len}]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


def metrics_text(engine: SimEngine, model: str) -> str:
    cfg = engine.config
    label = f'model_name="{model}"'
    usage = engine.kv_cache_usage
    lines = [
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{label}}} {usage}",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {engine.num_running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {engine.num_waiting}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{label}}} {engine.preemptions}",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{label}}} {engine.prompt_tokens_total}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{label}}} {engine.generation_tokens_total}",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {engine.prefix_cache_queries}",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {engine.prefix_cache_hits}",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",'
        # + vLLM's null block, which its pool counts and never gives a request
        f'num_gpu_blocks="{cfg.num_blocks + 1}",cache_dtype="auto",'
        f'enable_prefix_caching="{cfg.prefix_caching}"}} 1.0',
        "# TYPE sim:num_gpu_blocks_used gauge",
        f"sim:num_gpu_blocks_used{{{label}}} {engine.blocks_used}",
        "# TYPE sim:num_gpu_blocks_cached_free gauge",
        f"sim:num_gpu_blocks_cached_free{{{label}}} {engine.blocks_cached_free}",
        "# TYPE sim:prefix_cache_preempted_queries_total counter",
        f"sim:prefix_cache_preempted_queries_total{{{label}}} "
        f"{engine.prefix_cache_preempted_queries}",
        "# TYPE sim:prefix_cache_preempted_hits_total counter",
        f"sim:prefix_cache_preempted_hits_total{{{label}}} {engine.prefix_cache_preempted_hits}",
        "# TYPE sim:peak_gpu_blocks_used gauge",
        f"sim:peak_gpu_blocks_used{{{label}}} {engine.peak_blocks_used}",
        "# TYPE sim:invariant_violations_total counter",
        f"sim:invariant_violations_total{{{label}}} {engine.invariant_violations}",
    ]
    return "\n".join(lines) + "\n"


async def _metrics(request: web.Request) -> web.Response:
    text = metrics_text(request.app[ENGINE_KEY], request.app[SETTINGS_KEY].model)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _state(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({
        "num_blocks": engine.config.num_blocks, "block_size": engine.config.block_size,
        "blocks_used": engine.blocks_used, "peak_blocks_used": engine.peak_blocks_used,
        "blocks_cached_free": engine.blocks_cached_free,
        "prefix_caching": engine.config.prefix_caching,
        "prefix_cache_queries": engine.prefix_cache_queries,
        "prefix_cache_hits": engine.prefix_cache_hits,
        "running": engine.num_running, "waiting": engine.num_waiting,
        "preemptions": engine.preemptions, "finished": engine.finished,
        "invariant_violations": engine.invariant_violations,
        "generation_tokens_total": engine.generation_tokens_total,
    })


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = SimEngine(app[SETTINGS_KEY].engine)
    app[ENGINE_KEY] = engine
    engine.start()
    yield
    await engine.stop()


def build_app(settings: SimSettings) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[SETTINGS_KEY] = settings
    if settings.model_dir:
        try:
            app[COUNTER_KEY] = load_counter(settings.model_dir, name=settings.model)
        except ValueError as exc:
            raise ValueError(f"--model-dir: {exc}") from exc
    app.cleanup_ctx.append(_engine_ctx)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/state", _state)
    return app


async def start_sim(settings: SimSettings, host: str, port: int) -> web.AppRunner:
    """Start on host:port (0 picks a free port); the caller cleans the runner up."""
    runner = web.AppRunner(build_app(settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("runner has no TCP address")


async def serve_forever(runner: web.AppRunner, banner: str) -> None:
    """Print where it listens, then serve until cancelled (Ctrl-C), cleaning up after."""
    print(banner.format(port=bound_port(runner)), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_sim(settings: SimSettings, host: str, port: int) -> None:
    async def serve() -> None:
        runner = await start_sim(settings, host, port)
        await serve_forever(runner, f"kvgate sim: {settings.model} on http://{host}:{{port}} "
                            f"({settings.engine.num_blocks} blocks x "
                            f"{settings.engine.block_size} tokens)")

    asyncio.run(serve())
