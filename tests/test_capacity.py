"""Capacity math: exact integers, worked by hand in the comments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.capacity import (
    AttentionLayout,
    Deployment,
    FullAttentionLayer,
    GiB,
    MemoryBudget,
    MLALayer,
    SlidingWindowLayer,
    cdiv,
    dtype_bytes,
    plan,
)
from proxy.modelconfig import ConfigError, layout_from_hf_config, max_model_len_from_hf_config
from proxy.units import parse_bytes, parse_count

CONFIGS = Path(__file__).parent / "data" / "configs"


def config(name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


def dense(layers: int, kv_heads: int, head_dim: int, *, dtype: str = "bfloat16") -> Deployment:
    layout = AttentionLayout.uniform(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    return Deployment(layout=layout, cache_dtype=dtype)


# ------------------------------------------------------------------ the worksheet


def test_worksheet_bytes_per_token_and_sequence() -> None:
    d = dense(80, 8, 128)
    # 2 x 80 layers x 8 KV heads x 128 x 2 bytes
    assert d.kv_bytes_per_token == 327_680
    assert d.sequence_bytes(8192) == 2_684_354_560
    assert d.sequence_bytes(8192) == int(2.5 * GiB)


@pytest.mark.parametrize(
    ("bits", "weights_gib", "max_seqs"),
    [(16, "130.39", 0), (8, "65.19", 2), (4, "32.60", 15)],
)
def test_worksheet_70b_on_80gib_none_fits_16_sequences(
    bits: int, weights_gib: str, max_seqs: int
) -> None:
    d = dense(80, 8, 128)
    budget = MemoryBudget(
        usable_bytes=80 * GiB, weights_bytes=70_000_000_000 * bits // 8, overhead=0.12
    )
    result = plan(d, budget, tokens=8192, concurrency=16)
    assert f"{result.weights_bytes / GiB:.2f}" == weights_gib
    assert result.fits is False
    assert result.max_sequences == max_seqs


def test_worksheet_4bit_15_sequences_total_78_51_gib_fits() -> None:
    budget = MemoryBudget(usable_bytes=80 * GiB, weights_bytes=35_000_000_000, overhead=0.12)
    result = plan(dense(80, 8, 128), budget, tokens=8192, concurrency=15)
    # (35e9 + 15 x 2,684,354,560) x 1.12 = 84,297,156,608 bytes, exact
    assert result.total_bytes == 84_297_156_608
    assert f"{result.total_bytes / GiB:.2f}" == "78.51"
    assert result.fits is True


def test_worksheet_80gb_decimal_lowers_4bit_limit_to_13() -> None:
    budget = MemoryBudget(usable_bytes=80 * 10**9, weights_bytes=35_000_000_000, overhead=0.12)
    assert plan(dense(80, 8, 128), budget, tokens=8192, concurrency=1).max_sequences == 13


def test_worksheet_32k_tokens_is_10_gib_per_sequence_limit_3() -> None:
    budget = MemoryBudget(usable_bytes=80 * GiB, weights_bytes=35_000_000_000, overhead=0.12)
    result = plan(dense(80, 8, 128), budget, tokens=32_768, concurrency=1)
    assert result.kv_bytes_per_sequence == 10 * GiB
    assert result.max_sequences == 3


def test_worksheet_8bit_cache_leaves_weights_unchanged() -> None:
    budget = MemoryBudget(usable_bytes=80 * GiB, weights_bytes=35_000_000_000, overhead=0.12)
    a = plan(dense(80, 8, 128), budget, tokens=8192, concurrency=15)
    b = plan(dense(80, 8, 128, dtype="fp8"), budget, tokens=8192, concurrency=15)
    assert a.weights_bytes == b.weights_bytes == 35_000_000_000
    assert b.kv_bytes_per_token == a.kv_bytes_per_token // 2 == 163_840


def test_40_layer_gqa_sequence_and_six_sequences() -> None:
    d = dense(40, 8, 128)
    assert d.kv_bytes_per_token == 163_840
    assert d.sequence_bytes(4096) == 671_088_640
    assert d.sequence_bytes(4096) / GiB == 0.625
    assert 6 * d.sequence_bytes(4096) == 4_026_531_840
    assert 6 * d.sequence_bytes(4096) / GiB == 3.75


def test_classic_mha_and_8_to_1_gqa() -> None:
    mha = layout_from_hf_config(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "torch_dtype": "bfloat16"}
    )
    gqa = layout_from_hf_config(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 4, "torch_dtype": "bfloat16"}
    )
    assert Deployment(layout=mha).kv_bytes_per_token == 524_288
    assert Deployment(layout=gqa).kv_bytes_per_token == 65_536


# ------------------------------------------------------------------ real configs


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 2 x 80 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16)
        ("llama-3.1-70b", 327_680),
        # 2 x 32 x 8 x 128 x 2
        ("llama-3.1-8b-instruct", 131_072),
        # plain MHA, fp16: 2 x 32 x 32 x 128 x 2
        ("llama-2-7b", 524_288),
        # explicit head_dim 128: 2 x 40 x 8 x 128 x 2
        ("qwen3-14b", 163_840),
        # head_dim 128 (not 5120/32 = 160): 2 x 40 x 8 x 128 x 2
        ("mistral-nemo-instruct-2407", 163_840),
        # 10 KV heads, head_dim 5120/40 = 128: 2 x 40 x 10 x 128 x 2
        ("phi-4", 204_800),
        # MLA: 61 layers x (512 + 64) elements x 2 bytes, no factor 2
        ("deepseek-v3", 70_272),
        # hybrid, every layer at short context: 2 x 24 x 8 x 64 x 2
        ("gpt-oss-20b", 49_152),
        # hybrid multimodal: text_config, 2 x 48 x 8 x 256 x 2
        ("gemma-3-12b-it", 393_216),
    ],
)
def test_real_config_kv_bytes_per_token(name: str, expected: int) -> None:
    assert Deployment(layout=layout_from_hf_config(config(name))).kv_bytes_per_token == expected


@pytest.mark.parametrize(
    ("tp", "expected"), [(1, 327_680), (2, 163_840), (4, 81_920), (8, 40_960), (16, 40_960)]
)
def test_gqa_8_kv_heads_split_per_device_then_replicated(tp: int, expected: int) -> None:
    layout = layout_from_hf_config(config("llama-3.1-70b"))
    # 8 KV heads: TP 8 leaves one per rank; TP 16 replicates, still one per rank.
    assert Deployment(layout=layout, tp=tp).kv_bytes_per_token == expected


def test_tp_that_does_not_divide_kv_heads_is_rejected() -> None:
    layout = layout_from_hf_config(config("phi-4"))  # 10 KV heads
    assert Deployment(layout=layout, tp=2).kv_bytes_per_token == 102_400
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide 10 KV heads"):
        Deployment(layout=layout, tp=4)


def test_mla_is_not_split_by_tensor_parallelism() -> None:
    layout = layout_from_hf_config(config("deepseek-v3"))
    assert isinstance(layout.layers[0], MLALayer)
    assert Deployment(layout=layout, tp=8).kv_bytes_per_token == 70_272


def test_pipeline_parallel_busiest_stage_decides() -> None:
    layout = layout_from_hf_config(config("deepseek-v3"))
    # 61 layers over 2 stages: 31 + 30; busiest 31 x 576 x 2
    assert Deployment(layout=layout, pp=2).kv_bytes_per_token == 35_712


def test_gpt_oss_sliding_layers_stop_at_the_window() -> None:
    d = Deployment(layout=layout_from_hf_config(config("gpt-oss-20b")))
    layers = d.layout.layers
    assert sum(isinstance(x, SlidingWindowLayer) for x in layers) == 12
    # Full layers: 12 x 8192 tokens x 2048 B = 201,326,592.
    # Window 128, block 16: cdiv(127, 16) + 1 = 9 blocks = 144 slots;
    # 12 x 144 x 2048 = 3,538,944. Sum 204,865,536.
    assert d.sequence_bytes(8192) == 204_865_536
    # Ledger: (12 x 8192 + 12 x 144) / 24 layers = 4168 token-equivalents
    assert d.ledger_tokens(8192) == 4168
    # Below the window every layer keeps every token: plain block rounding.
    assert d.ledger_tokens(100) == 112


def test_gemma3_hybrid_8_full_40_sliding() -> None:
    d = Deployment(layout=layout_from_hf_config(config("gemma-3-12b-it")))
    full = [x for x in d.layout.layers if not isinstance(x, SlidingWindowLayer)]
    assert len(full) == 8
    # 8 full x 8192 x 8192 B + 40 sliding x (cdiv(1023,16)+1 = 65 blocks = 1040) x 8192 B
    assert d.sequence_bytes(8192) == 8 * 8192 * 8192 + 40 * 1040 * 8192 == 877_658_112
    assert d.ledger_tokens(8192) == 2232


def test_gemma3_hub_config_without_head_dim_uses_class_default() -> None:
    hub_style = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 3840,
            "num_attention_heads": 16,
            "num_hidden_layers": 48,
            "num_key_value_heads": 8,
            "sliding_window": 1024,
        },
    }
    layout = layout_from_hf_config(hub_style)
    first = layout.layers[0]
    # hidden/heads would give 240; Gemma3TextConfig's default is 256.
    assert isinstance(first, SlidingWindowLayer)
    assert first.head_dim == 256
    assert [i for i, x in enumerate(layout.layers) if not isinstance(x, SlidingWindowLayer)] == [
        5, 11, 17, 23, 29, 35, 41, 47
    ]


def test_qwen2_switched_off_sliding_window_is_full_attention() -> None:
    qwen25_7b = {
        "model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "hidden_size": 3584, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16",
    }
    layout = layout_from_hf_config(qwen25_7b)
    assert not layout.is_hybrid
    assert Deployment(layout=layout).kv_bytes_per_token == 57_344  # 2 x 28 x 4 x 128 x 2


def test_bundled_configs_agree_with_transformers_config_classes() -> None:
    import transformers
    for path in sorted(CONFIGS.glob("*.json")):
        raw = json.loads(path.read_text())
        cls = transformers.CONFIG_MAPPING[raw["model_type"]]
        hf = cls(**{k: v for k, v in raw.items() if k != "model_type"})
        text = hf.get_text_config()
        layout = layout_from_hf_config(raw)
        if raw["model_type"].startswith("deepseek"):
            assert layout.layers[0] == MLALayer(
                kv_lora_rank=text.kv_lora_rank, qk_rope_head_dim=text.qk_rope_head_dim
            ), path.name
            continue
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        for layer, kind in zip(layout.layers, kinds, strict=True):
            assert layer.head_dim == head_dim, path.name
            assert layer.num_kv_heads == text.num_key_value_heads, path.name
            assert isinstance(layer, SlidingWindowLayer) == (kind == "sliding_attention"), path.name


# ------------------------------------------------------------------ blocks, budget


def test_cdiv_and_block_rounding() -> None:
    assert cdiv(17, 16) == 2
    assert cdiv(16, 16) == 1
    assert cdiv(0, 16) == 0
    d = dense(1, 1, 64)  # 256 B per token
    assert d.sequence_bytes(17) == 32 * 256
    assert d.ledger_tokens(17) == 32


@pytest.mark.parametrize("deployment", [
    dense(40, 8, 128),
    Deployment(layout=AttentionLayout.uniform(num_layers=36, num_kv_heads=8, head_dim=128),
               cache_dtype="bfloat16", tp=4, pp=3, block_size=32),
    Deployment(layout=AttentionLayout(layers=(MLALayer(kv_lora_rank=512,
                                                       qk_rope_head_dim=64),) * 61),
               cache_dtype="fp8", tp=8, block_size=64),
], ids=["dense", "dense-tp4-pp3-block32", "mla"])
def test_ledger_tokens_of_a_layout_without_windows_are_its_bytes_over_a_tokens(
    deployment: Deployment,
) -> None:
    # Whole blocks, taken without summing the layers: the same as the definition
    # (the busiest device's bytes over the bytes of one token), at every length.
    assert not deployment.layout.is_hybrid
    for tokens in [0, 1, *range(15, 70), 1000, 4095, 4096, 4097, 131_072]:
        by_bytes = cdiv(deployment.sequence_bytes(tokens), deployment.kv_bytes_per_token)
        assert deployment.ledger_tokens(tokens) == by_bytes, tokens
    with pytest.raises(ValueError, match=">= 0"):
        deployment.ledger_tokens(-1)


def test_token_capacity_counts_whole_blocks() -> None:
    d = dense(1, 1, 64)  # 256 B per token, 4096 B per block
    budget = MemoryBudget(usable_bytes=4096 * 10 + 4095, weights_bytes=0)
    assert budget.token_capacity(d) == 160


def test_zero_weights_zero_overhead_makes_usable_memory_the_pool() -> None:
    d = dense(80, 8, 128)
    budget = MemoryBudget(usable_bytes=10 * GiB, weights_bytes=0, overhead=0.0)
    assert budget.kv_pool_bytes(d) == 10 * GiB
    assert budget.token_capacity(d) == 10 * GiB // 327_680 // 16 * 16 == 32_768


def test_gpu_memory_utilization_and_reserve_bytes() -> None:
    d = dense(80, 8, 128)
    budget = MemoryBudget(
        usable_bytes=80 * GiB, gpu_memory_utilization=0.9, weights_bytes=35_000_000_000,
        reserve_bytes=2 * GiB,
    )
    assert budget.kv_pool_bytes(d) == int(80 * GiB * 0.9) - 35_000_000_000 - 2 * GiB


def test_weights_split_over_tp_devices() -> None:
    d = Deployment(layout=layout_from_hf_config(config("llama-3.1-70b")), tp=4)
    budget = MemoryBudget(usable_bytes=80 * GiB, weights_bytes=140_000_000_000, overhead=0.0)
    assert budget.weights_bytes_per_device(d) == 35_000_000_000
    assert plan(d, budget, tokens=8192, concurrency=1).kv_bytes_per_token == 81_920


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0, "num_kv_heads": 8, "head_dim": 128}, "`layers` must be"),
        ({"num_layers": 8, "num_kv_heads": 0, "head_dim": 128}, "`num_kv_heads` must be"),
        ({"num_layers": 8, "num_kv_heads": 8, "head_dim": -1}, "`head_dim` must be"),
    ],
)
def test_bad_shape_names_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionLayout.uniform(**kwargs)


def test_bad_budget_and_plan_inputs_name_the_field() -> None:
    d = dense(8, 8, 128)
    with pytest.raises(ValueError, match="`overhead` must be a finite"):
        MemoryBudget(usable_bytes=GiB, overhead=float("nan"))
    with pytest.raises(ValueError, match="`overhead` must be a finite"):
        MemoryBudget(usable_bytes=GiB, overhead=-0.1)
    with pytest.raises(ValueError, match="`usable_memory` must be > 0"):
        MemoryBudget(usable_bytes=0)
    budget = MemoryBudget(usable_bytes=GiB)
    with pytest.raises(ValueError, match="`tokens` must be an integer >= 1. Given: 0"):
        plan(d, budget, tokens=0, concurrency=1)
    with pytest.raises(ValueError, match="`concurrency` must be an integer >= 0. Given: -1"):
        plan(d, budget, tokens=10, concurrency=-1)


def test_unknown_dtype_and_auto_without_model_dtype() -> None:
    with pytest.raises(ValueError, match="unknown cache dtype 'fp7'"):
        dtype_bytes("fp7")
    with pytest.raises(ValueError, match="cache dtype `auto` needs the model's dtype"):
        dtype_bytes("auto")
    assert dtype_bytes("auto", model_dtype="float16") == 2
    assert dtype_bytes("fp8_e4m3") == 1


def test_config_missing_a_needed_field_names_it() -> None:
    with pytest.raises(ConfigError, match="no `num_attention_heads`"):
        layout_from_hf_config({"num_hidden_layers": 2, "hidden_size": 64})
    with pytest.raises(ConfigError, match="no `num_hidden_layers`"):
        layout_from_hf_config({})
    with pytest.raises(ConfigError, match="not a multiple"):
        layout_from_hf_config(
            {"num_hidden_layers": 2, "hidden_size": 100, "num_attention_heads": 3}
        )


def test_max_model_len_from_config() -> None:
    assert max_model_len_from_hf_config(config("qwen3-14b")) == 40_960
    assert max_model_len_from_hf_config(config("gemma-3-12b-it")) == 131_072


def test_full_and_sliding_layer_specs_compare_by_value() -> None:
    assert FullAttentionLayer(num_kv_heads=8, head_dim=64) != SlidingWindowLayer(
        num_kv_heads=8, head_dim=64, sliding_window=128
    )


# ------------------------------------------------------------------ units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 85_899_345_920),
        ("80 GiB", 85_899_345_920),
        ("80GB", 80_000_000_000),
        ("80gb", 80_000_000_000),
        ("85899345920", 85_899_345_920),
        ("1.5GiB", 1_610_612_736),
        ("512MiB", 536_870_912),
        ("0", 0),
    ],
)
def test_parse_bytes_units_are_explicit(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80XB", "eighty GiB", "-5GiB", "", "80 Gi"])
def test_parse_bytes_rejects_what_does_not_parse(text: str) -> None:
    with pytest.raises(ValueError, match="usable"):
        parse_bytes(text, field="usable")


def test_parse_count() -> None:
    assert parse_count("70e9", field="params") == 70_000_000_000
    assert parse_count("8_192", field="tokens") == 8192
    with pytest.raises(ValueError, match="whole number"):
        parse_count("1.5", field="tokens")
    with pytest.raises(ValueError, match="must be a number"):
        parse_count("lots", field="tokens")
