"""`kvgate simulate` with shared prefixes: hash ids reach the engines and the ledger."""

from __future__ import annotations

import random

from policies.engines import PrefixSharing
from policies.placement import BackendRoom, PlacementName, rank_backends
from policies.reservation import ReservationMode
from proxy.config import QueueConfig
from proxy.recent_blocks import RecentBlocks
from proxy.replay import Scenario, TraceRequest, simulate


def _groups(n: int, *, groups: int = 4, seed: int = 0) -> list[TraceRequest]:
    """Requests of `groups` applications, each with its own 4,096-token system prompt
    (8 hash ids) and a unique 512-token question: the llm-d shape, in hash ids."""
    rng = random.Random(seed)
    out = []
    fresh = 10_000
    for i in range(n):
        g = rng.randrange(groups)
        ids = (*(g * 100 + k for k in range(8)), fresh + i)
        out.append(TraceRequest(arrival_s=i * 0.02, prompt_tokens=9 * 512,
                                output_tokens=rng.randrange(20, 200), hash_ids=ids))
    return out


def _scenario(sharing: PrefixSharing, **kw: object) -> Scenario:
    return Scenario(capacity_tokens=32_768, backends=2, reservation=ReservationMode.STRICT,
                    queue=QueueConfig(max_depth=256, default_deadline_s=3.0),
                    client="cap-256", ttft_slo_s=3.0, prefix_sharing=sharing,
                    **kw)  # type: ignore[arg-type]


def test_shared_system_prompts_are_charged_once_and_serve_more() -> None:
    requests = _groups(600)
    blind = simulate(requests, _scenario(PrefixSharing.OFF))
    aware = simulate(requests, _scenario(PrefixSharing.AUTO))
    for report in (blind, aware):
        assert report.completed + report.rejected_total == len(requests)
        assert report.preemptions == 0  # strict: nothing shared was double-booked
        assert report.ledger_use["peak"] <= 1.0
    assert blind.shared_prefix_tokens == 0
    assert aware.shared_prefix_tokens > 0
    # what kvgate did not charge, the engines hit (they hit cached free blocks too)
    assert aware.shared_prefix_tokens <= aware.engine_prefix_hit_tokens
    assert aware.completed > 1.3 * blind.completed, (aware.completed, blind.completed)
    assert aware.goodput > blind.goodput


def test_engines_without_prefix_caching_share_nothing() -> None:
    report = simulate(_groups(200), _scenario(PrefixSharing.AUTO, prefix_caching=False))
    assert report.shared_prefix_tokens == 0 and report.engine_prefix_hit_tokens == 0


def test_recent_blocks_is_a_bounded_lru() -> None:
    recent = RecentBlocks(capacity_blocks=3)
    recent.remember(["a", "b", "c"])
    assert recent.leading(["a", "b", "c", "d"]) == 3
    recent.remember(["a"])  # a is now the most recent
    recent.remember(["d"])  # b goes
    assert len(recent) == 3
    assert recent.leading(["a", "b"]) == 1
    assert recent.leading(["x", "c"], start=1) == 1


def test_placement_is_sticky_to_a_prefix_until_that_backend_is_much_fuller() -> None:
    def room(name: str, resident: int, shared: int = 0, cached: int = 0) -> BackendRoom:
        return BackendRoom(name=name, capacity_tokens=1000, resident_tokens=resident,
                           shared_tokens=shared, cached_tokens=cached)

    # b holds 200 of the demand's 300 tokens: it costs 100 there and goes first,
    # although best-fit alone would pick a (least room left after it)
    rooms = [room("a", 650), room("b", 500, shared=200)]
    assert rank_backends(rooms, 300, PlacementName.BEST_FIT) == ["b", "a"]
    # fits only because of what it shares: 950 + 100 <= 1000 would not without it
    assert rank_backends([room("a", 950, shared=250)], 300, PlacementName.BEST_FIT) == ["a"]
    # a cached prefix (no smaller charge) also attracts it
    rooms = [room("a", 100), room("b", 200, cached=128)]
    assert rank_backends(rooms, 300, PlacementName.LEAST_RESIDENT) == ["b", "a"]
    # more than 25% of the pool fuller than the least filled: the load wins
    rooms = [room("a", 100), room("b", 500, shared=100)]
    assert rank_backends(rooms, 300, PlacementName.LEAST_RESIDENT) == ["a", "b"]
