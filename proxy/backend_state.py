"""The one writer of a model's backends' state: its admission controller.

`Backend` (`proxy.leases`) is read by anyone; its capacity, slots, health, admission
target and prefix sharing change only through these setters, which the controller
inherits, so every change that can open room wakes its queue (`kick`), the one place
that knows who waits.
"""

from __future__ import annotations

from proxy.leases import Backend

__all__ = ["BackendWriter"]


class BackendWriter:
    """The setters of `AdmissionController` (`proxy.admission`)."""

    def kick(self) -> None:
        """Run dispatch soon (the controller's)."""
        raise NotImplementedError

    def set_capacity(self, backend: Backend, capacity_tokens: int) -> None:
        """A new capacity applies to the next reservation; live leases stay as they are."""
        if capacity_tokens < 0:
            raise ValueError(f"`capacity_tokens` must be >= 0. Given: {capacity_tokens}")
        backend._capacity_tokens = capacity_tokens
        self.kick()

    def set_slots(self, backend: Backend, slots: int | None) -> None:
        """The engine's own concurrency (llama.cpp reports it in /props)."""
        if slots is not None and slots < 1:
            raise ValueError(f"`slots` must be >= 1. Given: {slots}")
        backend._slots = slots
        self.kick()

    def set_shares_prefixes(self, backend: Backend, shares: bool) -> None:
        backend._shares_prefixes = shares

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        """A backend that becomes healthy may take the queue's head at once."""
        if healthy == backend._healthy:
            return
        backend._healthy = healthy
        if healthy:
            self.kick()

    def set_target_factor(self, backend: Backend, factor: float) -> None:
        """Move the share of capacity new admissions may fill; a looser target wakes
        the queue, a tighter one holds back the next admissions only."""
        before, backend._target_factor = backend._target_factor, factor
        if factor > before:
            self.kick()
