"""The CPU lane of large bodies (`proxy.tokenize.cpu_lane`): its budget, its turns by
tenant, cancellation, and over HTTP which requests run in it and that their answers
are what they were.

No timed assertion: the budget is checked from what it charged and which job waited,
the turns from the order jobs started in; the share itself is measured in
benchmarks/bench_hostile.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp

from proxy.tokenize.cpu_lane import LARGE_BODY_BYTES, CpuLane, Flow, cpu_lane, large_body
from tests.support.stack import MODEL, running_stack

T = TypeVar("T")


def in_thread(job: Callable[[], T]) -> asyncio.Future[T]:
    return asyncio.get_running_loop().run_in_executor(None, job)


def spin(cpu_s: float) -> float:
    """Burn `cpu_s` of this thread's CPU time; -> what it burnt."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass
    return time.thread_time() - t0


def test_a_job_in_debt_makes_the_next_wait_and_is_charged_its_cpu() -> None:
    async def scenario() -> tuple[CpuLane, list[str], float]:
        lane = CpuLane(share=50.0, burst_s=0.0)  # debt repaid at 50 CPU-s per second
        order: list[str] = []

        async def job(name: str, cpu_s: float) -> float:
            def work() -> float:
                order.append(f"{name} starts")
                spent = spin(cpu_s)
                order.append(f"{name} ends")
                return spent

            return await lane.run("t", in_thread, work)

        async with asyncio.timeout(30):
            spent = await asyncio.gather(job("a", 0.02), job("b", 0.0))
        return lane, order, spent[0]

    lane, order, spent = asyncio.run(scenario())
    assert order == ["a starts", "a ends", "b starts", "b ends"]  # one at a time
    assert lane.jobs == 2 and lane.waited == 1
    assert lane.spent_s >= spent >= 0.02
    assert not lane._busy and lane.waiting() == 0


def test_tenants_of_equal_use_take_turns() -> None:
    """Behind z's running job, x queues two jobs, then y one: neither has used any CPU,
    so x's first (the longest waiting) goes first, then y's, then x's second."""
    async def scenario() -> list[str]:
        lane = CpuLane(share=1.0, burst_s=10.0)
        order: list[str] = []
        gate = threading.Event()

        def first() -> None:
            gate.wait(30)

        async def job(tenant: str, name: str) -> None:
            await lane.run(tenant, in_thread, order.append, name)

        async with asyncio.timeout(30):
            running = asyncio.ensure_future(lane.run("z", in_thread, first))
            await asyncio.sleep(0.05)
            waiting = [asyncio.ensure_future(job("x", "x1")),
                       asyncio.ensure_future(job("x", "x2"))]
            await asyncio.sleep(0)
            waiting.append(asyncio.ensure_future(job("y", "y1")))
            await asyncio.sleep(0.05)
            assert lane.waiting() == 3 and not order
            gate.set()
            await asyncio.gather(running, *waiting)
        return order

    assert asyncio.run(scenario()) == ["x1", "y1", "x2"]


def test_the_tenant_that_used_the_least_cpu_goes_first() -> None:
    """x's jobs cost 20 ms of CPU each, y's next to nothing: once x's first has run,
    all of y's go before x's next (plain turns would alternate x2, y1, x3, y2, ...)."""
    async def scenario() -> list[str]:
        lane = CpuLane(share=1000.0, burst_s=10.0)  # no debt to wait for: order only
        order: list[str] = []
        gate = threading.Event()

        def heavy(name: str) -> None:
            gate.wait(30)
            spin(0.02)
            order.append(name)

        async with asyncio.timeout(30):
            jobs = [asyncio.ensure_future(lane.run("x", in_thread, heavy, "x1"))]
            await asyncio.sleep(0.05)
            jobs += [asyncio.ensure_future(lane.run("x", in_thread, heavy, name))
                     for name in ("x2", "x3")]
            await asyncio.sleep(0)
            jobs += [asyncio.ensure_future(lane.run("y", in_thread, order.append, name))
                     for name in ("y1", "y2", "y3")]
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(*jobs)
        assert lane._used == {} and lane.waiting() == 0  # idle: the tally starts again
        return order

    assert asyncio.run(scenario()) == ["x1", "y1", "y2", "y3", "x2", "x3"]


