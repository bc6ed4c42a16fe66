"""Adaptive reservation: the learnt output budget, resizable leases, engine feedback."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from policies.ordering import make_ordering
from policies.reservation import AdmissionTarget, OutputHistory, _kaplan_meier
from proxy.admission import AdmissionController, Backend, Demand
from proxy.engine_metrics import engine_load
from proxy.errors import QueueTimeout
from proxy.ledger import MemoryLedger
from proxy.redis_ledger import RedisLedger
from proxy.reservation import (
    Progress,
    ReservationTracker,
    output_tokens_from_tail,
)
from proxy.sim.engine import OutputLength
from tests.support.redis_server import RedisServer
from tests.support.servers import running_sim
from tests.support.stack import MODEL, Stack, running_stack

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


# ----------------------------------------------------------------------------- history


def test_history_remaining_is_the_conditional_quantile() -> None:
    h = OutputHistory(size=1000, min_samples=100, quantile=0.9)
    for length in range(10, 1001, 10):  # 10, 20, ..., 1000
        h.observe(length)
    assert h.ready
    assert h.remaining(0) == 910  # index int(0.9 * 100) = 90 -> 910
    # 50 samples longer than 500 (510..1000): index int(0.9 * 50) = 45 -> 960
    assert h.remaining(500) == 960 - 500
    # past the tail (fewer than 8 longer samples): as long again as it has run
    assert h.remaining(995) == 995
    assert h.quantile_of(0.5) == 510


def test_history_counts_the_running_as_outliving_what_they_have_generated() -> None:
    """Kaplan-Meier, worked by hand. Ten answers of 10, 20, ..., 100 tokens; ten
    requests still running at 55 generated. At risk at first: 20. The answers of 10-50
    end one each: P(L > 50) = 19/20 x 18/19 x ... x 15/16 = 0.75. The ten running
    leave the risk set past 55, so 5 are at risk at 60: 0.75 x 4/5 = 0.6; at 70:
    0.6 x 3/4 = 0.45 < 0.5, the median. On the answers alone it is 60."""
    h = OutputHistory(size=100, min_samples=10, quantile=0.5)
    for length in range(10, 101, 10):
        h.observe(length)
    assert h.remaining(0) == 60
    h.censor([55] * 10)
    assert h.ready and h.remaining(0) == 70
    # 60 generated: P(L > t | L > 60) < 0.5 first at 90 (0.15 / 0.6; at 80, 0.3 / 0.6)
    assert h.remaining(60) == 30
    # the running below every answer change nothing: a plain empirical curve
    h.censor([5] * 10)
    assert h.remaining(0) == 60
    h.censor([])  # nothing running: the empirical quantile again
    assert h.remaining(0) == 60


def test_history_with_the_running_behind_every_answer_reads_as_without_them() -> None:
    """Running requests that have generated less than every answer seen say nothing
    new: the Kaplan-Meier quantile is then the empirical one at every point, for any
    q (random histories, fixed seed)."""
    rng = random.Random(7)
    for _ in range(200):
        q = rng.choice([0.1, 0.5, 0.75, 0.9, 0.99, 1.0])
        h = OutputHistory(size=500, min_samples=1, quantile=q)
        for _ in range(rng.randint(1, 300)):
            h.observe(rng.randint(5, 2000))
        points = [rng.randint(0, 2100) for _ in range(20)]
        plain = [h.remaining(g) for g in points]
        running = sorted(rng.randint(0, 4) for _ in range(rng.randint(1, 50)))
        h.censor(running)
        assert h.ready
        assert [h.remaining(g) for g in points] == plain
        # censor skips the curve there; drawn anyway, it reads the same
        h._km_lengths, h._km_minus_survival = _kaplan_meier(h._sorted, running)
        assert [h.remaining(g) for g in points] == plain


def test_history_guesses_the_ends_of_the_running_that_outlive_what_it_has_seen() -> None:
    """Short answers end first: ten answers of 10-100 while twenty requests have run
    past 150. P(L > 100) = 20/30 > 0.5, so the median is past every answer seen. Each
    of the twenty is then taken to end at twice what it has generated (2 x 150 + 1),
    and the curve is drawn again: the median is 301 (on the answers alone, 60; the
    history stays ready). When they end at 160, it is 160."""
    h = OutputHistory(size=100, min_samples=10, quantile=0.5)
    for length in range(10, 101, 10):
        h.observe(length)
    assert h.ready and h.remaining(0) == 60
    h.censor([150] * 20)
    assert h.ready and h.remaining(0) == 301
    # one of them, at 150: past every answer seen, as long again as it has run
    assert h.remaining(150) == 150
    # five more behind the answers stay at risk to 55, as in the plain curve; the
    # guess changes only the tail: still 301
    h.censor([150] * 20 + [55] * 5)
    assert h.remaining(0) == 301
    for _ in range(20):  # they end at 160
        h.observe(160)
    h.censor([])
    assert h.ready and h.remaining(0) == 160


def test_history_guess_applies_only_when_the_quantile_is_past_every_answer() -> None:
    """At q = 0.25 the same twenty running streams leave P(L > 100) = 20/30 below
    0.75, so the 0.25-quantile lies among the answers seen and the plain Kaplan-Meier
    curve answers: P(L > 30) = 27/30 = 0.9, P(L > 40) = 0.867,
    P(L > 50) = 0.833, P(L > 60) = 0.8, P(L > 70) = 0.767, P(L > 80) = 0.733 < 0.75,
    so 80 (on the answers alone, int(0.25 x 10) -> 30)."""
    h = OutputHistory(size=100, min_samples=10, quantile=0.25)
    for length in range(10, 101, 10):
        h.observe(length)
    assert h.remaining(0) == 30
    h.censor([150] * 20)
    assert h.remaining(0) == 80


def test_history_longest_prompt_is_that_of_the_answers_in_the_window() -> None:
    h = OutputHistory(size=3, min_samples=1, quantile=0.5)
    assert h.longest_prompt is None
    h.observe(10)  # no prompt given
    assert h.longest_prompt is None
    for prompt in (500, 100, 200):
        h.observe(10, prompt)
    assert h.longest_prompt == 500
    h.observe(10, 150)  # the 500-token prompt's answer leaves the window
    assert h.longest_prompt == 200
    h.observe(10, 50)
    h.observe(10, 40)
    assert h.longest_prompt == 150
    h.observe(10)
    assert h.longest_prompt == 50


def test_history_not_ready_below_min_samples_and_evicts_oldest() -> None:
    h = OutputHistory(size=4, min_samples=3, quantile=0.5)
    h.observe(100)
    h.observe(200)
    assert not h.ready
    for length in (5, 5, 5, 5):
        h.observe(length)
    assert h.ready and len(h) == 4
    assert h.quantile_of(1.0) == 5  # 100 and 200 have left the window
    with pytest.raises(ValueError, match="output_tokens"):
        h.observe(-1)


def test_admission_target_tightens_at_once_and_loosens_slowly() -> None:
    t = AdmissionTarget(tighten=0.8, loosen_per_s=0.05, floor=0.5)
    assert t.observe(now=0.0, preemptions_total=3, engine_tokens=100, reserved_tokens=1000,
                     capacity_tokens=1024) == 1.0  # first sight of the counter: no delta
    assert t.observe(now=1.0, preemptions_total=4, engine_tokens=100, reserved_tokens=1000,
                     capacity_tokens=1024) == pytest.approx(0.8)
    # the engine holds more than all leases: tighten again
    assert t.observe(now=2.0, preemptions_total=4, engine_tokens=1100, reserved_tokens=1000,
                     capacity_tokens=1024) == pytest.approx(0.64)
    assert t.observe(now=4.0, preemptions_total=4, engine_tokens=900, reserved_tokens=1000,
                     capacity_tokens=1024) == pytest.approx(0.74)
    for now in range(5, 100):
        t.observe(now=float(now), preemptions_total=4, engine_tokens=0, reserved_tokens=0,
                  capacity_tokens=1024)
    assert t.factor == 1.0
    for i in range(20):
        t.observe(now=100.0 + i, preemptions_total=10 + i, engine_tokens=None,
                  reserved_tokens=0, capacity_tokens=1024)
    assert t.factor == 0.5  # never below the floor


# ----------------------------------------------------------------------------- engine figures


def test_engine_load_reads_the_simulators_and_vllms_metric_text() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=1024, output_length=OutputLength.MAX,
                               decode_step_ms=20.0) as url, aiohttp.ClientSession() as s:
            body = {"model": "sim-model", "prompt": "hello " * 250, "max_tokens": 100,
                    "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as resp:
                await resp.content.readline()  # running now
                async with s.get(f"{url}/metrics") as metrics:
                    load = engine_load(await metrics.text())
                resp.close()
        assert load.preemptions_total == 0
        assert load.usage_ratio is not None and load.usage_ratio > 0.2

    asyncio.run(scenario())
    vllm_v0 = (
        '# TYPE vllm:gpu_cache_usage_perc gauge\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        '# TYPE vllm:num_preemptions_total counter\n'
        'vllm:num_preemptions_total{model_name="m"} 3.0\n'
    )
    load = engine_load(vllm_v0)
    assert (load.usage_ratio, load.preemptions_total) == (0.25, 3)
    assert engine_load("not prometheus {{{").usage_ratio is None
    nonsense = vllm_v0.replace("0.25", "NaN").replace("3.0", "+Inf")
    assert engine_load(nonsense) == engine_load("")  # says nothing, raises nothing
    histogram = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}"}} {i}\n'
                        for i in range(2000))
    assert engine_load(histogram + vllm_v0) == load  # other families do not get in the way


def test_usage_is_read_from_the_end_of_an_answer() -> None:
    assert output_tokens_from_tail(b'..."usage":{"prompt_tokens":5,"completion_tokens":42}}') == 42
    assert output_tokens_from_tail(b'data: {"choices":[]}\n\n') is None


# ----------------------------------------------------------------------------- ledgers


def test_memory_ledger_resize_shrinks_and_grows_only_into_free_room() -> None:
    led = MemoryLedger()
    assert led.reserve_now("gpu", "a", 400, 1000)
    assert led.reserve_now("gpu", "b", 500, 1000)
    assert led.resize_now("a", 200, 1000) == 200  # shrink always
    assert led.resident("gpu") == 700
    assert led.resize_now("a", 900, 1000) == 500  # only the 300 free tokens
    assert led.resident("gpu") == 1000
    led.release("b")
    assert led.resize_now("a", 900, 1000) == 900
    assert led.resize_now("gone", 10, 1000) == 0
    led.release("a")
    assert led.resident("gpu") == 0


def test_redis_resize_never_takes_what_another_replica_holds(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        async with _redis(redis_server) as one, _redis(redis_server) as two:
            a, b = uuid.uuid4().hex, uuid.uuid4().hex
            assert await one.reserve("gpu-a", a, 400, 1000)
            assert await two.reserve("gpu-a", b, 500, 1000)
            assert await one.resize(a, 900, 1000) == 500  # 100 left for it, not 500
            assert await one.resident_now("gpu-a") == 1000
            assert await two.resize(b, 100, 1000) == 100
            assert await one.resident_now("gpu-a") == 600
            assert await one.resize(a, 900, 1000) == 900
            one.release(a)
            two.release(b)
            assert await one.resize(a, 50, 1000) == 0  # released: nothing to resize
            await one._ops.join()
            await two._ops.join()
            assert await one.resident_now("gpu-a") == 0

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def _redis(server: RedisServer) -> AsyncIterator[RedisLedger]:
    led = RedisLedger(server.url, backends=["gpu-a"], key_prefix="r")
    await led.start()
    try:
        yield led
    finally:
        await led.close()


def test_a_shrinking_lease_admits_the_waiter_it_made_room_for() -> None:
    async def scenario() -> None:
        backend = Backend(name="gpu", url="http://127.0.0.1:9", capacity_tokens=1000)
        c = AdmissionController(model="m", backends=[backend], ledger=MemoryLedger(),
                                ordering=make_ordering("fifo"))
        first = await c.acquire(Demand(tokens=800, prompt_tokens=100, max_tokens=700), 1e9)
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(
            c.acquire(Demand(tokens=600, prompt_tokens=100, max_tokens=500), loop.time() + 5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        assert await c.resize(first, 1100) == 1000  # grows only to the capacity
        assert first.shortfall_tokens == 100
        assert await c.resize(first, 300) == 300
        second = await asyncio.wait_for(waiter, 1)
        first.release()
        second.release()
        assert c.rooms()[0].resident_tokens == 0

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- over HTTP


ADAPTIVE = {"reservation": "adaptive", "adaptive": {"min_samples": 4, "quantile": 0.5}}
# The simulated engine here runs every answer to its max_tokens, so a warm-up with
# max_tokens N teaches the history "answers are N tokens long".


def _strict_tokens(prompt_tokens: int, max_tokens: int) -> int:
    return -(-(prompt_tokens + max_tokens) // 16) * 16


async def _chat(s: aiohttp.ClientSession, stack: Stack, **body: Any) -> tuple[int, dict[str, str]]:
    async with s.post(f"{stack.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": MSGS, **body}) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def _headers(s: aiohttp.ClientSession, stack: Stack,
                   **body: Any) -> tuple[int, dict[str, str]]:
    """Admission's answer only: read the headers, then leave (the engine aborts)."""
    async with s.post(f"{stack.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": MSGS, **body}) as resp:
        headers = dict(resp.headers)
        resp.close()
        return resp.status, headers


