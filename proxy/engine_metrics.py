"""Read an engine's own KV capacity from its Prometheus text (vLLM's names).

vLLM exports `vllm:cache_config_info{block_size="16",num_gpu_blocks="N",...} 1`; the
simulated backend exports the same line. N x block_size is the measured KV capacity in
tokens, the figure vLLM logs as "GPU KV cache size" at start.
"""

from __future__ import annotations

import re

__all__ = ["kv_capacity_tokens"]

_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_capacity_tokens(metrics_text: str) -> int | None:
    """Tokens of KV cache the engine reports, or None when it does not say.

    >>> kv_capacity_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0')
    1600
    """
    match = _INFO.search(metrics_text)
    if match is None:
        return None
    labels = dict(_LABEL.findall(match.group(1)))
    try:
        blocks = int(labels["num_gpu_blocks"])
        block_size = int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    if blocks <= 0 or block_size <= 0:
        return None
    return blocks * block_size
