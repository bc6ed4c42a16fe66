"""The Redis ledger against a real redis-server: atomicity, expiry, notifications, outages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from policies.ordering import Fifo
from proxy.admission import AdmissionController, Backend, Demand
from proxy.errors import LedgerUnavailable
from proxy.redis_ledger import RESERVE_LUA, RedisLedger
from tests.support.redis_server import RedisServer
from tests.support.tcp_tap import reply_dropping_relay


def ledger(server: RedisServer, **kw: float) -> RedisLedger:
    return RedisLedger(server.url, backends=["gpu-a", "gpu-b"], key_prefix="t",
                       lease_ttl_s=kw.get("ttl", 30.0),
                       refresh_interval_s=kw.get("refresh", 0.5),
                       recovery_window_s=kw.get("window"))


async def lease_fields(admin: aioredis.Redis, led: RedisLedger, backend: str) -> list[bytes]:
    """The lease ids Redis holds for `backend` (the hash also holds the epoch fields)."""
    return [f for f in await admin.hkeys(led.keys(backend)[1]) if not f.startswith((b"=", b"#"))]


@contextlib.asynccontextmanager
async def started(server: RedisServer, **kw: float) -> AsyncIterator[RedisLedger]:
    led = ledger(server, **kw)
    await led.start()
    try:
        yield led
    finally:
        await led.close()


def lid() -> str:
    return uuid.uuid4().hex


def test_redis_reserve_over_capacity_returns_false_release_twice_is_noop(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        async with started(redis_server) as led:
            a, b = lid(), lid()
            assert await led.reserve("gpu-a", a, 60, 100) is True
            assert await led.reserve("gpu-a", lid(), 41, 100) is False
            assert await led.reserve("gpu-a", b, 40, 100) is True
            assert await led.resident_now("gpu-a") == 100
            assert await led.resident_now("gpu-b") == 0
            led.release(a)
            led.release(a)
            await led.drain()
            assert await led.resident_now("gpu-a") == 40
            led.release(b)
            await led.drain()
            assert await led.resident_now("gpu-a") == 0

    asyncio.run(scenario())


def test_redis_keys_share_a_hash_tag_and_prefix() -> None:
    led = RedisLedger("redis://127.0.0.1:1/0", backends=["gpu-a"], key_prefix="prod")
    keys = led.keys("gpu-a")
    assert keys == ["prod:{gpu-a}:resident", "prod:{gpu-a}:leases", "prod:{gpu-a}:expiry",
                    "prod:{gpu-a}:refs", "prod:{gpu-a}:ready"]


def test_redis_three_replicas_never_exceed_capacity(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        replicas = [ledger(redis_server) for _ in range(3)]
        for r in replicas:
            await r.start()
        rng = random.Random(5)
        capacity = 1000
        held: list[tuple[RedisLedger, str, int]] = []

        async def attempt(r: RedisLedger) -> None:
            tokens = rng.randint(1, 120)
            lease = lid()
            if await r.reserve("gpu-a", lease, tokens, capacity):
                held.append((r, lease, tokens))

        try:
            await asyncio.gather(*(attempt(replicas[i % 3]) for i in range(300)))
            resident = await replicas[0].resident_now("gpu-a")
            assert resident == sum(t for _, _, t in held)
            assert resident <= capacity
            assert resident > capacity - 120  # it filled up
            for r, lease, _ in held:
                r.release(lease)
            for r in replicas:
                await r._ops.join()
            assert await replicas[0].resident_now("gpu-a") == 0
        finally:
            for r in replicas:
                await r.close()

    asyncio.run(scenario())


def test_redis_crashed_replica_leases_reclaimed_within_ttl(redis_server: RedisServer) -> None:
    ttl, refresh = 1.0, 0.2

    async def scenario() -> None:
        crashed = ledger(redis_server, ttl=ttl, refresh=refresh)
        alive = ledger(redis_server, ttl=ttl, refresh=refresh)
        await crashed.start()
        await alive.start()
        try:
            assert await crashed.reserve("gpu-a", lid(), 80, 100)
            # the replica dies: no release, no renewal (what SIGKILL leaves behind)
            crashed._closing = True
            for task in crashed._tasks:
                task.cancel()
            await asyncio.gather(*crashed._tasks, return_exceptions=True)
            t0 = time.perf_counter()
            assert not await alive.reserve("gpu-a", lid(), 50, 100)
            async with asyncio.timeout(ttl + refresh + 2):
                while not await alive.reserve("gpu-a", lid(), 50, 100):
                    await asyncio.sleep(0.05)
            reclaimed_after = time.perf_counter() - t0
            # stated bound: lease_ttl_s + refresh_interval_s
            assert reclaimed_after <= ttl + refresh + 0.3
            assert await alive.resident_now("gpu-a") == 50
        finally:
            crashed._tasks = []
            await crashed.close()
            await alive.close()

    asyncio.run(scenario())


def test_redis_live_leases_survive_many_ttls_by_renewal(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with started(redis_server, ttl=0.6, refresh=0.1) as led:
            lease = lid()
            assert await led.reserve("gpu-a", lease, 70, 100)
            await asyncio.sleep(2.0)  # more than three TTLs
            assert await led.resident_now("gpu-a") == 70
            assert not await led.reserve("gpu-a", lid(), 31, 100)
            led.release(lease)
            await led.drain()
            assert await led.resident_now("gpu-a") == 0

    asyncio.run(scenario())


def test_redis_release_notification_wakes_waiter_on_other_replica(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        # a slow periodic refresh: only the pub/sub message can wake B quickly
        led_a = ledger(redis_server, refresh=30.0, window=0.5)
        led_b = ledger(redis_server, refresh=30.0, window=0.5)
        controllers = []
        for led in (led_a, led_b):
            c = AdmissionController(
                model="m", ledger=led, ordering=Fifo(),
                backends=[Backend(name="gpu-a", url="http://127.0.0.1:1", capacity_tokens=100)],
            )
            led.add_listener(lambda _b, c=c: c.kick())
            await led.start()
            controllers.append(c)
        try:
            loop = asyncio.get_running_loop()
            demand = Demand(tokens=80, prompt_tokens=40, max_tokens=40)
            held = await controllers[0].acquire(demand, loop.time() + 5)
            await asyncio.sleep(0.3)  # let B's subscription settle
            waiter = asyncio.create_task(controllers[1].acquire(demand, loop.time() + 10))
            await asyncio.sleep(0.2)
            assert not waiter.done()
            t0 = time.perf_counter()
            held.release()
            lease = await asyncio.wait_for(waiter, 5)
            assert time.perf_counter() - t0 < 1.0
            lease.release()
            await led_b._ops.join()
            assert await led_b.resident_now("gpu-a") == 0
        finally:
            await led_a.close()
            await led_b.close()

    asyncio.run(scenario())


def test_redis_outage_refuses_admission_and_restores_exact_accounting(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        async with started(redis_server, ttl=3.0, refresh=0.1) as led:
            kept, dropped = lid(), lid()
            assert await led.reserve("gpu-a", kept, 30, 100)
            assert await led.reserve("gpu-a", dropped, 20, 100)
            redis_server.stop()
            with pytest.raises(LedgerUnavailable) as info:
                await led.reserve("gpu-a", lid(), 1, 100)
            assert info.value.status == 503 and info.value.code == "ledger_unavailable"
            assert not led.available
            led.release(dropped)  # a request ends during the outage
            await asyncio.sleep(0.3)
            redis_server.start()  # an empty Redis: every key is gone
            async with asyncio.timeout(5):
                while not led.available or await led.resident_now("gpu-a") != 30:
                    await asyncio.sleep(0.05)
            # the live lease is back, the released one is not, nothing doubled
            await asyncio.sleep(0.5)
            assert await led.resident_now("gpu-a") == 30
            assert led.readded_total >= 1
            led.release(kept)
            await led.drain()
            assert await led.resident_now("gpu-a") == 0

    asyncio.run(scenario())


def test_redis_closing_pooled_connections_between_requests_does_not_refuse_the_next_one(
    redis_server: RedisServer,
) -> None:
    """A pooled connection that Redis closed (a failover, an idle timeout) is not an outage.

    The kill comes from a blocking client, so the ledger's client has not yet seen the
    old socket close when the next reserve borrows it: the race replicas hit in
    production after a failover. (A restart without persistence is not this case: it
    loses the data, and the ledger refuses until it has rebuilt it; see
    tests/test_redis_recovery.py.)
    """

    async def scenario() -> None:
        async with started(redis_server) as led:
            assert await led.reserve("gpu-a", lid(), 10, 100)
            killer = redis.Redis.from_url(redis_server.url)
            try:
                assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
            finally:
                killer.close()
            assert await led.reserve("gpu-a", lid(), 10, 100)
            assert led.available

    asyncio.run(scenario())


def test_redis_reserve_retried_after_a_lost_reply_counts_once(
    redis_server: RedisServer,
) -> None:
    """A retry of the same lease (its first reply lost) must not book it twice."""

    async def scenario() -> None:
        async with started(redis_server) as led:
            lease = lid()
            assert await led.reserve("gpu-a", lease, 30, 100)
            assert await led.reserve("gpu-a", lease, 30, 100)
            assert await led.resident_now("gpu-a") == 30
            with pytest.raises(ValueError, match="already recorded with 30 tokens"):
                await led.reserve("gpu-a", lease, 31, 100)
            led.release(lease)
            await led.drain()
            assert await led.resident_now("gpu-a") == 0

    asyncio.run(scenario())


def test_redis_reserve_whose_reply_is_lost_is_undone(redis_server: RedisServer) -> None:
    """The script runs but its reply never comes (twice: the one retry too), so kvgate
    answers 503. The undo queued with the 503 releases what Redis recorded; without it
    the capacity would be held by nobody until the TTL."""

    async def scenario() -> None:
        async with reply_dropping_relay(redis_server.port) as relay:
            led = RedisLedger(f"redis://127.0.0.1:{relay.port}/0", backends=["gpu-a"],
                              key_prefix="t", lease_ttl_s=60.0, socket_timeout_s=0.2)
            await led.start()
            admin = aioredis.Redis.from_url(redis_server.url)
            try:
                warm = lid()  # Redis caches the script, so the next EVALSHA runs it
                assert await led.reserve("gpu-a", warm, 10, 100)
                led.release(warm)
                await led.drain()
                # the undo may reach Redis before any read of ours (or only once replies
                # flow again): a keyspace event says the reserve ran
                await admin.config_set("notify-keyspace-events", "Kh")
                events = admin.pubsub()
                await events.subscribe(f"__keyspace@0__:{led.keys('gpu-a')[1]}")
                async with asyncio.timeout(5):  # subscribed before the reserve runs
                    while (await events.get_message(timeout=0.1) or {}).get("type") \
                            != "subscribe":
                        pass
                relay.drop_replies = True
                with pytest.raises(LedgerUnavailable):
                    await led.reserve("gpu-a", lid(), 40, 100)
                seen: list[bytes] = []
                async with asyncio.timeout(5):  # it did run
                    while b"hset" not in seen:
                        message = await events.get_message(ignore_subscribe_messages=True,
                                                           timeout=0.1)
                        if message is not None:
                            seen.append(message["data"])
                relay.drop_replies = False
                async with asyncio.timeout(5):
                    await led.drain()
                    while b"hdel" not in seen[seen.index(b"hset"):]:  # and the undo did
                        message = await events.get_message(ignore_subscribe_messages=True,
                                                           timeout=0.1)
                        if message is not None:
                            seen.append(message["data"])
                await events.aclose()  # type: ignore[no-untyped-call]
                assert await admin.get(led.keys("gpu-a")[0]) == b"0"
                assert await lease_fields(admin, led, "gpu-a") == []
            finally:
                relay.drop_replies = False
                await admin.aclose()
                await led.close()

    asyncio.run(scenario())


def test_redis_resize_during_a_known_outage_keeps_the_size_without_waiting(
    redis_server: RedisServer,
) -> None:
    """Once Redis is known to be down, a resize keeps the lease's size at once: the
    resize tick and dispatch must not each wait out a socket timeout per lease."""

    async def scenario() -> None:
        async with reply_dropping_relay(redis_server.port) as relay:
            led = RedisLedger(f"redis://127.0.0.1:{relay.port}/0", backends=["gpu-a"],
                              key_prefix="t", lease_ttl_s=60.0, socket_timeout_s=0.5)
            await led.start()
            try:
                lease = lid()
                assert await led.reserve("gpu-a", lease, 10, 100)
                relay.drop_replies = True
                with pytest.raises(LedgerUnavailable):
                    await led.reserve("gpu-a", lid(), 40, 100)
                assert not led.available
                async with asyncio.timeout(0.25):  # one round trip would take 0.5 s
                    assert await led.resize(lease, 50, 100) == 10
            finally:
                relay.drop_replies = False
                await led.close()

    asyncio.run(scenario())


def test_redis_refresh_pass_reclaims_expired_leases_within_ttl_plus_refresh(
    redis_server: RedisServer,
) -> None:
    """A lease nobody renews (its replica died) goes on the survivor's refresh schedule,
    not at its next renewal: the documented bound lease_ttl_s + refresh_interval_s. The
    survivor's own TTL is long, so it renews nothing during the test."""
    ttl_s, refresh_s = 2.0, 0.1

    async def scenario() -> None:
        async with started(redis_server, ttl=600.0, refresh=refresh_s) as survivor:
            # a replica reserved, then died: its lease is never renewed nor released
            admin = aioredis.Redis.from_url(redis_server.url)
            keys = survivor.keys("gpu-a")
            await admin.eval(RESERVE_LUA, len(keys), *keys, lid(), 500, 1000,  # type: ignore[misc]
                             int(ttl_s * 1000), "t:released", "gpu-a", survivor._epoch["gpu-a"],
                             0, "")
            reserved_at = time.monotonic()
            await admin.aclose()
            async with asyncio.timeout(ttl_s + 5):
                while await survivor.resident_now("gpu-a") != 0:
                    await asyncio.sleep(0.01)
            reclaimed_s = time.monotonic() - reserved_at
            assert survivor.resident("gpu-a") == 0
            assert reclaimed_s <= ttl_s + refresh_s + 0.5  # + one round trip and scheduling
            assert survivor.reclaimed_total == 1

    asyncio.run(scenario())


