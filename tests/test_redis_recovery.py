"""The Redis ledger when Redis loses its data: a restart without persistence, an evicted
key, a drifted counter, an evicting maxmemory-policy. Against a real redis-server.

The measure of safety is what the replicas hold, not only what Redis says: `held` is
the sum of the live leases of every replica in the test (what the backends would be
running), sampled in a tight loop next to Redis' resident counter. Neither may ever
exceed the capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis

from proxy.errors import LedgerUnavailable
from proxy.redis_ledger import RedisLedger, UnsafeRedisConfig
from proxy.redis_scripts import (
    READY_LUA,
    RECLAIM_LUA,
    RELEASE_LUA,
    RENEW_LUA,
    RESERVE_LUA,
    RESIZE_LUA,
)
from tests.support.procs import Proc, start_proxy
from tests.support.redis_server import RedisServer

BACKEND = "gpu-a"


def lid() -> str:
    return uuid.uuid4().hex


def make(url: str, **kw: float) -> RedisLedger:
    return RedisLedger(url, backends=[BACKEND], key_prefix="t",
                       lease_ttl_s=kw.get("ttl", 30.0),
                       refresh_interval_s=kw.get("refresh", 0.1),
                       recovery_window_s=kw.get("window"))


@contextlib.asynccontextmanager
async def replicas(url: str, n: int, **kw: float) -> AsyncIterator[list[RedisLedger]]:
    leds = [make(url, **kw) for _ in range(n)]
    try:
        for led in leds:
            await led.start()
        yield leds
    finally:
        for led in leds:
            await led.close()


def held(leds: Iterable[RedisLedger]) -> int:
    """Tokens the replicas' live leases hold: what the backend is really running."""
    return sum(live.tokens for led in leds for live in led._live.values())


async def lease_ids(admin: aioredis.Redis, led: RedisLedger) -> list[bytes]:
    return [f for f in await admin.hkeys(led.keys(BACKEND)[1]) if not f.startswith((b"=", b"#"))]


async def assert_all_back_to_zero(admin: aioredis.Redis, leds: list[RedisLedger]) -> None:
    for led in leds:
        for lease in list(led._live):
            led.release(lease)
    async with asyncio.timeout(10):
        for led in leds:
            await led.drain()
    keys = leds[0].keys(BACKEND)
    assert int(await admin.get(keys[0]) or 0) == 0
    assert await lease_ids(admin, leds[0]) == []
    assert await admin.zcard(keys[2]) == 0
    assert held(leds) == 0


@dataclass
class Sampler:
    """Redis' resident counter and the replicas' held tokens, every ~2 ms."""

    admin: aioredis.Redis
    leds: list[RedisLedger]
    key: str
    resident: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    done: bool = False

    async def run(self) -> None:
        while not self.done:
            self.held.append(held(self.leds))
            with contextlib.suppress(redis.RedisError, OSError):
                self.resident.append(int(await self.admin.get(self.key) or 0))
            await asyncio.sleep(0.002)


@dataclass
class Hammer:
    """New requests: a 100-token reserve every 5 ms on each ledger; admitted ones stay."""

    leds: list[RedisLedger]
    admitted: list[float] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    done: bool = False

    async def run(self) -> None:
        while not self.done:
            for led in self.leds:
                try:
                    if await led.reserve(BACKEND, lid(), 100, CAPACITY):
                        self.admitted.append(time.monotonic())
                except LedgerUnavailable as exc:
                    kind = "rebuilding" if "rebuil" in exc.message or "lost" in exc.message \
                        else "unreachable"
                    self.refused[kind] = self.refused.get(kind, 0) + 1
            await asyncio.sleep(0.005)


CAPACITY = 1000


async def stop(loops: list[Sampler | Hammer], tasks: list[asyncio.Task[None]]) -> None:
    # on a flag, not a cancel: redis-py may absorb a cancel mid-command
    for each in loops:
        each.done = True
    async with asyncio.timeout(10):
        await asyncio.gather(*tasks)


