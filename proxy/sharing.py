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

__all__ = ["counted_with_blocks", "scope_of"]


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