@contextlib.asynccontextmanager
async def _adaptive_stack(**engine: Any) -> AsyncIterator[Stack]:
    async with running_stack(backends=1, kv_tokens=8192, model=ADAPTIVE,
                             engine={"decode_step_ms": 2.0, **engine}) as stack:
        yield stack


def test_adaptive_cold_start_then_what_answers_use() -> None:
    """No history: a lease holds its output so far twice over and new requests leave
    room for the live ones to grow; with history: what answers have used."""

    async def scenario() -> None:
        async with _adaptive_stack() as stack, aiohttp.ClientSession() as s:
            async with s.get(f"{stack.url}/admin/state") as resp:
                cold = (await resp.json())["models"][MODEL]["backends"]["sim-0"]
            assert cold["admission_target_tokens"] == 8192
            assert cold["cold_start_reserve_tokens"] == 0  # nothing live that could grow
            status, headers = await _chat(s, stack, max_tokens=24)
            prompt = int(headers["x-kvgate-prompt-tokens"])
            assert status == 200
            assert int(headers["x-kvgate-reserved-tokens"]) == _strict_tokens(prompt, 1)
            for _ in range(4):  # history: four answers of 24 tokens
                assert (await _chat(s, stack, max_tokens=24))[0] == 200
            # a client cap of 4,000 now reserves what answers really used, not the cap
            status, headers = await _headers(s, stack, max_tokens=4000, stream=True)
            assert status == 200
            assert int(headers["x-kvgate-reserved-tokens"]) == _strict_tokens(prompt, 24)
            # ignore_eos runs to max_tokens: nothing learnt about EOS applies
            status, headers = await _chat(s, stack, max_tokens=300, ignore_eos=True)
            assert int(headers["x-kvgate-reserved-tokens"]) == _strict_tokens(prompt, 300)
            # min_tokens is a floor the engine honours: reserved at least that
            status, headers = await _headers(s, stack, max_tokens=4000, min_tokens=1000)
            assert int(headers["x-kvgate-reserved-tokens"]) == _strict_tokens(prompt, 1000)
            status, headers = await _chat(s, stack, max_tokens=40, min_tokens="many")
            assert status == 400
            await _settled(stack)

    asyncio.run(scenario())