def test_restart_without_persistence_never_admits_above_capacity_and_leaks_nothing(
    redis_server: RedisServer,
) -> None:
    """Replicas A and B hold 900 of 1,000 tokens when Redis restarts empty; A and a third
    replica C keep trying to admit. B does nothing but its refresh pass: with 30 s TTLs
    its renewal is 10 s away, so only loss detection brings its leases back in time."""

    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_server.url)
        async with replicas(redis_server.url, 3, refresh=0.1) as (a, b, c):
            window = a.recovery_window_s
            assert await a.reserve(BACKEND, lid(), 300, CAPACITY)
            assert await a.reserve(BACKEND, lid(), 200, CAPACITY)
            assert await b.reserve(BACKEND, lid(), 400, CAPACITY)
            sampler = Sampler(admin, [a, b, c], a.keys(BACKEND)[0])
            hammer = Hammer([a, c])
            tasks = [asyncio.create_task(sampler.run())]
            await asyncio.to_thread(redis_server.stop)
            tasks.append(asyncio.create_task(hammer.run()))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(redis_server.start)  # same port, every key gone
            up_at = time.monotonic()
            async with asyncio.timeout(window + 5):
                while not hammer.admitted:
                    await asyncio.sleep(0.005)
            resumed_s = hammer.admitted[0] - up_at
            await asyncio.sleep(0.5)  # more attempts on the full ledger
            await stop([sampler, hammer], tasks)
            max_held, max_resident = max(sampler.held), max(sampler.resident)
            print(f"\nrestart: window {window:.2f} s, admissions resumed {resumed_s:.2f} s "
                  f"after Redis was back; max held {max_held}/{CAPACITY}, max resident "
                  f"{max_resident}/{CAPACITY}; refused {hammer.refused}; "
                  f"samples {len(sampler.held)}")
            assert max_held <= CAPACITY
            assert max_resident <= CAPACITY
            assert len(hammer.admitted) == 1  # the 100 tokens that were free, once
            assert resumed_s >= window - 0.05  # nobody admitted while B re-registered
            assert resumed_s <= window + 1.0
            assert b.readded_total == 1  # by its refresh pass, not by a renewal
            assert hammer.refused.get("rebuilding", 0) > 0
            assert await a.resident_now(BACKEND) == held([a, b, c]) == CAPACITY
            assert all(led.available for led in (a, b, c))
            await assert_all_back_to_zero(admin, [a, b, c])
        await admin.aclose()

    asyncio.run(scenario())


def test_an_evicted_lease_hash_is_rebuilt_before_anyone_admits_and_nothing_leaks(
    redis_server: RedisServer,
) -> None:
    """Redis evicts whole keys: the lease hash going (allkeys-lru, a DEL) left the counter
    at 1,024 while renewals re-added every lease, so the counter double-counted and, once
    they were released, kept tokens nobody held. The epoch lives in that hash: its loss is
    seen by the next script, A refuses, both replicas re-register, and the counter is the
    sum of the leases again."""

    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_server.url)
        async with replicas(redis_server.url, 2, refresh=0.1) as (a, b):
            for _ in range(3):
                assert await a.reserve(BACKEND, lid(), 256, 2048)
            assert await b.reserve(BACKEND, lid(), 256, 2048)
            keys = a.keys(BACKEND)
            registered_b: list[float] = []

            async def watch_b() -> None:
                while not b.readded_total:
                    await asyncio.sleep(0.001)
                registered_b.append(time.monotonic())

            watcher = asyncio.create_task(watch_b())
            await admin.delete(keys[1])  # what an eviction of the hash does
            lost_at = time.monotonic()
            with pytest.raises(LedgerUnavailable, match="lost its data"):
                await a.reserve(BACKEND, lid(), 1024, 2048)
            admitted_at = None
            async with asyncio.timeout(a.recovery_window_s + 5):
                while admitted_at is None:
                    with contextlib.suppress(LedgerUnavailable):
                        if await a.reserve(BACKEND, lid(), 1024, 2048):
                            admitted_at = time.monotonic()
                    assert held([a, b]) <= 2048
                    assert int(await admin.get(keys[0]) or 0) <= 2048
                    await asyncio.sleep(0.005)
            await watcher
            print(f"\neviction: B re-registered {registered_b[0] - lost_at:.2f} s after the "
                  f"loss, A admitted {admitted_at - lost_at:.2f} s after it")
            assert registered_b[0] < admitted_at
            assert await a.resident_now(BACKEND) == held([a, b]) == 2048
            assert not await b.reserve(BACKEND, lid(), 1, 2048)
            await assert_all_back_to_zero(admin, [a, b])
        await admin.aclose()

    asyncio.run(scenario())


