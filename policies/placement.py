"""Placement: which backend with room takes a request.

Where a request's prefix already lives. A backend whose live leases hold some of
the request's leading blocks (ready: their engine has answered) charges it less, and
its engine computes less (a prefix hit); one where they were released recently
probably still caches them (`proxy.recent_blocks`): no smaller charge, the same hit.
Among the backends with room, the one that would hold most of the prefix goes
first, *sticky until saturated*, as llm-d's precise prefix routing and SGLang's
cache-aware router do: it stays first while its fill after the placement is at most
`PREFIX_IMBALANCE` above the least filled backend's that fits; past that the request
goes where the load is (and, once answered there, seeds the prefix there too), so a
hot prefix does not pile onto one backend while others idle. SGLang switches to load
on an absolute gap of 32 running requests; a share of the pool is the same idea in
the unit kvgate admits in.

When the backends that hold most of a prefix are full, a request whose prefix is at
least `STICKY_SHARE` of it (`worth_waiting_for`) waits for room there rather than take
a backend that is not idle (less than `IDLE_FILL` full, and `PREFIX_IMBALANCE` of its
pool less than the homes, now): there it would be computed and held a second time,
and the copy stays, a second home, for as long as the group keeps coming, while the
room it takes would have served several of that backend's own. (With any backend
`PREFIX_IMBALANCE` less loaded taking copies, a G run made 20 copies of 8 groups,
most while the backends filled at different speeds in its first seconds.) It goes
anywhere with room once it has waited a third of its time to the deadline
(`proxy.waiting_room.SPILL_AFTER`), so no backend idles while it waits.
As SGLang's router sends to the busy worker that matches and lets it queue.

A prefix held nowhere yet (no lease there has answered with it) goes where a live
lease already brings it, if it fits there (`Seeding.held`): its engine computes it
first, and the requests after it hit. Else it is seeded by rendezvous hashing of its
opening (`seed_score`) among the backends not much fuller than the least filled
and holding at most half a demand more in prefix blocks than the lightest of those
(`Seeding.spanned_tokens`). Rendezvous alone: every request that opens alike, from
every replica, goes to the same backend, so a group's first requests do not each
seed a copy on another backend (best-fit put every group's first requests on the
first backend with room, and each group ended up held on three or four of them).
Rendezvous among the lightest: hashing 8 groups onto 4 backends gave them 3, 2, 2
and 1 homes, and the lightest backend then drew copies of the others' groups. A
request that finds its prefix's first lease still computing it must not seed again:
in G's first second, 12 of 20 copies came from requests that went where the load
was lighter while their group's first request was still in prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from hashlib import blake2b

__all__ = ["IDLE_FILL", "PREFIX_IMBALANCE", "STICKY_SHARE", "BackendRoom", "PlacementName",
           "Seeding", "rank_backends", "worth_waiting_for"]

# fill (resident / admission room) a prefix-holding backend may run ahead of the least
# filled backend that fits and still be preferred
PREFIX_IMBALANCE = 0.25
# below this fill a backend is idle enough for a copy of a prefix whose homes are full
# (where it is also PREFIX_IMBALANCE less filled than they): busier, its own arrivals
# will fill it, while the copy would be held there for as long as its group comes
IDLE_FILL = 0.5
# share of a demand a backend must hold as its prefix (ready or cached) for the demand to
# wait for that backend rather than go to one that is not clearly less loaded
STICKY_SHARE = 1 / 3


class PlacementName(StrEnum):
    BEST_FIT = "best-fit"  # least free room that still fits: keeps big holes for big requests
    LEAST_RESIDENT = "least-resident"  # spread load evenly


@dataclass(frozen=True, slots=True)
class Seeding:
    """What seeds a new prefix on a backend: the demand's seed key (its opening,
    `proxy.prefix_view.PrefixView.seed_key`; empty: no seeding), whether a live lease
    there holds that key (answered or not yet), and the tokens its live leases' prefix
    blocks span there (each block once: the prefixes it is home to)."""

    key: str = ""
    held: bool = False
    spanned_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendRoom:
    name: str
    capacity_tokens: int
    resident_tokens: int
    shared_tokens: int = 0  # of the demand, held there in ready shared blocks: not charged
    cached_tokens: int = 0  # more of its prefix, probably still in the engine's cache there
    seeding: Seeding = Seeding()  # how a new prefix of the demand is seeded (`Seeding`)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.resident_tokens

    @property
    def prefix_tokens(self) -> int:
        """Of the demand's prefix, what the engine there would not compute again."""
        return self.shared_tokens + self.cached_tokens

    def cost(self, demand_tokens: int) -> int:
        """What the demand adds here."""
        return demand_tokens - self.shared_tokens

    @property
    def seed(self) -> int:
        """The demand's rendezvous score here: asked only when placement needs it."""
        return seed_score(self.seeding.key, self.name) if self.seeding.key else 0

    @property
    def fill(self) -> float:
        return self.resident_tokens / max(1, self.capacity_tokens)

    def fill_after(self, demand_tokens: int) -> float:
        return (self.resident_tokens + self.cost(demand_tokens)) / max(1, self.capacity_tokens)


