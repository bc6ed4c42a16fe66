"""Read an engine's own KV capacity from its Prometheus text (vLLM's names).

vLLM exports `vllm:cache_config_info{block_size="16",num_gpu_blocks="N",...} 1`; the
simulated backend exports the same line. N x block_size is the measured KV capacity in
tokens, the figure vLLM logs as "GPU KV cache size" at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EngineLoad", "engine_load", "kv_capacity_tokens"]

def kv_capacity_tokens(metrics_text: str) -> int | None:
    """Tokens of KV cache the engine can give requests, or None when it does not say.

    vLLM v1's block pool keeps one of its `num_gpu_blocks` as the null block, never
    handed to a request (measured on vLLM's CPU build: 1,024 blocks of 16 hold a
    16,368-token sequence at most), so the capacity is one block less:

    >>> kv_capacity_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0')
    1584
    """
    try:
        families = list(text_string_to_metric_families(
            _lines_of(metrics_text, ("vllm:cache_config_info",))))
    except ValueError:
        return None
    for family in families:
        for sample in family.samples:
            if sample.name != "vllm:cache_config_info":
                continue
            try:
                blocks = int(sample.labels["num_gpu_blocks"])
                block_size = int(sample.labels["block_size"])
            except (KeyError, ValueError):
                return None
            if blocks <= 1 or block_size <= 0:
                return None
            return (blocks - 1) * block_size
    return None


_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREEMPTION_NAMES = ("vllm:num_preemptions_total", "vllm:num_preemptions")


def _lines_of(metrics_text: str, names: tuple[str, ...]) -> str:
    """Only the sample lines of `names`: an engine's page runs to tens of kilobytes of
    histograms, and the pure-Python parser would read all of it on the event loop."""
    return "\n".join(line for line in metrics_text.splitlines() if line.startswith(names))


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """What the engine says about its own KV cache; None where it does not say."""

    usage_ratio: float | None
    preemptions_total: int | None
    prefix_caching: bool | None = None  # `enable_prefix_caching` in cache_config_info
    block_size: int | None = None
    prefix_hit_tokens_total: int | None = None  # vllm:prefix_cache_hits_total
    prefix_query_tokens_total: int | None = None  # vllm:prefix_cache_queries_total


_CACHE_CONFIG = "vllm:cache_config_info"
_HITS, _QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"


def engine_load(metrics_text: str) -> EngineLoad:
    """KV use (0..1) and preemptions since start, summed over the engine's label sets;
    its prefix caching setting, block size and prefix-cache counters (tokens).

    vLLM v1 names the usage `vllm:kv_cache_usage_perc` (a fraction, despite the
    name); v0 named it `vllm:gpu_cache_usage_perc`. Both are read.
    """
    usage: dict[str, float] = {}
    preemptions: float | None = None
    caching: bool | None = None
    block_size: int | None = None
    counters: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(_lines_of(
            metrics_text, _USAGE_NAMES + _PREEMPTION_NAMES + (_CACHE_CONFIG, _HITS, _QUERIES))))
    except ValueError:
        return EngineLoad(usage_ratio=None, preemptions_total=None)
    for family in families:
        for sample in family.samples:
            if sample.name == _CACHE_CONFIG:
                flag = sample.labels.get("enable_prefix_caching")
                if flag is not None:
                    caching = flag.strip().lower() == "true"
                size = sample.labels.get("block_size", "")
                block_size = int(size) if size.isdigit() else None
                continue
            if not math.isfinite(sample.value):  # NaN or Inf says nothing usable
                continue
            if sample.name in _USAGE_NAMES:
                usage[sample.name] = usage.get(sample.name, 0.0) + sample.value
            elif sample.name in _PREEMPTION_NAMES:
                preemptions = (preemptions or 0.0) + sample.value
            elif sample.name in (f"{_HITS}_total", f"{_QUERIES}_total"):
                counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    ratio = next((usage[n] for n in _USAGE_NAMES if n in usage), None)
    hits, queries = counters.get(f"{_HITS}_total"), counters.get(f"{_QUERIES}_total")
    return EngineLoad(
        usage_ratio=ratio,
        preemptions_total=None if preemptions is None else int(preemptions),
        prefix_caching=caching, block_size=block_size,
        prefix_hit_tokens_total=None if hits is None else int(hits),
        prefix_query_tokens_total=None if queries is None else int(queries),
    )
