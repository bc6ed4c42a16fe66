"""A model's KV capacity from its `[models.deployment]` table: measured (`kv_tokens`),
estimated from config.json and the memory left after weights (`usable_memory`), or read
from the backend's own report (`capacity_from_backend`).

Kept apart from `proxy.config` because it is the one section that does arithmetic: the
estimate goes through `proxy.capacity`'s pure math, and every figure it refuses names
its key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.capacity import Deployment, MemoryBudget
from proxy.config_values import (
    check_keys,
    field_default,
    get_bytes,
    get_flag,
    get_int,
    get_num,
    get_str,
)
from proxy.modelconfig import ConfigError, layout_from_hf_config, max_model_len_from_hf_config
from proxy.units import parse_count

__all__ = ["ModelCapacity", "parse_capacity"]


@dataclass(frozen=True, slots=True)
class ModelCapacity:
    deployment: Deployment | None  # None: no config.json, only a measured kv_tokens
    block_size: int
    tokens: int  # per backend, whole blocks; 0 until the backend reports it
    source: str  # "measured kv_tokens", "estimate from ..." or the backend's report
    config_max_model_len: int | None  # config.json's, when there is one
    from_backend: bool


_DEPLOYMENT_KEYS = {
    "kv_tokens", "block_size", "model_config", "usable_memory", "gpu_memory_utilization",
    "weights_bytes", "params", "weight_bits", "reserve_bytes", "overhead", "tp", "pp",
    "cache_dtype", "capacity_from_backend",
}


def parse_capacity(
    data: Mapping[str, Any], w: str, model_path: Path, base: Path, *,
    from_backend_default: bool,
) -> ModelCapacity:
    """`[models.deployment]` -> where the model's KV capacity comes from, and how much."""
    check_keys(data, _DEPLOYMENT_KEYS, w)
    block_size = get_int(data, "block_size", w, field_default(Deployment, "block_size"), minimum=1)
    config_path: Path | None = None
    if "model_config" in data:
        config_path = base / get_str(data, "model_config", w)
    elif (model_path / "config.json").is_file():
        config_path = model_path / "config.json"
    deployment: Deployment | None = None
    config_len: int | None = None
    if config_path is not None:
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
            deployment = Deployment(
                layout=layout_from_hf_config(raw),
                cache_dtype=get_str(data, "cache_dtype", w,
                                    field_default(Deployment, "cache_dtype")),
                tp=get_int(data, "tp", w, field_default(Deployment, "tp"), minimum=1),
                pp=get_int(data, "pp", w, field_default(Deployment, "pp"), minimum=1),
                block_size=block_size,
            )
            config_len = max_model_len_from_hf_config(raw)
        except (OSError, json.JSONDecodeError, ValueError) as exc:
            raise ConfigError(f"`{w}model_config` ({config_path}): {exc}") from exc
    from_backend = get_flag(
        data, "capacity_from_backend", w, from_backend_default
    )
    if from_backend and "kv_tokens" not in data and "usable_memory" not in data:
        # Nothing is admitted to a backend until its /metrics has given its capacity.
        source = "the backend's report (vLLM /metrics cache_config_info, llama.cpp /props)"
        return ModelCapacity(deployment, block_size, 0, source, config_len, from_backend)
    if "kv_tokens" in data:
        kv_tokens = get_int(data, "kv_tokens", w, None, minimum=block_size)
        capacity = kv_tokens // block_size * block_size
        return ModelCapacity(deployment, block_size, capacity, "measured kv_tokens", config_len,
                             from_backend)
    if deployment is None:
        raise ConfigError(
            f"`{w}kv_tokens` is required when the model has no config.json to estimate from"
        )
    if "usable_memory" not in data:
        raise ConfigError(f"`{w}usable_memory` (or a measured `{w}kv_tokens`) is required")
    if "weights_bytes" in data:
        weights = get_bytes(data, "weights_bytes", w)
    elif "params" in data:
        try:
            params = parse_count(data["params"], field=f"{w}params")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        weights = (params * get_int(data, "weight_bits", w, 16, minimum=1) + 7) // 8
    else:
        raise ConfigError(f"`{w}weights_bytes` or `{w}params` is required to estimate capacity")
    try:
        budget = MemoryBudget(
            usable_bytes=get_bytes(data, "usable_memory", w),
            weights_bytes=weights,
            gpu_memory_utilization=get_num(data, "gpu_memory_utilization", w, 0.9, minimum=0.01),
            reserve_bytes=get_bytes(data, "reserve_bytes", w) if "reserve_bytes" in data else None,
            overhead=(get_num(data, "overhead", w, None, minimum=0.0) if "overhead" in data
                      else None),
        )
    except ValueError as exc:
        raise ConfigError(f"`{w}`: {exc}") from exc
    capacity = budget.token_capacity(deployment)
    if capacity < block_size:
        raise ConfigError(
            f"`{w}`: the estimate leaves no KV cache ({budget.kv_pool_bytes(deployment)} bytes "
            "per device after weights and reserve)"
        )
    source = "estimate from config.json and usable_memory"
    return ModelCapacity(deployment, block_size, capacity, source, config_len, from_backend)
