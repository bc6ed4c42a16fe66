"""KV-cache and memory arithmetic: pure, typed, no I/O.

Every admission decision rests on two numbers computed here: how many bytes a
resident token costs on the busiest device of a backend, and how many tokens
that device's KV pool holds. The shapes follow vLLM's
`vllm/v1/kv_cache_interface.py`: one small frozen spec per kind of attention
layer, each answering "how many blocks does a sequence of N tokens keep".

Units: bytes are integers; GiB = 2**30 and GB = 10**9 are only used for display.

Ledger tokens. Kvgate's ledger counts *token-equivalents*: the bytes a request
keeps on the busiest device divided by the bytes one token costs when every
layer keeps it. For a model whose layers all use full attention this is the
block-rounded token count itself. For a hybrid model (sliding-window layers
beside full ones) a long sequence costs fewer token-equivalents than tokens,
because the window layers stop growing. vLLM's hybrid allocator sizes its
shared block pool the same way, so capacity and demand stay comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = [
    "GB",
    "AttentionLayout",
    "CapacityPlan",
    "Deployment",
    "FullAttentionLayer",
    "GiB",
    "LayerSpec",
    "MLALayer",
    "MemoryBudget",
    "SlidingWindowLayer",
    "cdiv",
    "dtype_bytes",
    "plan",
]

GiB = 2**30
GB = 10**9


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: cdiv(17, 16) == 2."""
    return -(-a // b)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Given: {value!r}")


# KV-cache element types by the names vLLM's `--kv-cache-dtype` and HF configs use.
_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}


def dtype_bytes(name: str, *, model_dtype: str | None = None) -> int:
    """Bytes per element of a cache dtype; `auto` resolves to the model's dtype.

    >>> dtype_bytes("auto", model_dtype="bfloat16")
    2
    """
    key = name.strip().lower()
    if key == "auto":
        if model_dtype is None:
            raise ValueError(
                "cache dtype `auto` needs the model's dtype (`torch_dtype` or `dtype` in "
                "config.json); pass an explicit cache dtype instead"
            )
        return dtype_bytes(model_dtype)
    if key not in _DTYPE_BYTES:
        raise ValueError(
            f"unknown cache dtype {name!r}; expected one of {sorted(_DTYPE_BYTES)} or 'auto'"
        )
    return _DTYPE_BYTES[key]


