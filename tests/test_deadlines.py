"""The prediction behind admission by deadline, worked by hand."""

from __future__ import annotations

import math

import pytest

from proxy.deadlines import passed_wait_s, predict_waits
from proxy.release_rate import ReleaseRate


def test_waiters_that_time_out_take_no_room() -> None:
    # rate 100/s, 50 free: the first needs 50 more (0.5 s, in time); the second would
    # need 150 more (1.5 s) but leaves at 0.2 s; the third needs 100 more (1.0 s).
    waits = predict_waits(100.0, 50, [(100, 5.0), (100, 0.2), (50, 1.0)], now=0.0)
    assert waits == [(0.5, True), (1.5, False), (1.0, True)]


def test_free_room_starts_a_waiter_at_once() -> None:
    assert predict_waits(10.0, 500, [(200, 0.0), (300, 0.0), (1, 0.0)], now=0.0) == [
        (0.0, True), (0.0, True), (0.1, False)]


def test_smaller_arrivals_that_pass_stretch_a_newcomers_wait() -> None:
    # 1 s ahead in queue order at 5,000 tokens/s, 2,500 tokens/s of smaller arrivals
    # passing it: what is ahead drains at 2,500 tokens/s, so 2 s.
    assert passed_wait_s(1.0, 5000.0, 2500.0) == 2.0
    assert passed_wait_s(1.0, 5000.0, 0.0) == 1.0
    assert passed_wait_s(0.0, 5000.0, 6000.0) == 0.0  # room now: nothing passes it
    assert passed_wait_s(0.5, 5000.0, 5000.0) == math.inf  # they take all the room


def test_nobody_passes_a_newcomer_that_starves() -> None:
    # they take all the room for 5 s; then what is ahead (0.5 s at the whole rate) drains
    assert passed_wait_s(0.5, 5000.0, 5000.0, nobody_passes_after_s=5.0) == 5.5
    assert passed_wait_s(0.5, 5000.0, 9000.0, nobody_passes_after_s=5.0) == 5.5
    # half the room for 1 s (0.2 s of the 1 s ahead done), then the rest at full rate
    assert passed_wait_s(1.0, 5000.0, 4000.0, nobody_passes_after_s=1.0) == pytest.approx(1.8)
    # starving later than it would start: the bound changes nothing
    assert passed_wait_s(1.0, 5000.0, 2500.0, nobody_passes_after_s=5.0) == 2.0


def test_passing_counts_smaller_arrivals_over_the_whole_window() -> None:
    now = [0.0]
    rate = ReleaseRate(window_s=30, clock=lambda: now[0])
    assert rate.passing_tokens_per_s(500) == 0.0  # nothing has joined yet
    rate.queued(300)
    rate.queued(900)
    now[0] = 30.0
    assert rate.passing_tokens_per_s(500) == 10.0  # 300 tokens / 30 s; 900 is not smaller
    assert rate.passing_tokens_per_s(1000) == 40.0
    assert rate.passing_tokens_per_s(300) == 0.0  # an equal does not pass
    now[0] = 31.0
    assert rate.passing_tokens_per_s(1000) == 0.0


def test_passing_at_a_cold_start_is_over_the_time_seen_not_the_whole_window() -> None:
    """Read over the whole 30 s window, the first seconds of a burst under-read how much
    passes a large newcomer, which was queued, passed, and refused after waiting
    (`kvgate simulate`, 34 s windows of the Azure conversation trace at 2x: refusals
    answered within 50 ms 57-67% -> 73-87%)."""
    now = [100.0]
    rate = ReleaseRate(window_s=30, clock=lambda: now[0])
    rate.queued(300)
    now[0] = 100.5
    assert rate.passing_tokens_per_s(500) == 60.0  # over 5 s at least: an instant is no rate
    now[0] = 110.0
    rate.queued(600)
    assert rate.passing_tokens_per_s(1000) == 90.0  # 900 tokens / 10 s
    now[0] = 130.0
    assert rate.passing_tokens_per_s(1000) == 30.0  # the whole window once it is seen


class _Held:
    def __init__(self, lease_id: str, tokens: int, shared_tokens: int = 0) -> None:
        self.lease_id, self.tokens, self.shared_tokens = lease_id, tokens, shared_tokens


def test_before_any_release_the_live_leases_give_a_drain_rate_to_judge_arrivals_on() -> None:
    """Once a live lease has run 1 s, each frees its charged tokens at a quarter of
    tokens / age (an age of 1 s at least); the prior goes once the busy rate is
    measured."""
    now = [0.0]
    rate = ReleaseRate(window_s=30, clock=lambda: now[0], min_busy_releases=2)
    assert rate.arrival_tokens_per_s() is None  # nothing live, nothing released
    a, b = _Held("a", 1_000), _Held("b", 800, shared_tokens=200)
    rate.started(a)
    now[0] = 0.9
    assert rate.arrival_tokens_per_s() is None  # no lease has run a second yet
    now[0] = 1.5
    rate.started(b)  # just granted: counted as 1 s old
    assert rate.arrival_tokens_per_s() == pytest.approx(0.25 * (1_000 / 1.5 + 600 / 1.0))
    now[0] = 4.0
    assert rate.cold_start_tokens_per_s() == pytest.approx(0.25 * (1_000 / 4.0 + 600 / 2.5))
    assert rate.busy_tokens_per_s() is None  # the measured rate: still unknown
    rate.set_busy(True)
    rate.released(a)  # frees what it was charged, and leaves the prior
    assert rate.arrival_tokens_per_s() == pytest.approx(0.25 * 600 / 2.5)
    now[0] = 4.5
    rate.released(b)
    assert rate.cold_start_tokens_per_s() is None
    # two busy releases, 1,600 tokens over 0.5 s of waiting: measured, and judged on
    assert rate.arrival_tokens_per_s() == rate.busy_tokens_per_s() == pytest.approx(3_200)
