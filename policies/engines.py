"""What each inference engine generates when a request names no `max_tokens`.

The reservation for such a request is the engine's own default, so it depends on the
engine behind the backend. The defaults, as each engine documents its OpenAI-compatible
routes (None: no bound, generation runs until the context is full):

| engine | /v1/completions | /v1/chat/completions |
|---|---|---|
| vLLM | 16 (`CompletionRequest.max_tokens = 16`) | None (max_model_len - prompt) |
| SGLang | 16 (`CompletionRequest.max_tokens = 16`) | None (capped at context - prompt) |
| TGI | None (`max_total_tokens` - input length) | None (`max_total_tokens` - input length) |
| llama.cpp | None (`n_predict = -1`: until the slot's context ends) | None (`n_predict = -1`) |

An unbounded default reserves max_model_len - prompt tokens, the most the engine may
generate: exact, but a short prompt then holds a whole context's worth of KV cache.
For TGI and llama.cpp behind completions traffic without `max_tokens`, output policy
`require` (or `cap`) is the one that admits more than a few requests at a time. For
llama.cpp, `max_model_len` must be the per-slot context (`--ctx-size` / `--parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ENGINE_DEFAULTS", "ENGINE_TRAITS", "EngineKind", "EngineTraits", "OutputDefault",
           "PrefixSharing", "caches_prefixes", "counts_as_llama_cpp", "default_output_tokens",
           "engine_kind", "max_tokens_within_context", "requested_output",
           "unsafe_for_adaptive"]


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    LLAMA_CPP = "llama.cpp"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputDefault:
    """Output tokens generated at most without `max_tokens`; None: up to the context end."""

    completions_tokens: int | None
    chat_tokens: int | None


ENGINE_DEFAULTS: dict[EngineKind, OutputDefault] = {
    EngineKind.VLLM: OutputDefault(completions_tokens=16, chat_tokens=None),
    EngineKind.SGLANG: OutputDefault(completions_tokens=16, chat_tokens=None),
    EngineKind.TGI: OutputDefault(completions_tokens=None, chat_tokens=None),
    EngineKind.LLAMA_CPP: OutputDefault(completions_tokens=None, chat_tokens=None),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTraits:
    """What an engine does with more work than its KV pool holds, and which request
    fields bound its output besides `max_tokens` / `max_completion_tokens`.

    `preempts`: over-admitted work waits or is preempted inside the engine and still
    completes (vLLM and SGLang preempt and recompute; TGI's router admits by its own
    token budget and queues the rest). llama.cpp does neither: when a shared pool
    overflows, every running request fails at once (a 500, or an error event
    mid-stream), so adaptive reservation, which may hold less than a request can grow
    to, is unsafe there and only strict leases are.
    `output_fields`: llama.cpp's `n_predict` wins over `max_tokens` (-1: until the
    context ends).
    `caches_prefixes`: a prefix block is held once for every running request that uses
    it, by default (vLLM v1's automatic prefix caching, SGLang's radix cache, TGI 3's
    prefix caching); llama.cpp's slots each keep their own cache. A running engine's
    own report (`vllm:cache_config_info`) can turn this off, never on.
    `max_tokens_within_context`: the engine refuses a `max_tokens` above its context
    whatever the prompt (vLLM 0.32: `400` "max_tokens=4096 cannot be greater than
    max_model_len=1024"), though it serves prompt + max_tokens past the context's end
    when max_tokens alone fits (tests/test_real_vllm_limits.py). llama.cpp serves any
    max_tokens to the context's end.
    """

    preempts: bool
    output_fields: tuple[str, ...] = ()
    caches_prefixes: bool = True
    max_tokens_within_context: bool = False


ENGINE_TRAITS: dict[EngineKind, EngineTraits] = {
    EngineKind.VLLM: EngineTraits(preempts=True, max_tokens_within_context=True),
    EngineKind.SGLANG: EngineTraits(preempts=True),
    EngineKind.TGI: EngineTraits(preempts=True),
    EngineKind.LLAMA_CPP: EngineTraits(preempts=False, output_fields=("n_predict",),
                                       caches_prefixes=False),
}


class PrefixSharing(StrEnum):
    """A model's `prefix_sharing`: `auto` charges a shared prefix block once on each
    backend whose engine caches prefixes; `off` charges every lease its whole prompt."""

    AUTO = "auto"
    OFF = "off"


def max_tokens_within_context(kinds: Iterable[EngineKind]) -> list[EngineKind]:
    """The engines among `kinds` that refuse a max_tokens above the context."""
    return sorted({k for k in kinds if ENGINE_TRAITS[k].max_tokens_within_context})


def caches_prefixes(kind: EngineKind) -> bool:
    return ENGINE_TRAITS[kind].caches_prefixes


def unsafe_for_adaptive(kinds: Iterable[EngineKind]) -> list[EngineKind]:
    """The engines among `kinds` in front of which only strict leases are safe."""
    return sorted({k for k in kinds if not ENGINE_TRAITS[k].preempts})


def counts_as_llama_cpp(kinds: Iterable[EngineKind]) -> bool:
    """Whether a model's prompts are counted as llama.cpp counts them: it skips the
    tokenizer's NFC normalizer (decomposed accents hold more tokens) and continues a
    final assistant message (no end of turn). Only where every backend is llama.cpp; a
    model served by both counts as vLLM does, and llama.cpp may then hold a few tokens
    more than kvgate reserved on such text."""
    kinds = set(kinds)
    return bool(kinds) and all(k is EngineKind.LLAMA_CPP for k in kinds)


def requested_output(kinds: Iterable[EngineKind], *, max_tokens: int | None,
                     n_predict: int | None) -> int | None:
    """The most output any of `kinds` will generate as the request asks; None: it set no
    bound one of them honours (the engine's default applies).

    Example: `{"max_tokens": 100, "n_predict": -1}` on llama.cpp runs to the context's
    end (n_predict wins, -1 is no bound) -> None; on vLLM it is 100.
    """
    asked: list[int | None] = []
    for kind in set(kinds) or {EngineKind.VLLM}:
        if n_predict is not None and "n_predict" in ENGINE_TRAITS[kind].output_fields:
            asked.append(None if n_predict < 0 else n_predict)
        else:
            asked.append(max_tokens)
    if any(a is None for a in asked):
        return None
    return max(a for a in asked if a is not None)


def engine_kind(name: str) -> EngineKind:
    try:
        return EngineKind(name)
    except ValueError:
        raise ValueError(
            f"unknown engine kind {name!r}; expected one of {sorted(k.value for k in EngineKind)}"
        ) from None


def default_output_tokens(
    kinds: Iterable[EngineKind], *, chat: bool, prompt_tokens: int, max_model_len: int
) -> int:
    """The most any of `kinds` generates for a request without `max_tokens`.

    The backend is picked after the demand is known, so a model served by several
    engines reserves the largest default among them. Example: max_model_len 4096,
    prompt 100, completions on vLLM and llama.cpp -> max(16, 4096 - 100) = 3996.
    A fixed default is not cut to the room left: vLLM and SGLang check prompt + 16
    against the context and refuse a completion that does not fit, and so does
    kvgate's context check with the 16 returned here. Never negative.
    """
    room = max(0, max_model_len - prompt_tokens)
    out = 0
    for kind in set(kinds) or {EngineKind.VLLM}:
        default = ENGINE_DEFAULTS[kind]
        tokens = default.chat_tokens if chat else default.completions_tokens
        out = max(out, room if tokens is None else tokens)
    return out