# --------------------------------------------------------------------------- layers


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionLayer:
    """A layer that keeps K and V for every resident token."""

    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_dim", self.head_dim)

    def kv_heads_per_device(self, tp: int) -> int:
        """Tensor parallelism splits KV heads; past one head per rank they are replicated.

        8 KV heads: TP 2 -> 4 per rank, TP 8 -> 1, TP 16 -> 1 (each head on two ranks).
        """
        _require_positive("tp", tp)
        heads = self.num_kv_heads
        if tp <= heads:
            if heads % tp:
                raise ValueError(
                    f"tensor parallel size {tp} does not divide {heads} KV heads; "
                    "engines reject this split"
                )
            return heads // tp
        if tp % heads:
            raise ValueError(
                f"tensor parallel size {tp} is not a multiple of {heads} KV heads; "
                "engines reject this split"
            )
        return 1

    def elements_per_token(self, tp: int) -> int:
        """K and V: the factor 2."""
        return 2 * self.kv_heads_per_device(tp) * self.head_dim

    def blocks_kept(self, tokens: int, block_size: int) -> int:
        return cdiv(tokens, block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowLayer(FullAttentionLayer):
    """A layer that attends to the last `sliding_window` tokens only.

    It keeps at most `cdiv(sliding_window - 1, block_size) + 1` blocks, as vLLM
    allocates it: +1 because the window may not start on a block boundary.
    Example: window 128, block 16 -> at most 9 blocks (144 token slots).
    """

    sliding_window: int

    def __post_init__(self) -> None:
        FullAttentionLayer.__post_init__(self)
        _require_positive("sliding_window", self.sliding_window)

    def blocks_kept(self, tokens: int, block_size: int) -> int:
        return min(cdiv(tokens, block_size), cdiv(self.sliding_window - 1, block_size) + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class MLALayer:
    """Multi-head latent attention (DeepSeek V2/V3).

    One compressed latent of `kv_lora_rank + qk_rope_head_dim` elements per token
    and layer: no separate K and V (no factor 2), and every tensor-parallel rank
    keeps the whole latent (no split).
    Example, DeepSeek V3: 512 + 64 = 576 elements per token per layer.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        _require_positive("kv_lora_rank", self.kv_lora_rank)
        _require_positive("qk_rope_head_dim", self.qk_rope_head_dim)

    def elements_per_token(self, tp: int) -> int:
        _require_positive("tp", tp)
        return self.kv_lora_rank + self.qk_rope_head_dim

    def blocks_kept(self, tokens: int, block_size: int) -> int:
        return cdiv(tokens, block_size)


LayerSpec = FullAttentionLayer | SlidingWindowLayer | MLALayer


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionLayout:
    """The attention layers of a model, in order, and the dtype its weights use."""

    layers: tuple[LayerSpec, ...]
    model_dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("`num_hidden_layers` must be >= 1. Given: 0")

    @classmethod
    def uniform(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model_dtype: str | None = None,
    ) -> AttentionLayout:
        """Every layer full attention with the same shape (the common dense case)."""
        _require_positive("layers", num_layers)
        layer = FullAttentionLayer(num_kv_heads=num_kv_heads, head_dim=head_dim)
        return cls(layers=(layer,) * num_layers, model_dtype=model_dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_hybrid(self) -> bool:
        return any(isinstance(layer, SlidingWindowLayer) for layer in self.layers)

    def stages(self, pp: int) -> list[tuple[LayerSpec, ...]]:
        """Split layers into `pp` contiguous pipeline stages, earlier stages one larger.

        80 layers, PP 3 -> 27, 27, 26.
        """
        _require_positive("pp", pp)
        if pp > self.num_layers:
            raise ValueError(
                f"pipeline parallel size {pp} exceeds {self.num_layers} layers"
            )
        base, extra = divmod(self.num_layers, pp)
        out: list[tuple[LayerSpec, ...]] = []
        start = 0
        for stage in range(pp):
            size = base + (1 if stage < extra else 0)
            out.append(self.layers[start : start + size])
            start += size
        return out


# ----------------------------------------------------------------------- deployment


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """A layout placed on devices: cache dtype, tensor/pipeline split, paging.

    All figures are for the busiest device, since that one runs out first.
    """

    layout: AttentionLayout
    cache_dtype: str = "auto"
    tp: int = 1
    pp: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        _require_positive("tp", self.tp)
        _require_positive("pp", self.pp)
        _require_positive("block_size", self.block_size)
        # Validate eagerly so a bad split fails at configuration time.
        self.layout.stages(self.pp)
        for layer in self.layout.layers:
            layer.elements_per_token(self.tp)
        dtype_bytes(self.cache_dtype, model_dtype=self.layout.model_dtype)

    @property
    def bytes_per_element(self) -> int:
        return dtype_bytes(self.cache_dtype, model_dtype=self.layout.model_dtype)

    def _stage_bytes_per_token(self, stage: tuple[LayerSpec, ...]) -> int:
        return sum(layer.elements_per_token(self.tp) for layer in stage) * self.bytes_per_element

    @property
    def _busiest_stage(self) -> tuple[LayerSpec, ...]:
        return max(self.layout.stages(self.pp), key=self._stage_bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token costs on the busiest device when every layer keeps it.

        80 layers x 8 KV heads x 128 head_dim, 2-byte cache: 2*80*8*128*2 = 327,680.
        """
        return self._stage_bytes_per_token(self._busiest_stage)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes a sequence of `tokens` resident tokens keeps on the busiest device.

        Paged: each layer keeps whole blocks. Block 16, 17 tokens -> 2 blocks.
        """
        if tokens < 0:
            raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
        best = 0
        for stage in self.layout.stages(self.pp):
            stage_bytes = sum(
                layer.blocks_kept(tokens, self.block_size)
                * self.block_size
                * layer.elements_per_token(self.tp)
                for layer in stage
            )
            best = max(best, stage_bytes * self.bytes_per_element)
        return best

    def ledger_tokens(self, tokens: int) -> int:
        """Token-equivalents a sequence holds in the ledger (see module docstring).

        Dense model, block 16: 17 tokens -> 32. Hybrid models: at most that.
        """
        if not self.layout.is_hybrid:
            # Every layer keeps every block (full attention, MLA): the bytes are whole
            # blocks times the bytes of a token, so the token-equivalents are whole
            # blocks, without summing the layers (asked on every request).
            if tokens < 0:
                raise ValueError(f"`tokens` must be >= 0. Given: {tokens}")
            return cdiv(tokens, self.block_size) * self.block_size
        return cdiv(self.sequence_bytes(tokens), self.kv_bytes_per_token)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBudget:
    """What one device offers the KV cache.

    usable_bytes: memory per device the engine may use (before utilization).
    gpu_memory_utilization: fraction of usable_bytes the engine takes, as vLLM's flag.
    weights_bytes: the whole model's weight payload; each device holds 1/(tp*pp).
    reserve_bytes: measured runtime reserve per device (activations, CUDA graphs...).
    overhead: alternatively, a fraction added on top of weights plus cache. It is
        an assumption, and reports label it so.
    """

    usable_bytes: int
    weights_bytes: int = 0
    gpu_memory_utilization: float = 1.0
    reserve_bytes: int | None = None
    overhead: float | None = None

    def __post_init__(self) -> None:
        if self.usable_bytes < 1:
            raise ValueError(f"`usable_memory` must be > 0 bytes. Given: {self.usable_bytes}")
        if self.weights_bytes < 0:
            raise ValueError(f"`weights_bytes` must be >= 0. Given: {self.weights_bytes}")
        util = self.gpu_memory_utilization
        if not (math.isfinite(util) and 0 < util <= 1):
            raise ValueError(f"`gpu_memory_utilization` must be in (0, 1]. Given: {util}")
        if self.reserve_bytes is not None and self.overhead is not None:
            raise ValueError("give either `reserve_bytes` or `overhead`, not both")
        if self.reserve_bytes is not None and self.reserve_bytes < 0:
            raise ValueError(f"`reserve_bytes` must be >= 0. Given: {self.reserve_bytes}")
        if self.overhead is not None and not (math.isfinite(self.overhead) and self.overhead >= 0):
            raise ValueError(f"`overhead` must be a finite fraction >= 0. Given: {self.overhead}")

    @property
    def _overhead_exact(self) -> Fraction:
        """0.12 as exactly 3/25, so byte counts do not pick up binary rounding."""
        return Fraction(repr(self.overhead or 0.0))

    @property
    def budget_bytes(self) -> int:
        return math.floor(self.usable_bytes * self.gpu_memory_utilization)

    def weights_bytes_per_device(self, deployment: Deployment) -> int:
        """An even split over tp*pp devices: an estimate (embeddings and norms differ)."""
        return cdiv(self.weights_bytes, deployment.tp * deployment.pp)

    def kv_pool_bytes(self, deployment: Deployment) -> int:
        """Bytes left for the KV cache on the busiest device; may be negative.

        With overhead f: (weights + cache) * (1 + f) <= budget, so the pool is
        budget / (1 + f) - weights. 80 GiB, f=0.12, 32.6 GiB weights -> 38.83 GiB.
        """
        weights = self.weights_bytes_per_device(deployment)
        if self.overhead is not None:
            return math.floor(self.budget_bytes / (1 + self._overhead_exact)) - weights
        return self.budget_bytes - weights - (self.reserve_bytes or 0)

    def total_bytes(self, deployment: Deployment, *, cache_bytes: int) -> int:
        """Memory the busiest device needs for its weights plus `cache_bytes` of KV."""
        weights = self.weights_bytes_per_device(deployment)
        if self.overhead is not None:
            return math.ceil((weights + cache_bytes) * (1 + self._overhead_exact))
        return weights + cache_bytes + (self.reserve_bytes or 0)

    def token_capacity(self, deployment: Deployment) -> int:
        """Whole blocks that fit in the pool, in ledger tokens (0 when nothing fits)."""
        pool = self.kv_pool_bytes(deployment)
        if pool <= 0:
            return 0
        return (pool // deployment.kv_bytes_per_block) * deployment.block_size


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityPlan:
    """The capacity note for one deployment at one workload; every figure per device."""

    kv_bytes_per_token: int
    tokens_per_sequence: int
    kv_bytes_per_sequence: int
    concurrency: int
    weights_bytes: int
    cache_bytes: int
    total_bytes: int
    usable_bytes: int
    budget_bytes: int
    capacity_bytes: int
    fits: bool
    max_sequences: int
    token_capacity: int
    block_size: int
    tp: int
    pp: int
    overhead: float | None
    reserve_bytes: int | None
    assumptions: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "tokens_per_sequence": self.tokens_per_sequence,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "concurrency": self.concurrency,
            "weights_bytes": self.weights_bytes,
            "cache_bytes": self.cache_bytes,
            "total_bytes": self.total_bytes,
            "usable_bytes": self.usable_bytes,
            "budget_bytes": self.budget_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "max_sequences": self.max_sequences,
            "token_capacity": self.token_capacity,
            "block_size": self.block_size,
            "tp": self.tp,
            "pp": self.pp,
            "overhead": self.overhead,
            "reserve_bytes": self.reserve_bytes,
            "per_device": self.tp * self.pp > 1,
            "assumptions": list(self.assumptions),
        }


def plan(
    deployment: Deployment, budget: MemoryBudget, *, tokens: int, concurrency: int
) -> CapacityPlan:
    """Does `concurrency` sequences of `tokens` resident tokens fit, and how many would?"""
    _require_positive("tokens", tokens)
    if not isinstance(concurrency, int) or concurrency < 0:
        raise ValueError(f"`concurrency` must be an integer >= 0. Given: {concurrency!r}")
    seq_bytes = deployment.sequence_bytes(tokens)
    cache_bytes = seq_bytes * concurrency
    pool = budget.kv_pool_bytes(deployment)
    total = budget.total_bytes(deployment, cache_bytes=cache_bytes)
    assumptions: list[str] = []
    if budget.overhead is not None:
        assumptions.append(
            f"runtime overhead assumed at {budget.overhead:g} of weights plus cache "
            "(not measured)"
        )
    if deployment.tp * deployment.pp > 1 and budget.weights_bytes:
        assumptions.append("weights assumed split evenly over tp x pp devices")
    return CapacityPlan(
        kv_bytes_per_token=deployment.kv_bytes_per_token,
        tokens_per_sequence=tokens,
        kv_bytes_per_sequence=seq_bytes,
        concurrency=concurrency,
        weights_bytes=budget.weights_bytes_per_device(deployment),
        cache_bytes=cache_bytes,
        total_bytes=total,
        usable_bytes=budget.usable_bytes,
        budget_bytes=budget.budget_bytes,
        capacity_bytes=pool,
        fits=pool >= 0 and total <= budget.budget_bytes,
        max_sequences=max(0, pool) // seq_bytes,
        token_capacity=budget.token_capacity(deployment),
        block_size=deployment.block_size,
        tp=deployment.tp,
        pp=deployment.pp,
        overhead=budget.overhead,
        reserve_bytes=budget.reserve_bytes,
        assumptions=tuple(assumptions),
    )
