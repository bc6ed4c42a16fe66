"""Typed reads of TOML values for `proxy.config`: every error names its key.

Every default is read from its dataclass, never typed again here: from a default
instance where all fields have one (`ServerConfig()`...), else with `field_default`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from proxy.modelconfig import ConfigError
from proxy.units import parse_bytes

__all__ = ["check_keys", "field_default", "get_bytes", "get_flag", "get_int", "get_num",
           "get_str", "get_table"]


def field_default(cls: type[Any], name: str) -> Any:
    """The default of dataclass `cls`'s field `name`."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise LookupError(f"{cls.__name__}.{name} has no default")


def get_table(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"`{where}{key}` must be a table")
    return value


def check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key `{where}{unknown[0]}`; expected one of {sorted(allowed)}"
        )


def get_num(
    data: Mapping[str, Any], key: str, where: str, default: float | None, *, minimum: float
) -> float:
    value = data.get(key, default)
    if value is None:
        raise ConfigError(f"`{where}{key}` is required")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"`{where}{key}` must be a number. Given: {value!r}")
    if value < minimum:
        raise ConfigError(f"`{where}{key}` must be >= {minimum}. Given: {value}")
    return float(value)


def get_int(
    data: Mapping[str, Any], key: str, where: str, default: int | None, *, minimum: int
) -> int:
    value = data.get(key, default)
    if value is None:
        raise ConfigError(f"`{where}{key}` is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"`{where}{key}` must be an integer. Given: {value!r}")
    if value < minimum:
        raise ConfigError(f"`{where}{key}` must be >= {minimum}. Given: {value}")
    return value


def get_str(data: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"`{where}{key}` must be a non-empty string. Given: {value!r}")
    return value


def get_bytes(data: Mapping[str, Any], key: str, where: str) -> int:
    try:
        return parse_bytes(data[key], field=f"{where}{key}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def get_flag(data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"`{where}{key}` must be true or false. Given: {value!r}")
    return value