def test_a_replica_that_missed_the_rebuild_registers_before_it_admits(
    redis_server: RedisServer,
) -> None:
    """B's refresh pass is 30 s away, so it sleeps through A's whole rebuild window: its
    first reserve after that sees a foreign epoch and is refused until its own leases
    are back; it never admits on totals that lack them."""

    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_server.url)
        a = make(redis_server.url, refresh=0.1, window=0.3)
        b = make(redis_server.url, refresh=30.0, window=0.3)
        await a.start()
        await b.start()
        try:
            assert await b.reserve(BACKEND, lid(), 600, CAPACITY)
            await b.drain()  # B's first renewal has run: its next pass is 30 s away
            await admin.delete(a.keys(BACKEND)[1])
            async with asyncio.timeout(3):  # A's refresh pass sees it and rebuilds
                while a.rebuilds_total < 2 or not a.available:
                    await asyncio.sleep(0.01)
            assert b.rebuilds_total == 0
            assert await admin.get(a.keys(BACKEND)[0]) == b"0"  # B's 600 are not there
            with pytest.raises(LedgerUnavailable, match="lost its data"):
                await b.reserve(BACKEND, lid(), 500, CAPACITY)
            await b.drain()  # B's re-registration
            assert await b.resident_now(BACKEND) == 600
            assert b.available
            assert not await b.reserve(BACKEND, lid(), 500, CAPACITY)
            assert await b.reserve(BACKEND, lid(), 400, CAPACITY)
            await assert_all_back_to_zero(admin, [a, b])
        finally:
            await a.close()
            await b.close()
            await admin.aclose()

    asyncio.run(scenario())


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait (bounded) for what this process learns from a reply Redis has sent."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


def test_refresh_pass_repairs_a_drifted_counter_and_a_lost_index(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_server.url)
        async with replicas(redis_server.url, 1, ttl=30.0, refresh=0.1) as (led,):
            keys = led.keys(BACKEND)
            leases = [lid() for _ in range(3)]
            for lease in leases:
                assert await led.reserve(BACKEND, lease, 300, CAPACITY)
            # drift upwards: the counter says more is reserved than any lease holds
            await admin.incrby(keys[0], 768)
            t0 = time.monotonic()
            async with asyncio.timeout(2):
                while int(await admin.get(keys[0]) or 0) != 900:
                    await asyncio.sleep(0.002)
            print(f"\ndrift +768 repaired in {time.monotonic() - t0:.3f} s")
            # Redis has run the repair; the replica reads the script's reply next
            await until(lambda: led.drift_fixed_total == 768)
            # drift downwards would admit above capacity: the counter lost (evicted)
            # alone is recomputed from the leases by the very script that reads it
            await admin.delete(keys[0])
            assert not await led.reserve(BACKEND, lid(), 101, CAPACITY)
            assert await admin.get(keys[0]) == b"900"
            await admin.set(keys[0], 100)
            async with asyncio.timeout(2):
                while int(await admin.get(keys[0]) or 0) != 900:
                    await asyncio.sleep(0.002)
            await until(lambda: led.drift_fixed_total == 768 + 800)
            assert await led.resident_now(BACKEND) == 900
            # a lease whose expiry is gone would never be reclaimed: it gets one TTL
            await admin.delete(keys[2])
            async with asyncio.timeout(2):
                while await admin.zcard(keys[2]) != 3:
                    await asyncio.sleep(0.002)
            await assert_all_back_to_zero(admin, [led])
        await admin.aclose()

    asyncio.run(scenario())


