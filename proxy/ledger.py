"""The ledger of reserved KV tokens per backend: atomic check-and-add, idempotent release.

`reserve` may await (the Redis ledger makes one round trip); `release` never does,
so capacity comes back even when the releasing task is being cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
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

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int) -> bool:
        """Add `tokens` to `backend` if resident + tokens <= capacity; record the lease."""
        ...

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        """Set a live lease to `tokens`, atomically; -> the tokens it holds now.

        Shrinking always succeeds. Growing takes only room that is free under
        `capacity`: a lease never takes capacity another lease (of any replica)
        already holds, so it may end up between its old and its wanted size.
        An unknown lease (released, or reclaimed) answers 0.
        """
        ...

    def release(self, lease_id: str) -> None:
        """Remove the lease and subtract its tokens; a second call is a no-op."""
        ...

    def resident(self, backend: str) -> int:
        """Tokens reserved on `backend` as this replica last knew it."""
        ...

    def lease_count(self, backend: str) -> int: ...


class MemoryLedger:
    """One replica, one process: a dict is atomic between awaits."""

    def __init__(self) -> None:
        self._resident: dict[str, int] = {}
        self._leases: dict[str, tuple[str, int]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    @property
    def available(self) -> bool:
        return True

    def add_listener(self, callback: Callable[[str], None]) -> None:
        return None  # every release happens in this process and wakes the queue itself

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int) -> bool:
        return self.reserve_now(backend, lease_id, tokens, capacity)

    def reserve_now(self, backend: str, lease_id: str, tokens: int, capacity: int) -> bool:
        if tokens < 0:
            raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is already recorded")
        resident = self._resident.get(backend, 0)
        if resident + tokens > capacity:
            return False
        self._resident[backend] = resident + tokens
        self._leases[lease_id] = (backend, tokens)
        return True

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        return self.resize_now(lease_id, tokens, capacity)

    def resize_now(self, lease_id: str, tokens: int, capacity: int) -> int:
        if tokens < 0:
            raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
        entry = self._leases.get(lease_id)
        if entry is None:
            return 0
        backend, held = entry
        resident = self._resident[backend]
        granted = tokens if tokens <= held else min(tokens, held + max(0, capacity - resident))
        self._resident[backend] = resident - held + granted
        self._leases[lease_id] = (backend, granted)
        return granted

    def release(self, lease_id: str) -> None:
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return
        backend, tokens = entry
        self._resident[backend] -= tokens

    def resident(self, backend: str) -> int:
        return self._resident.get(backend, 0)

    def lease_count(self, backend: str) -> int:
        return sum(1 for b, _ in self._leases.values() if b == backend)
