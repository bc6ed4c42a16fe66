"""Shared prefix blocks in the ledgers: each block held by live leases is charged once.

The model is the engine's (vLLM v1's block pool): a full block keyed by its tokens and
all before it, held once however many running requests use it. The property tests run
random lease sets over a few shared prefixes against both ledgers (the Redis one
against a real redis-server) and check after every step that the ledger's resident
equals what an engine would hold for the live leases, and never passes capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from policies.ordering import Fifo
from policies.placement import PlacementName, seed_score
from proxy.admission import AdmissionController, Backend, Demand, Lease, ReleaseRate
from proxy.errors import KvgateError, LedgerUnavailable
from proxy.ledger import Ledger, MemoryLedger
from proxy.prefix_view import PrefixView
from proxy.recent_blocks import RecentBlocks
from proxy.redis_ledger import RedisLedger
from proxy.waiting_room import SPILL_AFTER
from tests.support.redis_server import RedisServer, block_fields
from tests.support.tcp_tap import reply_dropping_relay
from tests.test_admission import busy_releases

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


def test_memory_ledger_charges_a_key_repeated_in_one_lease_once() -> None:
    """No hash chain repeats a key, but the ledger takes them as opaque: a key twice in
    one lease is one block, whether the keys come as a tuple (a demand's) or a list."""
    for kind in (tuple, list):
        led = MemoryLedger()
        blocks = kind([key(3, 0), key(3, 1), key(3, 0)])
        assert led.reserve_now("a", "l1", 100, 1000, blocks, BT)
        assert led.shared_resident("a") == 2 * BT and led.resident("a") == 100
        led.mark_ready("l1")
        assert led.reserve_now("a", "l2", 100, 1000, blocks, BT)
        assert led.shared_tokens("l2") == 2 * BT and led.resident("a") == 200 - 2 * BT
        led.release("l1")
        led.release("l2")
        assert led.resident("a") == 0 and led.shared_resident("a") == 0
        assert led.ready_blocks("a", blocks) == 0


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


def test_memory_ledger_registers_late_keys_only_where_none_is_held() -> None:
    """A lease reserved without its keys (admitted on a bound of its prompt) registers
    them once counted: as new blocks where none is held, charged once from then on and
    shared once it answers; where one is held, it references none and pays in full."""
    led = MemoryLedger()
    blocks = [key(4, i) for i in range(4)]
    assert led.reserve_now("a", "bound", 100, 1000)  # no keys: its whole prompt
    assert led.attach_now("bound", blocks, BT) == 4
    assert led.resident("a") == 100 and led.shared_resident("a") == 4 * BT  # same charge
    assert led.attach_now("bound", blocks, BT) == 0  # once
    assert led.ready_blocks("a", blocks) == 0
    led.mark_ready("bound")
    assert led.reserve_now("a", "joiner", 100, 1000, blocks, BT)
    assert led.shared_tokens("joiner") == 4 * BT and led.resident("a") == 136
    # another late one: the blocks are held, so it keeps paying for its own copy
    assert led.reserve_now("a", "late", 100, 1000)
    assert led.attach_now("late", blocks, BT) == 0 and led.resident("a") == 236
    with pytest.raises(ValueError):
        led.attach_now("late", [key(5, i) for i in range(7)], BT)  # more than it spans
    for lease in ("bound", "joiner", "late"):
        led.release(lease)
    assert led.resident("a") == 0 and led.shared_resident("a") == 0
    assert led.ready_blocks("a", blocks) == 0
    assert led.attach_now("bound", blocks, BT) == 0  # released: nothing to do


async def _random_walk(led: Ledger, backends: list[str], steps: int, seed: int) -> None:
    """Random reserves, resizes, readiness and releases over 3 shared prefixes per
    backend, a quarter of the reserves without keys that come later (`attach`: a lease
    admitted on a bound of its prompt); the ledger must agree with the engine's count
    after every step."""
    rng = random.Random(seed)
    capacity = 2_000
    held: dict[str, dict[str, Held]] = {b: {} for b in backends}
    lease_backend: dict[str, str] = {}
    ready: dict[str, set[str]] = {b: set() for b in backends}
    ready_leases: set[str] = set()
    late: dict[str, list[str]] = {}  # reserved without their keys, not attached yet
    for _ in range(steps):
        b = rng.choice(backends)
        live = held[b]
        action = rng.random()
        waiting = [lease for lease in live if lease in late]
        if waiting and action < 0.2:
            lease = rng.choice(waiting)
            blocks = late.pop(lease)
            # registered only where none is held on the backend: new there, charged
            # once, through it; else it references none and keeps paying in full
            held_now = {k for h in live.values() for k in h.refs}
            refs = blocks if blocks and blocks[0] not in held_now else []
            assert await led.attach(lease, blocks, BT) == len(refs)
            live[lease].refs = list(refs)
            live[lease].extra = len(blocks) - len(refs)
        elif rng.random() < 0.25 and (action < 0.45 or not live):
            group, n = rng.randrange(3), rng.randrange(0, 9)
            tokens = BT * n + rng.randrange(1, 200)
            lease = uuid.uuid4().hex
            fits = engine_resident(live) + tokens <= capacity
            got = await led.reserve(b, lease, tokens, capacity)
            assert got == fits, (got, fits)
            if got:
                live[lease] = Held(tokens, [], 0)
                lease_backend[lease] = b
                late[lease] = [key(group, i) for i in range(n)]
        elif action < 0.45 or not live:
            group, n = rng.randrange(3), rng.randrange(0, 9)
            blocks = [key(group, i) for i in range(n)]
            tokens = BT * n + rng.randrange(1, 200)
            # the leading run held ready; past it, the rest if nobody holds its first
            # key, else none (paid in full)
            run = next((i for i, k in enumerate(blocks) if k not in ready[b]), len(blocks))
            held_now = {k for h in live.values() for k in h.refs}
            refs = blocks[:run] + (blocks[run:] if run < len(blocks)
                                   and blocks[run] not in held_now else [])
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
            # (a lease waiting for its keys spans its whole prompt, them included)
            wanted = max(BT * len(h.refs), BT * len(late.get(lease, [])) + 1,
                         h.tokens + rng.randrange(-100, 200))
            free = capacity - engine_resident(live)
            expect = wanted if wanted <= h.tokens else min(wanted, h.tokens + max(0, free))
            assert await led.resize(lease, wanted, capacity) == expect
            h.tokens = expect
        else:
            lease = rng.choice(list(live))
            led.release(lease)
            del live[lease]
            late.pop(lease, None)
            assert await led.attach(lease, [key(0, 0)], BT) == 0  # gone: nothing to do
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
                # every refcount back to zero
                assert block_fields(await admin.hkeys(keys[3])) == []
                assert await admin.scard(keys[4]) == 0
            await admin.aclose()
        finally:
            await led.close()

    asyncio.run(scenario())


def test_redis_refs_hash_is_a_hash_table_and_its_extra_field_is_never_charged(
    redis_server: RedisServer,
) -> None:
    """A backend's refs hash holds its one extra field from its first block on, so Redis
    keeps it a hash table, never a listpack scanned field by field; the field counts
    for nothing when the resident counter is recomputed from the leases."""
    async def scenario() -> None:
        led = RedisLedger(redis_server.url, backends=["a"], key_prefix="w",
                          recovery_window_s=0)
        await led.start()
        admin = aioredis.Redis.from_url(redis_server.url)
        try:
            keys = led.keys("a")
            blocks = [key(7, i) for i in range(4)]
            assert await led.reserve("a", "l1", 100, 1000, blocks, BT)
            assert await admin.object("ENCODING", keys[3]) == b"hashtable"
            assert sorted(block_fields(await admin.hkeys(keys[3]))) == [
                b.encode() for b in blocks]
            await admin.delete(keys[0])  # the counter lost: recomputed from the leases
            assert await led.reserve("a", "l2", 10, 1000)
            assert await led.resident_now("a") == 110
            led.release("l1")
            led.release("l2")
            await led.drain()
            assert await led.resident_now("a") == 0
            assert block_fields(await admin.hkeys(keys[3])) == []
            await admin.delete(keys[0])
            assert await led.reserve("a", "l3", 10, 1000)
            assert await led.resident_now("a") == 10  # the extra field alone holds nothing
        finally:
            await admin.aclose()
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


# ------------------------------------------------------------------ placement's figures
# Dispatch reads, per waiter and backend, how much of its prefix is held ready there and
# how much more is probably cached (`proxy.prefix_view`), remembered between passes. A
# remembered figure must always be the one a fresh scan gives.


class ScanEveryCall(PrefixView):
    """Never remembers: every figure scanned again, as dispatch did before."""

    def held(self, backend: Backend, demand: Demand | None,
             owner: object | None = None) -> tuple[int, int]:
        return super().held(backend, demand, None)


def sharing_controller(ledger: Ledger, capacities: list[int], *,
                       placement: PlacementName = PlacementName.BEST_FIT,
                       starvation_s: float = 5.0,
                       on_event: Callable[[str, Lease | None], None] | None = None,
                       ) -> AdmissionController:
    bs = [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}", capacity_tokens=cap)
          for i, cap in enumerate(capacities)]
    c = AdmissionController(model="m", backends=bs, ledger=ledger, ordering=Fifo(),
                            placement=placement, max_queue_depth=64, on_event=on_event,
                            starvation_s=starvation_s)
    for b in bs:
        c.set_shares_prefixes(b, True)
    # no deadline predictions: what is refused must not hang on the clock
    c.release_rate = ReleaseRate(min_busy_releases=10**9)
    return c