def test_an_orphan_lease_that_lost_its_expiry_is_still_reclaimed(
    redis_server: RedisServer,
) -> None:
    """A replica died holding a lease, and the lease's expiry is gone too: without the
    index repair it would hold its tokens forever."""

    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_server.url)
        async with replicas(redis_server.url, 2, ttl=1.0, refresh=0.1) as (dead, alive):
            assert await dead.reserve(BACKEND, lid(), 700, CAPACITY)
            dead._closing = True
            for task in dead._tasks:
                task.cancel()
            await asyncio.gather(*dead._tasks, return_exceptions=True)
            dead._tasks = []
            await admin.delete(alive.keys(BACKEND)[2])
            t0 = time.monotonic()
            async with asyncio.timeout(5):
                while not await alive.reserve(BACKEND, lid(), 700, CAPACITY):
                    await asyncio.sleep(0.02)
            print(f"\norphan lease without expiry reclaimed in {time.monotonic() - t0:.2f} s")
            assert time.monotonic() - t0 <= 1.0 + 2 * 0.1 + 0.5
            dead._live.clear()
            await assert_all_back_to_zero(admin, [alive])
        await admin.aclose()

    asyncio.run(scenario())


def test_an_evicting_maxmemory_policy_is_refused_at_start(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.ledger")
    admin = redis.Redis.from_url(redis_server.url)

    async def start(**kw: float) -> RedisLedger:
        led = make(redis_server.url, **kw)
        await led.start()
        return led

    async def scenario() -> None:
        admin.config_set("maxmemory", 2 * 1024 * 1024)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(UnsafeRedisConfig) as info:
            await start()
        message = str(info.value)
        print(f"\nrefused: {message}")
        assert "maxmemory-policy allkeys-lru" in message
        assert "noeviction" in message and "volatile-" in message
        assert admin.dbsize() == 0  # refused before writing anything
        # without a maxmemory nothing is evicted (yet): it starts, and says what to set
        admin.config_set("maxmemory", 0)
        led = await start()
        assert led.available
        assert "no maxmemory is set" in caplog.text
        await led.close()
        # a policy turned unsafe while running is logged as an error at the next check
        admin.config_set("maxmemory-policy", "noeviction")
        led = await start(ttl=0.9, window=0.2)  # the policy is checked every ttl/3
        admin.config_set("maxmemory", 2 * 1024 * 1024)
        admin.config_set("maxmemory-policy", "allkeys-random")
        async with asyncio.timeout(3):
            while not any(r.levelno == logging.ERROR and "allkeys-random" in r.getMessage()
                          for r in caplog.records):
                await asyncio.sleep(0.05)
        await led.close()

    try:
        asyncio.run(scenario())
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 0)
        admin.close()


def test_volatile_policies_never_evict_the_ledger(redis_server: RedisServer) -> None:
    """The ledger's keys carry no TTL, so a volatile-* policy evicts other keys only."""
    admin = redis.Redis.from_url(redis_server.url)

    async def scenario() -> None:
        async with replicas(redis_server.url, 1, refresh=0.1) as (led,):
            leases = [lid() for _ in range(50)]
            for lease in leases:
                assert await led.reserve(BACKEND, lease, 20, CAPACITY)
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", used + 2 * 1024 * 1024)
            admin.config_set("maxmemory-policy", "volatile-lru")
            junk = b"x" * 10_000
            for i in range(1000):  # ~10 MB of cache entries with a TTL into 2 MB of room
                admin.set(f"cache:{i}", junk, ex=600)
                if i % 100 == 0:
                    assert await led.reserve(BACKEND, lid(), 0, CAPACITY)
            evicted = int(admin.info("stats")["evicted_keys"])
            print(f"\nvolatile-lru evicted {evicted} cache keys, none of the ledger's")
            assert evicted > 500
            assert await led.resident_now(BACKEND) == 1000
            assert led.rebuilds_total == 1  # its first start only: no loss since
            assert not await led.reserve(BACKEND, lid(), 1, CAPACITY)
            assert led.available
            a = aioredis.Redis.from_url(redis_server.url)
            await assert_all_back_to_zero(a, [led])
            await a.aclose()

    try:
        asyncio.run(scenario())
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 0)
        admin.close()