def test_adaptive_lease_grows_while_a_stream_generates_and_returns_to_zero() -> None:
    async def scenario() -> None:
        async with _adaptive_stack() as stack, aiohttp.ClientSession() as s:
            for _ in range(4):
                assert (await _chat(s, stack, max_tokens=8))[0] == 200
            lease_sizes: list[int] = []
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 600, "stream": True}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                initial = int(resp.headers["x-kvgate-reserved-tokens"])
                async for _ in resp.content:
                    lease_sizes.append(stack.resident()["sim-0"])
            prompt = int(resp.headers["x-kvgate-prompt-tokens"])
            assert initial == _strict_tokens(prompt, 8)  # what answers have used
            # it ran to 600 tokens: the lease followed it up to prompt + 600
            assert max(lease_sizes) >= _strict_tokens(prompt, 560)
            assert max(lease_sizes) <= _strict_tokens(prompt, 600)
            await _settled(stack)
            assert stack.resident()["sim-0"] == 0

    asyncio.run(scenario())


def test_adaptive_decisions_do_not_read_the_simulators_output_field() -> None:
    """Two requests admitted on the same history get the same lease with and without
    the simulator-only `sim_output_tokens` field."""

    async def scenario() -> None:
        async with _adaptive_stack(decode_step_ms=10.0) as stack, aiohttp.ClientSession() as s:
            for _ in range(4):
                assert (await _chat(s, stack, max_tokens=30))[0] == 200
            results = await asyncio.gather(
                _headers(s, stack, max_tokens=2000, stream=True, sim_output_tokens=5),
                _headers(s, stack, max_tokens=2000, stream=True),
            )
            assert results[0][1]["x-kvgate-reserved-tokens"] == \
                results[1][1]["x-kvgate-reserved-tokens"]
            await _settled(stack)

    asyncio.run(scenario())