def prefixed(tokens: int, blocks: list[str], **kw: object) -> Demand:
    prompt = BT * len(blocks) + 1
    return Demand(tokens=tokens, prompt_tokens=prompt, max_tokens=tokens - prompt,
                  blocks=tuple(blocks), block_tokens=BT, **kw)  # type: ignore[arg-type]


async def settle(c: AdmissionController) -> None:
    for _ in range(3):
        await asyncio.sleep(0)
        await c.drain()


def test_a_prefix_that_becomes_ready_between_two_passes_is_seen_by_the_second() -> None:
    """W does not fit anywhere while A's prefix on b0 is not ready (a pass remembers
    that it shares nothing there); A's answer readies it, and the next pass places W on
    b0 for only what it does not share."""
    prefix = [key(3, i) for i in range(20)]  # 320 tokens

    async def scenario() -> None:
        c = sharing_controller(MemoryLedger(), [1000, 1000])
        a = await c.try_acquire(prefixed(700, prefix))
        f = await c.try_acquire(demand_plain(700))
        assert a is not None and f is not None
        assert (a.backend.name, f.backend.name) == ("b0", "b1")
        w = asyncio.ensure_future(c.acquire(prefixed(400, [*prefix, key(4, 0)]), soon()))
        await settle(c)
        assert c.queue_depth == 1 and c.prefixes.remembered == 1  # a pass ran, remembered
        a.answered()  # b0 holds the prefix ready now: W costs 80 there, 300 are free
        await settle(c)
        lease = await asyncio.wait_for(w, 1)
        assert (lease.backend.name, lease.shared_tokens) == ("b0", 320)
        assert c.prefixes.remembered == 0
        for held in (lease, a, f):
            held.release()

    asyncio.run(scenario())


