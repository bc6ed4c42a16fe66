"""Admission: place a demand on a backend with room, or wait in a bounded queue.

No HTTP here. One `AdmissionController` per served model owns its backends'
view, its waiting room and its dispatch. The flow:

    lease = await controller.acquire(demand, deadline)   # QueueFull / QueueTimeout / ...
    try:
        ...forward...
    finally:
        lease.release()                                   # sync, idempotent

Dispatch offers capacity to waiters in the ordering policy's order and lets
smaller waiters backfill past one that does not fit yet, until the head has
waited `starvation_s`: then nobody passes it, so it gets the next room that
opens (unless it holds out for its prefix's backend while another has room for it:
then it would hold the queue for room it refuses). That bounds both head-of-line
blocking and starvation.

Its parts elsewhere: who waits and in which order (`proxy.waiting_room`), how much of
a demand's prefix each backend holds (`proxy.prefix_view`), when a waiter could start
at the recent release rate (`proxy.queue_forecast`), and the setters of its backends'
state (`proxy.backend_state`).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from policies.ordering import Ordering
from policies.placement import BackendRoom, PlacementName, rank_backends
from proxy.backend_state import BackendWriter
from proxy.errors import LedgerUnavailable, NoBackend, QueueFull, QueueTimeout, RequestTooLarge
from proxy.leases import Backend, Demand, Lease, sole_healthy
from proxy.ledger import Ledger
from proxy.prefix_view import PrefixView
from proxy.queue_forecast import forecast, predicted_late
from proxy.release_rate import ReleaseRate
from proxy.waiting_room import Waiter, WaitingRoom

__all__ = ["AdmissionController", "Backend", "Demand", "Lease", "ReleaseRate"]

# Lease ids: 64 random bits per process and a counter. Unique across the replicas that
# share a Redis ledger (which relies on it to recognise a retried reserve) without a
# random-number system call per lease, as uuid4() makes.
_LEASE_PREFIX = secrets.token_hex(8)
_lease_seq = itertools.count(1)


class AdmissionController(BackendWriter):
    """Reserve-or-queue for one model's backends; see the module docstring."""

    def __init__(
        self,
        *,
        model: str,
        backends: Sequence[Backend],
        ledger: Ledger,
        ordering: Ordering,
        placement: PlacementName = PlacementName.BEST_FIT,
        max_queue_depth: int = 128,
        max_depth_by_priority: Mapping[str, int] | None = None,
        starvation_s: float = 5.0,
        on_event: Callable[[str, Lease | None], None] | None = None,
    ) -> None:
        if not backends:
            raise ValueError(f"model {model!r} has no backends")
        self.model = model
        self.backends = list(backends)
        self._by_name = {b.name: b for b in self.backends}
        self._ledger = ledger
        self._ordering = ordering
        self._placement = placement
        self._max_depth = max_queue_depth
        self._starvation_s = starvation_s
        self._room = WaitingRoom(ordering, max_depth=max_queue_depth,
                                 class_depths=max_depth_by_priority)
        self._dispatching = False
        self._dispatch_again = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.release_rate = ReleaseRate()
        # per backend, how much of a demand's prefix it holds (`proxy.prefix_view`)
        self.prefixes = PrefixView(ledger, self._by_name, on_change=self.kick)
        self._on_event = on_event or (lambda _kind, _lease: None)
        # Adaptive reservation: what a followed demand should hold now. A waiter sized
        # by the cold-start rule is sized anew from the history once there is one.
        self.sizer: Callable[[Demand], int] | None = None
        # Tokens to keep free on a backend for followed leases to grow into while their
        # output lengths are not known yet (adaptive reservation's cold start).
        self.growth_reserve: Callable[[Backend, Demand | None], int] | None = None
        # Tokens by which followed leases overstate what they will hold at once (they
        # end at different times): admissions may fill them (adaptive reservation).
        self.overlap_credit: Callable[[Backend, Demand | None], int] | None = None
        # Live leases that wanted to grow and found no room: running requests come first
        # (as in an engine's scheduler), so admission leaves their shortfall free.
        self._short: dict[str, Lease] = {}

    # ------------------------------------------------------------------ views
    @property
    def inflight(self) -> int:
        """Leases this process holds for the model now."""
        return sum(b.inflight for b in self.backends)

    @property
    def queue_depth(self) -> int:
        return len(self._room)

    def oldest_wait_s(self, now: float) -> float:
        return self._room.oldest_wait_s(now)

    def queued_tokens(self) -> int:
        return self._room.queued_tokens()

    @property
    def max_capacity_tokens(self) -> int:
        """Largest known capacity; a backend whose capacity is not known yet counts 0."""
        return max(b.capacity_tokens for b in self.backends)

    def shortfall_tokens(self, backend: Backend) -> int:
        return sum(lease.shortfall_tokens for lease in self._short.values()
                   if lease.backend is backend)

    def _admission_room(self, backend: Backend, demand: Demand | None = None, *,
                        credit: bool = True) -> int:
        """Reserved tokens up to which new requests (`demand`) are admitted on `backend`:
        the admission target, less what live leases wanted to grow by and found no room
        for, less what the cold start keeps free for followed leases to grow into, plus
        (with `credit`) what followed leases overstate there (`overlap_credit`)."""
        room = backend.target_tokens
        if self._short:
            room -= self.shortfall_tokens(backend)
        if self.growth_reserve is not None:
            room -= self.growth_reserve(backend, demand)
        if credit and self.overlap_credit is not None:
            room += self.overlap_credit(backend, demand)
        return max(0, room)

    def _growth_room(self, backend: Backend) -> int:
        """Reserved tokens up to which live leases may grow: the whole capacity, and
        what followed leases overstate there (`overlap_credit`)."""
        room = backend.capacity_tokens
        if self.overlap_credit is not None:
            room += self.overlap_credit(backend, None)
        return room

    def rooms(self, demand: Demand | None = None, *,
              owner: object | None = None) -> list[BackendRoom]:
        """Each healthy backend's room for `demand`; `owner` (a waiter) lets the prefix
        figures be remembered between dispatch passes (`proxy.prefix_view`)."""
        rooms = []
        seed = self.prefixes.seed_key(demand) if len(self.backends) > 1 else None
        for b in self.backends:
            if not b.healthy:
                continue
            shared, cached = self.prefixes.held(b, demand, owner)
            rooms.append(BackendRoom(
                name=b.name, capacity_tokens=self._admission_room(b, demand),
                resident_tokens=self._ledger.resident(b.name), shared_tokens=shared,
                cached_tokens=cached,
                seeding=self.prefixes.seeding(b, seed)))
        return rooms

    def _predicted(self, order: list[Waiter], now: float,
                   extra: tuple[Demand, float] | None = None) -> list[tuple[float, bool]] | None:
        """When each waiter in `order` (and `extra`, a newcomer behind those the
        ordering puts ahead of it) could start: `proxy.queue_forecast`, from the free
        room of every healthy backend (for `extra`), each waiting for what it adds where
        its prefix lives (`PrefixView.least_cost`); None while the rate is unknown."""
        demand, cost = extra[0] if extra is not None else None, self.prefixes.least_cost
        return forecast(self.release_rate, lambda: self.rooms(demand),
                        ((cost(self.backends, w.demand, w), w.deadline) for w in order), now,
                        (extra[0].tokens, extra[1]) if extra is not None else None,
                        nobody_passes_after_s=self._starvation_s)

    def retry_after_s(self, extra_tokens: int = 0) -> float:
        free = sum(max(0, r.free_tokens) for r in self.rooms())
        ahead = max(0, self.queued_tokens() + extra_tokens - free)
        return self.release_rate.wait_s(ahead)

    # ------------------------------------------------------------------ acquire
    async def acquire(self, demand: Demand, deadline: float) -> Lease:
        """A lease now, or after waiting until `deadline` (loop time), or an error."""
        loop = asyncio.get_running_loop()
        if not any(b.healthy and b.capacity_tokens > 0 for b in self.backends):
            raise NoBackend(
                f"no healthy backend serves model {self.model!r}", retry_after_s=5.0
            )
        if demand.tokens > self.max_capacity_tokens:
            raise RequestTooLarge(
                f"demand {demand.tokens} tokens ({demand.prompt_tokens} prompt + "
                f"{demand.max_tokens} output{f' x {demand.n}' if demand.n > 1 else ''}, "
                f"block-rounded) exceeds the largest backend capacity "
                f"{self.max_capacity_tokens} tokens of model {self.model!r}; "
                "it can never be admitted",
                param="max_tokens",
            )
        if not self._room:
            lease = await self._admit_now(demand)
            if lease is not None:
                return lease
        if (class_depth := self._room.class_full(demand.priority)) is not None:
            raise QueueFull(
                f"queue for model {self.model!r} holds its most of class "
                f"{demand.priority!r} ({class_depth} waiting)",
                retry_after_s=self.retry_after_s(demand.tokens),
            )
        if self._room.full and not self._make_room_for(demand):
            raise QueueFull(
                f"queue for model {self.model!r} is full ({self._max_depth} waiting)",
                retry_after_s=self.retry_after_s(demand.tokens),
            )
        arrival = loop.time()
        predicted = self._predicted(self._room.ahead_of(demand, arrival), arrival,
                                    (demand, deadline))
        if predicted is not None and not predicted[-1][1]:
            raise predicted_late(self.model, demand.tokens, predicted[-1][0],
                                 deadline - arrival)
        self.release_rate.queued(demand.tokens)
        waiter = Waiter(self._room.next_view(demand, arrival), demand, loop.create_future(),
                        deadline)
        self._enqueue(waiter)
        self.kick()
        # held back for the backend that holds its prefix, it may go anywhere from then
        spill = loop.call_at(waiter.spill_at, self.kick) if demand.blocks else None
        handed_over = False
        try:
            async with asyncio.timeout_at(deadline):
                lease = await waiter.fut
            handed_over = True
            return lease
        except TimeoutError:
            waited = loop.time() - arrival
            raise QueueTimeout(
                f"no capacity for model {self.model!r} within the deadline: waited "
                f"{waited * 1000:.0f} ms for {demand.tokens} tokens",
                retry_after_s=self.retry_after_s(demand.tokens),
            ) from None
        finally:
            if spill is not None:
                spill.cancel()
            if waiter in self._room:
                self._dequeue(waiter)
                self.kick()  # a blocking head may have left
            fut = waiter.fut
            if (
                not handed_over
                and fut.done()
                and not fut.cancelled()
                and fut.exception() is None
            ):
                fut.result().release()  # a grant raced the cancel or the deadline

    def _enqueue(self, waiter: Waiter) -> None:
        self._room.add(waiter)
        self.release_rate.set_busy(True)

    def _dequeue(self, waiter: Waiter) -> None:
        """Every waiter leaves through here, so the release rate knows when the queue
        was empty (releases then measure traffic, not the pool), and the prefix view
        forgets its figures."""
        self._room.remove(waiter)
        self.prefixes.forget(waiter)
        if not self._room:
            self.release_rate.set_busy(False)

    def _make_room_for(self, demand: Demand) -> bool:
        """A full queue refuses the waiter `WaitingRoom.victim_for` names. -> room made."""
        victim = self._room.victim_for(demand.priority)
        if victim is None:
            return False
        self._dequeue(victim)
        victim.fut.set_exception(QueueFull(
            f"queue for model {self.model!r} is full: a request of a higher class took "
            f"this one's place ({self._max_depth} waiting)",
            retry_after_s=self.retry_after_s(victim.demand.tokens)))
        return True

    async def try_acquire(self, demand: Demand) -> Lease | None:
        """A lease at once if nobody waits and a healthy backend has room, else None;
        never queues and never refuses (the caller goes on to `acquire`)."""
        if self._room or demand.tokens > self.max_capacity_tokens:
            return None
        return await self._admit_now(demand)

    async def _admit_now(self, demand: Demand) -> Lease | None:
        lease = await self._try_place(demand)
        if lease is not None:
            now = asyncio.get_running_loop().time()
            self._ordering.on_admit(self._room.next_view(demand, now), now)
        return lease

    # ------------------------------------------------------------------ placing
    async def _try_place(self, demand: Demand, owner: object | None = None,
                         spill: bool = False) -> Lease | None:
        sole = sole_healthy(self.backends)
        if sole is not None and sole.slot_free:
            # Nothing to rank, and where the demand fits in full without the overlap credit
            # (a walk of the streamed leases: ~2% of the loop at 64 streams) it changes nothing.
            room = self._admission_room(sole, demand, credit=False)
            if (self._ledger.resident(sole.name) + demand.tokens <= room
                    and (lease := await self._reserve_on(sole, demand, room)) is not None):
                return lease  # else (another replica took the room) the full way
        rooms = self.rooms(demand, owner=owner)
        # the first try reserves against the room just worked out (nothing awaited since)
        fresh: dict[str, int] | None = {r.name: r.capacity_tokens for r in rooms}
        for name in rank_backends(rooms, demand.tokens, self._placement, spill=spill):
            backend = self._by_name[name]
            if not backend.slot_free:
                continue  # the engine would queue it inside, behind its busy slots
            room = fresh[name] if fresh is not None else self._admission_room(backend, demand)
            fresh = None
            if (lease := await self._reserve_on(backend, demand, room)) is not None:
                return lease
        return None

    async def _reserve_on(self, backend: Backend, demand: Demand, room: int) -> Lease | None:
        """A lease for `demand` on `backend` if the ledger has `room` for it."""
        lease_id = f"{_LEASE_PREFIX}{next(_lease_seq):x}"
        blocks = demand.blocks if backend.shares_prefixes else ()
        if not await self._ledger.reserve(backend.name, lease_id, demand.tokens, room,
                                          blocks, demand.block_tokens):
            return None
        lease = Lease(lease_id=lease_id, backend=backend, demand=demand, on_release=self._released,
                      on_answer=self._answered if blocks else None)
        lease.shared_tokens = self._ledger.shared_tokens(lease_id)
        backend._inflight += 1
        self.release_rate.started(lease)
        self._on_event("admit", lease)
        return lease

    async def attach(self, lease: Lease, blocks: tuple[str, ...], block_tokens: int) -> int:
        """A lease admitted on a bound of its prompt brings its block keys once counted:
        registered where they are new on its backend (`Ledger.attach`: it was charged
        its whole prompt and stays so), so that requests after it share them once it
        answers. -> the blocks it references."""
        if lease.released or not blocks or not lease.backend.shares_prefixes:
            return 0
        n = await self._ledger.attach(lease.lease_id, blocks, block_tokens)
        if n == 0 or lease.released:
            return 0
        lease.demand = replace(lease.demand, blocks=blocks, block_tokens=block_tokens)
        lease.on_answer(self._answered)
        return n

    def note_wanted(self, lease: Lease, tokens: int) -> None:
        """A lease wants `tokens` but stays at its size (within the caller's slack):
        record it, and forget a shortfall it no longer has."""
        lease.wanted_tokens = tokens
        if lease.shortfall_tokens == 0:
            self._short.pop(lease.lease_id, None)

    async def resize(self, lease: Lease, tokens: int) -> int:
        """Grow or shrink a live lease; growth takes only free room under the capacity.

        The request is running in the engine either way: a lease that cannot grow
        keeps what it has, records the shortfall, and the full ledger holds back
        new admissions until releases make room.
        """
        if lease.released or tokens == lease.tokens:
            self.note_wanted(lease, tokens)
            return lease.tokens
        lease.wanted_tokens = tokens
        # shrinking always succeeds: no room to work out (the credit walks the leases)
        room = lease.backend.capacity_tokens if tokens < lease.tokens else self._growth_room(
            lease.backend)
        granted = await self._ledger.resize(lease.lease_id, tokens, room)
        if lease.released or granted <= 0:
            return lease.tokens
        shrunk = granted < lease.tokens
        lease.tokens = granted
        if lease.shortfall_tokens > 0:
            self._short[lease.lease_id] = lease
        else:
            self._short.pop(lease.lease_id, None)
        self._on_event("resize", lease)
        if shrunk:
            self.kick()
        return granted

    def _answered(self, lease: Lease) -> None:
        """Its blocks are in the engine's cache now: free to share, so a waiter that
        brings the same prefix may cost less."""
        self._ledger.mark_ready(lease.lease_id)
        self.prefixes.answered(lease)
        self.kick()

    def _released(self, lease: Lease) -> None:
        lease.backend._inflight -= 1
        self._short.pop(lease.lease_id, None)
        self._ledger.release(lease.lease_id)
        self.prefixes.released(lease)
        self.release_rate.released(lease)
        self._on_event("release", lease)
        self.kick()

    def kick(self) -> None:
        """Run dispatch soon; safe to call from sync code, coalesces bursts of calls."""
        if not self._room:
            return
        if self._dispatching:
            self._dispatch_again = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._dispatching = True
        task = loop.create_task(self._dispatch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._dispatch_again = False
                await self._dispatch_once(loop.time())
                if not self._dispatch_again:
                    return
        finally:
            self._dispatching = False

    async def _dispatch_once(self, now: float) -> None:
        for short in list(self._short.values()):  # running requests first
            b = short.backend  # where the ledger shows no free room, a round trip buys nothing
            if self._ledger.resident(b.name) < self._growth_room(b):
                await self.resize(short, short.wanted_tokens)
        if self.sizer is not None:
            for w in self._room:
                if w.demand.follow:
                    w.resize(self.sizer(w.demand))
        order = self._room.in_order(now)
        for waiter in order:
            if waiter.fut.done():
                continue
            spill = now >= waiter.spill_at
            try:
                lease = await self._try_place(waiter.demand, waiter, spill=spill)
            except LedgerUnavailable as exc:
                self._fail_all(exc)
                return
            if lease is None:
                if (now - waiter.view.arrival >= self._starvation_s
                        and self._could_ever_fit(waiter.demand)
                        and (spill or not self._held_out(waiter))):
                    self._refuse_the_late(order, now)
                    return  # hold the next room for the starving waiter
                continue
            if waiter.fut.done():  # cancelled while the ledger answered
                lease.release()
                continue
            waiter.fut.set_result(lease)
            self._ordering.on_admit(waiter.view, now)
            if waiter in self._room:
                self._dequeue(waiter)
        self._refuse_the_late(order, now)

    def _refuse_the_late(self, order: list[Waiter], now: float) -> None:
        """Refuse now, rather than at its deadline, each waiter that releases at the
        recent rate cannot reach in time (`proxy.queue_forecast`)."""
        waiting = [w for w in order if not w.fut.done()]
        for w, (wait_s, in_time) in zip(waiting, self._predicted(waiting, now) or [],
                                        strict=False):
            if not in_time:
                self._dequeue(w)
                w.fut.set_exception(predicted_late(self.model, w.demand.tokens, wait_s,
                                                   w.deadline - now))

    def _held_out(self, waiter: Waiter) -> bool:
        """Whether the waiter holds out for its prefix's backend while another has room
        (and a free slot) for it: starving, it must not hold the next room it refuses."""
        d = waiter.demand
        return bool(d.blocks) and any(self._by_name[name].slot_free for name in rank_backends(
            self.rooms(d, owner=waiter), d.tokens, self._placement, spill=True))

    def _could_ever_fit(self, demand: Demand) -> bool:
        """Whether releases alone could make room for `demand` under today's admission
        targets. A demand above every target (a strict lease while the target is
        tightened) must not hold the queue: nobody behind it would pass until its
        deadline, while it could not be placed either."""
        return any(demand.tokens <= self._admission_room(b, demand)
                   for b in self.backends if b.healthy)

    def _fail_all(self, exc: LedgerUnavailable) -> None:
        """No ledger, no admission: every waiter gets the explicit 503 now."""
        for waiter in list(self._room):
            if not waiter.fut.done():
                waiter.fut.set_exception(
                    LedgerUnavailable(exc.message, retry_after_s=exc.retry_after_s)
                )
            self._dequeue(waiter)

    async def drain(self) -> None:
        """Wait for scheduled dispatches (used on shutdown and in tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

