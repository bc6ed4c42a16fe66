"""The admission core without sockets: ledger, queue, deadlines, policies, contract."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

import proxy.errors as errors_module
from policies.ordering import Fifo, PriorityFairShare, ShortestFirst, WaiterView, make_ordering
from policies.output import OutputPolicy, OutputPolicyName, decide_output
from policies.placement import BackendRoom, PlacementName, rank_backends
from proxy.admission import AdmissionController, Backend, Demand, ReleaseRate
from proxy.errors import (
    ERROR_TABLE,
    ContextLengthExceeded,
    KvgateError,
    NoBackend,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
)
from proxy.ledger import MemoryLedger


def controller(
    capacity: int = 100, *, backends: int = 1, depth: int = 8, starvation_s: float = 5.0,
    ordering: str = "fifo",
) -> tuple[AdmissionController, MemoryLedger]:
    ledger = MemoryLedger()
    bs = [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}", capacity_tokens=capacity)
          for i in range(backends)]
    return AdmissionController(model="m", backends=bs, ledger=ledger,
                               ordering=make_ordering(ordering), max_queue_depth=depth,
                               starvation_s=starvation_s), ledger


def demand(tokens: int, **kw: object) -> Demand:
    return Demand(tokens=tokens, prompt_tokens=tokens // 2, max_tokens=tokens - tokens // 2,
                  **kw)  # type: ignore[arg-type]


def soon(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


# ------------------------------------------------------------------ ledger


def test_reserve_over_capacity_returns_false() -> None:
    ledger = MemoryLedger()
    assert ledger.reserve_now("a", "l1", 60, 100) is True
    assert ledger.reserve_now("a", "l2", 41, 100) is False
    assert ledger.reserve_now("a", "l3", 40, 100) is True
    assert ledger.resident("a") == 100
    assert ledger.lease_count("a") == 2


def test_release_twice_is_noop() -> None:
    ledger = MemoryLedger()
    ledger.reserve_now("a", "l1", 60, 100)
    ledger.release("l1")
    ledger.release("l1")
    assert ledger.resident("a") == 0
    with pytest.raises(ValueError, match="already recorded"):
        ledger.reserve_now("a", "l2", 1, 100)
        ledger.reserve_now("a", "l2", 1, 100)


# ------------------------------------------------------------------ acquire


def test_acquire_admits_at_once_and_release_returns_capacity() -> None:
    async def scenario() -> None:
        c, ledger = controller()
        lease = await c.acquire(demand(60), soon())
        assert ledger.resident("b0") == 60
        lease.release()
        lease.release()
        assert ledger.resident("b0") == 0
        assert c.backends[0].inflight == 0

    asyncio.run(scenario())


def test_waiter_admitted_when_capacity_released() -> None:
    async def scenario() -> None:
        c, ledger = controller()
        first = await c.acquire(demand(80), soon())
        waiting = asyncio.create_task(c.acquire(demand(50), soon()))
        await asyncio.sleep(0.01)
        assert c.queue_depth == 1 and not waiting.done()
        first.release()
        second = await asyncio.wait_for(waiting, 1)
        assert ledger.resident("b0") == 50
        second.release()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_waiter_deadline_passed_raises_queue_timeout() -> None:
    async def scenario() -> None:
        c, ledger = controller()
        held = await c.acquire(demand(80), soon())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(QueueTimeout, match=r"waited \d+ ms for 50 tokens") as info:
            await c.acquire(demand(50), loop.time() + 0.1)
        assert 0.1 <= loop.time() - t0 < 0.2
        assert info.value.status == 429
        assert "Retry-After" in info.value.headers()
        assert c.queue_depth == 0
        held.release()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_queue_full_rejects_with_retry_after() -> None:
    async def scenario() -> None:
        c, _ = controller(depth=2)
        held = await c.acquire(demand(100), soon())
        waiters = [asyncio.create_task(c.acquire(demand(10), soon())) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match=r"full \(2 waiting\)") as info:
            await c.acquire(demand(10), soon())
        headers = info.value.headers()
        assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1
        held.release()
        for lease in await asyncio.gather(*waiters):
            lease.release()

    asyncio.run(scenario())


def test_demand_larger_than_any_backend_is_request_too_large() -> None:
    async def scenario() -> None:
        c, _ = controller(capacity=100)
        with pytest.raises(RequestTooLarge, match="exceeds the largest backend capacity 100"):
            await c.acquire(demand(101), soon())

    asyncio.run(scenario())


def test_no_healthy_backend_is_no_backend() -> None:
    async def scenario() -> None:
        c, _ = controller()
        c.set_healthy(c.backends[0], False)
        with pytest.raises(NoBackend):
            await c.acquire(demand(1), soon())

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_queue_and_holds_nothing() -> None:
    async def scenario() -> None:
        c, ledger = controller()
        held = await c.acquire(demand(100), soon())
        task = asyncio.create_task(c.acquire(demand(30), soon()))
        await asyncio.sleep(0.01)
        assert c.queue_depth == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert c.queue_depth == 0
        held.release()
        await c.drain()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_grant_racing_cancel_is_released() -> None:
    async def scenario() -> None:
        c, ledger = controller()
        held = await c.acquire(demand(100), soon())
        task = asyncio.create_task(c.acquire(demand(30), soon()))
        await asyncio.sleep(0.01)
        held.release()  # schedules a dispatch that grants the waiter...
        await asyncio.sleep(0)  # ...which runs now, resolving its future
        task.cancel()  # the client leaves before the waiter resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.drain()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_small_requests_backfill_past_a_big_head_until_it_starves() -> None:
    async def scenario() -> None:
        c, ledger = controller(capacity=100, starvation_s=0.2)
        held = [await c.acquire(demand(40), soon()), await c.acquire(demand(40), soon())]
        big = asyncio.create_task(c.acquire(demand(90), soon()))
        await asyncio.sleep(0.01)
        small = await asyncio.wait_for(c.acquire(demand(20), soon()), 1)  # backfills
        assert not big.done()
        small.release()
        await asyncio.sleep(0.25)  # the big head now starves: nobody passes it
        blocked = asyncio.create_task(c.acquire(demand(20), soon()))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        for lease in held:
            lease.release()
        big_lease = await asyncio.wait_for(big, 1)
        assert not blocked.done()
        big_lease.release()
        (await asyncio.wait_for(blocked, 1)).release()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_a_starving_head_above_the_admission_target_does_not_hold_the_queue() -> None:
    """The target (engine feedback, cold start) can sit below a demand that fits the
    capacity: such a head cannot be placed until the target loosens, so it must not
    stop smaller requests from passing meanwhile."""
    async def scenario() -> None:
        c, ledger = controller(capacity=1000, starvation_s=0.05)
        c.set_target_factor(c.backends[0], 0.75)
        big = asyncio.create_task(c.acquire(demand(800), soon(2)))
        await asyncio.sleep(0.1)  # starving now
        small = await asyncio.wait_for(c.acquire(demand(10), soon(2)), 1)
        assert not big.done()
        small.release()
        c.set_target_factor(c.backends[0], 1.0)
        c.kick()
        (await asyncio.wait_for(big, 1)).release()
        assert ledger.resident("b0") == 0

    asyncio.run(scenario())


def test_a_starving_head_waiting_for_a_slot_holds_the_queue() -> None:
    """Only a waiter held out for its prefix's backend lets others pass once it starves
    (`tests/test_shared_blocks.py`). A plain head that waits for b0's one llama.cpp
    slot (room enough there, the slot busy; b1 too full for it) holds the next room: a
    small request that fits b1 waits behind it."""
    async def scenario() -> None:
        ledger = MemoryLedger()
        bs = [Backend(name="b0", url="http://127.0.0.1:9000", capacity_tokens=1000, slots=1),
              Backend(name="b1", url="http://127.0.0.1:9001", capacity_tokens=1000)]
        c = AdmissionController(model="m", backends=bs, ledger=ledger,
                                ordering=make_ordering("fifo"), max_queue_depth=8,
                                starvation_s=0.05)
        busy = await c.acquire(demand(100), soon())  # b0's one slot
        filler = await c.acquire(demand(800), soon())  # no slot on b0: b1
        assert (busy.backend.name, filler.backend.name) == ("b0", "b1")
        big = asyncio.create_task(c.acquire(demand(500), soon()))
        await asyncio.sleep(0.1)  # starving now, before its spill time (1.7 s)
        small = asyncio.create_task(c.acquire(demand(100), soon()))
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done()
        busy.release()
        big_lease = await asyncio.wait_for(big, 1)
        small_lease = await asyncio.wait_for(small, 1)
        assert (big_lease.backend.name, small_lease.backend.name) == ("b0", "b1")
        for lease in (big_lease, small_lease, filler):
            lease.release()
        assert ledger.resident("b0") == ledger.resident("b1") == 0

    asyncio.run(scenario())


def test_best_fit_packs_and_spreads_over_backends() -> None:
    async def scenario() -> None:
        c, ledger = controller(capacity=100, backends=2)
        a = await c.acquire(demand(60), soon())
        b = await c.acquire(demand(30), soon())  # best fit: same backend, 10 left there
        assert a.backend is b.backend
        d = await c.acquire(demand(50), soon())  # does not fit there: the other one
        assert d.backend is not a.backend
        for lease in (a, b, d):
            lease.release()
        assert ledger.resident("b0") == ledger.resident("b1") == 0

    asyncio.run(scenario())


# ------------------------------------------------------------------ policies


def view(seq: int, arrival: float, tokens: int, priority: str = "", tenant: str = "") -> WaiterView:
    return WaiterView(seq=seq, arrival=arrival, demand_tokens=tokens, priority=priority,
                      tenant=tenant)


def test_fifo_orders_by_arrival() -> None:
    waiters = [view(2, 0, 10), view(0, 0, 900), view(1, 0, 5)]
    assert [w.seq for w in sorted(waiters, key=lambda w: Fifo().key(w, 0))] == [0, 1, 2]


def test_shortest_first_ages_long_requests_ahead() -> None:
    policy = ShortestFirst(aging_tokens_per_s=1000)
    old_big = view(0, arrival=0.0, tokens=30_000)
    new_small = view(1, arrival=19.5, tokens=1_000)
    # at 20 s: small ranks 1000 - 500 = 500, big 30000 - 20000 = 10000
    assert policy.key(new_small, 20.0) < policy.key(old_big, 20.0)
    # after 31 s the big one ranks as -1000 tokens: ahead of any fresh 1,000-token request
    assert policy.key(old_big, 31.0) < policy.key(view(2, 31.0, 1_000), 31.0)


def test_priority_classes_then_weighted_fair_share() -> None:
    policy = PriorityFairShare(weights={"gold": 2.0})
    assert policy.key(view(5, 0, 10, "high", "x"), 0) < policy.key(view(1, 0, 10, "low", "x"), 0)
    policy.on_admit(view(0, 0, 1000, "normal", "gold"), 0)  # 500 weighted
    policy.on_admit(view(1, 0, 1000, "normal", "free"), 0)  # 1000 weighted
    assert policy.key(view(2, 0, 10, "normal", "gold"), 0) < policy.key(
        view(3, 0, 10, "normal", "free"), 0
    )


def test_fair_share_usage_decays_with_the_half_life() -> None:
    policy = PriorityFairShare(half_life_s=60.0)
    policy.on_admit(view(0, 0, 100, tenant="b"), 0.0)
    policy.on_admit(view(1, 0, 1000, tenant="a"), 0.0)  # starts at b's 100: 1100
    assert policy.usage("a", 60.0) == pytest.approx(550.0)
    assert policy.usage("a", 120.0) == pytest.approx(275.0)
    assert policy.key(view(2, 0, 10, tenant="b"), 0.0) < policy.key(
        view(3, 0, 10, tenant="a"), 0.0)
    # heavy use long ago weighs less than light use now: at 600 s a's 1100 is ~1.1,
    # b's 100 is ~0.1 and b's new 100 counts whole (without decay: 1100 vs 200)
    policy.on_admit(view(4, 600, 100, tenant="b"), 600.0)
    assert policy.usage("b", 600.0) == pytest.approx(100.1, abs=0.01)
    assert policy.key(view(5, 600, 10, tenant="a"), 600.0) < policy.key(
        view(6, 600, 10, tenant="b"), 600.0)


def test_fair_share_new_tenant_starts_at_the_least_usage_not_zero() -> None:
    """A fresh tenant name per request must not jump ahead of the lightest tenant."""
    policy = PriorityFairShare(half_life_s=60.0)
    policy.on_admit(view(0, 0, 400, tenant="light"), 0.0)
    policy.on_admit(view(1, 0, 1000, tenant="heavy"), 0.0)  # 400 + 1000
    assert policy.usage("fresh-1", 0.0) == pytest.approx(400.0)
    light = view(2, 0, 10, tenant="light")
    churner = view(3, 0, 10, tenant="fresh-2")
    assert policy.key(light, 0.0) < policy.key(churner, 0.0)  # tie on usage; arrival decides
    policy.on_admit(churner, 0.0)
    assert policy.usage("fresh-2", 0.0) == pytest.approx(410.0)


def test_fair_share_forgets_the_lightest_half_beyond_max_tenants() -> None:
    policy = PriorityFairShare(max_tenants=8)
    for i in range(9):
        policy.on_admit(view(i, 0, 100 * (i + 1), tenant=f"t{i}"), 0.0)
    # t0 = 100, then each starts at that least: t_i = 100 + 100 (i + 1)
    assert policy.usage("t8", 0.0) == pytest.approx(1000.0)
    # the ninth tenant drops t0..t3; t0 comes back at the least kept (t4 = 600)
    assert policy.usage("t0", 0.0) == pytest.approx(600.0)


def test_admission_without_queueing_is_charged_to_the_tenant() -> None:
    async def scenario() -> None:
        ctl, _ = controller(1000, ordering="priority")
        lease = await ctl.acquire(demand(100, tenant="fast"), soon())
        lease.release()
        policy = ctl._ordering
        assert isinstance(policy, PriorityFairShare)
        assert policy.usage("fast", asyncio.get_running_loop().time()) == pytest.approx(
            100.0, rel=1e-3)

    asyncio.run(scenario())


def test_unknown_ordering_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown ordering 'lifo'; expected one of"):
        make_ordering("lifo")


def test_output_policies() -> None:
    fill = OutputPolicy(name=OutputPolicyName.FILL)
    assert decide_output(fill, requested=None, engine_default=8000).max_tokens == 8000
    assert decide_output(fill, requested=100, engine_default=8000).max_tokens == 100
    req = OutputPolicy(name=OutputPolicyName.REQUIRE)
    assert decide_output(req, requested=None, engine_default=8000).missing
    cap = OutputPolicy(name=OutputPolicyName.CAP, cap_tokens=512)
    d = decide_output(cap, requested=None, engine_default=8000)
    assert (d.max_tokens, d.set_max_tokens) == (512, 512)
    d = decide_output(cap, requested=100, engine_default=8000)
    assert (d.max_tokens, d.set_max_tokens) == (100, None)
    with pytest.raises(ValueError, match="needs `output_cap_tokens`"):
        OutputPolicy(name=OutputPolicyName.CAP)


def test_placement_rankings() -> None:
    rooms = [BackendRoom(name="a", capacity_tokens=100, resident_tokens=50),
             BackendRoom(name="b", capacity_tokens=100, resident_tokens=10),
             BackendRoom(name="c", capacity_tokens=100, resident_tokens=95)]
    assert rank_backends(rooms, 20, PlacementName.BEST_FIT) == ["a", "b"]
    assert rank_backends(rooms, 20, PlacementName.LEAST_RESIDENT) == ["b", "a"]


def test_release_rate_drives_retry_after() -> None:
    now = [0.0]
    rate = ReleaseRate(window_s=30, clock=lambda: now[0])
    assert rate.wait_s(1000) == 1.0  # nothing known: the floor
    for t in range(10):
        now[0] = float(t)
        rate.record(100)
    # 1000 tokens over 9 s ~ 111 tokens/s: 2,000 tokens ahead -> 18 s
    assert rate.wait_s(2000) == pytest.approx(18.0)
    assert rate.wait_s(10**9) == 60.0


def test_the_drain_rate_counts_only_releases_made_while_requests_wait() -> None:
    """Idle releases measure traffic, not the pool; the rate is unknown below four
    busy releases; and it divides by the time spent waiting, not by the window."""
    now = [0.0]
    rate = ReleaseRate(window_s=30, clock=lambda: now[0])
    for t in range(5):  # a quiet second: 5 releases, nobody waiting
        now[0] = t * 0.2
        rate.record(50)
    assert rate.busy_tokens_per_s() is None
    now[0] = 10.0
    rate.set_busy(True)  # a burst queues at 10 s
    for i in range(1, 4):
        now[0] = 10.0 + i * 0.01
        rate.record(900)
    assert rate.busy_tokens_per_s() is None  # three releases: not yet evidence
    now[0] = 10.04
    rate.record(900)
    # 3,600 tokens in 40 ms of waiting: 90,000 tokens/s, not 3,600/1 s nor /30 s
    assert rate.busy_tokens_per_s() == pytest.approx(90_000)
    now[0] = 10.05
    rate.set_busy(False)
    now[0] = 20.0  # ten idle seconds do not dilute it
    rate.record(10)
    assert rate.busy_tokens_per_s() == pytest.approx(3_600 / 0.05)
    now[0] = 40.5  # the burst has left the window
    assert rate.busy_tokens_per_s() is None


# ------------------------------------------------------------------ contract


def test_every_error_class_has_a_table_row_and_back() -> None:
    classes = {
        obj for obj in vars(errors_module).values()
        if isinstance(obj, type) and issubclass(obj, KvgateError) and obj is not KvgateError
    }
    assert classes == set(ERROR_TABLE.values())
    assert all(ERROR_TABLE[c.code] is c for c in classes)
    expected = {
        "invalid_request": 400, "context_length_exceeded": 400, "max_tokens_required": 400,
        "unauthorized": 401,
        "model_not_found": 404, "not_found": 404, "method_not_allowed": 405,
        "request_too_large": 413, "request_timeout": 408, "queue_full": 429,
        "queue_timeout": 429, "no_backend": 503,
        "ledger_unavailable": 503, "memory_budget": 503, "upstream_error": 502,
        "internal_error": 500,
    }
    assert {code: cls.status for code, cls in ERROR_TABLE.items()} == expected


def test_non_retryable_errors_say_so_and_context_message_wording() -> None:
    err = ContextLengthExceeded(max_model_len=8192, prompt_tokens=100, max_tokens=9000)
    assert err.headers() == {"x-should-retry": "false"}
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, you requested 9100 "
        "tokens (100 in the messages, 9000 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    assert err.to_body()["error"] == {"message": err.message, "type": "invalid_request_error",
                                      "code": "context_length_exceeded", "param": "messages"}
    assert err.sse_event().startswith(b"event: error\ndata: {")


@pytest.mark.parametrize(
    "module",
    ["proxy.capacity", "proxy.ledger", "proxy.admission", "proxy.errors", "proxy.metrics",
     "proxy.tokenize", "proxy.validation", "proxy.config", "policies.ordering",
     "policies.output", "policies.placement"],
)
def test_core_module_does_not_import_aiohttp(module: str) -> None:
    code = f"import sys, {module}; assert 'aiohttp' not in sys.modules, '{module}'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_capacity_change_keeps_live_leases_and_applies_to_next_reservation() -> None:
    async def scenario() -> None:
        c, ledger = controller(capacity=100)
        held = await c.acquire(demand(80), soon())
        c.set_capacity(c.backends[0], 60)  # the backend now reports less
        assert ledger.resident("b0") == 80 and not held.released
        waiting = asyncio.create_task(c.acquire(demand(50), soon()))
        await asyncio.sleep(0.02)
        assert not waiting.done()  # 80 + 50 > 60: waits
        held.release()
        lease = await asyncio.wait_for(waiting, 1)
        c.set_capacity(c.backends[0], 200)
        more = await asyncio.wait_for(c.acquire(demand(150), soon()), 1)
        assert ledger.resident("b0") == 200
        lease.release()
        more.release()

    asyncio.run(scenario())


def test_backend_with_unknown_capacity_is_no_backend_not_too_large() -> None:
    async def scenario() -> None:
        c, _ = controller(capacity=0)
        with pytest.raises(NoBackend):
            await c.acquire(demand(10), soon())

    asyncio.run(scenario())


def test_engine_metrics_give_measured_capacity() -> None:
    from proxy.engine_metrics import kv_capacity_tokens

    vllm_text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization='
        '"0.9",num_cpu_blocks="2048",num_gpu_blocks="27350",prefix_caching_hash_algo="sha256"}'
        " 1.0\n"
    )
    assert kv_capacity_tokens(vllm_text) == 437_584  # less vLLM's null block
    assert kv_capacity_tokens("vllm:num_requests_running 3\n") is None
    assert kv_capacity_tokens('vllm:cache_config_info{block_size="16"} 1\n') is None
    # label values are strings: a brace or an escaped quote inside one is still one label
    odd = ('vllm:cache_config_info{note="a} \\"b\\"",block_size="16",num_gpu_blocks="100"}'
           " 1.0\n")
    assert kv_capacity_tokens(odd) == 1584
    assert kv_capacity_tokens("not prometheus {{{\n") is None


def test_lease_ids_differ_within_and_across_processes() -> None:
    """Replicas share one Redis ledger keyed by lease id: no two leases may share one."""

    async def two_ids() -> list[str]:
        ctl, _ = controller(100)
        leases = [await ctl.acquire(demand(10), soon()) for _ in range(2)]
        ids = [lease.lease_id for lease in leases]
        for lease in leases:
            lease.release()
        return ids

    ours = asyncio.run(two_ids())
    code = ("import asyncio; from tests.test_admission import controller, demand, soon\n"
            "async def one():\n    ctl, _ = controller(100)\n"
            "    lease = await ctl.acquire(demand(10), soon())\n    print(lease.lease_id)\n"
            "asyncio.run(one())")
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60).stdout.strip()
    assert ours[0] != ours[1]
    assert theirs and theirs not in ours


def busy_releases(c: AdmissionController, clock: list[float], tokens: int) -> None:
    """A release rate on `clock` that has seen `tokens` released while requests waited."""
    c.release_rate = ReleaseRate(window_s=30, clock=lambda: clock[0], min_busy_releases=1)
    c.release_rate.set_busy(True)
    c.release_rate.record(tokens)


def smaller_arrivals(c: AdmissionController, t0: float, count: int) -> None:
    """Releases at 100 tokens/s (`busy_releases`) and `count` 30-token requests that
    joined the queue over the 30 s window before `t0` + 1 s, the clock's time then."""
    clock = [t0]
    busy_releases(c, clock, 100)
    clock[0] = t0 - 29.0  # a whole window seen by the time the newcomers come
    for _ in range(count):
        c.release_rate.queued(30)
    clock[0] = t0 + 1.0