def test_redis_release_is_queued_and_drain_waits_until_redis_applied_it(
    redis_server: RedisServer,
) -> None:
    """What benchmarks/bench_ledger.py counts: a pair is done once its release is in Redis."""
    async def scenario() -> None:
        async with started(redis_server) as led:
            leases = [lid() for _ in range(200)]
            for lease in leases:
                assert await led.reserve("gpu-a", lease, 16, 10**9)
            for lease in leases:
                led.release(lease)
            assert await led.resident_now("gpu-a") > 0  # queued, not applied yet
            await led.drain()
            assert await led.resident_now("gpu-a") == 0

    asyncio.run(scenario())


def error_records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    """The ledger's log records whose exception (logged with its traceback) says `text`."""
    return [r for r in caplog.records if r.name == "kvgate.ledger" and r.exc_info
            and text in str(r.exc_info[1])]


def test_redis_a_listener_that_raises_stops_no_background_loop(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """A listener that raises (a bug in what wakes the waiters) killed whichever loop
    called it: the refresh pass on its first pass, the pub/sub listener on the first
    release notice, the worker once Redis was back after an outage; releases then never
    reached Redis and `drain()` hung. Each loop logs it, with its traceback, and goes on;
    a listener that raises on every call is logged once, not on every pass."""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")

    async def scenario() -> None:
        calls: list[str] = []

        def broken(backend: str) -> None:
            calls.append(backend)
            raise RuntimeError("a waiter's bug")

        led = ledger(redis_server, ttl=3.0, refresh=0.1, window=0.2)
        led.add_listener(broken)
        await led.start()
        admin = aioredis.Redis.from_url(redis_server.url)
        try:
            lease = lid()
            assert await led.reserve("gpu-a", lease, 30, 100)
            led.release(lease)  # a release notice for the pub/sub listener
            await led.drain()
            # the refresh pass: a lease nobody renews is reclaimed on its schedule
            keys = led.keys("gpu-a")
            await admin.eval(RESERVE_LUA, len(keys), *keys, lid(), 40, 100,  # type: ignore[misc]
                             300, "t:released", "gpu-a", led._epoch["gpu-a"], 0, "")
            async with asyncio.timeout(3):
                while await led.resident_now("gpu-a") != 0:
                    await asyncio.sleep(0.02)
            # the worker: Redis is back after an outage, which listeners are told
            await asyncio.to_thread(redis_server.stop)
            with pytest.raises(LedgerUnavailable):
                await led.reserve("gpu-a", lid(), 10, 100)
            await asyncio.to_thread(redis_server.start)
            async with asyncio.timeout(5):
                while not led.available:
                    await asyncio.sleep(0.02)
            lease = lid()
            assert await led.reserve("gpu-a", lease, 30, 100)
            led.release(lease)
            async with asyncio.timeout(5):
                await led.drain()
            assert await led.resident_now("gpu-a") == 0
            assert not any(task.done() for task in led._tasks)
            assert len(calls) > 10
            assert len(error_records(caplog, "a waiter's bug")) == 1
        finally:
            await admin.aclose()
            await led.close()

    asyncio.run(scenario())


def test_redis_an_unexpected_error_stops_neither_the_worker_nor_the_refresh_pass(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Anything else either loop may raise (a reply misread, a bug): the worker logs it,
    drops that batch (the same bug would fail it again, so no retry loop) and runs the
    next, so later releases still reach Redis; the refresh pass logs it and runs its next
    pass on schedule, one per interval, not in a spin."""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")

    async def scenario() -> None:
        async with started(redis_server, refresh=0.1) as led:
            upkeep = led._upkeep
            doomed, kept = lid(), lid()
            assert await led.reserve("gpu-a", doomed, 30, 100)
            assert await led.reserve("gpu-a", kept, 40, 100)
            real_batch = upkeep._run_batch
            passes = 0

            async def failing_batch(batch: Any, *args: Any) -> Any:
                if any(lease == doomed for _, _, lease in batch):
                    raise RuntimeError("a batch's bug")
                return await real_batch(batch, *args)

            async def failing_pass() -> None:
                nonlocal passes
                passes += 1
                raise RuntimeError("a pass's bug")

            upkeep._run_batch = failing_batch  # type: ignore[method-assign]
            upkeep._reclaim_expired = failing_pass  # type: ignore[method-assign]
            led.release(doomed)
            async with asyncio.timeout(5):
                await led.drain()
            led.release(kept)
            async with asyncio.timeout(5):
                await led.drain()
            # the failed batch is dropped: Redis holds its lease until the TTL
            assert await led.resident_now("gpu-a") == 30
            await asyncio.sleep(1.0)
            assert 5 <= passes <= 15
            assert not any(task.done() for task in led._tasks)
            assert len(error_records(caplog, "a batch's bug")) == 1
            assert len(error_records(caplog, "a pass's bug")) == 1

    asyncio.run(scenario())


def ledger_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvgate.ledger" and r.levelno >= logging.ERROR]


def test_redis_an_error_reply_for_one_release_holds_up_no_other(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """A key of gpu-a holds the wrong type (another program wrote it), so every script
    on gpu-a gets a WRONGTYPE error reply. That is no outage: the worker retried the
    whole batch forever as "UNREACHABLE", gpu-b's release beside it never ran and
    `drain()` hung. The refused release is logged (what, which lease, which backend,
    the reply) and not retried, the replica counts it released, gpu-b goes on, and a
    reserve on gpu-a gets a 503 that says Redis refused it. Once the key is repaired,
    the refresh pass reconciles: the lease Redis kept gets one TTL, then is reclaimed."""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")

    async def scenario() -> None:
        async with started(redis_server, ttl=1.5, refresh=0.1) as led:
            admin = aioredis.Redis.from_url(redis_server.url)
            try:
                a1, b1 = lid(), lid()
                assert await led.reserve("gpu-a", a1, 30, 100)
                assert await led.reserve("gpu-b", b1, 40, 100)
                expiry = led.keys("gpu-a")[2]
                await admin.delete(expiry)
                await admin.set(expiry, "not a zset")
                led.release(a1)
                led.release(b1)
                async with asyncio.timeout(5):
                    await led.drain()
                assert await led.resident_now("gpu-b") == 0
                assert await led.resident_now("gpu-a") == 30  # refused: Redis keeps it
                assert led.resident("gpu-a") == 0 and led.lease_count("gpu-a") == 0
                refused = [m for m in ledger_errors(caplog) if a1 in m]
                assert refused, ledger_errors(caplog)
                assert "release" in refused[0] and "gpu-a" in refused[0]
                assert "WRONGTYPE" in refused[0]
                assert led.available
                assert await led.reserve("gpu-b", lid(), 50, 100)
                with pytest.raises(LedgerUnavailable, match="refused the reserve"):
                    await led.reserve("gpu-a", lid(), 10, 100)
                assert not any("UNREACHABLE" in r.getMessage() for r in caplog.records)
                await admin.delete(expiry)  # repaired
                async with asyncio.timeout(5):
                    while await led.resident_now("gpu-a") != 0:
                        await asyncio.sleep(0.05)
                assert led.available
            finally:
                await admin.aclose()

    asyncio.run(scenario())


def test_redis_a_script_lost_between_its_check_and_its_run_is_loaded_and_run_again(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline checks its scripts are loaded, then runs them; a script cache emptied in
    between (a SCRIPT FLUSH, a failover) answers NOSCRIPT for each op. The next pipeline
    fixes that by loading the scripts first, so the worker's release and the refresh
    pass's reclaim are each sent once more at once: no outage, no error logged. (The
    flush cannot be timed between the two with a real server, so the check is skipped
    once for the release's pipeline and once for a refresh pass's.)"""
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")
    real_load = Pipeline.load_scripts
    skipped: set[str] = set()

    async def scenario() -> None:
        async with started(redis_server, refresh=0.1) as led:
            lease = lid()
            assert await led.reserve("gpu-a", lease, 30, 100)
            reclaim_sha = led._upkeep._reclaim.sha

            async def load_scripts_late(self: Pipeline) -> None:
                sent = {str(arg) for args, _ in self.command_stack for arg in args}
                which = "release" if lease in sent else "reclaim" if reclaim_sha in sent \
                    else ""
                if which and which not in skipped:
                    skipped.add(which)  # as if the cache went after the check
                    return
                await real_load(self)

            admin = aioredis.Redis.from_url(redis_server.url)
            await admin.script_flush()
            await admin.aclose()
            monkeypatch.setattr(Pipeline, "load_scripts", load_scripts_late)
            led.release(lease)
            async with asyncio.timeout(5):
                await led.drain()
                while skipped != {"release", "reclaim"}:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # a few passes more
            assert await led.resident_now("gpu-a") == 0
            assert led.available
            assert not any("UNREACHABLE" in r.getMessage() for r in caplog.records)
            assert ledger_errors(caplog) == []

    asyncio.run(scenario())


def test_redis_a_pass_read_before_a_release_does_not_undo_it(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`release()` counts the lease released here at once and only queues its script.
    A refresh pass Redis answered just before (its reply not yet taken in) still holds
    the lease: taken in as it was read, it put the 30 tokens back into this replica's
    view. Each value read from Redis is taken less what was released here since its
    command was sent. (The pass's reply is held here until the release has been sent;
    on a loaded machine the scheduler does that by itself.)"""
    real_execute = Pipeline.execute
    answered, go_on = asyncio.Event(), asyncio.Event()
    held: list[str] = []

    async def scenario() -> None:
        async with started(redis_server, refresh=30.0) as led:
            lease = lid()
            assert await led.reserve("gpu-a", lease, 30, 100)
            reclaim_sha = led._upkeep._reclaim.sha

            async def execute_held(self: Pipeline, raise_on_error: bool = True) -> Any:
                sent = {str(arg) for args, _ in self.command_stack for arg in args}
                results = await real_execute(self, raise_on_error=raise_on_error)
                if reclaim_sha in sent and not held:
                    held.append("reclaim")
                    answered.set()
                    await go_on.wait()
                return results

            monkeypatch.setattr(Pipeline, "execute", execute_held)
            async with asyncio.timeout(5):
                passing = asyncio.create_task(led._upkeep._reclaim_expired())
                await answered.wait()  # Redis read 30 resident for gpu-a
                led.release(lease)
                assert led.resident("gpu-a") == 0
                await led.drain()
                assert await led.resident_now("gpu-a") == 0
                go_on.set()
                await passing
            assert held == ["reclaim"]
            assert led.resident("gpu-a") == 0  # not the 30 the pass read
            assert await led.reserve("gpu-a", lid(), 20, 100)
            assert led.resident("gpu-a") == 20

    asyncio.run(scenario())
