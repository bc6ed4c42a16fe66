"""What the engines say, applied: the adaptive resize timer, and each engine's own report
(preemptions, KV use, prefix caching) moving its backend's admission target or turning
shared prefixes off there.

A model's `Gate` holds one; `kvgate serve` and `kvgate simulate` both run it on their
event loop (`Gate.follow_engines`), reading an engine with whatever the transport has
(HTTP /metrics, or a simulated engine's own figures).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from policies.reservation import AdmissionTarget
from proxy.admission import AdmissionController, Backend
from proxy.config import AdaptiveConfig
from proxy.engine_metrics import EngineLoad
from proxy.ledger import Ledger
from proxy.metrics import Metrics
from proxy.reservation import ReservationTracker, apply_engine_report

__all__ = ["EngineFeedback", "every"]

_log = logging.getLogger("kvgate")


@dataclass(slots=True, kw_only=True)
class EngineFeedback:
    """One model's engine feedback; `tracker` and `targets` only in adaptive mode."""

    name: str
    adaptive: AdaptiveConfig
    block_size: int
    controller: AdmissionController
    ledger: Ledger
    metrics: Metrics
    tracker: ReservationTracker | None
    targets: Mapping[str, AdmissionTarget]
    prefix_sharing: bool
    kind_shares: Mapping[str, bool]  # by the engine's kind: its report can turn it off

    async def follow(
        self, read_engine: Callable[[Backend], Awaitable[EngineLoad | None]]
    ) -> None:
        """Until cancelled, in adaptive mode: resize the live leases as they generate,
        and read every healthy engine's own figures to move its admission target. With
        prefix sharing on (either mode) the engines are read too: one that reports its
        prefix caching off, or another block size, shares nothing."""
        a = self.adaptive
        if self.tracker is None:
            if self.prefix_sharing:  # a setting, not a load figure: read it less often
                await every(max(5.0, a.engine_poll_interval_s),
                            functools.partial(self._read_engines, read_engine),
                            f"reading the engines of {self.name}")
            return
        await asyncio.gather(
            every(a.resize_interval_s, self._resize_tick, f"resizing leases of {self.name}"),
            every(a.engine_poll_interval_s, functools.partial(self._read_engines, read_engine),
                   f"reading the engines of {self.name}"))

    async def _resize_tick(self) -> None:
        assert self.tracker is not None
        await self.tracker.tick(self.controller, asyncio.get_running_loop().time())

    async def _read_engines(
        self, read_engine: Callable[[Backend], Awaitable[EngineLoad | None]]
    ) -> None:
        for backend in self.controller.backends:
            if not backend.healthy:
                continue
            try:
                load = await read_engine(backend)
            except Exception:  # one engine's failure must not freeze the others' targets
                _log.exception("reading the engine of %s failed", backend.name)
                continue
            if load is not None:
                self.report(backend, load, asyncio.get_running_loop().time())

    def report(self, backend: Backend, load: EngineLoad, now: float) -> None:
        """A preemption, or the engine holding more than every lease, tightens the
        backend's admission target at once; quiet reports loosen it slowly."""
        self._shares(backend, load)
        target = self.targets.get(backend.name)
        if target is None:  # strict: read for its prefix caching only
            return
        before = apply_engine_report(
            self.controller, backend, target, now=now,
            preemptions_total=load.preemptions_total, usage_ratio=load.usage_ratio,
            reserved_tokens=self.ledger.resident(backend.name))
        self.metrics.engine_reported(backend.name, usage_ratio=load.usage_ratio,
                                     preemptions=load.preemptions_total)
        if backend.target_factor < before:
            _log.warning(
                "backend %s: engine pressure (preemptions %s, KV use %s); admission "
                "target now %d of %d tokens", backend.name, load.preemptions_total,
                load.usage_ratio, backend.target_tokens, backend.capacity_tokens)

    def _shares(self, backend: Backend, load: EngineLoad) -> None:
        """An engine that reports its prefix caching off (or another block size) shares
        nothing; one whose kind keeps no shared cache (llama.cpp) shares nothing
        whatever a metrics page says."""
        if load.prefix_hit_tokens_total is not None:
            self.metrics.engine_prefix_hits(backend.name, load.prefix_hit_tokens_total)
        if load.prefix_caching is not None and self.kind_shares[backend.name]:
            shares = load.prefix_caching and load.block_size in (None, self.block_size)
            if shares != backend.shares_prefixes:
                _log.warning("backend %s: engine reports prefix caching %s, block size %s "
                             "(config: %d): shared prefixes %s", backend.name,
                             load.prefix_caching, load.block_size, self.block_size,
                             "charged once" if shares else "charged per request")
                self.controller.set_shares_prefixes(backend, shares)


async def every(interval_s: float, action: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `action` now and every `interval_s` after, until cancelled; a failure is
    logged and the timer goes on (a dead timer would leave leases unfollowed)."""
    while True:
        try:
            await action()
        except Exception:
            _log.exception("%s failed", what)
        await asyncio.sleep(interval_s)
