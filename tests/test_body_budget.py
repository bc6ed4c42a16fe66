"""The body budget over real HTTP on 127.0.0.1: bodies being read, counted or waiting for
admission hold bytes, in total and per model; a body that would pass either budget is
refused `503 memory_budget` while small ones pass, and every byte comes back whatever
ended the request (answered, refused, client gone)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from proxy.errors import ERROR_TABLE
from tests.support.metrics import samples
from tests.support.stack import MODEL, Stack, running_stack

CHAT = "/v1/chat/completions"
KIB = 1024


def chat(size: int, max_tokens: int = 4) -> bytes:
    """A chat body of `size` bytes with a short prompt: JSON whitespace pads it out."""
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Hello there"}]}).encode()
    assert len(body) <= size
    return body + b" " * (size - len(body))


async def post(s: aiohttp.ClientSession, stack: Stack, body: bytes
               ) -> tuple[int, dict[str, str], Any]:
    async with s.post(stack.url + CHAT, data=body,
                      headers={"Content-Type": "application/json"}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def scrape(s: aiohttp.ClientSession, stack: Stack) -> dict[str, list[Any]]:
    async with s.get(f"{stack.url}/metrics") as resp:
        return samples(await resp.text())


def held(metrics: dict[str, list[Any]]) -> float:
    ((_, value),) = metrics["kvgate_body_budget_held_bytes"]
    return float(value)


def refusals(metrics: dict[str, list[Any]]) -> dict[tuple[str, str], float]:
    return {(labels["budget"], labels["model"]): value
            for labels, value in metrics.get("kvgate_body_budget_refusals_total", [])}


async def until(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Poll an async check (over HTTP) until it holds, within `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def stalled_upload(stack: Stack, declared: int) -> asyncio.StreamWriter:
    """A client that declares a body of `declared` bytes, sends a few and stops."""
    port = int(stack.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + b'{"model": ')
    await writer.drain()
    return writer


def assert_refused(status: int, headers: dict[str, str], data: Any) -> None:
    assert status == 503 == ERROR_TABLE["memory_budget"].status, data
    assert data["error"]["code"] == "memory_budget" and data["error"]["param"] == "body"
    assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1


def test_uploads_in_flight_hold_the_total_budget_until_their_clients_leave() -> None:
    """Two stalled uploads hold their declared 64 KiB each of a 160 KiB budget: large
    bodies sent meanwhile are refused (and reach no backend), small ones are served;
    once the uploaders leave, the bytes are back to 0 and large bodies pass again."""

    async def scenario() -> None:
        server = {"body_limit": "64KiB", "body_budget": "160KiB"}
        async with running_stack(backends=1, server=server) as stack, \
                aiohttp.ClientSession() as s:
            uploads = [await stalled_upload(stack, 64 * KIB) for _ in range(2)]

            async def both_held() -> bool:
                return held(await scrape(s, stack)) == 128 * KIB

            await until(both_held)
            answers = await asyncio.gather(
                *(post(s, stack, chat(40 * KIB)) for _ in range(3)),
                *(post(s, stack, chat(1 * KIB)) for _ in range(3)))
            for status, headers, data in answers[:3]:
                assert_refused(status, headers, data)
                assert "does not fit the 163840 bytes" in data["error"]["message"]
            assert [status for status, _, _ in answers[3:]] == [200] * 3
            assert (await stack.sim_state(s, 0))["finished"] == 3  # the small ones only
            metrics = await scrape(s, stack)
            assert refusals(metrics) == {("total", ""): 3}
            async with s.get(f"{stack.url}/admin/state") as resp:
                budget = (await resp.json())["body_budget"]
            assert budget["held_bytes"] == 128 * KIB and budget["budget_bytes"] == 160 * KIB
            for writer in uploads:
                writer.close()

            async def none_held() -> bool:
                return held(await scrape(s, stack)) == 0

            await until(none_held)
            assert (await post(s, stack, chat(40 * KIB)))[0] == 200
            assert stack.state.bodies.held == 0
            assert stack.state.bodies.held_by_model == {MODEL: 0}

    asyncio.run(scenario())


def test_bodies_waiting_for_admission_hold_their_models_share_until_served() -> None:
    """The backend is full: two 60 KiB bodies wait in the queue and hold 120 KiB of the
    model's 128 KiB share. A third is refused by the model's share (not the total); a
    1 KiB one fits and waits too. All three are served once the backend frees up, and
    each body left the budget when it was admitted."""

    async def scenario() -> None:
        server = {"body_limit": "64KiB", "body_budget": "1MiB",
                  "body_budget_per_model": "128KiB"}
        engine = {"decode_step_ms": 3.0}
        async with running_stack(backends=1, kv_tokens=512, server=server,
                                 engine=engine) as stack, aiohttp.ClientSession() as s:
            blocker = asyncio.ensure_future(post(s, stack, chat(1 * KIB, max_tokens=400)))

            async def admitted() -> bool:
                return any(stack.resident().values())

            await until(admitted)
            waiters = [asyncio.ensure_future(post(s, stack, chat(60 * KIB, max_tokens=100)))
                       for _ in range(2)]

            async def both_queued() -> bool:
                metrics = await scrape(s, stack)
                ((_, by_model),) = metrics["kvgate_body_budget_model_held_bytes"]
                return bool(by_model == 120 * KIB)

            await until(both_queued)
            assert stack.state.gates[MODEL].controller.queue_depth == 2
            assert_refused(*await post(s, stack, chat(60 * KIB, max_tokens=100)))
            small = asyncio.ensure_future(post(s, stack, chat(1 * KIB, max_tokens=100)))
            controller = stack.state.gates[MODEL].controller

            async def all_queued() -> bool:
                return controller.queue_depth == 3

            async def all_admitted() -> bool:
                return controller.queue_depth == 0

            await until(all_queued)
            await until(all_admitted)  # the blocker done, the three forwarded now
            assert stack.state.backends()[0].inflight > 0  # still generating, yet:
            assert stack.state.bodies.held == 0  # their bodies left the budget
            answers = await asyncio.gather(blocker, *waiters, small)
            assert [status for status, _, _ in answers] == [200] * 4, answers
            assert float(answers[1][1]["x-kvgate-queue-wait-ms"]) > 0  # they did wait
            metrics = await scrape(s, stack)
            assert refusals(metrics) == {("model", MODEL): 1}
            assert held(metrics) == 0
            assert metrics["kvgate_body_budget_model_held_bytes"] == [({"model": MODEL}, 0)]
            async with s.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            assert state["models"][MODEL]["body_bytes_held"] == 0
            assert state["body_budget"]["refusals"] == [
                {"budget": "model", "model": MODEL, "count": 1}]

    asyncio.run(scenario())


def test_every_way_out_gives_the_bytes_back() -> None:
    """Refused for its JSON, its model, its size, or its place in a full queue, or
    leaving while it waits: no request leaves a byte held."""

    async def scenario() -> None:
        server = {"body_limit": "64KiB", "body_budget": "256KiB"}
        queue = {"max_depth": 1}
        async with running_stack(backends=1, kv_tokens=512, server=server, queue=queue,
                                 engine={"decode_step_ms": 3.0}) as stack, \
                aiohttp.ClientSession() as s:
            unknown = chat(2 * KIB).replace(MODEL.encode(), b"no-such-model")
            assert (await post(s, stack, b"{" + b" " * 4000))[0] == 400
            assert (await post(s, stack, unknown))[0] == 404
            assert (await post(s, stack, b" " * (65 * KIB)))[0] == 413
            blocker = asyncio.ensure_future(post(s, stack, chat(1 * KIB, max_tokens=400)))

            async def admitted() -> bool:
                return any(stack.resident().values())

            await until(admitted)
            leaver = asyncio.ensure_future(post(s, stack, chat(30 * KIB, max_tokens=100)))

            async def queued() -> bool:
                return stack.state.gates[MODEL].controller.queue_depth == 1

            await until(queued)
            status, _, data = await post(s, stack, chat(30 * KIB, max_tokens=100))
            assert (status, data["error"]["code"]) == (429, "queue_full")
            assert stack.state.bodies.held == 30 * KIB  # the waiter's alone
            leaver.cancel()  # its client leaves while it waits

            async def none_held() -> bool:
                return held(await scrape(s, stack)) == 0

            await until(none_held)
            assert (await blocker)[0] == 200
            assert stack.state.bodies.held_by_model == {MODEL: 0}

    asyncio.run(scenario())