def test_a_prefix_released_between_two_passes_is_not_counted_by_the_second() -> None:
    """A pass remembers that W shares A's ready prefix on b0 (W fits nowhere then).
    A and F leave at once; b0 now only probably caches the prefix: W would cost its
    whole 400 there, too full for the prefix to hold it, so least-resident sends it to
    the emptied b1. A figure still counting the prefix as shared would have kept W
    on b0 (its fill after 0.62, within 0.25 of b1's 0.40; the true one is 0.70)."""
    prefix = [key(5, i) for i in range(20)]

    async def scenario() -> None:
        c = sharing_controller(MemoryLedger(), [4000, 1000],
                               placement=PlacementName.LEAST_RESIDENT)
        a = await c.try_acquire(prefixed(1550, prefix))
        assert a is not None and a.backend.name == "b0"
        a.answered()
        held = await c.try_acquire(demand_plain(2400))
        f = await c.try_acquire(demand_plain(700))
        assert held is not None and f is not None
        assert (held.backend.name, f.backend.name) == ("b0", "b1")  # free: 50 and 300
        w = asyncio.ensure_future(c.acquire(prefixed(400, [*prefix, key(6, 0)]), soon()))
        await settle(c)
        assert c.queue_depth == 1 and c.prefixes.remembered == 1
        b0 = c.backends[0]
        assert c.prefixes.held(b0, prefixed(400, [*prefix, key(6, 0)])) == (320, 0)
        a.release()  # its last holder: the prefix leaves b0's ready blocks
        f.release()
        await settle(c)
        lease = await asyncio.wait_for(w, 1)
        assert (lease.backend.name, lease.shared_tokens) == ("b1", 0)
        for x in (lease, held):
            x.release()

    asyncio.run(scenario())


def test_a_newcomer_is_judged_at_arrival_on_what_it_adds_where_its_prefix_lives() -> None:
    """The queue drains at 400 tokens/s; b0 holds A's 320-token prefix ready and has 50
    tokens free, b1 none; a 500-token waiter is ahead (1.125 s). A 400-token newcomer
    with that prefix adds 80 on b0: 1.325 s, within its 1.8 s, so it waits and is placed
    on b0 when room opens there, charged 80. The same 400 tokens without the prefix
    would wait 2.125 s: refused at once, as predicted to miss its deadline."""
    prefix = [key(7, i) for i in range(20)]

    async def scenario() -> None:
        ledger = MemoryLedger()
        c = sharing_controller(ledger, [1000, 1000])
        loop = asyncio.get_running_loop()
        clock = [loop.time()]
        busy_releases(c, clock, 400)
        clock[0] += 1.0
        a = await c.try_acquire(prefixed(700, prefix))
        filler = await c.try_acquire(demand_plain(250))
        hog = await c.try_acquire(demand_plain(1000))
        assert a is not None and filler is not None and hog is not None
        assert [x.backend.name for x in (a, filler, hog)] == ["b0", "b0", "b1"]
        a.answered()
        ahead = asyncio.ensure_future(c.acquire(demand_plain(500), loop.time() + 10))
        await settle(c)
        with pytest.raises(KvgateError) as late:
            await c.acquire(demand_plain(400), loop.time() + 1.8)
        assert late.value.reason == "queue_timeout_predicted"
        assert "predicted to wait 2125 ms more" in late.value.message
        turn = asyncio.ensure_future(
            c.acquire(prefixed(400, [*prefix, key(8, 0)]), loop.time() + 1.8))
        await settle(c)
        assert not turn.done() and c.queue_depth == 2
        filler.release()  # b0: 300 free, the waiter ahead still does not fit
        await settle(c)
        lease = await asyncio.wait_for(turn, 1)
        assert (lease.backend.name, lease.shared_tokens) == ("b0", 320)
        assert ledger.resident("b0") == 700 + 80
        for x in (lease, a, hog):
            x.release()
        (await asyncio.wait_for(ahead, 1)).release()

    asyncio.run(scenario())


def test_the_drain_rate_counts_what_releases_free_shared_blocks_once() -> None:
    """A holds a 320-token prefix (700 charged), B shares it (80 charged): the ledger
    held 780 and the two releases free 780, not the 1,100 the two leases span. The
    drain rate predicted waits are read from is in the tokens demands are judged on
    (what they add), so it counts 780."""
    prefix = [key(9, i) for i in range(20)]

    async def scenario() -> None:
        ledger = MemoryLedger()
        c = sharing_controller(ledger, [1000])
        clock = [0.0]
        c.release_rate = ReleaseRate(window_s=30, clock=lambda: clock[0], min_busy_releases=2)
        a = await c.try_acquire(prefixed(700, prefix))
        assert a is not None
        a.answered()
        b = await c.try_acquire(prefixed(400, [*prefix, key(10, 0)]))
        assert b is not None and (b.tokens, b.shared_tokens) == (400, 320)
        assert ledger.resident("b0") == 780
        c.release_rate.set_busy(True)
        clock[0] = 0.5
        b.release()
        a.release()
        clock[0] = 1.0
        assert ledger.resident("b0") == 0
        assert c.release_rate.busy_tokens_per_s() == pytest.approx(780)

    asyncio.run(scenario())


