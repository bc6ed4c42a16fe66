"""kvgate's TOML configuration: parsed once at start, every error names its key.

Relative paths (`models.path`, `models.deployment.model_config`) are resolved
against the config file's directory, so a config and its model files travel together.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from policies.engines import EngineKind, PrefixSharing, engine_kind, unsafe_for_adaptive
from policies.ordering import (
    AGING_TOKENS_PER_S,
    FAIR_SHARE_HALF_LIFE_S,
    ORDERINGS,
    PRIORITY_CLASSES,
)
from policies.output import OutputPolicy, OutputPolicyName
from policies.placement import PlacementName
from policies.reservation import ReservationMode
from proxy.capacity import Deployment
from proxy.clients import Clients, load_clients
from proxy.config_capacity import parse_capacity
from proxy.config_values import (
    check_keys,
    field_default,
    get_bytes,
    get_flag,
    get_int,
    get_num,
    get_str,
    get_table,
)
from proxy.modelconfig import ConfigError

__all__ = [
    "AdaptiveConfig",
    "BackendConfig",
    "ConfigError",
    "KvgateConfig",
    "LedgerConfig",
    "ModelConfig",
    "QueueConfig",
    "ServerConfig",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    body_limit_bytes: int = 4 * 2**20
    body_read_timeout_s: float = 30.0
    # Bytes of request bodies being read, counted or waiting for admission, in all and
    # per model (None: a model may take the whole budget); past either, 503 memory_budget.
    body_budget_bytes: int = 256 * 2**20
    body_budget_per_model_bytes: int | None = None
    admin_token: str | None = None
    # Signs the tickets a 429 carries (`proxy.tickets`); the same on every replica lets a
    # ticket from one be honoured by another. None: each process draws its own.
    ticket_secret: str | None = None
    health_interval_s: float = 2.0
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 600.0
    count_workers: int = 0
    # Admit on an upper bound of the prompt while nothing waits, exact count after.
    admit_on_bound: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueConfig:
    max_depth: int = 128
    default_deadline_s: float = 30.0
    max_deadline_s: float = 120.0
    ordering: str = "fifo"
    starvation_s: float = 5.0
    aging_tokens_per_s: float = AGING_TOKENS_PER_S
    priority_header: str = "x-kvgate-priority"
    tenant_header: str = "x-kvgate-tenant"
    trust_tenant_header: bool = False
    fair_share_half_life_s: float = FAIR_SHARE_HALF_LIFE_S
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    priority_by_api_key: Mapping[str, str] = field(default_factory=dict)
    # Waiters a class may fill at most (a class not named: up to max_depth). Apart from
    # these, a full queue makes room for a higher class by refusing its lowest waiter.
    max_depth_by_priority: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerConfig:
    kind: str = "memory"
    url: str | None = None
    lease_ttl_s: float = 30.0
    key_prefix: str = "kvgate"
    refresh_interval_s: float = 0.5
    prefix_mirror_interval_s: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    name: str
    url: str
    api_key: str | None = None
    kind: EngineKind = EngineKind.VLLM
    slots: int | None = None  # requests the engine runs at once (llama.cpp: -np); None: any


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveConfig:
    """`[models.adaptive]`: how adaptive reservation learns and follows requests."""

    quantile: float = 0.5
    min_samples: int = 10
    history: int = 2000
    resize_interval_s: float = 0.1
    engine_poll_interval_s: float = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    name: str
    path: Path
    max_model_len: int
    output: OutputPolicy = field(default_factory=OutputPolicy)
    placement: PlacementName = PlacementName.BEST_FIT
    deployment: Deployment | None
    block_size: int
    capacity_tokens: int
    capacity_source: str  # "measured kv_tokens" or "estimate from ..."
    backends: tuple[BackendConfig, ...]
    capacity_from_backend: bool = False
    reservation: ReservationMode = ReservationMode.ADAPTIVE
    adaptive: AdaptiveConfig = field(default_factory=lambda: AdaptiveConfig())
    prefix_sharing: PrefixSharing = PrefixSharing.AUTO  # policies.engines, proxy.sharing


@dataclass(frozen=True, slots=True, kw_only=True)
class KvgateConfig:
    server: ServerConfig
    queue: QueueConfig
    ledger: LedgerConfig
    models: tuple[ModelConfig, ...]
    clients: Clients = field(default_factory=Clients)
    source: Path | None = None


# ----------------------------------------------------------------------------- sections


def _server(data: Mapping[str, Any]) -> ServerConfig:
    w = "server."
    check_keys(data, {"listen", "body_limit", "admin_token", "health_interval_s",
                       "upstream_connect_timeout_s", "upstream_read_timeout_s",
                       "count_workers", "admit_on_bound", "clients_file",
                       "body_read_timeout_s", "body_budget", "body_budget_per_model",
                       "ticket_secret"}, w)
    d = ServerConfig()
    listen = get_str(data, "listen", w, f"{d.host}:{d.port}")
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"`server.listen` must be HOST:PORT. Given: {listen!r}")
    token = data.get("admin_token")
    if token is not None and not (isinstance(token, str) and token):
        # "" must not read as "no token": that would turn the admin auth off unnoticed
        raise ConfigError(
            f"`server.admin_token` must be a non-empty string (leave it out for no "
            f"token). Given: {token!r}"
        )
    secret = data.get("ticket_secret")
    if secret is not None and not (isinstance(secret, str) and len(secret) >= 16):
        raise ConfigError("`server.ticket_secret` must be a string of at least 16 characters "
                          "(leave it out for one drawn per process)")
    body_limit = get_bytes(data, "body_limit", w) if "body_limit" in data else d.body_limit_bytes
    budget, per_model = _body_budget(data, w, d, body_limit)
    return ServerConfig(
        host=host.strip("[]") or d.host,
        port=int(port_text),
        body_limit_bytes=body_limit,
        body_budget_bytes=budget,
        body_budget_per_model_bytes=per_model,
        admin_token=token,
        ticket_secret=secret,
        **{k: get_num(data, k, w, getattr(d, k), minimum=least) for k, least in (
            ("health_interval_s", 0.05), ("upstream_connect_timeout_s", 0.1),
            ("upstream_read_timeout_s", 0.1), ("body_read_timeout_s", 0.01))},
        count_workers=get_int(data, "count_workers", w, d.count_workers, minimum=0),
        admit_on_bound=get_flag(data, "admit_on_bound", w, d.admit_on_bound),
    )


def _body_budget(data: Mapping[str, Any], w: str, d: ServerConfig, body_limit: int
                 ) -> tuple[int, int | None]:
    """`body_budget` and `body_budget_per_model`: each must hold one body of the largest
    size, or that body would be refused for ever with a 503 that says "retry"."""
    total = get_bytes(data, "body_budget", w) if "body_budget" in data else d.body_budget_bytes
    per_model = (get_bytes(data, "body_budget_per_model", w) if "body_budget_per_model" in data
                 else d.body_budget_per_model_bytes)
    for key, value in (("body_budget", total), ("body_budget_per_model", per_model)):
        if value is not None and value < body_limit:
            raise ConfigError(f"`{w}{key}` ({value} bytes) must be at least `{w}body_limit` "
                              f"({body_limit} bytes): a body of the largest size must fit")
    if per_model is not None and per_model > total:
        raise ConfigError(f"`{w}body_budget_per_model` ({per_model} bytes) must not exceed "
                          f"`{w}body_budget` ({total} bytes)")
    return total, per_model


def _queue(data: Mapping[str, Any]) -> QueueConfig:
    w = "queue."
    check_keys(data, {"max_depth", "default_deadline_s", "max_deadline_s", "ordering",
                       "starvation_s", "aging_tokens_per_s", "priority_header",
                       "tenant_header", "tenant_weights", "priority_by_api_key",
                       "trust_tenant_header", "fair_share_half_life_s",
                       "max_depth_by_priority"}, w)
    d = QueueConfig()
    ordering = get_str(data, "ordering", w, d.ordering)
    if ordering not in ORDERINGS:
        raise ConfigError(
            f"`queue.ordering` must be one of {sorted(ORDERINGS)}. Given: {ordering!r}"
        )
    weights = data.get("tenant_weights", d.tenant_weights)
    if not isinstance(weights, Mapping) or not all(
        isinstance(v, int | float) and v > 0 for v in weights.values()
    ):
        raise ConfigError("`queue.tenant_weights` must map tenant names to numbers > 0")
    by_key = data.get("priority_by_api_key", d.priority_by_api_key)
    if not isinstance(by_key, Mapping) or not all(
        isinstance(v, str) and v in PRIORITY_CLASSES for v in by_key.values()
    ):
        raise ConfigError(
            f"`queue.priority_by_api_key` must map API keys to one of {list(PRIORITY_CLASSES)}"
        )
    depths = data.get("max_depth_by_priority", d.max_depth_by_priority)
    if not isinstance(depths, Mapping) or not all(
        k in PRIORITY_CLASSES and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in depths.items()
    ):
        raise ConfigError(f"`queue.max_depth_by_priority` must map classes of "
                          f"{list(PRIORITY_CLASSES)} to waiter counts >= 0")
    trust = get_flag(data, "trust_tenant_header", w, d.trust_tenant_header)
    half_life = get_num(data, "fair_share_half_life_s", w, d.fair_share_half_life_s, minimum=0.0)
    if half_life <= 0:
        raise ConfigError(f"`queue.fair_share_half_life_s` must be > 0. Given: {half_life}")
    default = get_num(data, "default_deadline_s", w, d.default_deadline_s, minimum=0.0)
    # unset, the maximum rises to a larger default deadline rather than refuse it
    maximum = get_num(data, "max_deadline_s", w, max(d.max_deadline_s, default), minimum=0.0)
    if default > maximum:
        raise ConfigError(
            f"`queue.default_deadline_s` {default} exceeds `queue.max_deadline_s` {maximum}"
        )
    return QueueConfig(
        max_depth=get_int(data, "max_depth", w, d.max_depth, minimum=0),
        default_deadline_s=default,
        max_deadline_s=maximum,
        ordering=ordering,
        starvation_s=get_num(data, "starvation_s", w, d.starvation_s, minimum=0.0),
        aging_tokens_per_s=get_num(data, "aging_tokens_per_s", w, d.aging_tokens_per_s,
                                   minimum=0.0),
        priority_header=get_str(data, "priority_header", w, d.priority_header).lower(),
        tenant_header=get_str(data, "tenant_header", w, d.tenant_header).lower(),
        trust_tenant_header=trust,
        fair_share_half_life_s=half_life,
        tenant_weights={str(k): float(v) for k, v in weights.items()},
        priority_by_api_key={str(k): str(v) for k, v in by_key.items()},
        max_depth_by_priority={str(k): int(v) for k, v in depths.items()},
    )


def _ledger(data: Mapping[str, Any]) -> LedgerConfig:
    w = "ledger."
    check_keys(data, {"kind", "url", "lease_ttl_s", "key_prefix", "refresh_interval_s",
                      "prefix_mirror_interval_s"}, w)
    d = LedgerConfig()
    kind = get_str(data, "kind", w, d.kind)
    if kind not in ("memory", "redis"):
        raise ConfigError(f"`ledger.kind` must be 'memory' or 'redis'. Given: {kind!r}")
    url = data.get("url", d.url)
    if kind == "redis" and not (isinstance(url, str) and url.startswith(("redis://", "rediss://",
                                                                         "unix://"))):
        raise ConfigError(f"`ledger.url` must be a redis:// URL for kind 'redis'. Given: {url!r}")
    return LedgerConfig(
        kind=kind,
        url=url,
        lease_ttl_s=get_num(data, "lease_ttl_s", w, d.lease_ttl_s, minimum=1.0),
        key_prefix=get_str(data, "key_prefix", w, d.key_prefix),
        refresh_interval_s=get_num(data, "refresh_interval_s", w, d.refresh_interval_s,
                                   minimum=0.01),
        prefix_mirror_interval_s=get_num(data, "prefix_mirror_interval_s", w,
                                         d.prefix_mirror_interval_s, minimum=0.0),
    )


def _choice(data: Mapping[str, Any], key: str, w: str, choices: type[StrEnum]) -> str:
    """One of an enum's values; the default is `ModelConfig`'s."""
    value = get_str(data, key, w, field_default(ModelConfig, key))
    if value not in {c.value for c in choices}:
        raise ConfigError(f"`{w}{key}` must be one of {sorted(c.value for c in choices)}. "
                          f"Given: {value!r}")
    return value


def _model(data: Mapping[str, Any], i: int, base: Path) -> ModelConfig:
    w = f"models[{i}]."
    check_keys(data, {"name", "path", "max_model_len", "output_policy", "output_cap_tokens",
                       "placement", "deployment", "backends", "reservation", "adaptive",
                       "prefix_sharing"}, w)
    name = get_str(data, "name", w)
    path = base / get_str(data, "path", w)
    if not path.is_dir():
        raise ConfigError(f"`{w}path` {str(path)!r} is not a directory")
    policy_name = get_str(data, "output_policy", w, field_default(ModelConfig, "output").name)
    try:
        policy = OutputPolicyName(policy_name)
    except ValueError as exc:
        raise ConfigError(
            f"`{w}output_policy`: {exc}; expected one of "
            f"{sorted(p.value for p in OutputPolicyName)}"
        ) from exc
    cap_tokens: int | None = None
    if policy is OutputPolicyName.CAP:
        if "output_cap_tokens" not in data:
            raise ConfigError(f"`{w}output_policy` `cap` needs `{w}output_cap_tokens` >= 1")
        cap_tokens = get_int(data, "output_cap_tokens", w, None, minimum=1)
    elif "output_cap_tokens" in data:
        # silently ignored, it would look like a cap that is not applied
        raise ConfigError(
            f"`{w}output_cap_tokens` applies only to `output_policy = \"cap\"`; this model's "
            f"policy is {policy.value!r}"
        )
    output = OutputPolicy(name=policy, cap_tokens=cap_tokens)
    placement = PlacementName(_choice(data, "placement", w, PlacementName))
    reservation = ReservationMode(_choice(data, "reservation", w, ReservationMode))
    sharing = PrefixSharing(_choice(data, "prefix_sharing", w, PrefixSharing))
    adaptive = _adaptive(get_table(data, "adaptive", w), f"{w}adaptive.")
    capacity = parse_capacity(
        get_table(data, "deployment", w), f"{w}deployment.", path, base,
        from_backend_default=field_default(ModelConfig, "capacity_from_backend"))
    max_len = data.get("max_model_len", capacity.config_max_model_len)
    if max_len is None:
        raise ConfigError(f"`{w}max_model_len` is required (no config.json gives it)")
    max_model_len = get_int({"max_model_len": max_len}, "max_model_len", w, None, minimum=1)
    backends_raw = data.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ConfigError(f"`{w}backends` must list at least one backend")
    backends: list[BackendConfig] = []
    for j, b in enumerate(backends_raw):
        bw = f"{w}backends[{j}]."
        if not isinstance(b, Mapping):
            raise ConfigError(f"`{bw[:-1]}` must be a table")
        check_keys(b, {"name", "url", "api_key", "kind", "slots"}, bw)
        url = get_str(b, "url", bw)
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"`{bw}url` must start with http:// or https://. Given: {url!r}")
        # Anything but a non-empty string is refused: dropping it silently would send
        # the client's own Authorization upstream instead of the backend's key.
        key = get_str(b, "api_key", bw) if "api_key" in b else None
        try:
            kind = engine_kind(get_str(b, "kind", bw, field_default(BackendConfig, "kind")))
        except ValueError as exc:
            raise ConfigError(f"`{bw}kind`: {exc}") from exc
        slots = get_int(b, "slots", bw, None, minimum=1) if "slots" in b else None
        backends.append(BackendConfig(
            name=get_str(b, "name", bw, f"{name}-{j}"), url=url, api_key=key, kind=kind,
            slots=slots))
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise ConfigError(f"`{w}backends` names must be unique. Given: {names}")
    unsafe = unsafe_for_adaptive(b.kind for b in backends)
    if unsafe and "reservation" not in data:
        reservation = ReservationMode.STRICT  # the safe default in front of such an engine
    elif unsafe and reservation is ReservationMode.ADAPTIVE:
        raise ConfigError(
            f"`{w}reservation = \"adaptive\"` is unsafe with {', '.join(unsafe)} backends: "
            "they cannot preempt, and when their KV pool overflows every running request "
            "fails; use `reservation = \"strict\"` (the default for them)")
    return ModelConfig(
        name=name, path=path, max_model_len=max_model_len, output=output, placement=placement,
        deployment=capacity.deployment, block_size=capacity.block_size,
        capacity_tokens=capacity.tokens, capacity_source=capacity.source,
        backends=tuple(backends), capacity_from_backend=capacity.from_backend,
        reservation=reservation, adaptive=adaptive, prefix_sharing=sharing,
    )


def _adaptive(data: Mapping[str, Any], w: str) -> AdaptiveConfig:
    check_keys(data, {"quantile", "min_samples", "history", "resize_interval_s",
                       "engine_poll_interval_s"}, w)
    d = AdaptiveConfig()
    quantile = get_num(data, "quantile", w, d.quantile, minimum=0.01)
    if quantile > 1.0:
        raise ConfigError(f"`{w}quantile` must be <= 1. Given: {quantile}")
    min_samples = get_int(data, "min_samples", w, d.min_samples, minimum=1)
    history = get_int(data, "history", w, d.history, minimum=1)
    if history < min_samples:
        raise ConfigError(f"`{w}history` {history} must be >= `{w}min_samples` {min_samples}")
    return AdaptiveConfig(
        quantile=quantile, min_samples=min_samples, history=history,
        resize_interval_s=get_num(data, "resize_interval_s", w, d.resize_interval_s, minimum=0.01),
        engine_poll_interval_s=get_num(
            data, "engine_poll_interval_s", w, d.engine_poll_interval_s, minimum=0.05
        ),
    )


def parse_config(
    data: Mapping[str, Any], *, base: Path, source: Path | None = None
) -> KvgateConfig:
    check_keys(data, {"server", "queue", "ledger", "models", "clients"}, "")
    models_raw = data.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("`models` must list at least one [[models]] table")
    models = tuple(
        _model(m if isinstance(m, Mapping) else {}, i, base) for i, m in enumerate(models_raw)
    )
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError(f"`models` names must be unique. Given: {names}")
    backend_names = [b.name for m in models for b in m.backends]
    if len(set(backend_names)) != len(backend_names):
        raise ConfigError(f"backend names must be unique across models. Given: {backend_names}")
    server_table = get_table(data, "server", "")
    queue = _queue(get_table(data, "queue", ""))
    clients = load_clients(data.get("clients", []), server_table, base, queue.tenant_weights,
                           queue.priority_by_api_key)
    if clients.by_digest:
        queue = replace(queue, tenant_weights={**queue.tenant_weights, **clients.weights()})
    return KvgateConfig(
        server=_server(server_table),
        queue=queue,
        ledger=_ledger(get_table(data, "ledger", "")),
        models=models,
        clients=clients,
        source=source,
    )



def load_config(path: str | Path) -> KvgateConfig:
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {str(file)!r} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(file)!r} is not valid TOML: {exc}") from exc
    return parse_config(data, base=file.resolve().parent, source=file)
