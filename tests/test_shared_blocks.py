"""Shared prefix blocks in the ledgers: each block held by live leases is charged once.

The model is the engine's (vLLM v1's block pool): a full block keyed by its tokens and
all before it, held once however many running requests use it. The property tests run
random lease sets over a few shared prefixes against both ledgers (the Redis one
against a real redis-server) and check after every step that the ledger's resident
equals what an engine would hold for the live leases, and never passes capacity.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from proxy.errors import LedgerUnavailable
from proxy.ledger import Ledger, MemoryLedger
from proxy.redis_ledger import RedisLedger
from tests.support.redis_server import RedisServer
from tests.support.tcp_tap import reply_dropping_relay

BT = 16  # tokens per block


def key(group: int, i: int) -> str:
    return f"{group:08x}{i:08x}"


@dataclass
class Held:
    tokens: int
    refs: list[str]  # the blocks it references, as the model says it must
    extra: int  # blocks paid for in full because they were not ready


def engine_resident(held: dict[str, Held]) -> int:
    """What the engine holds: each lease's own tokens, each referenced block once."""
    own = sum(h.tokens - BT * len(h.refs) for h in held.values())
    return own + BT * len({k for h in held.values() for k in h.refs})


def test_memory_ledger_charges_a_shared_block_once_and_frees_it_with_its_last_holder() -> None:
    led = MemoryLedger()
    blocks = [key(1, i) for i in range(4)]  # a 64-token system prompt
    # the first holder pays all: 4 blocks + 36 of its own
    assert led.reserve_now("a", "l1", 100, 1000, blocks, BT)
    assert led.resident("a") == 100 and led.shared_tokens("l1") == 0
    # not ready yet: a second one pays its own copy in full
    assert led.reserve_now("a", "l2", 100, 1000, blocks, BT)
    assert led.resident("a") == 200 and led.shared_tokens("l2") == 0
    assert led.ready_blocks("a", blocks) == 0
    led.mark_ready("l1")  # l1's engine answered: its blocks are cached there
    assert led.ready_blocks("a", blocks) == 4 and led.ready_blocks("b", blocks) == 0
    assert led.reserve_now("a", "l3", 100, 1000, blocks, BT)
    assert led.resident("a") == 236 and led.shared_tokens("l3") == 64
    assert led.shared_resident("a") == 64
    led.release("l1")  # l3 still references the blocks: they stay, charged once
    assert led.resident("a") == 200 and led.shared_resident("a") == 64
    led.release("l3")
    assert led.resident("a") == 100 and led.shared_resident("a") == 0
    led.release("l2")
    assert led.resident("a") == 0


def test_memory_ledger_refuses_what_does_not_fit_after_sharing() -> None:
    led = MemoryLedger()
    blocks = [key(2, i) for i in range(6)]  # 96 shared tokens
    assert led.reserve_now("a", "l1", 120, 200, blocks, BT)
    led.mark_ready("l1")
    # 120 more would not fit unshared (240 > 200); sharing 96 it adds 24
    assert led.reserve_now("a", "l2", 120, 200, blocks, BT)
    assert led.resident("a") == 144
    assert not led.reserve_now("a", "l3", 120, 200, blocks[:2], BT)  # adds 88: 232 > 200
    # a resize moves only what a lease holds outside its shared blocks
    assert led.resize_now("l2", 10, 200) == 96  # never below its referenced blocks
    assert led.resident("a") == 120
    with pytest.raises(ValueError):
        led.reserve_now("a", "l4", 10, 200, blocks, BT)  # blocks bigger than the lease