def demand_plain(tokens: int) -> Demand:
    return Demand(tokens=tokens, prompt_tokens=tokens // 2, max_tokens=tokens - tokens // 2)


def soon(seconds: float = 60.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def _prefix_walk(c: AdmissionController, steps: int, seed: int,
                       check: bool = True) -> None:
    """Random arrivals, answers, releases, cancellations, sharing switched off and on,
    over 3 shared prefixes; after every step, each waiter's remembered figures on every
    backend must be a fresh scan's."""
    rng = random.Random(seed)
    live: list[Lease] = []
    tasks: list[asyncio.Task[None]] = []
    n = 0

    async def arrive(d: Demand) -> None:
        with contextlib.suppress(KvgateError):
            live.append(await c.acquire(d, soon()))

    for _ in range(steps):
        action = rng.random()
        if action < 0.4 or not live:
            group, shared = rng.randrange(3), rng.randrange(0, 16)
            blocks = [key(group, i) for i in range(shared)]
            blocks += [key(1000 + n, i) for i in range(rng.randrange(0, 3))]
            n += 1
            tasks.append(asyncio.ensure_future(arrive(prefixed(
                BT * len(blocks) + rng.randrange(1, 200), blocks, tenant=f"d{n}"))))
        elif action < 0.6:
            rng.choice(live).answered()
        elif action < 0.85:
            live.pop(rng.randrange(len(live))).release()
        elif action < 0.95:
            waiting = [t for t in tasks if not t.done()]
            if waiting:
                rng.choice(waiting).cancel()
        else:
            b = rng.choice(c.backends)
            c.set_shares_prefixes(b, not b.shares_prefixes)
        await settle(c)
        if check:
            for w in c._room:
                for b in c.backends:
                    assert c.prefixes.held(b, w.demand, w) == c.prefixes.held(b, w.demand)
            assert c.prefixes.remembered <= c.queue_depth
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for lease in live:
        lease.release()
    assert c.prefixes.remembered == 0


@pytest.mark.parametrize("seed", range(4))
def test_remembered_prefix_figures_are_always_a_fresh_scans(seed: int) -> None:
    asyncio.run(_prefix_walk(sharing_controller(MemoryLedger(), [900, 700, 500]), 400, seed))


def test_remembered_prefix_figures_hold_over_the_redis_ledger(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        led = RedisLedger(redis_server.url, backends=["b0", "b1", "b2"], key_prefix="pv",
                          recovery_window_s=0)
        await led.start()
        try:
            await _prefix_walk(sharing_controller(led, [900, 700, 500]), 200, 11)
        finally:
            await led.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(3))
def test_remembering_the_figures_changes_no_decision(seed: int) -> None:
    """The same random run twice, figures remembered and scanned on every call: every
    admission on the same backend, with the same tokens shared."""
    def run(view: type[PrefixView]) -> list[tuple[str, str, int]]:
        admitted: list[tuple[str, str, int]] = []

        def record(kind: str, lease: Lease | None) -> None:
            if kind == "admit" and lease is not None:
                admitted.append((lease.demand.tenant, lease.backend.name,
                                 lease.shared_tokens))

        async def scenario() -> None:
            ledger = MemoryLedger()
            c = sharing_controller(ledger, [900, 700, 500], on_event=record)
            c.prefixes = view(ledger)
            await _prefix_walk(c, 400, seed, check=False)

        asyncio.run(scenario())
        return admitted

    remembered = run(PrefixView)
    assert len(remembered) > 100
    assert remembered == run(ScanEveryCall)


def test_recent_blocks_say_which_keys_came_in_or_were_evicted() -> None:
    """What a remembered `cached` figure must be forgotten for."""
    recent = RecentBlocks(capacity_blocks=3)
    assert recent.remember(["a", "b"]) == ["a", "b"]
    assert recent.remember(["a"]) == []  # only its order moved: `leading` answers alike
    assert recent.remember(["c", "d"]) == ["c", "d", "b"]  # b, the least recent, left
    assert recent.leading(["a", "c", "d", "b"]) == 3


class _ReferenceLru:
    """The LRU `RecentBlocks` models, written plainly: move or insert each key, then
    evict the least recent past the capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[str, None] = OrderedDict()

    def remember(self, keys: list[str]) -> list[str]:
        moved = []
        for k in keys:
            if k in self.keys:
                self.keys.move_to_end(k)
            else:
                self.keys[k] = None
                moved.append(k)
        while len(self.keys) > self.capacity:
            moved.append(self.keys.popitem(last=False)[0])
        return moved


@pytest.mark.parametrize("seed", range(3))
def test_recent_blocks_are_an_exact_lru_over_random_releases(seed: int) -> None:
    """Evictions, keys remembered again (a hot prefix, enough to compact the order many
    times), repeats within one call: the same keys come and go, in the same order."""
    rng = random.Random(seed)
    for capacity in (0, 1, 7, 50, 300, 10_000):
        recent, reference = RecentBlocks(capacity), _ReferenceLru(capacity)
        hot = [f"h{i}" for i in range(20)]
        for step in range(3000):
            keys = hot[:rng.randrange(len(hot))] if rng.random() < 0.6 else []
            keys += [f"k{rng.randrange(400)}" for _ in range(rng.randrange(0, 8))]
            if rng.random() < 0.3:
                keys = list(dict.fromkeys(keys))  # all new, as a unique prompt's
            assert recent.remember(tuple(keys)) == reference.remember(keys), step
            assert len(recent) == len(reference.keys)
            probe = [rng.choice([*hot, "k1", "k2", "nope"]) for _ in range(4)]
            assert recent.leading(probe) == sum(
                1 for _ in itertools.takewhile(reference.keys.__contains__, probe))
        # new keys to the capacity evict every old one, least recent first
        fresh = [f"z{i}" for i in range(capacity)]
        for at in range(0, capacity, 64):
            chunk = tuple(fresh[at:at + 64])
            assert recent.remember(chunk) == reference.remember(list(chunk))
        assert len(recent) == len(reference.keys)


def test_redis_reserve_retried_after_a_lost_reply_records_the_blocks_redis_recorded(
    redis_server: RedisServer,
) -> None:
    """The reserve's first reply is lost and redis-py's one retry gets "already recorded"
    back. The lease brought 6 blocks: the first 2 held ready by one lease, the next 2
    registered by another but not ready (paid in full, not referenced, with the 2
    after them), so Redis recorded it with 68 own tokens and 2 referenced blocks. The
    replica must record the same 2, or a same-size resize writes an own size of 4 and
    Redis' resident drops from 236 to 172 while all three still run."""
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
                ready, first, retried = "ready-1", "first-1", "retried-1"
                assert await led.reserve("a", ready, 100, 1000, blocks[:2], BT)
                led.mark_ready(ready)
                await led.drain()
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
                assert await led.resident_now("a") == 236  # 100 + 68 + 68
                assert led.shared_tokens(retried) == 0  # not recorded: unknown on a retry
                assert await led.resize(retried, 100, 1000) == 100
                assert await led.resident_now("a") == 236  # the same size stays the same
                assert led.shared_resident("a") == BT * 4
                led.release(first)  # blocks 3 and 4 were its alone
                await led.drain()
                assert await led.resident_now("a") == 168
                assert led.shared_resident("a") == BT * 2
                assert led.ready_blocks("a", blocks[2:]) == 0
                led.release(ready)  # the retried lease still references blocks 1 and 2
                await led.drain()
                assert await led.resident_now("a") == 100
                assert led.shared_resident("a") == BT * 2
                led.release(retried)
                await led.drain()
                assert await led.resident_now("a") == 0
                assert block_fields(await admin.hkeys(keys[3])) == []
                assert led.shared_resident("a") == 0
            finally:
                relay.drop_replies = False
                await admin.aclose()
                await led.close()

    asyncio.run(scenario())


def test_the_cache_model_evicts_a_released_prompts_tail_first_as_the_engine_does() -> None:
    """vLLM v1 frees a request's blocks tail first (and `kvgate sim`, `proxy.sim.kv_cache`):
    under pressure the private tail goes, the shared head stays. A model that evicted the
    head first would say the whole prefix gone (a prefix hit reads leading blocks only).
    The model keeps one key per 128 tokens (every 8th 16-token block)."""
    a_keys = [key(7, i) for i in range(40)]
    b_keys = [key(8, i) for i in range(40)]

    async def scenario() -> None:
        c = sharing_controller(MemoryLedger(), [60 * BT])  # room for 7 modelled keys
        backend = c.backends[0]
        for keys in (a_keys, b_keys):  # one after the other, each answered
            lease = await c.try_acquire(prefixed(40 * BT + 1, keys))
            assert lease is not None
            lease.answered()
            lease.release()
        # 10 modelled keys released into 7: A's last 3 went (blocks 39, 31, 23), so its
        # first 16 blocks are still cached
        assert c.prefixes.held(backend, prefixed(40 * BT + 1, a_keys)) == (0, 16 * BT)
        assert c.prefixes.held(backend, prefixed(40 * BT + 1, b_keys)) == (0, 40 * BT)

    asyncio.run(scenario())


@pytest.mark.parametrize("block_tokens", [16, 32, 128, 256])
def test_the_cache_model_counts_whole_strides_of_128_tokens(block_tokens: int) -> None:
    """One modelled key per 128 tokens (every block where blocks are that large): a
    cached figure ends at the last modelled key of the run, from the first one at or
    past the ready blocks; blocks past the prompt's last modelled key are not counted."""
    stride = max(1, 128 // block_tokens)
    blocks = [key(9, i) for i in range(5 * stride + stride // 2)]
    prompt = block_tokens * len(blocks) + 1

    def demand(keys: list[str]) -> Demand:
        return Demand(tokens=prompt + 16, prompt_tokens=prompt, max_tokens=16,
                      blocks=tuple(keys), block_tokens=block_tokens)

    async def scenario() -> None:
        c = sharing_controller(MemoryLedger(), [100 * prompt])
        backend = c.backends[0]
        lease = await c.try_acquire(demand(blocks))
        assert lease is not None
        lease.answered()
        lease.release()
        assert c.prefixes.held(backend, demand(blocks)) == (0, 5 * stride * block_tokens)
        # a prompt that leaves at its 3rd modelled block: the first 2 strides cached
        other = [*blocks[:3 * stride - 1], key(10, 0), *blocks[3 * stride:]]
        assert c.prefixes.held(backend, demand(other)) == (0, 2 * stride * block_tokens)
        # part of it ready on a live lease: cached counts on from there
        ready = await c.try_acquire(demand(blocks[:stride + 1]))
        assert ready is not None
        ready.answered()
        held = c.prefixes.held(backend, demand(blocks))
        assert held == ((stride + 1) * block_tokens, (5 * stride - stride - 1) * block_tokens)
        ready.release()

    asyncio.run(scenario())


def seeded_on(backend: str, backends: list[str], blocks: int) -> list[str]:
    """A prefix of `blocks` blocks that placement seeds on `backend` (held nowhere yet,
    all backends alike)."""
    for g in itertools.count(1000):
        prefix = [key(g, i) for i in range(blocks)]
        seed = PrefixView.seed_key(prefixed(BT * blocks + 100, prefix))
        assert seed is not None
        if max(backends, key=lambda b: seed_score(seed, b)) == backend:
            return prefix
    raise AssertionError("unreachable")


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_requests_that_bring_a_prefix_still_in_prefill_follow_it_there(
    kind: str, request: pytest.FixtureRequest,
) -> None:
    """A's prefix is seeded on b0 and A has not answered yet: nothing is ready anywhere.
    B brings the same prefix; by load alone it would go to b1 (b0 at 33%, b1 empty, and
    the least-resident policy), and by seeding too (b0 is more than 25% of its pool
    fuller after B). It goes to b0, where its engine will hit A's blocks, and is
    charged in full there (they are not ready). With b1 as loaded by a prompt that
    shares nothing, C, a new prefix whose rendezvous picks b0, is seeded on b1: b0 is
    home to A's prefix, b1 to none."""
    prefix = seeded_on("b0", ["b0", "b1"], 40)  # its seed block (the 32nd) is in it
    other = next(p for p in ([key(g, i) for i in range(40)] for g in itertools.count(2000))
                 if max(("b0", "b1"), key=lambda b, p=p: seed_score(p[31], b)) == "b0")
    # (C's rendezvous alone would pick b0 as well)

    async def scenario() -> None:
        ledger: Ledger
        if kind == "memory":
            ledger = MemoryLedger()
        else:
            server = request.getfixturevalue("redis_server")
            ledger = RedisLedger(server.url, backends=["b0", "b1"], key_prefix="pf",
                                 recovery_window_s=0)
        await ledger.start()
        try:
            c = sharing_controller(ledger, [3000, 3000],
                                   placement=PlacementName.LEAST_RESIDENT)
            a = await c.try_acquire(prefixed(1000, prefix))
            assert a is not None and a.backend.name == "b0"
            b = await c.try_acquire(prefixed(1000, [*prefix, key(8, 0)]))
            assert b is not None
            assert (b.backend.name, b.shared_tokens) == ("b0", 0)
            assert ledger.resident("b0") == 2000
            filler = await c.try_acquire(demand_plain(2000))
            assert filler is not None and filler.backend.name == "b1"
            cc = await c.try_acquire(prefixed(700, other))
            assert cc is not None and cc.backend.name == "b1"
            a.answered()
            for held in (a, b, filler, cc):
                held.release()
            if isinstance(ledger, RedisLedger):
                await ledger.drain()
                assert [await ledger.resident_now(n) for n in ("b0", "b1")] == [0, 0]
            assert [ledger.resident(n) for n in ("b0", "b1")] == [0, 0]
            assert not ledger.holds("b0", prefix[-1])
        finally:
            await ledger.close()

    asyncio.run(scenario())


def test_a_waiter_holds_out_for_its_prefix_s_backend_and_takes_it_when_room_opens() -> None:
    """b0 holds W's 320-token prefix ready but is full (95%); b1 could take W whole and
    is not clearly less loaded (75%). W waits rather than hold a second copy on b1, and takes
    b0 for what it does not share as soon as a lease there ends."""
    prefix = seeded_on("b0", ["b0", "b1"], 20)

    async def scenario() -> None:
        c = sharing_controller(MemoryLedger(), [2000, 2000])
        a = await c.try_acquire(prefixed(700, prefix))
        assert a is not None and a.backend.name == "b0"
        a.answered()
        filler = await c.try_acquire(demand_plain(1250))  # b0: 1,950 of 2,000
        busy = await c.try_acquire(demand_plain(1500))  # b1: 1,500, fits W's whole 400
        assert filler is not None and busy is not None
        assert (filler.backend.name, busy.backend.name) == ("b0", "b1")
        w = asyncio.ensure_future(c.acquire(prefixed(400, [*prefix, key(8, 0)]), soon()))
        await settle(c)
        assert c.queue_depth == 1  # b0 would charge it 80; b1 400 and a second prefix
        filler.release()
        await settle(c)
        lease = await asyncio.wait_for(w, 1)
        assert (lease.backend.name, lease.shared_tokens) == ("b0", 320)
        for held in (lease, a, busy):
            held.release()

    asyncio.run(scenario())


def test_a_waiter_held_out_for_its_prefix_s_backend_spills_after_a_third_of_its_wait() -> None:
    """The same W, but nothing ends on b0: a third of the way to its deadline it goes
    to b1, where there was room all along, with no other event to wake the queue."""
    prefix = seeded_on("b0", ["b0", "b1"], 20)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        c = sharing_controller(MemoryLedger(), [2000, 2000])
        a = await c.try_acquire(prefixed(700, prefix))
        assert a is not None
        a.answered()
        filler = await c.try_acquire(demand_plain(1250))
        busy = await c.try_acquire(demand_plain(1500))
        assert filler is not None and busy is not None
        assert (filler.backend.name, busy.backend.name) == ("b0", "b1")
        start = loop.time()
        lease = await c.acquire(prefixed(400, [*prefix, key(10, 0)]), soon(0.9))
        waited = loop.time() - start
        assert (lease.backend.name, lease.shared_tokens) == ("b1", 0)
        assert SPILL_AFTER * 0.9 - 0.01 <= waited < 0.9
        for held in (lease, a, filler, busy):
            held.release()
        assert c.queue_depth == 0 and all(c._ledger.resident(b.name) == 0 for b in c.backends)

    asyncio.run(scenario())


def test_a_starving_waiter_held_out_for_its_prefix_s_backend_holds_up_nobody() -> None:
    """Past `starvation_s` a waiter holds the queue's next room. W, held out for b0 (its
    prefix's backend, full) while b1 has room, must not: X behind it, which fits b1, is
    admitted at once rather than at W's spill time (3 s). W still takes b0 when room
    opens there."""
    prefix = seeded_on("b0", ["b0", "b1"], 20)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        c = sharing_controller(MemoryLedger(), [2000, 2000], starvation_s=0.2)
        a = await c.try_acquire(prefixed(700, prefix))
        assert a is not None and a.backend.name == "b0"
        a.answered()
        filler = await c.try_acquire(demand_plain(1250))  # b0: 1,950 of 2,000
        busy = await c.try_acquire(demand_plain(1500))  # b1: 1,500
        assert filler is not None and busy is not None
        w = asyncio.ensure_future(c.acquire(prefixed(400, [*prefix, key(11, 0)]), soon(9)))
        await asyncio.sleep(0.3)
        assert not w.done() and c.queue_depth == 1  # held out for b0, starving now
        start = loop.time()
        x = await asyncio.wait_for(c.acquire(demand_plain(300), soon(9)), 1)
        assert x.backend.name == "b1" and loop.time() - start < 0.1
        assert not w.done()
        filler.release()
        lease = await asyncio.wait_for(w, 1)
        assert (lease.backend.name, lease.shared_tokens) == ("b0", 320)
        for held in (lease, a, busy, x):
            held.release()
        assert c.queue_depth == 0 and all(c._ledger.resident(b.name) == 0 for b in c.backends)

    asyncio.run(scenario())


def test_a_group_s_requests_from_two_replicas_seed_its_prefix_on_one_backend() -> None:
    """Eight groups' first requests arrive (nothing answered, so nothing is shared yet)
    at two replicas that know nothing of each other: each group's requests all go to
    one backend, the same from both replicas, and the groups spread over the backends
    (best-fit alone sends every group's first ones to the first backend with room)."""
    groups = [[key(100 + g, i) for i in range(40)] for g in range(8)]  # 640 tokens each

    async def scenario() -> None:
        replicas = [sharing_controller(MemoryLedger(), [100_000] * 4) for _ in range(2)]
        where: dict[int, set[str]] = {g: set() for g in range(8)}
        leases = []
        for _round in range(3):
            for g, prefix in enumerate(groups):
                for c in replicas:
                    lease = await c.try_acquire(prefixed(900, [*prefix, key(200, len(leases))]))
                    assert lease is not None
                    leases.append(lease)
                    where[g].add(lease.backend.name)
        assert all(len(backends) == 1 for backends in where.values()), where
        homes = [next(iter(backends)) for backends in where.values()]
        assert len(set(homes)) >= 3, homes
        for lease in leases:
            lease.release()

    asyncio.run(scenario())


# ------------------------------------------------------------------ across replicas
# A replica places by where prefixes live; those another replica's leases hold reach it
# through the mirror of Redis' ready sets (`proxy.prefix_mirror`).


async def _until(check: Callable[[], bool], timeout_s: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        assert loop.time() < end, "not within the time allowed"
        await asyncio.sleep(0.01)


def _replica(server: RedisServer, prefix: str, mirror_s: float) -> RedisLedger:
    return RedisLedger(server.url, backends=["b0", "b1"], key_prefix=prefix,
                       recovery_window_s=0, refresh_interval_s=0.05,
                       prefix_mirror_interval_s=mirror_s)


def test_a_replica_sees_the_prefixes_another_replica_holds_ready(
    redis_server: RedisServer,
) -> None:
    """A's lease on b0 answers with a 320-token prefix: B, which holds nothing, reads it
    ready there within a mirror interval (and is told so), counts its blocks among
    b0's shared ones, and sees it go when A releases it. With the mirror off it never
    sees it."""
    blocks = [key(30, i) for i in range(20)]

    async def scenario() -> None:
        a, b, off = (_replica(redis_server, "mx", s) for s in (0.05, 0.05, 0.0))
        told: list[str] = []
        b.add_prefix_listener(told.append)
        for led in (a, b, off):
            await led.start()
        try:
            assert await a.reserve("b0", "la", 400, 2000, blocks, BT)
            await asyncio.sleep(0.2)  # registered, not ready: placement waits for it
            assert b.ready_blocks("b0", blocks) == 0 and "b0" not in told
            a.mark_ready("la")
            await a.drain()
            await _until(lambda: "b0" in told)
            assert b.ready_blocks("b0", blocks) == 20
            assert b.ready_blocks("b0", [*blocks[:5], key(31, 0)]) == 5
            assert b.ready_blocks("b1", blocks) == 0
            assert b.holds("b0", blocks[-1]) and not b.holds("b1", blocks[-1])
            assert b.shared_resident("b0") == 320 and b.shared_resident("b1") == 0
            assert off.ready_blocks("b0", blocks) == 0 and off.shared_resident("b0") == 0
            told.clear()
            a.release("la")
            await a.drain()
            await _until(lambda: "b0" in told)
            assert b.ready_blocks("b0", blocks) == 0 and b.shared_resident("b0") == 0
            assert not b.holds("b0", blocks[0])
        finally:
            for led in (a, b, off):
                await led.close()

    asyncio.run(scenario())


def test_a_replica_places_a_prefix_where_another_replica_holds_it(
    redis_server: RedisServer,
) -> None:
    """A group's prefix lives on b0, through replica A, though its rendezvous seed is
    b1. Replica B's request of the group goes to b0 and is charged only what it does
    not share; with the mirror off, B seeds a second copy on b1 and pays it whole."""
    prefix = seeded_on("b1", ["b0", "b1"], 40)  # 640 tokens

    async def scenario(mirror_s: float, name: str) -> tuple[str, int]:
        a, b = _replica(redis_server, name, 0.05), _replica(redis_server, name, mirror_s)
        for led in (a, b):
            await led.start()
        try:
            assert await a.reserve("b0", "la", 1000, 4000, prefix, BT)
            a.mark_ready("la")
            await a.drain()
            c = sharing_controller(b, [4000, 4000], placement=PlacementName.LEAST_RESIDENT)
            await _until(lambda: b.resident("b0") == 1000)  # B's view of A's reserve
            await asyncio.sleep(3 * max(mirror_s, 0.05))
            lease = await c.try_acquire(prefixed(900, [*prefix, key(32, 0)]))
            assert lease is not None
            where = (lease.backend.name, lease.shared_tokens)
            lease.release()
            a.release("la")
            for led in (a, b):  # both releases in Redis before it is read
                await led.drain()
            for led in (a, b):
                assert [await led.resident_now(n) for n in ("b0", "b1")] == [0, 0]
            return where
        finally:
            for led in (a, b):
                await led.close()

    assert asyncio.run(scenario(0.05, "pa")) == ("b0", 640)
    assert asyncio.run(scenario(0.0, "pb")) == ("b1", 0)


def test_a_waiter_takes_the_prefix_another_replica_readies(
    redis_server: RedisServer,
) -> None:
    """W, on replica B, fits nowhere whole (b0 600 free, b1 500) and shares nothing
    yet: it waits. Replica A's lease on b0 answers with W's 320-token prefix; B's
    mirror learns it, forgets W's remembered figures for b0 and runs dispatch: W takes
    b0 for the 300 tokens it does not share, long before its deadline."""
    prefix = [key(33, i) for i in range(20)]

    async def scenario() -> None:
        a, b = _replica(redis_server, "pw", 0.05), _replica(redis_server, "pw", 0.05)
        for led in (a, b):
            await led.start()
        try:
            assert await a.reserve("b0", "f0", 1000, 2000)
            assert await a.reserve("b1", "f1", 1500, 2000)
            assert await a.reserve("b0", "la", 400, 2000, prefix, BT)  # b0: 1,400
            c = sharing_controller(b, [2000, 2000])
            await _until(lambda: (b.resident("b0"), b.resident("b1")) == (1400, 1500))
            w = asyncio.ensure_future(c.acquire(prefixed(620, [*prefix, key(34, 0)]), soon(10)))
            await asyncio.sleep(0.3)
            assert not w.done() and c.queue_depth == 1 and c.prefixes.remembered == 1
            a.mark_ready("la")
            lease = await asyncio.wait_for(w, 2)
            assert (lease.backend.name, lease.shared_tokens) == ("b0", 320)
            assert await b.resident_now("b0") == 1700
            lease.release()
            for lease_id in ("f0", "f1", "la"):
                a.release(lease_id)
            for led in (a, b):
                await led.drain()
            assert [await a.resident_now(n) for n in ("b0", "b1")] == [0, 0]
        finally:
            for led in (a, b):
                await led.close()

    asyncio.run(scenario())


def test_a_mirror_reply_it_cannot_read_is_logged_once_and_the_last_read_stands(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Something else wrote b1's block size as text: B's mirror (A's is off) logs it
    once, keeps what it last read of b0 (A's ready prefix), and reads on once the
    field is whole."""
    blocks = [key(35, i) for i in range(8)]

    async def scenario() -> None:
        a, b = _replica(redis_server, "mb", 0.0), _replica(redis_server, "mb", 0.05)
        told: list[str] = []
        b.add_prefix_listener(told.append)
        for led in (a, b):
            await led.start()
        admin = aioredis.Redis.from_url(redis_server.url)
        try:
            assert await a.reserve("b0", "la", 200, 2000, blocks, BT)
            a.mark_ready("la")
            await a.drain()
            await _until(lambda: b.ready_blocks("b0", blocks) == 8)
            await admin.hset(b.keys("b1")[1], "=bt", "sixteen")
            a.release("la")
            await a.drain()
            await asyncio.sleep(0.5)  # ten passes, each failing
            failures = [r for r in caplog.records if "prefixes failed" in r.getMessage()]
            assert len(failures) == 1
            assert b.ready_blocks("b0", blocks) == 8 and told == ["b0"]
            await admin.hset(b.keys("b1")[1], "=bt", "16")
            await _until(lambda: b.ready_blocks("b0", blocks) == 0)
            assert told == ["b0", "b0"]
        finally:
            await admin.aclose()
            for led in (a, b):
                await led.close()

    asyncio.run(scenario())
