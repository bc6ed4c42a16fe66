"""The routes beside inference: model list, health, readiness, metrics, admin state.

Read-only views of the runtime; nothing here admits, holds or releases.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from aiohttp import web

from proxy.admission import Backend
from proxy.errors import Unauthorized
from proxy.gate import Gate
from proxy.metrics import CONTENT_TYPE
from proxy.runtime import Runtime

__all__ = ["AdminViews", "bearer_token"]


def bearer_token(request: web.Request) -> str:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), or "";
    the one place it is parsed. Another scheme, or none, is no token."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class AdminViews:
    """`/v1/models`, `/healthz`, `/readyz`, `/metrics` and `/admin/state`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.models), web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz), web.get("/metrics", self.metrics),
                web.get("/admin/state", self.admin_state)]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvgate",
             "max_model_len": g.config.max_model_len}
            for name, g in self.runtime.gates.items()
        ]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        runtime = self.runtime
        missing = [name for name, g in runtime.gates.items()
                   if not any(b.healthy for b in g.backends)]
        ledger_ok = runtime.ledger.available
        if missing or not ledger_ok:
            return web.json_response(
                {"ready": False, "models_without_backend": missing,
                 "ledger_available": ledger_ok},
                status=503,
            )
        return web.json_response({"ready": True, "ledger_available": True})

    def backend_view(self, gate: Gate, backend: Backend, now: float) -> dict[str, Any]:
        """One backend as this replica sees it now: the ledger's view and the engine's."""
        ledger = self.runtime.ledger
        view: dict[str, Any] = {
            "url": backend.url, "healthy": backend.healthy,
            "capacity_tokens": backend.capacity_tokens,
            "resident_tokens": ledger.resident(backend.name),
            "admission_target_tokens": backend.target_tokens,
            "leases": ledger.lease_count(backend.name),
            "inflight": backend.inflight,
            "slots": backend.slots,
            "shares_prefixes": backend.shares_prefixes,
            "shared_prefix_resident_tokens": ledger.shared_resident(backend.name),
        }
        if gate.tracker is not None:
            target = gate.targets[backend.name]
            view.update({
                "engine_estimate_tokens": gate.tracker.engine_estimate_tokens(backend.name, now),
                "lease_shortfall_tokens": gate.controller.shortfall_tokens(backend),
                "cold_start_reserve_tokens": gate.tracker.growth_reserve(backend, None),
                "overlap_credit_tokens": gate.tracker.overlap_credit(backend, None),
                "engine_kv_usage_ratio": target.usage_ratio,
                "engine_preemptions_reported": target.preemptions_seen,
            })
        return view

    def body_budget_view(self) -> dict[str, Any]:
        """The body budget: its limits, the bytes held now, and the refusals so far."""
        bodies = self.runtime.bodies
        return {"budget_bytes": bodies.total_bytes, "per_model_bytes": bodies.per_model_bytes,
                "held_bytes": bodies.held,
                "refusals": [{"budget": budget, "model": model, "count": count}
                             for (budget, model), count in sorted(bodies.refusals.items())]}

    async def metrics(self, request: web.Request) -> web.Response:
        runtime = self.runtime
        metrics = runtime.metrics
        now = asyncio.get_running_loop().time()
        for gate in runtime.gates.values():
            metrics.queue_depth(gate.name, gate.controller.queue_depth)
            for b in gate.backends:
                view = self.backend_view(gate, b, now)
                metrics.backend_view(
                    b.name, resident=view["resident_tokens"], inflight=b.inflight,
                    target=b.target_tokens, engine_estimate=view.get("engine_estimate_tokens", 0),
                    shortfall=view.get("lease_shortfall_tokens", 0),
                    shared_resident=view["shared_prefix_resident_tokens"],
                )
        metrics.ledger_available(runtime.ledger.available)
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def admin_state(self, request: web.Request) -> web.Response:
        runtime = self.runtime
        token = runtime.config.server.admin_token
        if token is not None:
            given = bearer_token(request)
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                       token.encode()):
                raise Unauthorized(f"{request.path} needs `Authorization: Bearer <admin token>`",
                                   param="Authorization")
        now = asyncio.get_running_loop().time()
        out: dict[str, Any] = {"ledger": {"kind": runtime.config.ledger.kind,
                                          "available": runtime.ledger.available}, "models": {}}
        out["body_budget"] = self.body_budget_view()
        if runtime.count_workers is not None:
            out["count_workers"] = runtime.count_workers.describe()
        for name, g in runtime.gates.items():
            c = g.controller
            out["models"][name] = {
                "queue_depth": c.queue_depth,
                "oldest_wait_ms": round(c.oldest_wait_s(now) * 1000, 1),
                "queued_tokens": c.queued_tokens(),
                "body_bytes_held": runtime.bodies.held_by_model[name],
                **({"output_history": {
                    "samples": len(g.tracker.history), "ready": g.tracker.history.ready,
                    "p50_tokens": g.tracker.history.quantile_of(0.5),
                    "p90_tokens": g.tracker.history.quantile_of(0.9),
                    # what a new request's lease holds for its output, the running
                    # counted (`OutputHistory.censor`); null on the cold-start rule
                    "running_counted": g.tracker.history.running_counted,
                    "expected_output_tokens": (g.tracker.history.remaining(0)
                                               if g.tracker.history.ready else None),
                    "decode_tokens_per_s": round(g.tracker.decode_tokens_per_s, 1),
                }} if g.tracker is not None else {}),
                "capacity_source": g.config.capacity_source,
                "reservation": g.config.reservation.value,
                "backends": {b.name: self.backend_view(g, b, now) for b in c.backends},
            }
        return web.json_response(out)