def test_config_refused_by_acl_warns_what_to_set(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Managed Redis often refuses CONFIG: kvgate starts, and says what the operator must
    make sure of."""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "&*", "+@all", "-config")
    admin.close()
    url = f"redis://kv:pw@127.0.0.1:{redis_server.port}/0"

    async def scenario() -> None:
        async with replicas(url, 1, refresh=0.1) as (led,):
            assert led.available
            assert await led.reserve(BACKEND, lid(), 10, CAPACITY)
        assert "cannot read Redis' maxmemory-policy" in caplog.text
        assert "noeviction" in caplog.text

    asyncio.run(scenario())


def test_kvgate_serve_exits_with_the_reason_on_an_evicting_redis(
    tmp_path: Path, redis_server: RedisServer,
) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("maxmemory", 64 * 1024 * 1024)
    admin.config_set("maxmemory-policy", "allkeys-lfu")
    admin.close()
    nowhere = cast(Proc, SimpleNamespace(url="http://127.0.0.1:9"))
    proxy = start_proxy(tmp_path, name="p", redis_url=redis_server.url, sims=[nowhere],
                        kv_tokens=2048)
    try:
        assert proxy.proc.wait(timeout=60) == 2
    finally:
        proxy.kill()
    log = (tmp_path / "p.log").read_text()
    assert "kvgate serve: error: Redis runs maxmemory-policy allkeys-lfu" in log, log
    assert "noeviction" in log


def test_scripts_lost_that_may_not_be_reloaded_refuse_each_operation_and_hold_up_none(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis lost its script cache (a SCRIPT FLUSH, a failover to a fresh server) and the
    ACL forbids SCRIPT LOAD, so every script answers NOSCRIPT and reloading it is refused:
    an error reply, not an outage. The worker retried the batch forever as "UNREACHABLE"
    and `drain()` hung; now the release is logged as refused (lease, backend, why) and
    dropped, the replica counts it released, a reserve gets a 503 saying Redis refused
    it. With the scripts back, admission works and the kept lease goes at its TTL."""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "&*", "+@all",
                          "-script|load")
    scripts = (RESERVE_LUA, RESIZE_LUA, RELEASE_LUA, RENEW_LUA, RECLAIM_LUA, READY_LUA)

    def load_scripts() -> None:
        for script in scripts:
            admin.script_load(script)

    load_scripts()
    url = f"redis://kv:pw@127.0.0.1:{redis_server.port}/0"

    async def scenario() -> None:
        async with replicas(url, 1, ttl=1.0, refresh=0.1) as (led,):
            lease = lid()
            assert await led.reserve(BACKEND, lease, 300, CAPACITY)
            await asyncio.to_thread(admin.script_flush)
            led.release(lease)
            async with asyncio.timeout(5):
                await led.drain()
            assert led.lease_count(BACKEND) == 0 and led.resident(BACKEND) == 0
            assert int(admin.get(led.keys(BACKEND)[0]) or 0) == 300  # refused: kept
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            refused = [m for m in errors if lease in m]
            assert refused, errors
            assert "release" in refused[0] and BACKEND in refused[0]
            assert "script|load" in refused[0]
            # a pipeline whose SCRIPT LOAD failed must not keep its pooled connection:
            # after a second of refused renewals and refresh passes, the ledger still
            # holds its pub/sub connection and a pooled one or two, not one per refusal
            await asyncio.sleep(1.0)
            assert len([c for c in admin.client_list() if c["user"] == "kv"]) <= 4
            with pytest.raises(LedgerUnavailable, match="refused the reserve"):
                await led.reserve(BACKEND, lid(), 10, CAPACITY)
            assert not any("UNREACHABLE" in r.getMessage() for r in caplog.records)
            await asyncio.to_thread(load_scripts)
            assert await led.reserve(BACKEND, lid(), 10, CAPACITY)
            async with asyncio.timeout(5):  # the refused one, unrenewed, goes at its TTL
                while int(admin.get(led.keys(BACKEND)[0]) or 0) != 10:
                    await asyncio.sleep(0.05)
            a = aioredis.Redis.from_url(redis_server.url)
            await assert_all_back_to_zero(a, [led])
            await a.aclose()

    try:
        asyncio.run(scenario())
    finally:
        admin.close()