async def _random_walk(led: Ledger, backends: list[str], steps: int, seed: int) -> None:
    """Random reserves, resizes, readiness and releases over 3 shared prefixes per
    backend; the ledger must agree with the engine's count after every step."""
    rng = random.Random(seed)
    capacity = 2_000
    held: dict[str, dict[str, Held]] = {b: {} for b in backends}
    lease_backend: dict[str, str] = {}
    ready: dict[str, set[str]] = {b: set() for b in backends}
    ready_leases: set[str] = set()
    for _ in range(steps):
        b = rng.choice(backends)
        live = held[b]
        action = rng.random()
        if action < 0.45 or not live:
            group, n = rng.randrange(3), rng.randrange(0, 9)
            blocks = [key(group, i) for i in range(n)]
            tokens = BT * n + rng.randrange(1, 200)
            refs = [k for k in blocks
                    if k in ready[b] or not any(k in h.refs for h in live.values())]
            lease = uuid.uuid4().hex
            fits = (engine_resident(live) + tokens
                    - BT * sum(1 for k in blocks if k in ready[b]) <= capacity)
            got = await led.reserve(b, lease, tokens, capacity, blocks, BT)
            assert got == fits, (got, fits)
            if got:
                live[lease] = Held(tokens, refs, len(blocks) - len(refs))
                lease_backend[lease] = b
        elif action < 0.6:
            lease = rng.choice(list(live))
            led.mark_ready(lease)
            ready[b].update(live[lease].refs)
            ready_leases.add(lease)
        elif action < 0.75:
            lease = rng.choice(list(live))
            h = live[lease]
            wanted = max(BT * len(h.refs), h.tokens + rng.randrange(-100, 200))
            free = capacity - engine_resident(live)
            expect = wanted if wanted <= h.tokens else min(wanted, h.tokens + max(0, free))
            assert await led.resize(lease, wanted, capacity) == expect
            h.tokens = expect
        else:
            lease = rng.choice(list(live))
            led.release(lease)
            del live[lease]
            still = {k for h in live.values() for k in h.refs}
            ready[b] &= still
        if isinstance(led, RedisLedger):
            # Redis holds the truth; the replica's own figure is its last view of it (a
            # release notice read late may leave it behind until the next reply)
            await led.drain()
            assert await led.resident_now(b) == engine_resident(live) <= capacity
        else:
            assert led.resident(b) == engine_resident(live) <= capacity
        assert led.shared_resident(b) == BT * len({k for h in live.values() for k in h.refs})
    for b in backends:
        for lease in list(held[b]):
            led.release(lease)
        assert led.resident(b) == 0 and led.shared_resident(b) == 0


@pytest.mark.parametrize("seed", range(5))
def test_memory_ledger_matches_the_engine_over_random_lease_sets(seed: int) -> None:
    asyncio.run(_random_walk(MemoryLedger(), ["a", "b"], 600, seed))


@pytest.mark.parametrize("seed", range(2))
def test_redis_ledger_matches_the_engine_over_random_lease_sets(
    redis_server: RedisServer, seed: int,
) -> None:
    async def scenario() -> None:
        led = RedisLedger(redis_server.url, backends=["a", "b"], key_prefix="s",
                          recovery_window_s=0)
        await led.start()
        try:
            await _random_walk(led, ["a", "b"], 300, seed)
            await led.drain()
            admin = aioredis.Redis.from_url(redis_server.url)
            for b in ("a", "b"):
                keys = led.keys(b)
                assert await admin.get(keys[0]) == b"0"
                assert await admin.hlen(keys[3]) == 0  # every refcount back to zero
                assert await admin.scard(keys[4]) == 0
            await admin.aclose()
        finally:
            await led.close()

    asyncio.run(scenario())


