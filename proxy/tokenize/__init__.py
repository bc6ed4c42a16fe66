"""Exact prompt-token counts, as the serving engine will count them.

Admission is only as good as its count: low by 5% overcommits the GPU, high wastes
it. So the count follows the engine's path, not an estimate:

* chat requests: render the model's own chat template with the semantics of
  transformers' `apply_chat_template` (what vLLM and SGLang call), then encode the
  text *without* adding special tokens again (the template writes BOS itself);
* plain prompts (`/v1/completions`): encode with the tokenizer's own BOS rule;
  token-id prompts count as given.

Loading happens once per model; `count_*` are synchronous and CPU-bound, and the
server runs them in a thread pool (`TokenCounter.count_chat_async`).

Hostile text (a million spaces in a row breaks tiktoken's regex, and its Rust core
panics with a `BaseException`) is counted exactly all the same, on a path that can
take it; where none can, every count path raises `CountFailed`, which the HTTP
layer answers as a 500 naming the request id (`proxy.tokenize.guard`).

The package: `base` (request and protocol types, errors), `templates` (jinja with
transformers' semantics), `encoders` (`tokenizers`, tiktoken, and the fast exact
byte-level BPE), `guard` (what keeps hostile text from breaking them), `counting`
(the counters), `loading` (a model directory -> a counter).

Import as `proxy.tokenize`: the name shadows the stdlib's `tokenize` only for code
run from inside `proxy/`.
"""
from __future__ import annotations

from proxy.tokenize.base import (
    ChatRequest,
    PromptCounter,
    RenderedChat,
    TemplateError,
    TokenizerLoadError,
)
from proxy.tokenize.counting import TokenCounter, count_executor
from proxy.tokenize.guard import CountFailed
from proxy.tokenize.loading import load_counter
from proxy.tokenize.mistral import MistralTokenCounter

__all__ = [
    "ChatRequest",
    "CountFailed",
    "MistralTokenCounter",
    "PromptCounter",
    "RenderedChat",
    "TemplateError",
    "TokenCounter",
    "TokenizerLoadError",
    "count_executor",
    "load_counter",
]