def test_within_a_tenant_the_request_that_used_the_least_goes_first() -> None:
    """One tenant, two requests: a's jobs cost 20 ms each, b's next to nothing; after
    a's first, b's go before a's next."""
    async def scenario() -> list[str]:
        lane = CpuLane(share=1000.0, burst_s=10.0)
        order: list[str] = []
        gate = threading.Event()
        a, b = Flow(), Flow()

        def heavy(name: str) -> None:
            gate.wait(30)
            spin(0.02)
            order.append(name)

        async with asyncio.timeout(30):
            jobs = [asyncio.ensure_future(lane.run("t", in_thread, heavy, "a1", flow=a))]
            await asyncio.sleep(0.05)
            jobs += [asyncio.ensure_future(lane.run("t", in_thread, heavy, name, flow=a))
                     for name in ("a2", "a3")]
            await asyncio.sleep(0)
            jobs += [asyncio.ensure_future(lane.run("t", in_thread, order.append, name,
                                                    flow=b))
                     for name in ("b1", "b2")]
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(*jobs)
        return order

    assert asyncio.run(scenario()) == ["a1", "b1", "b2", "a2", "a3"]


def test_cancelled_jobs_free_the_lane_and_a_running_one_holds_it_to_its_end() -> None:
    async def scenario() -> tuple[list[str], CpuLane]:
        lane = CpuLane(share=1.0, burst_s=10.0)
        order: list[str] = []
        release = threading.Event()

        def long() -> None:
            order.append("long starts")
            release.wait(30)
            order.append("long ends")

        async with asyncio.timeout(30):
            running = asyncio.ensure_future(lane.run("x", in_thread, long))
            await asyncio.sleep(0.05)
            queued = asyncio.ensure_future(lane.run("y", in_thread, order.append, "never"))
            later = asyncio.ensure_future(lane.run("z", in_thread, order.append, "z"))
            await asyncio.sleep(0.05)
            queued.cancel()
            running.cancel()  # its thread still runs: the lane stays held
            await asyncio.sleep(0.05)
            assert order == ["long starts"] and lane._busy
            release.set()
            await later
        return order, lane

    order, lane = asyncio.run(scenario())
    assert order == ["long starts", "long ends", "z"]
    assert not lane._busy and lane.waiting() == 0


# ------------------------------------------------------------------ over HTTP


def _padded(body: dict[str, Any], size: int) -> bytes:
    """`body` with whitespace before its closing brace: the same request, `size` bytes."""
    raw = json.dumps(body)
    return (raw[:-1] + " " * (size - len(raw)) + "}").encode()


def test_large_bodies_run_in_the_lane_small_ones_never_and_answers_are_unchanged() -> None:
    chat = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]}
    long_text = "Token-aware admission, counted exactly. " * 20_000  # ~800 KB, > context
    cases: list[tuple[str, bytes, int, str | None]] = [
        ("/v1/chat/completions", _padded(chat, LARGE_BODY_BYTES + 10), 200, None),
        ("/v1/chat/completions", json.dumps(
            {**chat, "messages": [{"role": "user", "content": long_text}]}).encode(),
         400, "context_length_exceeded"),
        ("/v1/completions", json.dumps(
            {"model": MODEL, "max_tokens": 1, "prompt": ["a"] * 100_000}).encode(),
         413, "request_too_large"),
        ("/v1/chat/completions", _padded({**chat, "stream": "yes"}, LARGE_BODY_BYTES),
         400, "invalid_request"),
        ("/v1/chat/completions", b"[" * 100 + b" " * LARGE_BODY_BYTES, 400,
         "invalid_request"),
    ]

    async def scenario() -> tuple[list[tuple[int, str | None]], int, int, int,
                                  dict[str, int]]:
        async with running_stack(backends=1, kv_tokens=65536) as stack, \
                aiohttp.ClientSession() as s:
            lane = cpu_lane()
            answers: list[tuple[int, str | None]] = []
            async with asyncio.timeout(120):
                for _ in range(3):  # small ones: never in the lane
                    async with s.post(f"{stack.url}/v1/chat/completions", json=chat) as r:
                        assert r.status == 200, await r.text()
                small_jobs = lane.jobs
                for path, raw, _, _ in cases:
                    async with s.post(stack.url + path, data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                        body = await r.json()
                        answers.append((r.status, body.get("error", {}).get("code")))
                large_jobs = lane.jobs
                async with s.post(f"{stack.url}/v1/chat/completions", json=chat) as r:
                    assert r.status == 200  # the keep-alive connection carries no mark
                after = lane.jobs
                assert large_body.get() is None
            return answers, small_jobs, large_jobs, after, stack.resident()

    answers, small_jobs, large_jobs, after, resident = asyncio.run(scenario())
    assert answers == [(status, code) for _, _, status, code in cases]
    assert small_jobs == 0
    # each large body's check is a job; the long prompt's render and counting more
    assert large_jobs > len(cases)
    assert after == large_jobs
    assert set(resident.values()) == {0}
