"""Counting in worker processes (`[server] count_workers = N`), off the event loop's core.

A Python process runs its event loop on one core at a time: parsing HTTP, forwarding,
streaming and counting all take turns on it. With `count_workers = N`, N processes
started with the proxy each load every model's counter (the same `load_counter`, the
same chat templates, the same fast encoder and count cache) and do the rendering and
encoding; the proxy sends each request's body as it arrived and gets the counts back.
The counts are the same function of the same bytes, so they are exactly the same.

Wire: one Unix socket pair per worker; frames of `!II` (payload length, request id) and
a payload. Request: one byte for the endpoint (`c` chat, `p` completions) then the body;
a request that wants its shared-prefix block keys too starts with `k`, the block size
and the scope (`_keys_job`). Answer: JSON, `{"ok": [counts...], "cache": [hits, misses,
bytes, entries]}` (with `"keys"`: the block keys' hex joined in one string, where
asked and the counter has ids), or
`{"template": message}` (the chat template refused: the caller's 400), or
`{"count_failed": message}` (no tokenizer could count the text: `CountFailed`, the
caller's 500), or `{"fail": message}` (a defect: the caller's 500). Id 0 is the
worker's "loaded and ready". A tokenizer library's panic (a `BaseException`) is
answered as `count_failed` too: the worker goes on.

A worker that dies (killed, out of memory) is restarted, at most `RESTARTS_PER_MINUTE`
times a minute over all workers (each restart and each wait is logged); the requests
it held, and every later one while no worker is up, count in the proxy process as
without workers. A worker exits when its socket closes, so it never outlives the proxy.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import itertools
import json
import logging
import operator
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from proxy.prefix_blocks import KEY_CHARS
from proxy.tokenize import CountFailed, TemplateError, TokenCounter
from proxy.tokenize.cache import CacheStats
from proxy.tokenize.chunked import CountExceeded
from proxy.tokenize.guard import is_panic

__all__ = ["CountWorkers", "WorkerGone"]

_HEADER = struct.Struct("!II")
_KEYS_JOB = struct.Struct("!II")  # block tokens, scope length (`_keys_job`)
_LIMIT_JOB = struct.Struct("!I")  # the most prompt tokens to count (`_limit_job`)
_ENDPOINT_BYTE = {"chat": b"c", "completions": b"p"}
_READY_ID = 0
_STATS_FIELDS = ("hits", "misses", "size_bytes", "entries")  # the order workers send
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
START_TIMEOUT_S = 120.0
# A worker that dies is started again, but not more often than this over a minute (all
# workers together): a model that kills every worker it loads must not fork forever.
RESTARTS_PER_MINUTE = 5
_RESTART_WINDOW_S = 60.0

log = logging.getLogger("kvgate")


class WorkerGone(RuntimeError):
    """The worker holding a request died before it answered; count it elsewhere."""


class _Worker(asyncio.Protocol):
    """The proxy's side of one worker: frames out, answers matched back to their waiter."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.alive = True
        self.counted = 0
        self.restarts = 0  # how many workers held this slot before this one
        self.on_lost: Any = None  # called with this worker once it is gone (set when in use)
        self.cache: dict[str, list[int]] = {}
        self._ids = itertools.count(1)
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        offset = 0
        size = len(buf)
        while size - offset >= _HEADER.size:
            length, rid = _HEADER.unpack_from(buf, offset)
            end = offset + _HEADER.size + length
            if end > size:
                break
            payload = bytes(buf[offset + _HEADER.size:end])
            offset = end
            if rid == _READY_ID:
                if not self.ready.done():
                    self.ready.set_result(None)
                continue
            waiter = self.pending.pop(rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(payload)
        del buf[:offset]

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        gone = WorkerGone(f"count worker {self.index} (pid {self.proc.pid}) exited")
        if not self.ready.done():
            self.ready.set_exception(gone)
        for waiter in self.pending.values():
            if not waiter.done():
                waiter.set_exception(gone)
        self.pending.clear()
        if self.on_lost is not None:
            self.on_lost(self)

    def send(self, endpoint: str, body: bytes, job: bytes = b"") -> asyncio.Future[Any]:
        """`job`: what comes before the endpoint byte (`_keys_job`), if anything."""
        assert self.transport is not None
        rid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[rid] = waiter
        self.transport.writelines((_HEADER.pack(len(job) + len(body) + 1, rid), job,
                                   _ENDPOINT_BYTE[endpoint], body))
        return waiter


class CountWorkers:
    """N worker processes that count for every configured model; see the module doc."""

    def __init__(self, models: Mapping[str, str], workers: int, *,
                 llama_cpp: Collection[str] = (),
                 on_exit: Callable[[], None] | None = None,
                 on_restart: Callable[[], None] | None = None) -> None:
        """`on_exit` and `on_restart` are told of each worker lost while in use and of
        each one started in its place (the runtime counts them in its metrics)."""
        if workers < 1:
            raise ValueError(f"count workers must be >= 1. Given: {workers}")
        self._models = dict(models)
        self._llama_cpp = sorted(llama_cpp)  # models counted as llama.cpp counts them
        self._size = workers
        self._workers: list[_Worker] = []
        self._turn = itertools.count()
        self._closing = False
        self._restarted_at: collections.deque[float] = collections.deque()
        self._restarting: set[asyncio.Task[None]] = set()
        self._on_exit = on_exit
        self._on_restart = on_restart

    @property
    def alive(self) -> list[_Worker]:
        return [w for w in self._workers if w.alive]

    async def _spawn(self, index: int) -> _Worker:
        """One worker process and its socket; it says ready once it has loaded."""
        loop = asyncio.get_running_loop()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.count_workers", str(theirs.fileno()),
                json.dumps(self._models), json.dumps(self._llama_cpp),
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        worker = _Worker(index, proc)
        try:
            await loop.create_unix_connection(lambda: worker, sock=mine)
        except BaseException:
            mine.close()
            await _stop(worker)
            raise
        return worker

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every worker and wait until each has loaded its counters."""
        try:
            for index in range(self._size):
                self._workers.append(await self._spawn(index))
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(w.ready for w in self._workers))
        except BaseException:
            await self.close()
            raise
        for worker in self._workers:
            worker.on_lost = self._lost

    def _lost(self, worker: _Worker) -> None:
        """A worker in use is gone: start another in its slot (not while closing)."""
        if self._closing or self._workers[worker.index] is not worker:
            return
        if self._on_exit is not None:
            self._on_exit()
        task = asyncio.get_running_loop().create_task(self._restart(worker))
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _restart(self, dead: _Worker) -> None:
        """Replace `dead` once a new worker in its slot is ready; within the budget of
        `RESTARTS_PER_MINUTE`, waiting where it is spent; a failed start is retried."""
        loop = asyncio.get_running_loop()
        await _reap(dead.proc)
        log.error("count worker %d (pid %d) exited with status %s; starting another",
                  dead.index, dead.proc.pid, dead.proc.returncode)
        while not self._closing:
            now = loop.time()
            while self._restarted_at and now - self._restarted_at[0] >= _RESTART_WINDOW_S:
                self._restarted_at.popleft()
            if len(self._restarted_at) >= RESTARTS_PER_MINUTE:
                wait = _RESTART_WINDOW_S - (now - self._restarted_at[0])
                log.error("count workers were restarted %d times in the last minute; "
                          "worker %d starts again in %.0f s (its requests count in the "
                          "proxy process meanwhile)", len(self._restarted_at), dead.index,
                          wait)
                await asyncio.sleep(wait)
                continue
            self._restarted_at.append(now)
            worker: _Worker | None = None
            try:
                worker = await self._spawn(dead.index)
                async with asyncio.timeout(START_TIMEOUT_S):
                    await worker.ready
            except Exception as exc:
                log.error("restarting count worker %d failed: %s", dead.index, exc)
                if worker is not None:
                    await _stop(worker)
                continue
            except BaseException:  # cancelled by `close`
                if worker is not None:
                    await _stop(worker)
                raise
            worker.restarts = dead.restarts + 1
            if self._closing:
                await _stop(worker)
                return
            self._workers[dead.index] = worker
            worker.on_lost = self._lost
            log.warning("count worker %d restarted (pid %d, restart %d of this slot)",
                        dead.index, worker.proc.pid, worker.restarts)
            if self._on_restart is not None:
                self._on_restart()
            return

    async def close(self) -> None:
        self._closing = True
        for task in list(self._restarting):
            task.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        for w in self._workers:
            if w.transport is not None:
                w.transport.close()
        for w in self._workers:
            await _reap(w.proc)

    def _pick(self) -> _Worker | None:
        """The worker with the fewest requests in hand; ties go round in turn."""
        alive = self.alive
        if not alive:
            return None
        turn = next(self._turn)
        return min(alive, key=lambda w: (len(w.pending), (w.index - turn) % len(alive)))

    async def count(self, endpoint: str, body: bytes,
                    limit: int | None = None) -> list[int] | None:
        """The prompt counts of a validated request body; None when no worker is left
        (the caller counts in its own process). Raises `TemplateError` as the counter
        would, `CountExceeded` where a prompt passed `limit` (counting stopped there),
        and `RuntimeError` for a worker's unexpected failure."""
        answer = await self._ask(endpoint, body, _limit_job(limit))
        if answer is None:
            return None
        counts: list[int] = answer["ok"]
        return counts

    async def count_keys(self, endpoint: str, body: bytes, block_tokens: int,
                         scope: str, limit: int | None = None,
                         ) -> tuple[int, tuple[str, ...]] | None:
        """The exact count and shared-prefix block keys of a validated body with one
        prompt (`TokenCounter.count_chat_keys`, `count_prompt_keys`), for blocks of
        `block_tokens` in `scope`; None when no worker is left. Raises as `count`."""
        answer = await self._ask(endpoint, body,
                                 _limit_job(limit) + _keys_job(block_tokens, scope))
        if answer is None:
            return None
        (count,) = answer["ok"]
        keys: str = answer.get("keys") or ""
        return count, tuple(keys[i:i + KEY_CHARS] for i in range(0, len(keys), KEY_CHARS))

    async def _ask(self, endpoint: str, body: bytes, job: bytes) -> dict[str, Any] | None:
        worker = self._pick()
        if worker is None:
            return None
        try:
            payload = await (worker.send(endpoint, body, job) if job
                             else worker.send(endpoint, body))
        except WorkerGone as exc:
            # Not handed to the next worker: a request that killed one would kill them all.
            log.error("%s; its requests count in the proxy process", exc)
            return None
        answer: dict[str, Any] = json.loads(payload)
        if "ok" in answer:
            worker.counted += 1
            worker.cache[answer["model"]] = answer["cache"]
            return answer
        if "template" in answer:
            raise TemplateError(answer["template"])
        if "count_failed" in answer:
            raise CountFailed(answer["count_failed"])
        if "exceeded" in answer:
            raise CountExceeded(answer["exceeded"], answer["limit"])
        raise RuntimeError(f"count worker {worker.index} failed: {answer['fail']}")

    def cache_stats(self, model: str) -> CacheStats | None:
        """The workers' count caches for `model`, summed (as each last reported)."""
        seen = [CacheStats(**dict(zip(_STATS_FIELDS, w.cache[model], strict=True)))
                for w in self._workers if model in w.cache]
        return functools.reduce(operator.add, seen) if seen else None

    def describe(self) -> list[dict[str, Any]]:
        return [{"pid": w.proc.pid, "alive": w.alive, "counted": w.counted,
                 "restarts": w.restarts} for w in self._workers]


async def _stop(worker: _Worker) -> None:
    """A worker not (or no longer) in use: close its socket, which ends it, and reap it."""
    worker.on_lost = None
    if worker.transport is not None:
        worker.transport.close()
    await _reap(worker.proc)


async def _reap(proc: asyncio.subprocess.Process, timeout_s: float = 5.0) -> None:
    """A worker exits on its socket's end; wait a little, then make sure."""
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# ----------------------------------------------------------------------------- worker side


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        got = sock.recv(n - len(chunks))
        if not got:
            return None
        chunks += got
    return bytes(chunks)


def _limit_job(limit: int | None) -> bytes:
    """A job that may stop past `limit` tokens: `l`, then `!I`; first, before any other."""
    return b"" if limit is None else b"l" + _LIMIT_JOB.pack(limit)


def _keys_job(block_tokens: int, scope: str) -> bytes:
    """A job that wants block keys too: `k`, then `!II` (block tokens, scope bytes), the
    scope in UTF-8, then the endpoint byte and the body as for a count."""
    raw = scope.encode()
    return b"k" + _KEYS_JOB.pack(block_tokens, len(raw)) + raw


def _answer(counters: Mapping[str, Any], payload: bytes,
            llama_cpp: Collection[str] = ()) -> dict[str, Any]:
    from proxy.validation import Endpoint, validate

    limit: int | None = None
    if payload[:1] == b"l":
        (limit,) = _LIMIT_JOB.unpack_from(payload, 1)
        payload = payload[1 + _LIMIT_JOB.size:]
    keyed: tuple[int, str] | None = None
    if payload[:1] == b"k":
        block_tokens, size = _KEYS_JOB.unpack_from(payload, 1)
        at = 1 + _KEYS_JOB.size
        keyed = block_tokens, payload[at:at + size].decode()
        payload = payload[at + size:]
    endpoint = Endpoint.CHAT if payload[:1] == b"c" else Endpoint.COMPLETIONS
    keys: str | None = None
    try:
        req = validate(payload[1:], endpoint)
        counter = counters[req.model]
        counts: Sequence[int]
        chat = req.chat
        if chat is not None and req.model in llama_cpp:
            chat = chat.as_llama_cpp_reads()
        if keyed is not None and isinstance(counter, TokenCounter) and req.n == 1 and (
                chat is not None or len(req.prompts) == 1):
            count, key_list = (
                counter.count_chat_keys(chat, *keyed, limit) if chat is not None
                else counter.count_prompt_keys(req.prompts[0], *keyed, limit))
            counts, keys = [count], "".join(key_list)
        elif chat is not None:
            counts = [counter.count_chat(chat, limit)]
        else:
            counts = [counter.count_prompt(p, limit) for p in req.prompts]
    except TemplateError as exc:
        return {"template": str(exc)}
    except CountExceeded as exc:
        return {"exceeded": exc.at_least, "limit": exc.limit}
    except CountFailed as exc:
        return {"count_failed": str(exc)}
    except Exception as exc:  # reported to the proxy, which answers 500 and logs it
        return {"fail": f"{type(exc).__name__}: {exc}"}
    except BaseException as exc:
        if is_panic(exc):  # the counters catch theirs; this one must not end the worker
            return {"count_failed": f"the tokenizer panicked: {exc}"}
        raise
    stats = counter.cache_stats()
    cache = ([getattr(stats, f) for f in _STATS_FIELDS] if stats is not None
             else [0] * len(_STATS_FIELDS))
    answer: dict[str, Any] = {"ok": list(counts), "model": req.model, "cache": cache}
    if keys is not None:
        answer["keys"] = keys
    return answer


def serve(fd: int, models: Mapping[str, str], llama_cpp: Collection[str] = ()) -> None:
    """A worker's life: load, say ready, then count until the proxy closes the socket."""
    from proxy.tokenize import load_counter

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the proxy; it closes us
    sock = socket.socket(fileno=fd)
    counters = {name: load_counter(path, name=name, unicode_normalizer=name not in llama_cpp)
                for name, path in models.items()}
    gc.freeze()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the proxy is gone
        sock.sendall(_HEADER.pack(0, _READY_ID))
        while True:
            header = _recv_exact(sock, _HEADER.size)
            if header is None:
                return
            length, rid = _HEADER.unpack(header)
            payload = _recv_exact(sock, length)
            if payload is None:
                return
            answer = json.dumps(_answer(counters, payload, llama_cpp)).encode()
            sock.sendall(_HEADER.pack(len(answer), rid) + answer)


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]),
          json.loads(sys.argv[3]) if len(sys.argv) > 3 else ())