def test_adaptive_state_and_metrics_show_engine_figures() -> None:
    async def scenario() -> None:
        async with _adaptive_stack() as stack, aiohttp.ClientSession() as s:
            for _ in range(4):
                assert (await _chat(s, stack, max_tokens=8))[0] == 200
            await asyncio.sleep(0.8)  # one engine poll
            async with s.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
            model = state["models"][MODEL]
            assert model["reservation"] == "adaptive"
            assert model["output_history"]["samples"] == 4
            assert model["output_history"]["p50_tokens"] == 8
            # what a new chat's lease holds for its output; none of the four still runs
            assert model["output_history"]["expected_output_tokens"] == 8
            assert model["output_history"]["running_counted"] == 0
            backend = model["backends"]["sim-0"]
            assert backend["engine_kv_usage_ratio"] == 0.0
            assert backend["engine_preemptions_reported"] == 0
            assert backend["admission_target_tokens"] == 8192
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            from prometheus_client.parser import text_string_to_metric_families

            values = {(smp.name, smp.labels.get("backend")): smp.value
                      for fam in text_string_to_metric_families(text) for smp in fam.samples}
            assert values[("kvgate_admission_target_tokens", "sim-0")] == 8192
            assert values[("kvgate_engine_kv_usage_ratio", "sim-0")] == 0.0
            assert values[("kvgate_engine_preemptions_reported", "sim-0")] == 0
            assert values[("kvgate_resident_tokens", "sim-0")] == 0

    asyncio.run(scenario())


async def _settled(stack: Stack) -> None:
    async with asyncio.timeout(5):
        while any(stack.resident().values()):
            await asyncio.sleep(0.01)


def test_a_followed_waiter_waits_for_what_it_will_need_once_history_exists() -> None:
    """Queued before there was history (prompt + max_tokens), sized anew at dispatch."""

    async def scenario() -> None:
        backend = Backend(name="gpu", url="http://127.0.0.1:9", capacity_tokens=1000)
        c = AdmissionController(model="m", backends=[backend], ledger=MemoryLedger(),
                                ordering=make_ordering("fifo"))
        first = await c.acquire(Demand(tokens=700, prompt_tokens=100, max_tokens=600), 1e9)
        loop = asyncio.get_running_loop()
        big = Demand(tokens=900, prompt_tokens=100, max_tokens=800, follow=True)
        waiter = asyncio.ensure_future(c.acquire(big, loop.time() + 5))
        await asyncio.sleep(0.01)
        assert not waiter.done() and c.queued_tokens() == 900
        c.sizer = lambda d: 300  # the history says: 100 prompt + ~200 output
        c.kick()
        second = await asyncio.wait_for(waiter, 1)
        assert second.tokens == 300
        first.release()
        second.release()

    asyncio.run(scenario())