def test_a_request_that_cannot_start_in_time_is_refused_at_once() -> None:
    """Releases have run at 100 tokens/s; the pool (100) is full and 150 tokens wait
    ahead with time to spare. A 50-token request with 1 s left would need 2 s: refused
    at once with the predicted reason; with 3 s left it waits and gets in."""
    async def scenario() -> None:
        c, _ = controller(capacity=100, depth=8)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        clock = [t0]
        busy_releases(c, clock, 100)
        clock[0] = t0 + 1.0  # 100 tokens in the last second, with requests waiting
        hog = await c.acquire(demand(100), soon())
        ahead = [asyncio.ensure_future(c.acquire(demand(75), loop.time() + 10))
                 for _ in range(2)]
        await asyncio.sleep(0)
        started = loop.time()
        with pytest.raises(QueueTimeout) as late:
            await c.acquire(demand(50), loop.time() + 1.0)
        assert late.value.predicted and late.value.reason == "queue_timeout_predicted"
        assert late.value.code == "queue_timeout"
        assert "predicted to wait 2000 ms more for 50 tokens" in late.value.message
        assert loop.time() - started < 0.05
        waiter = asyncio.ensure_future(c.acquire(demand(50), loop.time() + 3.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # 2 s < 3 s: it waits
        hog.release()
        for fut in ahead:  # 75 + 75 > 100: one after the other
            (await asyncio.wait_for(fut, 1)).release()
        (await asyncio.wait_for(waiter, 1)).release()

    asyncio.run(scenario())


def test_at_a_cold_start_what_cannot_start_in_time_is_refused_at_once() -> None:
    """No release seen yet. The pool (100) has been held by one lease for 4 s: the
    prior reads 0.25 x 100 / 4 = 6.25 tokens/s, so a 50-token newcomer would wait 8 s.
    With 1 s left it is refused at arrival, not after waiting out its deadline; with
    20 s left it waits, and gets in when the lease ends. Before the lease had run a
    second, the same newcomer waited: nothing was known yet."""
    async def scenario() -> None:
        c, _ = controller(capacity=100, depth=8)
        loop = asyncio.get_running_loop()
        clock = [loop.time()]
        c.release_rate = ReleaseRate(window_s=30, clock=lambda: clock[0])
        hog = await c.acquire(demand(100), soon())
        clock[0] += 0.9
        young = asyncio.ensure_future(c.acquire(demand(50), loop.time() + 0.2))
        await asyncio.sleep(0.05)
        assert not young.done()  # no prior yet: it waits
        with pytest.raises(QueueTimeout, match=r"waited \d+ ms for 50 tokens"):
            await young
        clock[0] += 3.1
        started = loop.time()
        with pytest.raises(QueueTimeout) as late:
            await c.acquire(demand(50), loop.time() + 1.0)
        assert late.value.predicted and late.value.reason == "queue_timeout_predicted"
        assert "predicted to wait 8000 ms more for 50 tokens" in late.value.message
        assert loop.time() - started < 0.05
        waiter = asyncio.ensure_future(c.acquire(demand(50), loop.time() + 20.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        hog.release()
        (await asyncio.wait_for(waiter, 1)).release()

    asyncio.run(scenario())


def test_a_waiter_that_can_no_longer_start_in_time_is_refused_before_its_deadline() -> None:
    async def scenario() -> None:
        c, _ = controller(capacity=100, depth=8)
        loop = asyncio.get_running_loop()
        hog = await c.acquire(demand(100), soon())
        waiter = asyncio.ensure_future(c.acquire(demand(60), loop.time() + 2.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # no release seen yet: nothing to predict from
        clock = [loop.time()]
        c.release_rate = ReleaseRate(window_s=30, clock=lambda: clock[0], min_busy_releases=1)
        c.release_rate.set_busy(True)
        c.release_rate.record(10)
        clock[0] += 1.0  # 10 tokens/s: 60 tokens take 6 s, past its deadline
        c.kick()
        with pytest.raises(QueueTimeout) as late:
            await asyncio.wait_for(waiter, 1)
        assert late.value.predicted
        hog.release()

    asyncio.run(scenario())


def test_a_newcomer_that_smaller_arrivals_would_pass_is_refused_at_once() -> None:
    """Releases run at 100 tokens/s into a full pool; 2,250 tokens of 30-token requests
    joined the queue 30 s ago (75 tokens/s over the window). A 50-token request needs 0.5 s in
    queue order, but the smaller arrivals take 75 of every 100 tokens released before
    it: 2 s, past its 0.8 s. Refused at once, Retry-After that 2 s. A 20-token request,
    which nothing smaller passes, needs 0.2 s: it waits and gets in."""
    async def scenario() -> None:
        c, _ = controller(capacity=100, depth=8)
        loop = asyncio.get_running_loop()
        smaller_arrivals(c, loop.time(), 75)
        hog = await c.acquire(demand(100), soon())
        with pytest.raises(QueueTimeout) as late:
            await c.acquire(demand(50), loop.time() + 0.8)
        assert late.value.predicted
        assert "predicted to wait 2000 ms more for 50 tokens" in late.value.message
        assert late.value.retry_after_s == pytest.approx(2.0)
        small = asyncio.ensure_future(c.acquire(demand(20), loop.time() + 0.8))
        await asyncio.sleep(0.01)
        assert not small.done()
        hog.release()
        (await asyncio.wait_for(small, 1)).release()

    asyncio.run(scenario())


def test_smaller_arrivals_pass_a_newcomer_only_until_it_starves() -> None:
    """Smaller requests join as fast as releases free room (100 tokens/s of 30-token
    requests, the release rate): in queue order they would pass a 50-token newcomer
    forever, but once it has waited `starvation_s` (2 s) nobody passes it. It waits
    2 s + its 0.5 s in queue order: refused at once with 2 s left (Retry-After 2.5 s),
    queued with 3 s left, and it gets in once the pool frees."""
    async def scenario() -> None:
        c, _ = controller(capacity=100, depth=8, starvation_s=2.0)
        loop = asyncio.get_running_loop()
        smaller_arrivals(c, loop.time(), 100)
        hog = await c.acquire(demand(100), soon())
        with pytest.raises(QueueTimeout) as late:
            await c.acquire(demand(50), loop.time() + 2.0)
        assert "predicted to wait 2500 ms more for 50 tokens" in late.value.message
        assert late.value.retry_after_s == pytest.approx(2.5)
        waiter = asyncio.ensure_future(c.acquire(demand(50), loop.time() + 3.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # queued, not refused
        hog.release()
        (await asyncio.wait_for(waiter, 1)).release()

    asyncio.run(scenario())
