"""Resolve a Hugging Face `config.json` into an `AttentionLayout`, as engines read it.

Real hub configs omit fields whose defaults live in transformers' config classes
(Gemma 3 ships without `head_dim` or a sliding-window pattern) and keep fields
that are switched off (`sliding_window` beside `use_sliding_window: false` in
Qwen2/Qwen3). Reading the raw JSON naively gives wrong KV sizes, so the defaults
that matter for the KV cache are copied here from transformers' configuration
classes (v5.x), per `model_type`. The tests check this table against transformers
itself on every bundled config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.capacity import (
    AttentionLayout,
    FullAttentionLayer,
    LayerSpec,
    MLALayer,
    SlidingWindowLayer,
)

__all__ = ["ConfigError", "layout_from_hf_config", "max_model_len_from_hf_config"]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key.

    kvgate's one configuration error, for its TOML file (`proxy.config`, which
    re-exports it) and for a model's `config.json` lacking or contradicting what the
    KV formula needs (here). It lives here, the lower of the two modules.
    """


# Defaults from transformers' configuration classes, only the KV-relevant keys.
# "sliding_window_pattern": every Nth layer (1-based) is full attention.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"sliding_window": None},
    "mistral": {"sliding_window": 4096},
    "mixtral": {"sliding_window": None},
    "phi3": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {
        "head_dim": 128,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3_moe": {
        "head_dim": 128,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 2},
    "gemma3_text": {
        "head_dim": 256,
        "num_key_value_heads": 4,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
    # The checkpoint names no dtype (experts are MXFP4); attention and KV run in bf16.
    "gpt_oss": {
        "torch_dtype": "bfloat16",
        "head_dim": 64,
        "sliding_window": 128,
        "sliding_window_pattern": 2,
    },
    "deepseek_v2": {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
}

_MLA_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2"}


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs (Gemma 3, Llava...) nest the language model in `text_config`."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        merged: dict[str, Any] = {}
        if "torch_dtype" in config or "dtype" in config:
            merged["torch_dtype"] = config.get("torch_dtype", config.get("dtype"))
        merged.update(inner)
        if "model_type" not in inner and config.get("model_type"):
            merged["model_type"] = f"{config['model_type']}_text"
        return merged
    return config


def _int_field(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"model config has no `{key}`, which the KV-cache formula needs")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model config `{key}` must be an integer >= 1. Given: {value!r}")
    return value


def _resolved(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(_text_config(config))
    model_type = str(cfg.get("model_type") or "")
    for key, value in _DEFAULTS.get(model_type, {}).items():
        cfg.setdefault(key, value)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
    if pattern is not None:
        cfg["sliding_window_pattern"] = pattern
    return cfg


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    explicit = cfg.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != num_layers:
            raise ConfigError(
                f"model config `layer_types` must list {num_layers} entries "
                f"(`num_hidden_layers`). Given: {explicit!r}"
            )
        return [str(kind) for kind in explicit]
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    if window is None:
        return ["full_attention"] * num_layers
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        return [
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
            for i in range(num_layers)
        ]
    if "max_window_layers" in cfg and cfg.get("use_sliding_window"):
        first = int(cfg["max_window_layers"])
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def layout_from_hf_config(config: Mapping[str, Any]) -> AttentionLayout:
    """Build the per-layer KV layout of a model from its `config.json` contents.

    >>> layout_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8,
    ...     "hidden_size": 1024, "torch_dtype": "float16"}).layers[0].head_dim
    128
    """
    cfg = _resolved(config)
    num_layers = _int_field(cfg, "num_hidden_layers")
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    model_dtype = str(dtype) if dtype is not None else None
    model_type = str(cfg.get("model_type") or "")

    if model_type in _MLA_TYPES or "kv_lora_rank" in cfg:
        mla = MLALayer(
            kv_lora_rank=_int_field(cfg, "kv_lora_rank"),
            qk_rope_head_dim=_int_field(cfg, "qk_rope_head_dim"),
        )
        return AttentionLayout(layers=(mla,) * num_layers, model_dtype=model_dtype)

    num_heads = _int_field(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    num_kv_heads = num_heads if kv_heads is None else _int_field(cfg, "num_key_value_heads")
    if cfg.get("head_dim") is not None:
        head_dim = _int_field(cfg, "head_dim")
    else:
        hidden = _int_field(cfg, "hidden_size")
        if hidden % num_heads:
            raise ConfigError(
                f"model config has no `head_dim` and `hidden_size` {hidden} is not a "
                f"multiple of `num_attention_heads` {num_heads}"
            )
        head_dim = hidden // num_heads

    layers: list[LayerSpec] = []
    for kind in _layer_types(cfg, num_layers):
        if kind == "sliding_attention":
            window = _int_field(cfg, "sliding_window")
            layers.append(
                SlidingWindowLayer(
                    num_kv_heads=num_kv_heads, head_dim=head_dim, sliding_window=window
                )
            )
        elif kind == "full_attention":
            layers.append(FullAttentionLayer(num_kv_heads=num_kv_heads, head_dim=head_dim))
        else:
            raise ConfigError(
                f"model config `layer_types` has {kind!r}; kvgate knows "
                "'full_attention' and 'sliding_attention'"
            )
    return AttentionLayout(layers=tuple(layers), model_dtype=model_dtype)


def max_model_len_from_hf_config(config: Mapping[str, Any]) -> int | None:
    """The context length an engine defaults to: `max_position_embeddings`."""
    value = _text_config(config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None
