"""The prediction behind admission by deadline, worked by hand."""

from __future__ import annotations

from proxy.deadlines import predict_waits


def test_waiters_that_time_out_take_no_room() -> None:
    # rate 100/s, 50 free: the first needs 50 more (0.5 s, in time); the second would
    # need 150 more (1.5 s) but leaves at 0.2 s; the third needs 100 more (1.0 s).
    waits = predict_waits(100.0, 50, [(100, 5.0), (100, 0.2), (50, 1.0)], now=0.0)
    assert waits == [(0.5, True), (1.5, False), (1.0, True)]


def test_free_room_starts_a_waiter_at_once() -> None:
    assert predict_waits(10.0, 500, [(200, 0.0), (300, 0.0), (1, 0.0)], now=0.0) == [
        (0.0, True), (0.0, True), (0.1, False)]