def test_room_that_opens_goes_to_a_running_request_before_a_waiter() -> None:
    async def scenario() -> None:
        backend = Backend(name="gpu", url="http://127.0.0.1:9", capacity_tokens=1000)
        c = AdmissionController(model="m", backends=[backend], ledger=MemoryLedger(),
                                ordering=make_ordering("fifo"))
        running = await c.acquire(Demand(tokens=600, prompt_tokens=100, max_tokens=900), 1e9)
        other = await c.acquire(Demand(tokens=400, prompt_tokens=100, max_tokens=300), 1e9)
        assert await c.resize(running, 700) == 600  # full: 100 short
        assert c.shortfall_tokens(backend) == 100
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(
            c.acquire(Demand(tokens=350, prompt_tokens=100, max_tokens=250), loop.time() + 0.3))
        await asyncio.sleep(0.01)
        other.release()  # 400 free: 100 for the running request first, 300 left
        await c.drain()
        assert running.tokens == 700 and c.shortfall_tokens(backend) == 0
        with pytest.raises(QueueTimeout):
            await waiter
        running.release()

    asyncio.run(scenario())


def test_a_lease_back_within_its_slack_leaves_the_shortfall_list_unshrunk() -> None:
    """The tick keeps a lease whose new estimate is within two blocks below its size
    (no flapping). If it had a shortfall, that is over: dispatch must neither regrow
    nor shrink it on the tick's behalf."""
    async def scenario() -> None:
        backend = Backend(name="gpu", url="http://127.0.0.1:9", capacity_tokens=1000)
        c = AdmissionController(model="m", backends=[backend], ledger=MemoryLedger(),
                                ordering=make_ordering("fifo"))
        history = OutputHistory(size=10, min_samples=1, quantile=0.5)
        history.observe(30)  # a request at 0 tokens still wants 30: 100 + 30 in all
        tracker = ReservationTracker(history=history, ledger_tokens=lambda t: t,
                                     block_size=16)
        lease = await c.acquire(Demand(tokens=150, prompt_tokens=100, max_tokens=500,
                                       follow=True), 1e9)
        other = await c.acquire(Demand(tokens=850, prompt_tokens=100, max_tokens=750), 1e9)
        assert await c.resize(lease, 200) == 150  # full: 50 short
        tracker.track(Progress(lease=lease, prompt_tokens=100, max_tokens=500, n=1,
                               min_tokens=0, stream=True, chat=True,
                               started_s=0.0))
        await tracker.tick(c, 0.0)  # wants 130: within 32 of 150, kept at 150
        assert (lease.tokens, lease.wanted_tokens) == (150, 130)
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(
            c.acquire(Demand(tokens=100, prompt_tokens=50, max_tokens=50), loop.time() + 0.1))
        await asyncio.sleep(0.01)
        await c.drain()  # a dispatch ran
        assert lease.tokens == 150
        with pytest.raises(QueueTimeout):
            await waiter
        lease.release()
        other.release()

    asyncio.run(scenario())


