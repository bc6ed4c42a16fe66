"""How much of a demand's prefix each backend holds, as placement reads it, remembered
for the demands that wait.

Two figures per demand and backend, in blocks: how many of its leading blocks the
ledger holds ready there (`ready`: shared, not charged), and how many after those
the engine there probably still caches (`cached`, `proxy.recent_blocks`: charged,
but a prefix hit). Each is a scan of the demand's keys up to the first one not held,
and dispatch asks for them for every waiter on every backend on every pass: with 200
waiters of 4,160-token prompts that share a 4,096-token prefix over 4 backends, the
scans were 90% of a 13 ms pass (`benchmarks/bench_ledger.py`, `dispatch_passes`).

So a waiting demand's figures are remembered per backend (`owner`: its waiter) and
forgotten exactly when something they read changes. A figure (ready r, cached c)
read: keys[0..r) ready and keys[r] not; keys[r..r+c) in the recent LRU and keys[r+c]
not. What can change that goes through the controller that owns this view:

- an answer (`mark_ready`) may make the lease's keys ready, never one unready: a
  figure is stale only if its keys[r] is one of them;
- a release may leave the lease's keys unready (it was their last holder), never make
  one ready: stale only if a key of the lease that is not ready now lies in
  keys[0..r). It may also remember the lease's keys in the LRU, which may evict
  others: stale only if a key that came or went lies in keys[r..r+c];
- a reservation changes neither: a block it registers is not ready before an answer,
  and the ready ones it joins stay ready (`proxy.ledger`).

The engine's cache is modelled one key per `MODEL_TOKENS` of a prompt (every
`stride`-th block key; every key where blocks are that large): a key stands for the
prefix that ends with its block (the keys are a hash chain), and the engine frees a
request's blocks tail first, so where it still caches a block it caches those before.
A figure is then `cached` to within a stride: the blocks up to the last sampled key
held in a run from the first one at or past `ready`, and it reads the sampled keys up
to the first one missing: keys[r..r+c+stride). Placement weighs prefixes of hundreds of
tokens at least (`policies.placement.STICKY_SHARE`), so a stride of 128 tokens changes
no choice worth making, while a unique 1,000-token prompt at 16-token blocks remembers
7 keys on release instead of 62, in a table an eighth the size.

One more thing changes what a ledger reports ready: the Redis ledger's mirror of every
replica's ready blocks (`proxy.prefix_mirror`), read every second or so. Its listener
(`_changed_elsewhere`) forgets every figure of the backend whose mirror changed. So a
remembered figure is always the one a scan would give now; the tests hold the two
side by side over random events. A demand that repeats a key (no hash chain does, but
the keys are opaque here) is not remembered: a key's position in it would not be
unique.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from policies.placement import Seeding
from proxy.leases import Backend, Demand, Lease
from proxy.ledger import Ledger
from proxy.recent_blocks import RecentBlocks

__all__ = ["MODEL_TOKENS", "SEED_TOKENS", "PrefixView"]

# how much of a prompt's opening picks the backend a new prefix is seeded on
SEED_TOKENS = 512
# the engine's cache is modelled one block key per this many tokens (module docstring)
MODEL_TOKENS = 128


def _stride(block_tokens: int) -> int:
    """Blocks per modelled key: one key per `MODEL_TOKENS`, at least every block."""
    return max(1, MODEL_TOKENS // block_tokens)


class _Memo:
    """One waiting demand: where each of its keys sits, and its figures per backend."""

    __slots__ = ("at", "blocks", "on")

    def __init__(self, blocks: tuple[str, ...]) -> None:
        self.blocks = blocks
        self.at: dict[str, int] = dict(zip(blocks, range(len(blocks)), strict=True))
        self.on: dict[str, tuple[int, int]] = {}  # backend -> (ready, cached) blocks

    def reads(self, keys: set[str], lo: int, hi: int) -> bool:
        """Whether one of `keys` lies at a position in [lo, hi)."""
        if self.at.keys().isdisjoint(keys):  # the usual case, at C speed
            return False
        return any(lo <= self.at.get(k, -1) < hi for k in keys)


class PrefixView:
    """Per backend: the recent-blocks model, and the figures of the waiting demands."""

    __slots__ = ("_backends", "_ledger", "_memos", "_on_change", "_recent")

    def __init__(self, ledger: Ledger, backends: Container[str] = (), *,
                 on_change: Callable[[], None] | None = None) -> None:
        self._ledger = ledger
        self._recent: dict[str, RecentBlocks] = {}  # per backend: `proxy.recent_blocks`
        self._memos: dict[object, _Memo] = {}  # per waiting owner
        self._backends = backends  # those whose changes through other replicas count
        self._on_change = on_change
        ledger.add_prefix_listener(self._changed_elsewhere)

    @property
    def remembered(self) -> int:
        """Owners whose figures are remembered (every one leaves through `forget`)."""
        return len(self._memos)

    def held(self, backend: Backend, demand: Demand | None,
             owner: object | None = None) -> tuple[int, int]:
        """(shared, cached) tokens of `demand` on `backend`: held there in ready blocks
        (not charged), and past those, probably still in its engine's cache. With an
        `owner` (a waiter, until `forget`) the figures are remembered."""
        if demand is None or not demand.blocks or not backend.shares_prefixes:
            return 0, 0
        blocks = demand.blocks
        if owner is None:
            ready, cached = self._scan(backend.name, blocks, demand.block_tokens)
        else:
            memo = self._memos.get(owner)
            if memo is None or memo.blocks is not blocks:
                memo = self._memos[owner] = _Memo(blocks)
            got = memo.on.get(backend.name)
            if got is None:
                got = self._scan(backend.name, blocks, demand.block_tokens)
                if len(memo.at) == len(blocks):  # no key repeats
                    memo.on[backend.name] = got
            ready, cached = got
        return demand.block_tokens * ready, demand.block_tokens * cached

    def least_cost(self, backends: Iterable[Backend], demand: Demand,
                   owner: object | None = None) -> int:
        """What `demand` adds on the healthy backend of `backends` that holds the most of
        its prefix ready: what admission by deadline predicts a waiter's wait on
        (`proxy.queue_forecast`; a newcomer's is read from the rooms worked out for
        it). On the whole demand, a conversation's next turn (its history ready in the
        turn before) was refused as too large to start in time. `kvgate simulate`, the
        Mooncake conversation slice (600 s, 4 x 262,144 tokens, 3 s deadline; clients
        capping at 2,048 at speed 4 and 6, without max_tokens at speed 4): engine
        prefix-hit tokens +20% / +14% / +16%, goodput 1,264 -> 1,268 / 1,090 -> 1,086 /
        1,213 -> 1,255, no preemption before or after. Judging only the newcomer so, a
        turn let in was refused at the next dispatch pass instead."""
        if not demand.blocks:
            return demand.tokens
        return demand.tokens - max((self.held(b, demand, owner)[0] for b in backends
                                    if b.healthy), default=0)

    @staticmethod
    def seed_key(demand: Demand | None) -> str | None:
        """The key placement seeds a prefix held nowhere by (`policies.placement`): its
        block at `SEED_TOKENS`, or its last below, so that prompts that open alike (a
        system prompt, a conversation's first turns) seed alike whatever follows."""
        if demand is None or not demand.blocks:
            return None
        return demand.blocks[min(len(demand.blocks), SEED_TOKENS // demand.block_tokens or 1) - 1]

    def seeding(self, backend: Backend, key: str | None) -> Seeding:
        """How a demand whose seed key is `key` would be seeded on `backend`
        (`policies.placement.Seeding`); nothing where it shares no prefixes."""
        if not key or not backend.shares_prefixes:
            return Seeding()
        return Seeding(key, self._ledger.holds(backend.name, key),
                       self._ledger.shared_resident(backend.name))

    def _scan(self, backend: str, blocks: tuple[str, ...],
              block_tokens: int) -> tuple[int, int]:
        """(ready, cached) blocks: `cached` from the modelled keys, a whole number of
        strides past the first one at or after `ready`, less the blocks before `ready`."""
        ready = self._ledger.ready_blocks(backend, blocks)
        recent = self._recent.get(backend)
        if recent is None:
            return ready, 0
        stride = _stride(block_tokens)
        first = (ready + stride) // stride - 1  # the first modelled key at or past `ready`
        hits = recent.leading(blocks[stride - 1::stride], first)
        return ready, (first + hits) * stride - ready if hits else 0

    def _changed_elsewhere(self, backend: str) -> None:
        """The ledger's view of `backend` changed through another replica
        (`Ledger.add_prefix_listener`): every figure there may be stale, and a waiter
        may be placed now (`on_change`)."""
        if backend not in self._backends:
            return
        for memo in self._memos.values():
            memo.on.pop(backend, None)
        if self._on_change is not None:
            self._on_change()

    def forget(self, owner: object) -> None:
        """The owner left the queue."""
        self._memos.pop(owner, None)

    def answered(self, lease: Lease) -> None:
        """After the ledger's `mark_ready(lease)`: its keys may be ready now."""
        if not self._memos or not lease.demand.blocks:
            return
        name = lease.backend.name
        keys = set(lease.demand.blocks)
        for memo in self._memos.values():
            got = memo.on.get(name)
            if got is not None and got[0] < len(memo.blocks) and memo.blocks[got[0]] in keys:
                del memo.on[name]

    def released(self, lease: Lease) -> None:
        """After the ledger's `release(lease)`. An answered lease's blocks are probably
        still in its engine's cache (the LRU remembers them); figures that read a key
        the release changed are forgotten."""
        d = lease.demand
        if not d.blocks:
            return
        name = lease.backend.name
        moved: list[str] = []  # keys that came into the LRU or left it
        stride = _stride(d.block_tokens)
        if lease.was_answered and lease.backend.shares_prefixes:
            recent = self._recent.get(name)
            if recent is None:  # as many modelled keys as the pool holds strides
                recent = self._recent[name] = RecentBlocks(
                    lease.backend.capacity_tokens // (d.block_tokens * stride))
            # tail first, as vLLM v1 frees a request's blocks (and `kvgate sim` does):
            # its private tail is evicted first, the prefix it shares last
            moved = recent.remember(d.blocks[stride - 1::stride][::-1])
        if not self._memos:
            return
        # the lease's keys not ready now: those it left may be among them, none before
        # its leading ready ones (a release readies nothing)
        ledger = self._ledger
        lead = ledger.ready_blocks(name, d.blocks)
        unready = {k for k in d.blocks[lead:] if not ledger.ready_blocks(name, (k,))}
        came_or_went = set(moved)
        if not unready and not came_or_went:
            return
        for memo in self._memos.values():
            got = memo.on.get(name)
            if got is None:
                continue
            ready, cached = got
            if (unready and memo.reads(unready, 0, ready)) or (
                    came_or_went and memo.reads(came_or_went, ready,
                                                ready + cached + stride)):
                del memo.on[name]
