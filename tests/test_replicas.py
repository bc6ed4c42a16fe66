"""Three proxy processes, one Redis, two simulated backends: one ceiling across replicas."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import redis
from prometheus_client.parser import text_string_to_metric_families

from policies.placement import seed_score
from proxy.leases import Demand
from proxy.prefix_view import PrefixView
from proxy.tokenize import ChatRequest, load_counter
from tests.support.procs import QWEN, Proc, start_proxy, start_sim
from tests.support.redis_server import RedisServer, block_fields
from tests.support.servers import wait_status
from tests.support.tasks import stop

KV_TOKENS = 2048
BACKENDS = ("gpu-0", "gpu-1")


def resident_key(backend: str) -> str:
    return f"kvgate-test:{{{backend}}}:resident"


@contextlib.contextmanager
def cluster(tmp: Path, server: RedisServer, *, replicas: int = 3,
            decode_step_ms: float = 2.0) -> Iterator[tuple[list[Proc], list[Proc]]]:
    procs: list[Proc] = []
    try:
        sims = [start_sim(tmp, kv_tokens=KV_TOKENS, decode_step_ms=decode_step_ms,
                          name=f"sim{i}") for i in range(2)]
        procs += sims
        proxies = [start_proxy(tmp, name=f"proxy{i}", redis_url=server.url, sims=sims,
                               kv_tokens=KV_TOKENS) for i in range(replicas)]
        procs += proxies
        for p in procs:
            p.wait_ready()
        yield proxies, sims
    finally:
        for p in procs:
            p.kill()


async def sim_state(s: aiohttp.ClientSession, sim: Proc) -> dict[str, Any]:
    async with s.get(f"{sim.url}/sim/state") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def body(i: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": "qwen3-14b", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"request number {i} " * 8}]}


async def gauges_read_zero(s: aiohttp.ClientSession, proxies: list[Proc]) -> None:
    """Redis holds zero: within one refresh (0.2 s) every replica's shared-state gauges
    say so at its next scrape, whichever replica served the last request."""
    await asyncio.sleep(0.2 + 0.1)
    for p in proxies:
        async with s.get(f"{p.url}/metrics") as resp:
            text = await resp.text()
        values = {(smp.name, smp.labels.get("backend")): smp.value
                  for fam in text_string_to_metric_families(text) for smp in fam.samples}
        for backend in BACKENDS:
            assert values[("kvgate_resident_tokens", backend)] == 0, (p.url, backend)
            assert values[("kvgate_inflight_requests", backend)] == 0, (p.url, backend)


async def wait_ready(s: aiohttp.ClientSession, proxies: list[Proc]) -> None:
    for p in proxies:
        await wait_status(s, f"{p.url}/readyz", 200, timeout_s=15, interval_s=0.1)


def test_three_replicas_overload_never_exceed_capacity(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    with cluster(tmp_path, redis_server) as (proxies, sims):

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, proxies)
                samples: list[tuple[int, int]] = []

                async def sample() -> None:
                    while True:
                        values = r.mget([resident_key(b) for b in BACKENDS])
                        samples.append((int(values[0] or 0), int(values[1] or 0)))
                        await asyncio.sleep(0.005)

                statuses: list[tuple[int, str | None]] = []

                async def one(i: int) -> None:
                    proxy = proxies[i % len(proxies)]
                    async with s.post(f"{proxy.url}/v1/chat/completions",
                                      json=body(i, 200 + (i % 3) * 50)) as resp:
                        data = await resp.json()
                        statuses.append((resp.status, None if resp.status == 200
                                         else data["error"]["code"]))

                sampler = asyncio.create_task(sample())
                # ~290 tokens each, 45 at once ~ 13,000 tokens against a 4,096-token ceiling
                async with asyncio.timeout(90):
                    await asyncio.gather(*(one(i) for i in range(45)))
                await stop(sampler)
                assert len(samples) > 20
                assert max(a for a, _ in samples) <= KV_TOKENS
                assert max(b for _, b in samples) <= KV_TOKENS
                assert max(a + b for a, b in samples) > KV_TOKENS  # both were used
                for sim in sims:
                    st = await sim_state(s, sim)
                    assert st["preemptions"] == 0
                    assert st["peak_blocks_used"] <= st["num_blocks"]
                ok = sum(1 for status, _ in statuses if status == 200)
                assert ok >= 15
                assert {code for _, code in statuses if code} <= {"queue_full", "queue_timeout"}
                async with asyncio.timeout(10):
                    while any(int(v or 0) for v in r.mget([resident_key(b) for b in BACKENDS])):
                        await asyncio.sleep(0.05)
                await gauges_read_zero(s, proxies)

        asyncio.run(scenario())


def test_sigkilled_replica_leases_are_reclaimed_for_the_others(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    ttl_s, refresh_s = 2.0, 0.2
    r = redis.Redis.from_url(redis_server.url)
    with cluster(tmp_path, redis_server, replicas=2, decode_step_ms=10.0) as (proxies, _sims):

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, proxies)
                doomed, survivor = proxies
                # two long streams through the doomed replica fill both backends
                streams = [await s.post(f"{doomed.url}/v1/chat/completions",
                                        json=body(i, 1900, stream=True)) for i in range(2)]
                for resp in streams:
                    assert resp.status == 200
                    await resp.content.readline()
                held = [int(v or 0) for v in r.mget([resident_key(b) for b in BACKENDS])]
                assert min(held) > 1900
                async with s.post(f"{survivor.url}/v1/chat/completions",
                                  json=body(9, 1500),
                                  headers={"x-kvgate-deadline-ms": "200"}) as resp:
                    assert resp.status == 429  # no room while the leases live
                doomed.kill(signal.SIGKILL)
                killed_at = time.monotonic()
                for resp in streams:
                    resp.close()
                async with asyncio.timeout(ttl_s + 5):
                    while any(int(v or 0) for v in r.mget([resident_key(b) for b in BACKENDS])):
                        await asyncio.sleep(0.05)
                reclaimed_s = time.monotonic() - killed_at
                # stated bound: lease_ttl_s + refresh_interval_s, plus scheduling slack
                assert reclaimed_s <= ttl_s + refresh_s + 0.5
                async with s.post(f"{survivor.url}/v1/chat/completions",
                                  json=body(10, 1500)) as resp:
                    assert resp.status == 200
                    data = await resp.json()
                assert data["usage"]["completion_tokens"] == 1500

        asyncio.run(scenario())


def test_redis_restart_gives_503_then_exact_accounting(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    with cluster(tmp_path, redis_server, replicas=2, decode_step_ms=5.0) as (proxies, _sims):

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, proxies)
                # a stream that lives across the outage
                live = await s.post(f"{proxies[0].url}/v1/chat/completions",
                                    json=body(1, 800, stream=True))
                await live.content.readline()
                reserved = int(live.headers["x-kvgate-reserved-tokens"])
                redis_server.stop()
                for p in proxies:
                    async with s.post(f"{p.url}/v1/chat/completions", json=body(2, 10)) as resp:
                        assert resp.status == 503
                        data = await resp.json()
                        assert data["error"]["code"] == "ledger_unavailable"
                        assert "Retry-After" in resp.headers
                await wait_status(s, f"{proxies[1].url}/readyz", 503, timeout_s=5)
                async with s.get(f"{proxies[1].url}/metrics") as resp:
                    assert "kvgate_ledger_available 0.0" in await resp.text()
                redis_server.start()  # empty: the live lease must come back by renewal
                async with asyncio.timeout(10):
                    while sum(int(v or 0) for v in
                              r.mget([resident_key(b) for b in BACKENDS])) != reserved:
                        await asyncio.sleep(0.05)
                # rebuilt from the live leases: no admission (503 ledger_unavailable, not
                # ready) until every replica has had the rebuild window to re-register
                await wait_status(s, f"{proxies[1].url}/readyz", 200, timeout_s=5)
                async with s.post(f"{proxies[1].url}/v1/chat/completions",
                                  json=body(3, 10)) as resp:
                    assert resp.status == 200, await resp.text()
                text = await live.read()
                assert b"[DONE]" in text
                async with asyncio.timeout(10):
                    while any(int(v or 0) for v in r.mget([resident_key(b) for b in BACKENDS])):
                        await asyncio.sleep(0.05)

        asyncio.run(scenario())


@contextlib.contextmanager
def adaptive_cluster(tmp: Path, server: RedisServer, kv_tokens: int = 8192
                     ) -> Iterator[tuple[list[Proc], list[Proc]]]:
    """Three adaptive replicas on `server` in front of two simulated engines whose
    answers end at EOS (the simulator's lognormal draw, median 64)."""
    procs: list[Proc] = []
    try:
        sims = [start_sim(tmp, kv_tokens=kv_tokens, decode_step_ms=5.0, name=f"sim{i}",
                          output_len="lognormal") for i in range(2)]
        procs += sims
        proxies = [start_proxy(tmp, name=f"proxy{i}", redis_url=server.url, sims=sims,
                               kv_tokens=kv_tokens, ttl_s=5.0, queue={"max_depth": 128},
                               reservation="adaptive") for i in range(3)]
        procs += proxies
        for p in procs:
            p.wait_ready()
        yield proxies, sims
    finally:
        for p in procs:
            p.kill()


async def assert_all_released(s: aiohttp.ClientSession, r: redis.Redis,
                              proxies: list[Proc]) -> None:
    """Redis' resident counters back to zero, every replica's gauges and leases too."""
    async with asyncio.timeout(10):
        while any(int(v or 0) for v in r.mget([resident_key(b) for b in BACKENDS])):
            await asyncio.sleep(0.05)
    await gauges_read_zero(s, proxies)
    for p in proxies:
        async with s.get(f"{p.url}/admin/state") as resp:
            state = await resp.json()
        for backend in state["models"]["qwen3-14b"]["backends"].values():
            assert backend["leases"] == 0
            assert backend["inflight"] == 0


def test_three_adaptive_replicas_under_3x_overload_keep_preemptions_rare(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Clients cap at 1,000 tokens, answers end at EOS (the simulator's lognormal draw,
    median 64): adaptive leases share one ceiling, the engines barely preempt, and every
    lease and the ledger are back to zero at the end. Pools of 8,192 tokens hold ~17
    requests of ~400 prompt tokens each, the proportions of a real pool."""
    r = redis.Redis.from_url(redis_server.url)
    with adaptive_cluster(tmp_path, redis_server) as (proxies, sims):

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, proxies)
                admitted: list[str] = []
                statuses: list[int] = []

                async def one(i: int) -> None:
                    proxy = proxies[i % len(proxies)]
                    request = body(i, 1000, stream=i % 2 == 0)
                    request["messages"][0]["content"] *= 10  # ~400 prompt tokens
                    async with s.post(f"{proxy.url}/v1/chat/completions",
                                      json=request) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                        if resp.status == 200:
                            admitted.append(resp.headers["x-kvgate-reserved-tokens"])

                # strict at first (1,000-token caps: ~5 requests per backend), adaptive
                # once each replica has seen 10 answers; waves of ~3x what the pools hold
                async with asyncio.timeout(150):
                    for wave in range(5):
                        await asyncio.gather(*(one(wave * 100 + i) for i in range(100)))
                preemptions = 0
                for sim in sims:
                    st = await sim_state(s, sim)
                    preemptions += st["preemptions"]
                    assert st["peak_blocks_used"] <= st["num_blocks"]
                assert len(admitted) >= 150
                assert set(statuses) <= {200, 429}
                # adaptive leases really were smaller than prompt + 1,000
                assert min(int(t) for t in admitted) < 1000
                assert preemptions <= len(admitted) // 100
                await assert_all_released(s, r, proxies)

        asyncio.run(scenario())


GROUP_RULES = [" ".join(f"Group {g} rule {i}: answer briefly, cite the rule, stay on topic."
                        for i in range(60)) for g in range(4)]


def test_three_replicas_share_prefixes_under_3x_overload_and_end_at_zero(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Four groups of chats, each a ~1,000-token system prompt of its own and a short
    question, from three adaptive replicas on one Redis to two engines that cache
    prefixes, in waves of ~3x what the pools hold with each group's prompt held once:
    shared blocks are charged once across the replicas (answers report the hits), the
    engines barely preempt, and at the end every lease, every block reference and
    every ready mark in Redis is gone and the resident counters read zero."""
    r = redis.Redis.from_url(redis_server.url)
    with adaptive_cluster(tmp_path, redis_server) as (proxies, sims):

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, proxies)
                admitted: list[int] = []
                shared: list[int] = []
                statuses: list[int] = []

                async def one(i: int) -> None:
                    request = {"model": "qwen3-14b", "max_tokens": 300, "stream": True,
                               "messages": [
                                   {"role": "system", "content": GROUP_RULES[i % 4]},
                                   {"role": "user", "content": f"Question {i}: which rule?"}]}
                    async with s.post(f"{proxies[i % 3].url}/v1/chat/completions",
                                      json=request) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                        if resp.status == 200:
                            admitted.append(int(resp.headers["x-kvgate-reserved-tokens"]))
                            shared.append(int(resp.headers.get(
                                "x-kvgate-shared-prefix-tokens", "0")))

                # ~1,000 shared + ~40 own prompt tokens and ~64 output each: with the
                # group prompts held once, the two pools hold ~60; waves of 180
                async with asyncio.timeout(150):
                    for wave in range(3):
                        await asyncio.gather(*(one(wave * 180 + i) for i in range(180)))
                preemptions = 0
                hits = 0
                for sim in sims:
                    st = await sim_state(s, sim)
                    preemptions += st["preemptions"]
                    assert st["peak_blocks_used"] <= st["num_blocks"]
                assert set(statuses) <= {200, 429}
                assert len(admitted) >= 100
                hits = sum(1 for x in shared if x >= 900)
                assert hits >= len(admitted) // 2, (hits, len(admitted))  # charged once
                assert preemptions <= len(admitted) // 100, (preemptions, len(admitted))
                await assert_all_released(s, r, proxies)
                for b in BACKENDS:
                    assert block_fields(r.hkeys(f"kvgate-test:{{{b}}}:refs")) == [], b
                    assert r.scard(f"kvgate-test:{{{b}}}:ready") == 0, b

        asyncio.run(scenario())


def system_seeded_on(backend: str) -> tuple[str, Callable[[str], tuple[str, ...]]]:
    """A ~700-token system prompt that placement seeds on `backend` where no replica knows
    of a copy (rendezvous over its opening), and the block keys of a chat that opens
    with it, as kvgate counts them."""
    counter = load_counter(QWEN, name="qwen3-14b")
    for g in itertools.count():
        system = " ".join(f"Desk {g} rule {i}: answer briefly, cite the rule." for i in range(60))

        def keys(question: str, system: str = system) -> tuple[str, ...]:
            chat = ChatRequest(messages=[{"role": "system", "content": system},
                                         {"role": "user", "content": question}])
            return tuple(counter.count_chat_keys(chat, 16, "qwen3-14b\0")[1])

        seed = PrefixView.seed_key(Demand(tokens=1, prompt_tokens=1, max_tokens=1,
                                          blocks=keys("q"), block_tokens=16))
        assert seed is not None
        if max(BACKENDS, key=lambda b, seed=seed: seed_score(seed, b)) == backend:
            return system, keys
    raise AssertionError("unreachable")


def test_a_replica_places_a_request_where_another_replicas_lease_holds_its_prefix(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Replica A serves only gpu-1; its streamed answer holds a ~700-token system prompt
    there whose seed, where nobody knows of a copy, is gpu-0. Replica B (prefix mirror
    every 0.2 s) reads that prefix ready on gpu-1 through Redis and sends its own chat
    with that system prompt there: charged only the blocks it does not share, a prefix
    hit in gpu-1's engine. Replica C (mirror off) knows its own leases only: it seeds
    the prompt on gpu-0, charged whole and computed again. At the end nothing is held."""
    system, keys = system_seeded_on("gpu-0")
    r = redis.Redis.from_url(redis_server.url)
    sims = [start_sim(tmp_path, kv_tokens=16384, decode_step_ms=20.0, name=f"sim{i}")
            for i in range(2)]
    procs: list[Proc] = list(sims)
    try:
        a, b, c = (start_proxy(tmp_path, name=name, redis_url=redis_server.url, sims=sims,
                               kv_tokens=16384, only=only, prefix_mirror_s=mirror)
                   for name, only, mirror in (("a", [1], 0.2), ("b", None, 0.2),
                                              ("c", None, 0.0)))
        procs += [a, b, c]
        for p in procs:
            p.wait_ready()

        def chat(question: str, max_tokens: int, stream: bool) -> dict[str, Any]:
            return {"model": "qwen3-14b", "max_tokens": max_tokens, "stream": stream,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": question}]}

        async def shared_resident(s: aiohttp.ClientSession, proxy: Proc) -> dict[str, int]:
            async with s.get(f"{proxy.url}/admin/state") as resp:
                state = await resp.json()
            return {name: view["shared_prefix_resident_tokens"]
                    for name, view in state["models"]["qwen3-14b"]["backends"].items()}

        def finished(now: list[dict[str, Any]], then: list[dict[str, Any]]) -> list[int]:
            return [x["finished"] - y["finished"] for x, y in zip(now, then, strict=True)]

        async def ask(s: aiohttp.ClientSession, proxy: Proc, question: str) -> int:
            async with s.post(f"{proxy.url}/v1/chat/completions",
                              json=chat(question, 4, False)) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                return int(resp.headers["x-kvgate-shared-prefix-tokens"])

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, [a, b, c])
                async with s.post(f"{a.url}/v1/chat/completions",
                                  json=chat("Which rule comes first?", 200, True)) as held:
                    assert held.status == 200
                    await held.content.readany()  # answering: its prefix is ready on gpu-1
                    async with asyncio.timeout(5):  # B's mirror has read A's blocks...
                        while (await shared_resident(s, b))["gpu-1"] == 0:
                            await asyncio.sleep(0.05)
                    await asyncio.sleep(1.0)  # ...and, five reads on, them ready
                    assert await shared_resident(s, c) == {"gpu-0": 0, "gpu-1": 0}
                    before = [await sim_state(s, sim) for sim in sims]

                    # B: to gpu-1, charged only what A's lease does not already hold
                    leading = sum(1 for _ in itertools.takewhile(
                        lambda pair: pair[0] == pair[1],
                        zip(keys("Which rule is last?"), keys("Which rule comes first?"),
                            strict=False)))
                    assert leading >= 40  # the system prompt's blocks
                    assert await ask(s, b, "Which rule is last?") == 16 * leading
                    after_b = [await sim_state(s, sim) for sim in sims]
                    assert finished(after_b, before) == [0, 1]
                    assert after_b[1]["prefix_cache_hits"] - before[1]["prefix_cache_hits"] \
                        >= 16 * leading

                    # C, mirror off: seeds a copy on gpu-0 and pays for all of it
                    assert await ask(s, c, "Which rule is next?") == 0
                    after_c = [await sim_state(s, sim) for sim in sims]
                    assert finished(after_c, after_b) == [1, 0]
                    assert after_c[0]["prefix_cache_hits"] == before[0]["prefix_cache_hits"]
                    assert held.headers["x-kvgate-shared-prefix-tokens"] == "0"
                    await held.read()  # A's answer to its end

                async with asyncio.timeout(10):
                    while any(int(v or 0) for v in r.mget([resident_key(n) for n in BACKENDS])):
                        await asyncio.sleep(0.05)
                for n in BACKENDS:
                    assert block_fields(r.hkeys(f"kvgate-test:{{{n}}}:refs")) == [], n
                    assert r.scard(f"kvgate-test:{{{n}}}:ready") == 0, n
                async with asyncio.timeout(5):
                    while any([(await shared_resident(s, p)).get("gpu-1") for p in (a, b)]):
                        await asyncio.sleep(0.05)  # the mirrors' next read: nothing held

        asyncio.run(scenario())
    finally:
        for p in procs:
            p.kill()