def rank_backends(
    backends: Sequence[BackendRoom], demand_tokens: int, policy: PlacementName,
    *, spill: bool = False,
) -> list[str]:
    """Backends that fit `demand_tokens` now (less what each shares), best first; ties
    keep config order. Unless `spill`, a demand that a backend without room would serve
    for much less (`worth_waiting_for`) goes only where the load is clearly lighter (by
    `PREFIX_IMBALANCE`): else it waits for room there."""
    fitting = [b for b in backends if b.free_tokens >= b.cost(demand_tokens)]
    if policy is PlacementName.BEST_FIT:
        fitting.sort(key=lambda b: b.free_tokens - b.cost(demand_tokens))
    else:
        fitting.sort(key=lambda b: b.resident_tokens / max(1, b.capacity_tokens))
    if not fitting:
        return []
    least = min(b.fill_after(demand_tokens) for b in fitting)
    near = [b for b in fitting if b.fill_after(demand_tokens) <= least + PREFIX_IMBALANCE]
    if max(b.prefix_tokens for b in backends) == 0:
        # a prefix held nowhere: where it is computed now, else its seed's backend
        seeded = _seeded(fitting, near, demand_tokens)
        if seeded is None:
            return [b.name for b in fitting]
        return [seeded.name] + [b.name for b in fitting if b is not seeded]
    sticky = [b for b in near if b.prefix_tokens > 0]
    sticky.sort(key=lambda b: (-b.prefix_tokens, -b.seed))  # stable: the policy's order
    rest = [b for b in fitting if b not in sticky]
    homes = [] if spill else worth_waiting_for(backends, demand_tokens)
    if homes and not any(b in fitting for b in homes):
        home_fill = min(b.fill for b in homes)  # loaded now: the least loaded home
        rest = [b for b in rest if b.prefix_tokens * 2 >= homes[0].prefix_tokens
                or (b.fill + PREFIX_IMBALANCE <= home_fill and b.fill < IDLE_FILL)]
    return [b.name for b in sticky + rest]


def _seeded(fitting: list[BackendRoom], near: list[BackendRoom],
            demand_tokens: int) -> BackendRoom | None:
    """Where a prefix held nowhere goes (module docstring); None: no seed key."""
    bringing = [b for b in fitting if b.seeding.held]
    if bringing:
        return min(bringing, key=lambda b: b.fill_after(demand_tokens))
    keyed = [b for b in near if b.seeding.key]
    if not keyed:
        return None
    lightest = min(b.seeding.spanned_tokens for b in keyed)
    return max((b for b in keyed if b.seeding.spanned_tokens <= lightest + demand_tokens // 2),
               key=lambda b: b.seed)


def worth_waiting_for(backends: Sequence[BackendRoom], demand_tokens: int) -> list[BackendRoom]:
    """The backends that hold the longest of the demand's prefix, when that prefix is at
    least `STICKY_SHARE` of the demand and they could ever take it: anywhere else an
    engine would compute that much again and hold a second copy of it."""
    best = max((b.prefix_tokens for b in backends), default=0)
    if best == 0 or best < STICKY_SHARE * demand_tokens:
        return []
    return [b for b in backends
            if b.prefix_tokens == best and b.cost(demand_tokens) <= b.capacity_tokens]


@lru_cache(maxsize=8192)
def seed_score(key: str, backend: str) -> int:
    """Rendezvous (highest random weight) hashing of a prefix's key onto a backend: of
    the backends that hold none of a new prefix, each replica picks the same one (the
    highest score), and a backend that leaves moves only the prefixes it had.
    Remembered: dispatch asks again for every waiter on every pass."""
    return int.from_bytes(blake2b(f"{backend}\0{key}".encode(), digest_size=8).digest())
