"""Output reservation: how many output tokens a request may still generate.

A capacity control never silently changes an answer: `require` rejects, `fill`
reserves what the engine would allow anyway, and `cap` sets max_tokens and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["OutputDecision", "OutputPolicy", "OutputPolicyName", "decide_output"]


class OutputPolicyName(StrEnum):
    REQUIRE = "require"  # reject requests without max_tokens
    FILL = "fill"  # reserve max_model_len - prompt, as engines default to
    CAP = "cap"  # set max_tokens = cap when absent or larger, in a response header


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputPolicy:
    name: OutputPolicyName = OutputPolicyName.FILL
    cap_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.name is OutputPolicyName.CAP and (self.cap_tokens is None or self.cap_tokens < 1):
            raise ValueError("output policy `cap` needs `output_cap_tokens` >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputDecision:
    """max_tokens to reserve; `set_max_tokens` when the body must carry a new value."""

    max_tokens: int
    set_max_tokens: int | None = None
    missing: bool = False  # policy `require` and nothing given


def decide_output(
    policy: OutputPolicy,
    *,
    requested: int | None,
    engine_default: int,
) -> OutputDecision:
    """`engine_default` is what the engine generates at most when the field is absent."""
    if policy.name is OutputPolicyName.REQUIRE:
        if requested is None:
            return OutputDecision(max_tokens=0, missing=True)
        return OutputDecision(max_tokens=requested)
    if policy.name is OutputPolicyName.CAP:
        cap = policy.cap_tokens or 0
        wanted = engine_default if requested is None else requested
        if wanted > cap:
            return OutputDecision(max_tokens=cap, set_max_tokens=cap)
        return OutputDecision(max_tokens=wanted)
    return OutputDecision(max_tokens=engine_default if requested is None else requested)