def _cold_controller(capacity: int) -> tuple[AdmissionController, ReservationTracker]:
    from proxy.reservation import follow_adaptively

    c = AdmissionController(model="m", backends=[Backend(name="gpu", url="http://127.0.0.1:9",
                                                         capacity_tokens=capacity)],
                            ledger=MemoryLedger(), ordering=make_ordering("fifo"))
    tracker, _ = follow_adaptively(c, quantile=0.5, min_samples=10, history=100,
                                   resize_interval_s=0.1,
                                   ledger_tokens=lambda t: -(-t // 16) * 16, block_size=16)
    return c, tracker


def test_a_cold_start_keeps_room_only_for_leases_that_can_grow() -> None:
    """A fresh kvgate on a 4,096-token pool: six strict-sized leases of 624 tokens fit
    (3,744) and are all admitted at once; followed leases that may grow to prompt +
    max_tokens leave up to a quarter of the pool free for that growth."""
    async def scenario() -> None:
        c, tracker = _cold_controller(4096)
        loop = asyncio.get_running_loop()
        strict = [await c.acquire(Demand(tokens=624, prompt_tokens=300, max_tokens=324),
                                  loop.time()) for _ in range(6)]
        assert sum(lease.tokens for lease in strict) == 3744
        for lease in strict:
            lease.release()
        # followed: 112 tokens now (prompt 100 + a first block), up to 2,112 later
        grows = Demand(tokens=112, prompt_tokens=100, max_tokens=2000, follow=True)
        followed = []
        with pytest.raises(QueueTimeout):
            while True:
                lease = await c.acquire(grows, loop.time())
                tracker.track(Progress(lease=lease, prompt_tokens=100, max_tokens=2000, n=1,
                                       min_tokens=0, stream=True, chat=True, started_s=0.0))
                followed.append(lease)
        assert len(followed) == 27  # 27 x 112 = 3,024 <= 4,096 - 1,024 < 28 x 112
        assert tracker.growth_reserve(c.backends[0], None) == 1024
        # the reserve is the live followed leases' to grow into, a strict one's too
        whole = Demand(tokens=1024, prompt_tokens=500, max_tokens=524)
        with pytest.raises(QueueTimeout):
            await c.acquire(whole, loop.time())
        for lease in followed:
            lease.release()
        assert tracker.growth_reserve(c.backends[0], None) == 0  # nothing left to grow
        assert (await c.acquire(Demand(tokens=4096, prompt_tokens=500, max_tokens=3596),
                                loop.time())).tokens == 4096

    asyncio.run(scenario())


def test_a_prompt_longer_than_the_history_knows_is_followed_as_at_a_cold_start() -> None:
    """Ten short chats (100-token prompts, 50-token answers) make the history. A request
    with a 5,000-token prompt is longer than any the history was learnt on, so what it
    says about answers does not apply: the request is held at its prompt and a first
    token, and room is kept for it to grow to prompt + max_tokens (at most a quarter of
    the pool). A 16,384-token pool admits two of them, not the three (~15,000 tokens)
    that the short answers alone would let in and that would outgrow the pool. The short
    chats are still sized from the history, beside them."""
    async def scenario() -> None:
        c, tracker = _cold_controller(16384)
        loop = asyncio.get_running_loop()
        assert c.sizer is not None
        chat = Demand(tokens=112, prompt_tokens=100, max_tokens=2048, follow=True)
        for _ in range(10):
            lease = await c.acquire(chat, loop.time())
            done = Progress(lease=lease, prompt_tokens=100, max_tokens=2048, n=1,
                            min_tokens=0, stream=False, chat=True, started_s=0.0)
            tracker.track(done)
            done.feed(b'{"usage": {"completion_tokens": 50}}')
            tracker.finish(done, 1.0, completed=True)
            lease.release()
        assert tracker.history.ready and tracker.history.longest_prompt == 100
        assert c.sizer(chat) == 160  # 100 + the median answer 50, in 16-token blocks
        assert tracker.growth_reserve(c.backends[0], None) == 0

        long = Demand(tokens=5008, prompt_tokens=5000, max_tokens=2048, follow=True)
        assert tracker.beyond_history(5000) and not tracker.beyond_history(100)
        assert c.sizer(long) == 5008  # the prompt and a first token
        admitted = []
        with pytest.raises(QueueTimeout):
            while True:
                lease = await c.acquire(long, loop.time())
                tracker.track(Progress(lease=lease, prompt_tokens=5000, max_tokens=2048,
                                       n=1, min_tokens=0, stream=True, chat=True,
                                       started_s=0.0))
                admitted.append(lease)
        assert len(admitted) == 2  # each may grow by 2,048; a quarter of the pool kept
        assert tracker.growth_reserve(c.backends[0], None) == 4096
        # the short chats take what is left under the reserve: 16,384 - 4,096 - 10,016
        chats = []
        with pytest.raises(QueueTimeout):
            while True:
                chats.append(await c.acquire(Demand(tokens=160, prompt_tokens=100,
                                                    max_tokens=2048, follow=True),
                                             loop.time()))
        assert len(chats) == 2272 // 160

    asyncio.run(scenario())


@pytest.mark.parametrize("admit_on_bound", [False, True])
def test_a_fresh_kvgate_admits_every_strict_sized_request_that_fits_at_once(
        admit_on_bound: bool) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=4096, model=ADAPTIVE,
                                 server={"admit_on_bound": admit_on_bound},
                                 engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            # ignore_eos: runs to max_tokens, so its lease is strict-sized (prompt + 650)
            answers = await asyncio.gather(*(
                _chat(s, stack, max_tokens=650, ignore_eos=True, stream=True)
                for _ in range(6)))
            prompt = int(answers[0][1]["x-kvgate-prompt-tokens"])
            assert 6 * _strict_tokens(prompt, 650) <= 4096 < 7 * _strict_tokens(prompt, 650)
            assert [status for status, _ in answers] == [200] * 6
            waits = [float(h["x-kvgate-queue-wait-ms"]) for _, h in answers]
            if not admit_on_bound:  # counted first: each finds room at once, never queues
                assert max(waits) < 5, waits
            else:
                # The first four are admitted on a bound of their prompts (64 tokens over
                # each); the sixth finds 3,616 reserved and queues until those shrink to
                # their exact counts: a count, then a pass of the one event loop that
                # runs kvgate, the engine and the clients here (20-60 ms with both cores
                # busy, 149 ms once in a loaded CI run). Not for another to finish (~2.5 s).
                assert max(waits) < 1000, waits
            await _settled(stack)

    asyncio.run(scenario())


def _learnt_controller(capacity: int) -> tuple[AdmissionController, ReservationTracker]:
    """A controller whose history holds ten 100-token answers to 100-token prompts, so
    a chat of that prompt is held at 100 + 100 = 208 tokens (16-token blocks)."""
    c, tracker = _cold_controller(capacity)
    for _ in range(10):
        tracker.history.observe(100, prompt_tokens=100)
    assert tracker.history.ready and tracker.history.remaining(0) == 100
    return c, tracker


def test_a_tick_tells_the_history_how_far_the_running_have_run() -> None:
    """The history learnt ten 100-token answers; twelve chats still stream past 150.
    Sized on the answers alone a new chat holds 208 tokens (100 + 100). Once the tick
    counts the running, the median lies past every answer seen, so each of the twelve
    is guessed to end at 2 x 150 + 1 = 301: a new chat holds 100 + 301 (416 in
    blocks), each running lease its output so far twice over (100 + 2 x 171, the
    lookahead included: 448 in blocks). When they end at 300, the history sizes on
    what it saw."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(65536)
        loop = asyncio.get_running_loop()
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=2048, follow=True)
        assert c.sizer is not None and c.sizer(chat) == 208
        running = [await c.acquire(chat, loop.time()) for _ in range(12)]
        progress = [_streamed(lease, 150) for lease in running]
        for p in progress:
            tracker.track(p)
        await tracker.tick(c, loop.time())
        assert tracker.history.ready and tracker.history.running_counted == 12
        lookahead = tracker.lookahead_tokens()
        held = -(-(100 + 2 * (150 + lookahead)) // 16) * 16
        assert [lease.tokens for lease in running] == [held] * 12
        assert c.sizer(chat) == 416
        for p in progress:
            p.feed(b"data: {}\n\n" * 150)
            p.tail += b'"usage":{"completion_tokens":300}'
            tracker.finish(p, loop.time(), completed=True)
            p.lease.release()
        await tracker.tick(c, loop.time())
        assert tracker.history.ready and tracker.history.remaining(0) == 300

    asyncio.run(scenario())


def test_a_non_streamed_answer_running_long_does_not_read_as_a_long_answer() -> None:
    """A non-streamed answer's progress is elapsed time x a decode rate that starts
    high on purpose: 100 s at 100 tokens/s would read as 10,000 tokens generated. The
    history is told only of streams, so it stays ready on what it has seen."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(65536)
        loop = asyncio.get_running_loop()
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=20000, follow=True)
        for _ in range(12):
            lease = await c.acquire(chat, loop.time())
            tracker.track(Progress(lease=lease, prompt_tokens=100, max_tokens=20000, n=1,
                                   min_tokens=0, stream=False, chat=True,
                                   started_s=loop.time() - 100.0))
        await tracker.tick(c, loop.time())
        assert tracker.history.ready and tracker.history.remaining(0) == 100

    asyncio.run(scenario())


def _streamed(lease: Any, generated: int) -> Progress:
    """A followed chat stream that has sent `generated` tokens (and its role event)."""
    p = Progress(lease=lease, prompt_tokens=100, max_tokens=2048, n=1, min_tokens=0,
                 stream=True, chat=True, started_s=0.0)
    p.feed(b"data: {}\n\n" * (generated + 3))  # role, tokens, finish and [DONE] counted
    assert p.streamed_tokens() == generated
    return p


def test_leases_that_end_at_different_times_let_admission_fill_what_they_overstate() -> None:
    """Two chats 96 tokens into their 100-token answers hold 196 tokens each in the
    engine and will let go of all of it in 12 more steps; a new chat's lease (208)
    holds 100 now and 208 in 108 steps. Their leases sum to 624, but the most they hold
    at once is 528 (at 12 steps: 100 + 12 for the new one, 196 + 12 for each old one),
    576 with a block of rounding each: 48 tokens of credit. A 600-token pool admits
    the third chat (624 reserved), which it would not on the sum of the leases; a
    fourth new chat overstates less than it adds and waits."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(600)
        backend = c.backends[0]
        loop = asyncio.get_running_loop()
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=2048, follow=True)
        assert c.sizer is not None and c.sizer(chat) == 208
        old = [await c.acquire(chat, loop.time()) for _ in range(2)]
        # not started yet: they end together, so they overstate nothing
        for lease in old:
            tracker.track(_streamed(lease, 0))
        assert tracker.overlap_credit(backend, None) == 0
        assert tracker.overlap_credit(backend, chat) == 0
        for lease in old:
            tracker.track(_streamed(lease, 96))
        assert tracker.overlap_credit(backend, None) == 0  # 2 x 208 - (2 x 196 + 2 x 12 + 32)
        assert tracker.overlap_credit(backend, chat) == 48
        third = await c.acquire(chat, loop.time() + 0.05)
        assert third.tokens == 208 and c._ledger.resident("gpu") == 624 > 600
        tracker.track(_streamed(third, 0))
        # 832 reserved for a peak of 640 + 64: 128 of credit, 600 + 128 < 832
        assert tracker.overlap_credit(backend, chat) == 128
        with pytest.raises(QueueTimeout):
            await c.acquire(chat, loop.time() + 0.05)
        # what a lease was not charged for shared blocks it does not hold either:
        # its charge and its peak are both 32 less (on a backend that shares nothing,
        # nothing is left behind when a lease ends)
        third.shared_tokens = 32
        assert tracker.overlap_credit(backend, chat) == 128
        third.shared_tokens = 0
        # a strict-sized lease (it cannot be followed) is held at its size all along
        strict = Demand(tokens=208, prompt_tokens=100, max_tokens=108)
        assert tracker.overlap_credit(backend, strict) == tracker.overlap_credit(backend, None)
        for lease in [*old, third]:
            lease.release()
        assert tracker.overlap_credit(backend, None) == 0

    asyncio.run(scenario())


def test_leases_that_share_a_prefix_earn_overlap_credit_on_their_charges() -> None:
    """On a backend that caches prefixes, a holder 96 tokens into its 100-token answer
    (208 charged, 196 held, 12 steps left) and three chats that share its six prompt
    blocks (96 tokens), none started: each charged 208 - 96 = 112, holding 4 of its
    own now, 108 steps left. When the holder ends, its blocks stay with the three:
    at 108 steps they hold 3 x (4 + 108) plus the holder's prompt (100, all it may
    have left behind) = 436; at 12 steps 4 x 12 + 196 + 12 = 256. Peak 436 + a block
    each (64) = 500 of 544 charged: 44 tokens of credit (without what the holder
    leaves behind, 144: too much; taking each lease at its whole prompt, as before,
    none). A 620-token pool then admits a fourth chat of the prefix (656 resident)
    only through the credit, and refuses a fifth."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(620)
        backend = c.backends[0]
        c.set_shares_prefixes(backend, True)
        loop = asyncio.get_running_loop()
        blocks = tuple(f"prefix-{i}" for i in range(6))
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=2048, follow=True,
                      blocks=blocks, block_tokens=16)
        holder = await c.acquire(chat, loop.time())
        c._ledger.mark_ready(holder.lease_id)  # answered: its blocks are cached
        tracker.track(_streamed(holder, 96))
        sharers = [await c.acquire(chat, loop.time()) for _ in range(3)]
        assert [lease.shared_tokens for lease in sharers] == [96, 96, 96]
        for lease in sharers:
            tracker.track(_streamed(lease, 0))
        assert c._ledger.resident("gpu") == 208 + 3 * 112 == 544
        assert tracker.overlap_credit(backend, None) == 44
        assert tracker.overlap_credit(backend, chat) == 44  # it may share: full charge
        fourth = await c.acquire(chat, loop.time() + 0.05)  # 656 > 620: 44 of credit
        assert fourth.shared_tokens == 96 and c._ledger.resident("gpu") == 656
        tracker.track(_streamed(fourth, 0))
        # 16 + 4 x 108 + 100 = 548 at 108 steps, + 80: 28 of credit; 768 > 648
        assert tracker.overlap_credit(backend, chat) == 28
        with pytest.raises(QueueTimeout):
            await c.acquire(chat, loop.time() + 0.05)
        # where the engine shares nothing, an ended lease leaves nothing behind: the
        # peak is 100 less (16 + 4 x 108 + 80)
        c.set_shares_prefixes(backend, False)
        assert tracker.overlap_credit(backend, None) == 656 - (16 + 4 * 108 + 80) == 128
        for lease in [holder, *sharers, fourth]:
            lease.release()
        assert c._ledger.resident("gpu") == 0

    asyncio.run(scenario())


