"""What a running kvgate holds: its config, its ledger, its metrics and one gate per model.

No HTTP here: `proxy.server` builds a `Runtime`, starts and closes it with the app,
and hands each request to `Runtime.gate(model)`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from policies.engines import counts_as_llama_cpp
from proxy.admission import Backend
from proxy.body_budget import BodyBudget
from proxy.config import KvgateConfig
from proxy.count_workers import CountWorkers
from proxy.errors import ModelNotFound
from proxy.gate import Gate
from proxy.ledger import Ledger, MemoryLedger
from proxy.metrics import Metrics
from proxy.tickets import Tickets
from proxy.tokenize import load_counter
from proxy.tokenize.cache import CacheStats

__all__ = ["Runtime", "make_ledger"]


def make_ledger(config: KvgateConfig) -> Ledger:
    """The `[ledger]` the config names: in memory (one replica) or Redis (shared)."""
    if config.ledger.kind == "redis":
        from proxy.redis_ledger import RedisLedger

        assert config.ledger.url is not None
        return RedisLedger(
            config.ledger.url,
            backends=[b.name for m in config.models for b in m.backends],
            key_prefix=config.ledger.key_prefix,
            lease_ttl_s=config.ledger.lease_ttl_s,
            refresh_interval_s=config.ledger.refresh_interval_s,
            prefix_mirror_interval_s=config.ledger.prefix_mirror_interval_s,
        )
    return MemoryLedger()


class Runtime:
    """The served models' gates over one ledger and one metrics registry."""

    def __init__(self, config: KvgateConfig, ledger: Ledger | None = None,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.ledger = ledger or make_ledger(config)
        self.metrics = metrics or Metrics()
        self.count_workers: CountWorkers | None = None
        server = config.server
        per_model = server.body_budget_per_model_bytes
        self.bodies = BodyBudget(
            server.body_budget_bytes,
            server.body_budget_bytes if per_model is None else per_model,
            [m.name for m in config.models])
        self.metrics.watch_body_budget(self.bodies)
        self.gates: dict[str, Gate] = {}
        secret = config.server.ticket_secret
        tickets = Tickets(secret.encode() if secret else None)  # one per process: single use
        for mc in config.models:
            gate = Gate(mc, queue=config.queue, ledger=self.ledger, metrics=self.metrics,
                        tickets=tickets,
                        counter=load_counter(mc.path, name=mc.name, unicode_normalizer=not (
                            counts_as_llama_cpp(b.kind for b in mc.backends))),
                        admit_on_bound=config.server.admit_on_bound)
            self.gates[mc.name] = gate
            self.metrics.watch_count_cache(mc.name, functools.partial(self._cache_stats, gate))

    def gate(self, model: str) -> Gate:
        gate = self.gates.get(model)
        if gate is None:
            raise ModelNotFound(
                f"The model `{model}` does not exist. Served models: {sorted(self.gates)}",
                param="model",
            )
        return gate

    def backends(self) -> list[Backend]:
        return [b for g in self.gates.values() for b in g.backends]

    def owners(self) -> Mapping[str, Gate]:
        return {b.name: g for g in self.gates.values() for b in g.backends}

    async def start(self) -> None:
        """Count workers (if configured), then the ledger, whose release notices from
        other replicas wake the queue of the backend's model."""
        n = self.config.server.count_workers
        if n > 0:
            workers = CountWorkers(
                {m.name: str(m.path) for m in self.config.models}, n,
                llama_cpp=[m.name for m in self.config.models
                           if counts_as_llama_cpp(b.kind for b in m.backends)],
                on_exit=self.metrics.count_worker_exited,
                on_restart=self.metrics.count_worker_restarted)
            await workers.start()
            self.count_workers = workers
            for gate in self.gates.values():
                gate.count_workers = workers
        owners = self.owners()

        def wake(backend: str) -> None:
            gate = owners.get(backend)
            if gate is not None:
                gate.controller.kick()

        self.ledger.add_listener(wake)
        await self.ledger.start()

    async def close(self) -> None:
        await self.ledger.close()
        workers, self.count_workers = self.count_workers, None
        for gate in self.gates.values():
            gate.count_workers = None
        if workers is not None:
            await workers.close()

    def _cache_stats(self, gate: Gate) -> CacheStats | None:
        """The model's count cache: this process's, plus the count workers' where they run."""
        own = gate.counter.cache_stats() if gate.counter is not None else None
        theirs = (self.count_workers.cache_stats(gate.name)
                  if self.count_workers is not None else None)
        if own is None or theirs is None:
            return own or theirs
        return own + theirs
