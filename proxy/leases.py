"""What admission places and holds: a demand, the backend it goes to, the lease it gets.

Plain state. A `Backend`'s capacity, health, admission target and in-flight count
are written only by the `AdmissionController` that owns it (`proxy.admission`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Backend", "Demand", "Lease", "sole_healthy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Demand:
    """What one request will hold: ledger tokens, and the numbers behind them."""

    tokens: int
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    priority: str = ""
    tenant: str = ""
    min_tokens: int = 0
    follow: bool = False  # an adaptive lease: sized from history, resized as it runs
    # the keys of its prompt's shareable full blocks (`proxy.prefix_blocks`), inside
    # `tokens`, `block_tokens` each; charged once per backend that shares prefixes
    blocks: tuple[str, ...] = ()
    block_tokens: int = 0
    held_place: bool = False  # it brought a good ticket (`proxy.tickets`)


class Backend:
    """A backend's capacity and live health, as the controller sees it.

    Read by anyone, written only by its `AdmissionController` (`set_capacity`,
    `set_healthy`, `set_target_factor`, and the leases it grants): every change that
    can open room then wakes the queue in the one place that knows about it.
    """

    __slots__ = ("_capacity_tokens", "_healthy", "_inflight", "_shares_prefixes", "_slots",
                 "_target_factor", "api_key", "name", "url")

    def __init__(self, *, name: str, url: str, capacity_tokens: int, api_key: str | None = None,
                 slots: int | None = None):
        self.name = name
        self.url = url.rstrip("/")
        self.api_key = api_key
        self._capacity_tokens = capacity_tokens
        self._healthy = capacity_tokens > 0  # unknown capacity: not ready yet
        self._inflight = 0
        self._slots = slots
        # The share of capacity new admissions may fill (adaptive reservation moves
        # it from the engine's own figures); growth of live leases may use it all.
        self._target_factor = 1.0
        self._shares_prefixes = False

    @property
    def shares_prefixes(self) -> bool:
        """Whether its engine holds a prefix block once for every request that uses it
        (prefix caching on): only then are a lease's shared blocks charged once."""
        return self._shares_prefixes

    @property
    def capacity_tokens(self) -> int:
        return self._capacity_tokens

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def inflight(self) -> int:
        """Leases this process holds on the backend now."""
        return self._inflight

    @property
    def slots(self) -> int | None:
        """Requests the engine runs at once; more would wait inside it, out of sight of
        kvgate's queue (llama.cpp's slots). None: no such limit."""
        return self._slots

    @property
    def slot_free(self) -> bool:
        return self._slots is None or self._inflight < self._slots

    @property
    def target_factor(self) -> float:
        return self._target_factor

    @property
    def target_tokens(self) -> int:
        return int(self._capacity_tokens * self._target_factor)


def sole_healthy(backends: Iterable[Backend]) -> Backend | None:
    """The one healthy backend, where exactly one is."""
    sole = None
    for backend in backends:
        if backend.healthy:
            if sole is not None:
                return None
            sole = backend
    return sole


class Lease:
    """Tokens held on one backend until `release()`; releasing twice is a no-op."""

    def __init__(
        self,
        *,
        lease_id: str,
        backend: Backend,
        demand: Demand,
        on_release: Callable[[Lease], None],
        on_answer: Callable[[Lease], None] | None = None,
    ) -> None:
        self.lease_id = lease_id
        self.backend = backend
        self.demand = demand
        self.tokens = demand.tokens  # what the ledger holds now; adaptive leases resize
        self.wanted_tokens = demand.tokens  # what the lease asked for at its last resize
        self.shared_tokens = 0  # of `tokens`, covered by other leases' ready blocks at reserve
        self._on_release = on_release
        self._on_answer = on_answer
        self._released = False
        self._answered = False

    @property
    def shortfall_tokens(self) -> int:
        """Tokens a live lease wanted to grow by but found no room for."""
        return max(0, self.wanted_tokens - self.tokens)

    @property
    def was_answered(self) -> bool:
        return self._answered

    @property
    def released(self) -> bool:
        return self._released

    def on_answer(self, callback: Callable[[Lease], None]) -> None:
        """Call `callback` when the engine begins to answer (at once if it has): for a
        lease whose block keys were registered after it was granted (`Ledger.attach`)."""
        self._on_answer = callback
        if self._answered and not self._released:
            callback(self)

    def answered(self) -> None:
        """The engine has begun to answer (its prefill is done): once, before release."""
        if self._answered or self._released:
            return
        self._answered = True
        if self._on_answer is not None:
            self._on_answer(self)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._on_release(self)
