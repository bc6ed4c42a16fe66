"""How many ledger tokens a request holds, for one model: the output decision, the
context check, block rounding and the strict or adaptive lease size, computed once per
request by the gate (`proxy.gate`), whether it serves or replays (`kvgate simulate`).

Pure: no I/O and no clock; the adaptive lease size comes from the model's
`ReservationTracker`, which knows what this model's answers have been.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from policies.engines import (
    EngineKind,
    default_output_tokens,
    max_tokens_within_context,
    requested_output,
)
from policies.output import decide_output
from proxy.admission import Demand
from proxy.capacity import cdiv
from proxy.config import ModelConfig
from proxy.errors import ContextLengthExceeded, InvalidRequest, MaxTokensRequired
from proxy.reservation import ReservationTracker
from proxy.validation import Endpoint, ValidRequest

__all__ = ["DemandRule", "ledger_rounding"]


def ledger_rounding(config: ModelConfig) -> Callable[[int], int]:
    """Resident tokens -> ledger tokens: whole blocks, or a hybrid layout's
    token-equivalents. Memoised: asked per layer kind, per request and again on every
    resize, and a model's layout never changes while lengths repeat."""
    deployment, block = config.deployment, config.block_size

    def rounded(resident_tokens: int) -> int:
        if deployment is not None:
            return deployment.ledger_tokens(resident_tokens)
        return cdiv(resident_tokens, block) * block

    return functools.lru_cache(maxsize=16384)(rounded)


class DemandRule:
    """One model's rule from (request, exact prompt counts) to what its lease holds."""

    def __init__(self, config: ModelConfig, kinds: Sequence[EngineKind],
                 tracker: ReservationTracker | None, ledger_tokens: Callable[[int], int]
                 ) -> None:
        self.config = config
        self.kinds = tuple(kinds)
        self.tracker = tracker  # None: strict, the whole prompt + max_tokens
        self.ledger_tokens = ledger_tokens
        self._bounded_by = max_tokens_within_context(self.kinds)

    def of(self, req: ValidRequest, prompts: list[int], *, priority: str = "",
           tenant: str = "", blocks: tuple[str, ...] = (),
           block_tokens: int = 0) -> tuple[Demand, int | None]:
        """Output reservation and context check per prompt; -> (demand, max_tokens to set).
        `blocks` (its prompt's shared-prefix keys, `block_tokens` each) go into the
        demand as they are: built once, not copied in (a frozen dataclass's `replace`
        is a few microseconds a request).

        Only a prompt that fills the context is refused; a max_tokens past the context's
        end is forwarded unchanged and reserved up to that end, as the engines serve it.
        The body carries one max_tokens for all its prompts: when the output policy caps
        any of them, every prompt is forwarded with that cap, so every prompt reserves it
        and must fit the context with it.
        """
        self.refuse_output_over_context(req)
        cfg = self.config
        # Several prompts in one call: one lease, several sequences; follow none of them.
        follow = not req.ignore_eos and len(prompts) == 1 and self.tracker is not None
        kinds = self.kinds
        requested = requested_output(kinds, max_tokens=req.max_tokens, n_predict=req.n_predict)
        decisions = []
        for prompt_tokens in prompts:
            engine_default = default_output_tokens(
                kinds, chat=req.endpoint is Endpoint.CHAT,
                prompt_tokens=prompt_tokens, max_model_len=cfg.max_model_len)
            decision = decide_output(cfg.output, requested=requested,
                                     engine_default=engine_default)
            if decision.missing:
                raise MaxTokensRequired(
                    f"model {cfg.name!r} requires `max_tokens` (or `max_completion_tokens`): "
                    "kvgate reserves KV cache for every output token a request may generate",
                    param="max_tokens",
                )
            decisions.append(decision)
        set_to = next((d.set_max_tokens for d in decisions if d.set_max_tokens is not None),
                      None)
        total = 0
        reserve_out = 0
        for prompt_tokens, decision in zip(prompts, decisions, strict=True):
            out = decision.max_tokens if set_to is None else set_to
            room = cfg.max_model_len - prompt_tokens
            if room < 1 or out < 1:  # the prompt alone leaves no room for one token
                raise ContextLengthExceeded(
                    max_model_len=cfg.max_model_len, prompt_tokens=prompt_tokens, max_tokens=out,
                )
            # vLLM and llama.cpp take prompt + max_tokens over the context and stop at its
            # end (finish_reason "length"): the request can hold no more than that.
            out = min(out, room)
            reserve_out = max(reserve_out, out)
            if self.tracker is not None:
                total += self.tracker.lease_tokens(
                    prompt_tokens=prompt_tokens, max_tokens=out, n=req.n,
                    min_tokens=min(req.min_tokens, out), strict=not follow,
                )
            else:
                total += req.n * self.ledger_tokens(prompt_tokens + out)
        demand = Demand(tokens=total, prompt_tokens=sum(prompts), max_tokens=reserve_out,
                        n=req.n, priority=priority, tenant=tenant,
                        min_tokens=min(req.min_tokens, reserve_out), follow=follow,
                        blocks=blocks, block_tokens=block_tokens if blocks else 0)
        return demand, set_to

    def refuse_output_over_context(self, req: ValidRequest) -> None:
        """A max_tokens above the context, where an engine behind the model refuses it
        whatever the prompt (vLLM): answered here, in kvgate's shape and before anything
        is counted or reserved, rather than queued, reserved and relayed as the engine's
        own 400."""
        cap = self.config.max_model_len
        if self._bounded_by and req.max_tokens is not None and req.max_tokens > cap:
            engines = ", ".join(k.value for k in self._bounded_by)
            raise InvalidRequest(
                f"`{req.max_tokens_field}` {req.max_tokens} is more than model "
                f"{self.config.name!r}'s context length {cap} tokens, and its {engines} "
                f"backends refuse a max_tokens above the context whatever the prompt; "
                f"ask for at most {cap} (a prompt + max_tokens past the context is served "
                "to the context's end)", param=req.max_tokens_field)

    def least_tokens(self, req: ValidRequest) -> int:
        """What parsing alone proves the request holds, before any count: one token per
        prompt and one output token per sequence, block-rounded."""
        prompts = 1 if req.chat is not None else len(req.prompts)
        return prompts * req.n * self.ledger_tokens(2)
