"""A request's shared-prefix block keys, counted from one encoding.

`prefix_sharing = "auto"` (a model's default, `policies.engines.PrefixSharing`)
shares on every backend whose engine caches prefixes: by its kind (vLLM v1, SGLang
and TGI 3 cache prefixes by default; llama.cpp's slots each keep their own cache),
unless the engine's own `vllm:cache_config_info` says its caching is off.
`"off"` charges every lease its whole prompt. Sharing
needs the exact token ids (a counter that gives them: not Mistral's) and a dense
layout (a hybrid model's ledger tokens are not whole blocks of the prompt).
"""

from __future__ import annotations

import json

from proxy.count_workers import CountWorkers
from proxy.tokenize import PromptCounter, TokenCounter
from proxy.validation import ValidRequest

__all__ = ["SharingProbe", "counted_with_blocks", "scope_of"]

# A run of this many keyed requests in a row that met no prefix kvgate knows (no other
# lease's ready block, no block its engine recently held) switches to sampling: keys
# for one request in `SAMPLE_EVERY`; the first sampled request that meets one switches
# back. bench_peers (unique ~1,000-token prompts): block keys and the shared-block
# bookkeeping took ~20% of the loop's time where nothing is ever shared.
MISSES_BEFORE_SAMPLING = 64
SAMPLE_EVERY = 8


class SharingProbe:
    """Whether a request's block keys are worth computing: always while prefixes are
    being met, one in `SAMPLE_EVERY` after `MISSES_BEFORE_SAMPLING` requests that met
    none. A request without keys is charged its whole prompt (prefix-blind, the safe
    side) and leaves no block behind, so sharing that starts is found by the second
    sampled request that carries the prefix: within 2 x `SAMPLE_EVERY` requests of it
    (tests/test_prefix_sharing.py).
    """

    __slots__ = ("_every", "_misses", "_needed", "_since_sample", "skipped")

    def __init__(self, *, misses_before_sampling: int = MISSES_BEFORE_SAMPLING,
                 sample_every: int = SAMPLE_EVERY) -> None:
        self._needed = misses_before_sampling
        self._every = sample_every
        self._misses = 0
        self._since_sample = 0
        self.skipped = 0  # requests admitted without keys (for /admin/state and tests)

    @property
    def sampling(self) -> bool:
        return self._misses >= self._needed

    def wanted(self) -> bool:
        """Whether to compute the next request's keys."""
        if not self.sampling:
            return True
        self._since_sample += 1
        if self._since_sample >= self._every:
            self._since_sample = 0
            return True
        self.skipped += 1
        return False

    def met(self, prefix_known: bool) -> None:
        """What a keyed request found: a prefix kvgate knows, or none."""
        self._misses = 0 if prefix_known else self._misses + 1


def scope_of(model: str, req: ValidRequest) -> str:
    """Blocks are shared within one model (a LoRA adapter is a model name of its own)
    and one `cache_salt`, never across."""
    salt = req.body.get("cache_salt")
    return f"{model}\0{salt if isinstance(salt, str) else ''}"


async def counted_with_blocks(counter: PromptCounter, req: ValidRequest, block_tokens: int,
                              scope: str, workers: CountWorkers | None = None, *,
                              limit: int | None = None) -> tuple[int, tuple[str, ...]] | None:
    """The exact prompt count and its block keys, from one id stream: in a count worker
    where they run, else in this process (`TokenCounter.count_chat_keys_async`: a
    repeated segment's ids come from the count cache). None where there is nothing to
    share (several prompts or sequences, a counter without ids: Mistral's).

    Raises as counting does: `TemplateError`, `CountFailed` (a tokenizer panic too),
    `CountExceeded` once the count passes `limit`."""
    if req.n != 1 or (req.chat is None and len(req.prompts) != 1):
        return None
    if not isinstance(counter, TokenCounter):
        return None
    prompt = req.prompts[0] if req.chat is None else None
    if workers is not None and not (prompt is not None and not isinstance(prompt, str)):
        # the body as parsed (the gate holds no raw bytes here); a worker validates it
        # again, to the same request
        body = json.dumps(req.body, ensure_ascii=False, separators=(",", ":")).encode()
        counted = await workers.count_keys(req.endpoint, body, block_tokens, scope, limit)
        if counted is not None:
            return counted
    if req.chat is not None:
        return await counter.count_chat_keys_async(req.chat, block_tokens, scope, limit)
    assert prompt is not None
    return await counter.count_prompt_keys_async(prompt, block_tokens, scope, limit)
