"""Tickets: a refused client's place in line, honoured when it comes back in time.

The ticket itself (signed, scoped, timed, single use), the orderings that put its
holder first within its class, and over real HTTP: a 429 carries one, and a retry
that brings it back is admitted before a request that was already waiting.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from policies.ordering import Fifo, PriorityFairShare, ShortestFirst, WaiterView
from proxy.tickets import GRACE_S, TICKET_HEADER, Tickets
from tests.support.stack import MODEL, running_stack


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_a_ticket_is_good_once_between_half_and_twice_its_wait() -> None:
    clock = Clock()
    tickets = Tickets(b"s" * 32, now=clock)
    ticket = tickets.issue("m", "team-a", retry_after_s=4.0)
    clock.t += 1.9
    assert not tickets.redeem(ticket, "m", "team-a")  # early: half the wait is 2 s
    clock.t += 0.2
    assert tickets.redeem(ticket, "m", "team-a")
    assert not tickets.redeem(ticket, "m", "team-a")  # used
    late = tickets.issue("m", "team-a", retry_after_s=4.0)
    clock.t += 8.0 + GRACE_S + 0.1
    assert not tickets.redeem(late, "m", "team-a")


def test_a_ticket_holds_only_for_its_model_tenant_and_secret() -> None:
    clock = Clock()
    tickets = Tickets(b"s" * 32, now=clock)
    ticket = tickets.issue("m", "team-a", retry_after_s=2.0)
    clock.t += 1.5
    assert not tickets.redeem(ticket, "other-model", "team-a")
    assert not tickets.redeem(ticket, "m", "team-b")
    assert not Tickets(b"t" * 32, now=clock).redeem(ticket, "m", "team-a")
    assert Tickets(b"s" * 32, now=clock).redeem(ticket, "m", "team-a")  # a replica's twin
    start, end, nonce, mac = ticket.split(".")
    forged = f"{start}.{int(end) + 60_000}.{nonce}.{mac}"  # stretched: the MAC no longer fits
    assert not tickets.redeem(forged, "m", "team-a")
    for junk in ("", "x", "a.b.c.d", "." * 200, ticket + "0", ticket.replace(".", ":")):
        assert not tickets.redeem(junk, "m", "team-a")


def test_a_place_holder_comes_first_within_its_class_in_every_ordering() -> None:
    def view(seq: int, *, held: bool = False, priority: str = "", tokens: int = 100
             ) -> WaiterView:
        return WaiterView(seq=seq, arrival=0.0, demand_tokens=tokens, priority=priority,
                          tenant="", held_place=held)

    waiters = [view(0), view(1, tokens=10), view(2, held=True, tokens=5000)]
    for ordering in (Fifo(), ShortestFirst(), PriorityFairShare()):
        first = min(waiters, key=lambda w: ordering.key(w, 0.0))
        assert first.seq == 2, ordering
    classes = [view(0, priority="high"), view(1, held=True, priority="low")]
    assert min(classes, key=lambda w: PriorityFairShare().key(w, 0.0)).seq == 0


async def _chat(s: aiohttp.ClientSession, url: str, max_tokens: int,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    body = {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Tell me about the KV cache."}]}
    async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def test_over_http_a_retry_with_its_ticket_goes_before_an_earlier_waiter() -> None:
    """One backend holds one request at a time. `a` runs; `b` waits; `c` gives up
    after 50 ms (429 with a ticket), comes back with it after half its Retry-After,
    and is admitted when `a` ends, before `b`, which had waited longer."""

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=2048, queue={"default_deadline_s": 30},
                                 engine={"decode_step_ms": 2.0}) as stack, \
                aiohttp.ClientSession() as s:
            order: list[str] = []

            async def run(name: str, headers: dict[str, str] | None = None) -> int:
                status, _, _ = await _chat(s, stack.url, 1500, headers)
                order.append(name)
                return status

            a = asyncio.ensure_future(run("a"))
            await asyncio.sleep(0.3)
            b = asyncio.ensure_future(run("b"))
            await asyncio.sleep(0.2)
            status, headers, data = await _chat(s, stack.url, 1500,
                                                {"x-kvgate-deadline-ms": "50"})
            assert status == 429, data
            ticket = headers[TICKET_HEADER]
            wait_s = int(headers["retry-after-ms"]) / 1000
            await asyncio.sleep(wait_s / 2 + 0.05)
            assert not a.done(), "the first request ended before the retry: too fast a sim"
            c = asyncio.ensure_future(run("c", {TICKET_HEADER: ticket}))
            assert await asyncio.gather(a, b, c) == [200, 200, 200]
            assert order == ["a", "c", "b"]
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert f'kvgate_tickets_redeemed_total{{model="{MODEL}"}} 1.0' in text

    asyncio.run(scenario())


@pytest.mark.parametrize("secret", ["short", 42])
def test_a_ticket_secret_must_be_long_enough(secret: Any) -> None:
    from proxy.config import ConfigError, parse_config
    from tests.support.stack import MODELS

    data = {"server": {"ticket_secret": secret},
            "models": [{"name": MODEL, "path": str(MODELS / MODEL),
                        "deployment": {"kv_tokens": 4096},
                        "backends": [{"url": "http://127.0.0.1:1"}]}]}
    with pytest.raises(ConfigError, match="ticket_secret"):
        parse_config(data, base=MODELS)