def test_one_healthy_backend_works_out_the_overlap_credit_only_for_a_demand_it_needs() -> None:
    """The credit is a walk of a backend's streamed leases. Where one backend is healthy
    and a demand fits in full without the credit, it changes nothing, so it is not
    worked out; a demand that fits only with it is admitted through it (the test
    above); with two healthy backends the credit ranks them, so it is worked out."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(600)
        loop = asyncio.get_running_loop()
        asked: list[str] = []

        def credit(backend: Backend, demand: Demand | None) -> int:
            asked.append(backend.name)
            return tracker.overlap_credit(backend, demand)

        c.overlap_credit = credit
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=2048, follow=True)
        old = [await c.acquire(chat, loop.time()) for _ in range(2)]
        assert asked == []  # 208 and 416 of 600: they fit as they are
        for lease in old:
            tracker.track(_streamed(lease, 96))
        third = await c.acquire(chat, loop.time() + 0.05)  # 624 > 600: only with 48 credit
        assert asked and c._ledger.resident("gpu") == 624
        for lease in [*old, third]:
            lease.release()

        two = AdmissionController(
            model="m", ledger=MemoryLedger(), ordering=make_ordering("fifo"),
            backends=[Backend(name=n, url="http://127.0.0.1:9", capacity_tokens=600)
                      for n in ("a", "b")])
        asked.clear()
        two.overlap_credit = credit
        (await two.acquire(chat, loop.time())).release()
        assert sorted(asked) == ["a", "b"]
        two.set_healthy(two.backends[1], False)
        asked.clear()
        (await two.acquire(chat, loop.time())).release()
        assert asked == []

    asyncio.run(scenario())


def test_only_streamed_leases_earn_overlap_credit() -> None:
    """The two chats of the test above 96 tokens in, answered without a stream: their
    progress is a guess from time, so they count at their full size and earn nothing;
    streamed, they earn the 48 tokens; finished, nothing again."""
    async def scenario() -> None:
        c, tracker = _learnt_controller(600)
        backend = c.backends[0]
        loop = asyncio.get_running_loop()
        chat = Demand(tokens=208, prompt_tokens=100, max_tokens=2048, follow=True)
        leases = [await c.acquire(chat, loop.time()) for _ in range(2)]
        quiet = [Progress(lease=lease, prompt_tokens=100, max_tokens=2048, n=1,
                          min_tokens=0, stream=False, chat=True, started_s=0.0)
                 for lease in leases]
        for p in quiet:
            p.feed(b"data: {}\n\n" * 99)
            tracker.track(p)
        assert tracker.overlap_credit(backend, chat) == 0
        for p in quiet:
            tracker.finish(p, loop.time(), completed=False)
        streamed = [_streamed(lease, 96) for lease in leases]
        for p in streamed:
            tracker.track(p)
        assert tracker.overlap_credit(backend, chat) == 48
        for p in streamed:
            tracker.finish(p, loop.time(), completed=False)
        assert tracker.overlap_credit(backend, chat) == 0

    asyncio.run(scenario())
