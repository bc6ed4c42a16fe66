"""`kvgate simulate` with shared prefixes: hash ids reach the engines and the ledger."""

from __future__ import annotations

import random

from policies.engines import PrefixSharing
from policies.placement import (
    STICKY_SHARE,
    BackendRoom,
    PlacementName,
    Seeding,
    rank_backends,
    seed_score,
)
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


def _room(name: str, resident: int, *, capacity: int = 1000, shared: int = 0,
          cached: int = 0, key: str | None = None, held: bool = False,
          spanned: int = 0) -> BackendRoom:
    return BackendRoom(name=name, capacity_tokens=capacity, resident_tokens=resident,
                       shared_tokens=shared, cached_tokens=cached,
                       seeding=Seeding(key or "", held, spanned))


def test_a_prefix_held_nowhere_is_seeded_by_rendezvous_hashing_of_its_opening() -> None:
    names = ["a", "b", "c", "d"]
    firsts = []
    for i in range(400):
        k = f"{i:016x}"
        ranked = rank_backends([_room(n, 100, key=k) for n in names], 300,
                               PlacementName.BEST_FIT)
        # the highest score goes first, the rest keep the policy's order
        best = max(names, key=lambda n: seed_score(k, n))
        assert ranked == [best] + [n for n in names if n != best]
        firsts.append(best)
    # a key picks the same backend every time (every replica computes the same scores),
    # and keys spread over the backends: 100 each expected
    assert all(60 <= firsts.count(n) <= 140 for n in names), [firsts.count(n) for n in names]
    # the seeded backend gives way when it is much fuller than the least filled one
    k = next(f"{i:016x}" for i in range(100)
             if max(names, key=lambda n, i=i: seed_score(f"{i:016x}", n)) == "a")
    rooms = [_room("a", 600, key=k), *(_room(n, 100, key=k) for n in names[1:])]
    assert rank_backends(rooms, 300, PlacementName.BEST_FIT)[0] != "a"


def test_a_new_prefix_is_seeded_among_the_backends_home_to_the_fewest_prefixes() -> None:
    names = ["a", "b", "c", "d"]
    spans = {"a": 4096, "b": 2048, "c": 1000, "d": 600}  # prefix blocks held there
    firsts = []
    for i in range(400):
        k = f"{i:016x}"
        rooms = [_room(n, 1000, capacity=10_000, key=k, spanned=spans[n]) for n in names]
        firsts.append(rank_backends(rooms, 2600, PlacementName.BEST_FIT)[0])
    # within half a demand (1,300 tokens) of the lightest: c and d, by rendezvous
    assert {n: firsts.count(n) for n in names if firsts.count(n)}.keys() == {"c", "d"}
    assert all(140 <= firsts.count(n) <= 260 for n in ("c", "d")), firsts.count("c")
    # a smaller demand's half is smaller: d alone
    rooms = [_room(n, 1000, capacity=10_000, key="00", spanned=spans[n]) for n in names]
    assert rank_backends(rooms, 600, PlacementName.BEST_FIT)[0] == "d"


def test_a_prefix_still_being_computed_draws_the_requests_that_bring_it() -> None:
    # "a" holds the demand's seed block through a lease that has not answered yet: no
    # prefix ready or cached anywhere, and "a" is much fuller than "b" (60% against 0%)
    rooms = [_room("a", 600, key="k", held=True), _room("b", 0, key="k")]
    assert rank_backends(rooms, 300, PlacementName.LEAST_RESIDENT) == ["a", "b"]
    # of two that bring it, the one less filled after it
    rooms = [_room("a", 600, key="k", held=True), _room("b", 0, key="k"),
             _room("c", 500, key="k", held=True)]
    assert rank_backends(rooms, 300, PlacementName.BEST_FIT)[0] == "c"
    # where it does not fit, it is seeded as if held nowhere: among the others
    rooms = [_room("a", 800, key="k", held=True), _room("b", 0, key="k")]
    assert rank_backends(rooms, 300, PlacementName.BEST_FIT) == ["b"]


def test_a_demand_waits_for_the_backend_that_holds_its_prefix_unless_another_is_emptier(
) -> None:
    # "h" holds 300 of the demand's 400 tokens ready but is full (95%); "o" fits it
    # whole but is not clearly less loaded (75%, not 25% of its pool below "h")
    home = _room("h", 950, shared=300)
    other = _room("o", 1500, capacity=2000)
    assert rank_backends([home, other], 400, PlacementName.BEST_FIT) == []
    # ... unless it may spill (it has waited long enough)
    assert rank_backends([home, other], 400, PlacementName.BEST_FIT, spill=True) == ["o"]
    # or the other backend is idle: less than half full, and 25% of its pool below "h"
    assert rank_backends([home, _room("o", 980, capacity=2000)], 400,
                         PlacementName.BEST_FIT) == ["o"]
    # 70% against 95% is less loaded, but busy with its own: a copy there would hold the
    # prefix twice for as long as the group keeps coming
    assert rank_backends([home, _room("o", 1400, capacity=2000)], 400,
                         PlacementName.BEST_FIT) == []
    # a prefix probably still cached there holds it back the same way
    cached_home = _room("h", 950, cached=300)
    assert rank_backends([cached_home, other], 400, PlacementName.BEST_FIT) == []
    # so does another backend's copy of half of it or more: it goes there
    half = _room("x", 1500, capacity=2000, shared=150)
    assert rank_backends([home, other, half], 400, PlacementName.BEST_FIT) == ["x"]
    # a prefix below STICKY_SHARE of the demand is not worth waiting for
    assert STICKY_SHARE * 400 > 120
    assert rank_backends([_room("h", 990, shared=120), other], 400,
                         PlacementName.BEST_FIT) == ["o"]
    # a home that could never take it (its cost is above its whole room) is no home
    assert rank_backends([_room("h", 0, capacity=90, shared=300), other], 400,
                         PlacementName.BEST_FIT) == ["o"]
