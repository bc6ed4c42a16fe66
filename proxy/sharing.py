"""A request's shared-prefix block keys, counted from one encoding.

`prefix_sharing = "auto"` (a model's default, `policies.engines.PrefixSharing`)
shares on every backend whose engine caches prefixes: what its
`vllm:cache_config_info` says where it reports it, else its kind (vLLM v1, SGLang
and TGI 3 cache prefixes by default; llama.cpp's slots each keep their own cache).
`"off"` charges every lease its whole prompt. Sharing
needs the exact token ids (a counter that gives them: not Mistral's) and a dense
layout (a hybrid model's ledger tokens are not whole blocks of the prompt).
"""

from __future__ import annotations

import asyncio

from proxy.prefix_blocks import block_keys
from proxy.tokenize import CountFailed, PromptCounter, count_executor
from proxy.tokenize.guard import is_panic
from proxy.validation import ValidRequest

__all__ = ["counted_with_blocks", "scope_of"]


def scope_of(model: str, req: ValidRequest) -> str:
    """Blocks are shared within one model (a LoRA adapter is a model name of its own)
    and one `cache_salt`, never across."""
    salt = req.body.get("cache_salt")
    return f"{model}\0{salt if isinstance(salt, str) else ''}"


def _ids(counter: PromptCounter, req: ValidRequest) -> list[int] | None:
    if req.chat is not None:
        chat_ids = getattr(counter, "chat_token_ids", None)
        return None if chat_ids is None else list(chat_ids(req.chat))
    prompt = req.prompts[0]
    if not isinstance(prompt, str):
        return list(prompt)
    prompt_ids = getattr(counter, "prompt_token_ids", None)
    return None if prompt_ids is None else list(prompt_ids(prompt))


def _counted(counter: PromptCounter, req: ValidRequest, block_tokens: int,
             scope: str) -> tuple[int, tuple[str, ...]] | None:
    try:
        ids = _ids(counter, req)
    except BaseException as exc:
        if is_panic(exc):
            raise CountFailed(f"the tokenizer panicked on this prompt: {exc}") from exc
        raise
    if ids is None:
        return None
    return len(ids), tuple(block_keys(ids, block_tokens, scope=scope))


async def counted_with_blocks(counter: PromptCounter, req: ValidRequest, block_tokens: int,
                              scope: str) -> tuple[int, tuple[str, ...]] | None:
    """The exact prompt count and its block keys, from one encoding in the count pool;
    None where there is nothing to share (several prompts or sequences, no ids)."""
    if req.n != 1 or (req.chat is None and len(req.prompts) != 1):
        return None
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(count_executor(), _counted, counter, req,
                                      block_tokens, scope)
