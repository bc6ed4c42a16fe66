"""The ledger of reserved KV tokens per backend: atomic check-and-add, idempotent release.

`reserve` may await (the Redis ledger makes one round trip); `release` never does,
so capacity comes back even when the releasing task is being cancelled.

Shared prefix blocks. An engine with prefix caching (vLLM v1, SGLang) holds a full
KV block once however many running requests use it: a reference count per block,
keyed by its token ids and those of every block before it. A lease may bring the
keys of its prompt's full blocks (`blocks`, each `block_tokens` tokens, already
inside its `tokens`); per backend the ledger reference-counts them the same way, so
each block held by live leases is charged once:

    resident = sum over leases of (tokens - block_tokens x blocks it references)
               + block_tokens x distinct blocks referenced by live leases

A block becomes free to share only once it is *ready*: a lease that references it
has been seen answering (`mark_ready`: its prefill is done, so the engine holds the
block in its cache). A lease joins the leading run of its blocks held ready; past it,
a block nobody holds starts blocks new here (referenced, charged once from then on),
and a block another lease registered but that is not ready yet is paid for in full
and not referenced, with every block after it (the blocks are a hash chain: those
past one not ready are not ready either). Two requests that bring the same new
prefix at once may both be prefilled before either's blocks are registered in the
engine (vLLM's chunked prefill computes a long prompt over several steps, and a
second request that starts meanwhile hits only the chunks already allocated), and
charging both copies is what keeps that from ever overfilling the pool. The cost is
conservative: a burst of same-prefix requests at cold start is charged as if nothing
were shared until the first one answers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["Ledger", "MemoryLedger"]


class Ledger(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def available(self) -> bool:
        """False while a shared ledger cannot be reached."""
        ...

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(backend)` when capacity may have come back through another replica."""
        ...

    def add_prefix_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(backend)` when what `ready_blocks`, `holds` or `shared_resident`
        say of `backend` changed through another replica (placement's figures read
        them: `proxy.prefix_view`)."""
        ...

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int,
                      blocks: Sequence[str] = (), block_tokens: int = 0) -> bool:
        """Add the lease to `backend` if resident + what it adds <= capacity.

        `tokens` is all the lease spans; `blocks` the keys of its shared-prefix blocks
        (inside `tokens`, `block_tokens` each). What it adds is `tokens` less the
        blocks other live leases there hold ready (see the module docstring).
        """
        ...

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        """Set a live lease to span `tokens`, atomically; -> the tokens it spans now.

        Shrinking always succeeds. Growing takes only room that is free under
        `capacity`: a lease never takes capacity another lease (of any replica)
        already holds, so it may end up between its old and its wanted size.
        An unknown lease (released, or reclaimed) answers 0. The shared blocks a
        lease references do not change.
        """
        ...

    async def attach(self, lease_id: str, blocks: Sequence[str], block_tokens: int) -> int:
        """Register the shared-prefix blocks of a live lease reserved without them (one
        admitted on a bound of its prompt, before its ids were counted); -> how many it
        references now.

        Only where none of them is held on its backend: they are new there, and are
        charged once from now on, through this lease, which was charged its whole
        prompt and still is (resident does not change). Where one is held it references
        none: its engine may have prefilled its own copy before those blocks were
        cached, so it keeps paying for it. 0 for an unknown lease or one that references
        blocks already.
        """
        ...

    def release(self, lease_id: str) -> None:
        """Remove the lease and what it adds; a second call is a no-op."""
        ...

    def mark_ready(self, lease_id: str) -> None:
        """The lease's engine has answered: the blocks it references are cached there."""
        ...

    def shared_tokens(self, lease_id: str) -> int:
        """Tokens of the lease that ready blocks of other leases covered at reserve."""
        ...

    def ready_blocks(self, backend: str, blocks: Sequence[str]) -> int:
        """How many of `blocks`, in order, are held ready on `backend` (as this replica
        knows it): the prefix a lease placed there would not be charged for."""
        ...

    def holds(self, backend: str, key: str) -> bool:
        """Whether a live lease on `backend` references block `key`, answered or not (as
        this replica knows it): where a new prefix is being computed now."""
        ...

    def resident(self, backend: str) -> int:
        """Tokens reserved on `backend` as this replica last knew it."""
        ...

    def shared_resident(self, backend: str) -> int:
        """Tokens of `backend`'s resident held in shared blocks (each counted once)."""
        ...

    def lease_count(self, backend: str) -> int: ...


class _MemoryLease:
    __slots__ = ("backend", "block_tokens", "refs", "shared", "tokens")

    def __init__(self, backend: str, tokens: int, refs: Sequence[str], block_tokens: int,
                 shared: int) -> None:
        self.backend = backend
        self.tokens = tokens  # all it spans
        self.refs = refs  # shared blocks it references
        self.block_tokens = block_tokens
        self.shared = shared  # tokens ready blocks of others covered at reserve

    @property
    def own(self) -> int:
        """What it holds outside the shared blocks."""
        return max(0, self.tokens - self.block_tokens * len(self.refs))


class _Blocks:
    """One backend's shared blocks: key -> live leases referencing it, and the ready
    ones. A count dict and a set rather than one record per key, so a lease whose keys
    are all new (every unique prompt) is recorded and readied by C-level bulk updates."""

    __slots__ = ("count", "ready", "tokens")

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.ready: set[str] = set()
        self.tokens = 0  # block_tokens x distinct blocks referenced


class MemoryLedger:
    """One replica, one process: a dict is atomic between awaits."""

    def __init__(self) -> None:
        self._resident: dict[str, int] = {}
        self._leases: dict[str, _MemoryLease] = {}
        self._blocks: dict[str, _Blocks] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def available(self) -> bool:
        return True

    def add_listener(self, callback: Callable[[str], None]) -> None:
        return None  # every release happens in this process and wakes the queue itself

    def add_prefix_listener(self, callback: Callable[[str], None]) -> None:
        return None  # one process: every change goes through its own controller

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int,
                      blocks: Sequence[str] = (), block_tokens: int = 0) -> bool:
        return self.reserve_now(backend, lease_id, tokens, capacity, blocks, block_tokens)

    def reserve_now(self, backend: str, lease_id: str, tokens: int, capacity: int,
                    blocks: Sequence[str] = (), block_tokens: int = 0) -> bool:
        if tokens < 0:
            raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is already recorded")
        if blocks and block_tokens * len(blocks) > tokens:
            raise ValueError(f"{len(blocks)} blocks of {block_tokens} tokens exceed the "
                             f"lease's {tokens} tokens")
        table = self._blocks.get(backend)
        if table is None:
            table = self._blocks[backend] = _Blocks()
        count = table.count
        # One dict for the usual case, all new: the keys once each (a key twice in one
        # prompt is one block), already holding the count each adds.
        fresh = dict.fromkeys(blocks, 1)
        refs: Sequence[str]
        if count.keys().isdisjoint(fresh):  # none of it held here: all new
            # the keys themselves where none repeats (a hash chain's never do)
            refs = (blocks if isinstance(blocks, tuple) and len(fresh) == len(blocks)
                    else tuple(fresh))
            joined, new = 0, len(fresh)
        else:
            # the leading run held ready (joined); past it, a key nobody holds starts
            # keys new here, and a key held but not ready is paid for in full, not
            # referenced, with all after it (a chain's keys past it are not ready either)
            ordered = list(fresh)
            ready = table.ready
            joined = 0
            for key in ordered:
                if key not in ready:
                    break
                joined += 1
            listed = ordered[:joined]
            new = 0
            if joined < len(ordered) and ordered[joined] not in count:
                for key in ordered[joined:]:
                    if key not in count:  # (a chain's all are not)
                        listed.append(key)
                        new += 1
            refs = listed
        shared = joined * block_tokens
        adds = tokens - shared
        resident = self._resident.get(backend, 0)
        if resident + adds > capacity:
            return False
        if joined:
            for key in refs:
                count[key] = count.get(key, 0) + 1
        else:
            count.update(fresh if refs is blocks or len(refs) == len(fresh)
                         else dict.fromkeys(refs, 1))
        table.tokens += new * block_tokens
        self._resident[backend] = resident + adds
        self._leases[lease_id] = _MemoryLease(backend, tokens, refs, block_tokens, shared)
        return True

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        return self.resize_now(lease_id, tokens, capacity)

    def resize_now(self, lease_id: str, tokens: int, capacity: int) -> int:
        if tokens < 0:
            raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        floor = lease.block_tokens * len(lease.refs)  # the shared blocks stay
        tokens = max(tokens, floor)
        held = lease.tokens
        resident = self._resident[lease.backend]
        granted = tokens if tokens <= held else min(tokens, held + max(0, capacity - resident))
        self._resident[lease.backend] = resident - held + granted
        lease.tokens = granted
        return granted

    async def attach(self, lease_id: str, blocks: Sequence[str], block_tokens: int) -> int:
        return self.attach_now(lease_id, blocks, block_tokens)

    def attach_now(self, lease_id: str, blocks: Sequence[str], block_tokens: int) -> int:
        lease = self._leases.get(lease_id)
        if lease is None or lease.refs or not blocks:
            return 0
        fresh = dict.fromkeys(blocks, 1)  # a key twice in one prompt is one block
        if block_tokens * len(fresh) > lease.tokens:
            raise ValueError(f"{len(fresh)} blocks of {block_tokens} tokens exceed the "
                             f"lease's {lease.tokens} tokens")
        table = self._blocks.get(lease.backend)
        if table is None:
            table = self._blocks[lease.backend] = _Blocks()
        if not table.count.keys().isdisjoint(fresh):
            return 0
        table.count.update(fresh)
        table.tokens += block_tokens * len(fresh)  # and its own tokens less by as much
        lease.refs = tuple(fresh)
        lease.block_tokens = block_tokens
        return len(fresh)

    def release(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        freed = lease.own
        table = self._blocks[lease.backend]
        count = table.count
        gone: Sequence[str] = ()
        if lease.refs and max(map(count.__getitem__, lease.refs)) == 1:
            gone = lease.refs  # it alone held them (every unique prompt): one C-level pass
            deque(map(count.__delitem__, gone), maxlen=0)
        else:
            left: list[str] = []
            for key in lease.refs:
                n = count[key] - 1
                if n:
                    count[key] = n
                else:
                    del count[key]
                    left.append(key)
            gone = left
        if gone:
            table.ready.difference_update(gone)
            freed += lease.block_tokens * len(gone)
            table.tokens -= lease.block_tokens * len(gone)
        self._resident[lease.backend] -= freed

    def mark_ready(self, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        self._blocks[lease.backend].ready.update(lease.refs)

    def shared_tokens(self, lease_id: str) -> int:
        lease = self._leases.get(lease_id)
        return 0 if lease is None else lease.shared

    def ready_blocks(self, backend: str, blocks: Sequence[str]) -> int:
        table = self._blocks.get(backend)
        if table is None:
            return 0
        ready = table.ready
        n = 0
        for key in blocks:
            if key not in ready:
                break
            n += 1
        return n

    def holds(self, backend: str, key: str) -> bool:
        table = self._blocks.get(backend)
        return table is not None and key in table.count

    def resident(self, backend: str) -> int:
        return self._resident.get(backend, 0)

    def shared_resident(self, backend: str) -> int:
        table = self._blocks.get(backend)
        return 0 if table is None else table.tokens

    def lease_count(self, backend: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.backend == backend)