def test_redis_ledger_replicas_share_blocks_and_rebuild_them_after_a_restart(
    redis_server: RedisServer,
) -> None:
    """Two replicas: a block one registered and marked ready is shared by the other;
    after Redis loses everything, re-registration restores the refs, counted once."""
    blocks = [key(7, i) for i in range(4)]

    async def scenario() -> None:
        leds = [RedisLedger(redis_server.url, backends=["a"], key_prefix="r",
                            refresh_interval_s=0.1, recovery_window_s=0.3) for _ in range(2)]
        for led in leds:
            await led.start()
        try:
            one, two = leds
            assert await one.reserve("a", "x1", 100, 1000, blocks, BT)
            one.mark_ready("x1")
            await one.drain()
            assert await two.reserve("a", "x2", 100, 1000, blocks, BT)
            assert two.shared_tokens("x2") == 64
            assert await two.resident_now("a") == 136
            redis_server.restart()  # no persistence: every key is gone
            async with asyncio.timeout(10):
                while True:
                    try:
                        if await two.reserve("a", "x3", 10, 1000):
                            break
                    except LedgerUnavailable:  # refused while it rebuilds
                        pass
                    await asyncio.sleep(0.1)
            await one.drain()
            await two.drain()
            assert await two.resident_now("a") == 146  # 36 + 36 + 64 once + 10
            for lease, led in (("x1", one), ("x2", two), ("x3", two)):
                led.release(lease)
            await one.drain()
            await two.drain()
            assert await one.resident_now("a") == 0
        finally:
            for led in leds:
                await led.close()

    asyncio.run(scenario())


def test_redis_reserve_retried_after_a_lost_reply_records_the_blocks_redis_recorded(
    redis_server: RedisServer,
) -> None:
    """The reserve's first reply is lost and redis-py's one retry gets "already recorded"
    back. The lease brought 6 blocks, 4 of them registered by another lease but not
    ready (paid in full, not referenced), so Redis recorded it with 68 own tokens and 2
    referenced blocks. The replica must record the same 2, or a same-size resize writes
    an own size of 4 and Redis' resident drops from 200 to 136 while both still run."""
    blocks = [key(9, i) for i in range(6)]

    async def scenario() -> None:
        async with reply_dropping_relay(redis_server.port) as relay:
            # a 30 s refresh pass: nothing else runs through the relay while it drops
            led = RedisLedger(f"redis://127.0.0.1:{relay.port}/0", backends=["a"],
                              key_prefix="s", lease_ttl_s=60.0, refresh_interval_s=30.0,
                              socket_timeout_s=0.5, recovery_window_s=0)
            await led.start()
            admin = aioredis.Redis.from_url(redis_server.url)
            keys = led.keys("a")
            try:
                first, retried = "first-1", "retried-1"
                assert await led.reserve("a", first, 100, 1000, blocks[:4], BT)  # not ready
                await admin.config_set("notify-keyspace-events", "Kh")
                events = admin.pubsub()
                await events.subscribe(f"__keyspace@0__:{keys[1]}")
                async with asyncio.timeout(5):
                    while (await events.get_message(timeout=0.1) or {}).get("type") \
                            != "subscribe":
                        pass
                relay.drop_replies = True
                reserving = asyncio.create_task(
                    led.reserve("a", retried, 100, 1000, blocks, BT))
                async with asyncio.timeout(5):  # the first run recorded it
                    while (await events.get_message(ignore_subscribe_messages=True,
                                                    timeout=0.1) or {}).get("data") != b"hset":
                        pass
                await asyncio.sleep(0.05)  # its reply is swallowed; the retry's comes
                relay.drop_replies = False
                await events.aclose()  # type: ignore[no-untyped-call]
                assert await reserving is True
                assert await admin.hget(keys[1], retried) == b"68"
                assert await led.resident_now("a") == 200
                assert led.shared_tokens(retried) == 0  # not recorded: unknown on a retry
                assert await led.resize(retried, 100, 1000) == 100
                assert await led.resident_now("a") == 200  # the same size stays the same
                assert led.shared_resident("a") == BT * 6
                led.release(first)  # the 4 blocks were the first lease's alone
                await led.drain()
                assert await led.resident_now("a") == 100
                assert led.shared_resident("a") == BT * 2
                assert led.ready_blocks("a", blocks[4:]) == 0
                led.release(retried)
                await led.drain()
                assert await led.resident_now("a") == 0
                assert await admin.hlen(keys[3]) == 0
                assert led.shared_resident("a") == 0
            finally:
                relay.drop_replies = False
                await admin.aclose()
                await led.close()

    asyncio.run(scenario())
