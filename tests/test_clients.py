"""Clients known to the operator: keys, tenants, priority ceilings, and what reaches the
backend; over real HTTP on loopback, with kvgate's real config parser."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.clients import Client, Clients, Identity, key_digest
from proxy.config import parse_config
from proxy.modelconfig import ConfigError
from tests.support.servers import fake_backend
from tests.support.stack import MODEL, MODELS, Stack, running_stack

MSGS = [{"role": "user", "content": "Say something short."}]
KEY_A, KEY_V = "sk-alpha-" + "a" * 24, "sk-victim-" + "v" * 24
CLIENTS = {"clients": [
    {"name": "alpha", "key": KEY_A, "priority": "normal"},
    {"name": "victim", "key_sha256": key_digest(KEY_V), "priority": "high"},
]}


def _config(extra: dict[str, Any], tmp_path: Path) -> Any:
    return parse_config({"models": [{
        "name": MODEL, "path": str(MODELS / MODEL), "max_model_len": 8192,
        "deployment": {"kv_tokens": 4096},
        "backends": [{"name": "b", "url": "http://127.0.0.1:9"}]}], **extra}, base=tmp_path)


def test_a_claimed_priority_lowers_and_never_raises() -> None:
    clients = Clients(by_digest={key_digest(KEY_A): Client(name="alpha", priority="normal")})
    assert clients.identify(KEY_A, "high") == Identity(tenant="alpha", priority="normal")
    assert clients.identify(KEY_A, "low") == Identity(tenant="alpha", priority="low")
    assert clients.identify(KEY_A, "") == Identity(tenant="alpha", priority="normal")
    assert clients.identify("sk-wrong", "high") is None  # keys required once configured
    assert clients.identify("", "") is None
    open_door = Clients(priority_by_api_key={"sk-vip": "high"})
    # Without [[clients]], anyone else is one default tenant at `normal`, whatever it claims.
    fresh = {open_door.identify(f"sk-{secrets.token_hex(8)}", "high") for _ in range(20)}
    assert fresh == {Identity(tenant="", priority="normal")}
    vip = open_door.identify("sk-vip", "")
    assert vip is not None and vip.priority == "high" and vip.tenant == key_digest("sk-vip")[:12]


def test_clients_config_is_checked_and_merged(tmp_path: Path) -> None:
    config = _config(CLIENTS, tmp_path)
    assert config.clients.required
    assert config.queue.tenant_weights == {"alpha": 1.0, "victim": 1.0}
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[clients]]\nname = "gamma"\nkey_sha256 = "{key_digest("sk-g")}"\n'
                    'priority = "low"\nweight = 3\n')
    config = _config({**CLIENTS, "server": {"clients_file": "keys.toml"}}, tmp_path)
    gamma = config.clients.client("sk-g")
    assert gamma is not None and (gamma.name, gamma.priority, gamma.weight) == ("gamma", "low", 3)
    assert config.queue.tenant_weights["gamma"] == 3.0
    bad = [
        ({"clients": [{"name": "x"}]}, "needs exactly one of `key` or `key_sha256`"),
        ({"clients": [{"name": "x", "key": "k", "key_sha256": "0" * 64}]}, "exactly one"),
        ({"clients": [{"name": "x", "key_sha256": "abc"}]}, "must be 64 hex digits"),
        ({"clients": [{"name": "x", "key": "k", "priority": "urgent"}]}, "`clients[0].priority`"),
        ({"clients": [{"name": "x", "key": "k"}, {"name": "x", "key": "j"}]}, "used once"),
        ({"clients": [{"name": "x", "key": "k"}, {"name": "y", "key": "k"}]}, "same key"),
        ({"clients": [{"name": "x", "key": "k", "weight": 0}]}, "weight` must be > 0"),
        ({"clients": [{"name": "x", "key": "k", "color": 1}]}, "unknown key `clients[0].color`"),
        ({"server": {"clients_file": "missing.toml"}}, "clients_file"),
        ({"queue": {"max_depth_by_priority": {"urgent": 3}}}, "max_depth_by_priority"),
    ]
    for extra, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")
                           .replace("(", r"\(").replace(")", r"\)")):
            _config(extra, tmp_path)


@contextlib.asynccontextmanager
async def _behind_recorder(seen: list[dict[str, str]], **kwargs: Any) -> AsyncIterator[Stack]:
    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"},
             "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})

    async with fake_backend(chat) as url, \
            running_stack(backends=0, extra_backend_urls=[url], **kwargs) as stack:
        async with asyncio.timeout(5):
            while not stack.state.backends()[0].healthy:
                await asyncio.sleep(0.02)
        yield stack


def test_without_a_valid_key_nothing_reaches_the_backend() -> None:
    seen: list[dict[str, str]] = []

    async def scenario() -> None:
        async with _behind_recorder(seen, extra=CLIENTS) as stack, aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5}
            for headers in ({}, {"Authorization": "Bearer sk-nope"},
                            {"Authorization": KEY_A}):  # no Bearer: not a key
                async with s.post(url, json=body, headers=headers) as resp:
                    assert resp.status == 401
                    error = (await resp.json())["error"]
                    assert error["code"] == "unauthorized" and error["param"] == "Authorization"
                    assert resp.headers["x-should-retry"] == "false"
            assert seen == []
            async with s.post(url, json=body, headers={
                    "Authorization": f"Bearer {KEY_A}", "X-Forwarded-For": "203.0.113.9",
                    "Connection": "keep-alive, x-secret-hop", "X-Secret-Hop": "1"},
                    skip_auto_headers=["Accept-Encoding"]) as resp:
                assert resp.status == 200, await resp.text()
            assert stack.resident() == {"sim-0": 0}
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert 'kvgate_rejections_total{model="qwen3-14b",reason="unauthorized"}' not in text
        [sent] = seen
        lower = {k.lower(): v for k, v in sent.items()}
        assert "authorization" not in lower  # kvgate's credential, not the backend's
        assert "x-secret-hop" not in lower  # named by Connection: hop-by-hop
        assert lower["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
        assert lower["accept-encoding"] == "identity"  # the client asked for no encoding

    asyncio.run(scenario())


def test_the_backend_key_replaces_the_clients() -> None:
    seen: list[dict[str, str]] = []

    async def scenario() -> None:
        backend = {"api_key": "backend-secret"}
        async with _behind_recorder(seen, extra=CLIENTS, backend=backend) as stack, \
                aiohttp.ClientSession() as s, s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 5},
                              headers={"Authorization": f"Bearer {KEY_V}",
                                       "Accept-Encoding": "gzip"}) as resp:
            assert resp.status == 200
        lower = {k.lower(): v for k, v in seen[0].items()}
        assert lower["authorization"] == "Bearer backend-secret"
        assert lower["accept-encoding"] == "gzip"  # the client's own, unchanged

    asyncio.run(scenario())


async def _one_at_a_time(stack: Stack, s: aiohttp.ClientSession,
                         senders: list[tuple[str, dict[str, str]]]) -> list[str]:
    """Hold the pool, queue `senders` in order, and return who was served in what order
    (the pool holds one request at a time, so completion order is admission order)."""
    url = f"{stack.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 480}
    done: list[tuple[float, str]] = []

    async def send(who: str, headers: dict[str, str]) -> None:
        async with s.post(url, json=body, headers=headers) as resp:
            await resp.read()
            if resp.status == 200:
                done.append((time.perf_counter(), who))
            else:
                assert resp.status == 401, await resp.text()

    hog = asyncio.create_task(send("hog", {"Authorization": f"Bearer {KEY_V}"}))
    await asyncio.sleep(0.15)
    tasks = []
    for who, headers in senders:
        tasks.append(asyncio.create_task(send(who, headers)))
        await asyncio.sleep(0.01)  # arrival order as listed
    await asyncio.wait_for(asyncio.gather(hog, *tasks), 60)
    return [who for _, who in sorted(done) if who != "hog"]


def test_a_priority_above_the_ceiling_is_not_honoured() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=512, extra=CLIENTS,
                                 queue={"ordering": "priority", "default_deadline_s": 30},
                                 engine={"decode_step_ms": 1}) as stack, \
                aiohttp.ClientSession() as s:
            order = await _one_at_a_time(stack, s, [
                ("alpha", {"Authorization": f"Bearer {KEY_A}", "x-kvgate-priority": "high"}),
                ("victim", {"Authorization": f"Bearer {KEY_V}"}),  # high by its ceiling
            ])
            assert order == ["victim", "alpha"]

    asyncio.run(scenario())


def test_fresh_keys_per_request_gain_no_share() -> None:
    """An attacker with one valid key and a fresh invalid one per request, against a
    victim, both queued into a pool that serves one request at a time: the fresh keys
    get 401, and the two tenants alternate (fair share), 50% each of the admissions."""
    async def scenario() -> None:
        clients = {"clients": [{"name": "alpha", "key": KEY_A},
                               {"name": "victim", "key": KEY_V}]}
        async with running_stack(backends=1, kv_tokens=512, extra=clients,
                                 queue={"ordering": "priority", "default_deadline_s": 30},
                                 engine={"decode_step_ms": 1}) as stack, \
                aiohttp.ClientSession() as s:
            attacker = ([("alpha", {"Authorization": f"Bearer {KEY_A}"})] * 4
                        + [("fresh", {"Authorization": f"Bearer sk-{secrets.token_hex(8)}"})
                           for _ in range(8)])
            victim = [("victim", {"Authorization": f"Bearer {KEY_V}"})] * 4
            order = await _one_at_a_time(stack, s, attacker + victim)
            assert "fresh" not in order
            assert sorted(order) == ["alpha"] * 4 + ["victim"] * 4
            first_half = order[:4]
            # the hog charged the victim: alpha first, then the two alternate
            assert first_half.count("alpha") == 2, order
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert 'kvgate_requests_total{model="qwen3-14b",outcome="completed"} 9.0' in text

    asyncio.run(scenario())


def test_a_low_priority_flood_does_not_take_the_room_of_high() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=512, extra=CLIENTS,
                                 queue={"ordering": "priority", "max_depth": 4,
                                        "default_deadline_s": 30},
                                 engine={"decode_step_ms": 1}) as stack, \
                aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 480}
            low = {"Authorization": f"Bearer {KEY_A}", "x-kvgate-priority": "low"}

            async def post(headers: dict[str, str]) -> tuple[int, str]:
                async with s.post(url, json=body, headers=headers) as resp:
                    data = json.loads(await resp.read())
                    return resp.status, data.get("error", {}).get("code", "")

            hog = asyncio.create_task(post({"Authorization": f"Bearer {KEY_V}"}))
            await asyncio.sleep(0.15)
            flood = [asyncio.create_task(post(low)) for _ in range(4)]
            await asyncio.sleep(0.2)
            assert await post(low) == (429, "queue_full")  # full for its own class
            high = asyncio.create_task(post({"Authorization": f"Bearer {KEY_V}"}))
            results = await asyncio.wait_for(asyncio.gather(hog, high, *flood), 60)
            assert results[1] == (200, "")  # high got a place
            assert sorted(results[2:]) == [(200, "")] * 3 + [(429, "queue_full")]

    asyncio.run(scenario())
