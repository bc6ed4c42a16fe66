"""Parsing and printing of byte sizes and counts. GiB = 2**30 and GB = 10**9, never mixed.

A bare integer is bytes. A unit must be explicit otherwise: "80GiB" and "80GB"
differ by 5.2 GB, exactly the mistake that makes a paper ceiling wrong.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from proxy.capacity import GB, GiB

__all__ = ["format_bytes", "parse_bytes", "parse_count"]

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": GB,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GiB,
    "tib": 2**40,
}

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int, *, field: str = "size") -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1024' -> 1024 bytes.

    Fractions of a byte are rounded down; a unit other than B, KB..TB, KiB..TiB is an error.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"`{field}` must be >= 0 bytes. Given: {text}")
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(
            f"`{field}` must be a number with a unit such as 80GiB, 80GB or a byte count. "
            f"Given: {text!r}"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower() or "b")
    if factor is None:
        raise ValueError(
            f"`{field}` has unknown unit {unit!r}; expected one of "
            "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2). "
            f"Given: {text!r}"
        )
    try:
        value = Decimal(number) * factor
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only numbers
        raise ValueError(f"`{field}` is not a number. Given: {text!r}") from exc
    return int(value)


def parse_count(text: str | int, *, field: str) -> int:
    """'70e9' -> 70000000000; counts must be whole numbers."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        value = Decimal(str(text).strip().replace("_", ""))
    except InvalidOperation as exc:
        raise ValueError(f"`{field}` must be a number such as 70e9. Given: {text!r}") from exc
    if not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"`{field}` must be a whole number. Given: {text!r}")
    return int(value)


def format_bytes(n: int) -> str:
    """85899345920 -> '85,899,345,920 B (80.00 GiB, 85.90 GB)'."""
    return f"{n:,} B ({n / GiB:.2f} GiB, {n / GB:.2f} GB)"
