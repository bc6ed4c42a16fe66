"""`kvgate plan`: the capacity note, and the user-error type every subcommand raises.

Apart from proxy/cli.py so `kvgate simulate` (proxy/replay_cli.py) can size a
deployment with plan's own flags and arithmetic without importing the command's
entry point (which imports it back).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from proxy.capacity import (
    AttentionLayout,
    CapacityPlan,
    Deployment,
    MemoryBudget,
    plan,
)
from proxy.units import format_bytes, parse_bytes, parse_count

__all__ = ["CliError", "add_plan", "build_plan", "load_json", "render_plan"]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def load_json(path: str, *, what: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CliError(f"{what} {path!r} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"{what} {path!r} must hold a JSON object")
    return data


# ----------------------------------------------------------------------------- plan


def _plan_layout(args: argparse.Namespace) -> AttentionLayout:
    from proxy.modelconfig import layout_from_hf_config

    explicit = (args.layers, args.kv_heads, args.head_dim)
    if args.model_config:
        if any(v is not None for v in explicit):
            raise CliError("give --model-config or --layers/--kv-heads/--head-dim, not both")
        return layout_from_hf_config(load_json(args.model_config, what="--model-config"))
    if any(v is None for v in explicit):
        raise CliError("give --model-config, or all of --layers, --kv-heads and --head-dim")
    return AttentionLayout.uniform(
        num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim
    )


def _cache_dtype(args: argparse.Namespace, layout: AttentionLayout) -> str:
    if args.kv_bits is not None and args.kv_dtype is not None:
        raise CliError("give --kv-bits or --kv-dtype, not both")
    if args.kv_bits is not None:
        by_bits = {32: "float32", 16: "bfloat16", 8: "fp8"}
        if args.kv_bits not in by_bits:
            raise CliError(f"--kv-bits must be one of 8, 16, 32. Given: {args.kv_bits}")
        return by_bits[args.kv_bits]
    dtype = args.kv_dtype or "auto"
    if dtype == "auto" and layout.model_dtype is None:
        raise CliError("the model dtype is unknown: pass --kv-bits or --kv-dtype")
    return str(dtype)


def _weights_bytes(args: argparse.Namespace) -> int:
    if args.weights_bytes is not None:
        if args.params is not None:
            raise CliError("give --params (with --weight-bits) or --weights-bytes, not both")
        return parse_bytes(args.weights_bytes, field="--weights-bytes")
    if args.params is None:
        raise CliError("give --params (with --weight-bits) or --weights-bytes (0 for none)")
    params = parse_count(args.params, field="--params")
    if params < 0:
        raise CliError(f"--params must be >= 0. Given: {args.params}")
    if args.weight_bits < 1:
        raise CliError(f"--weight-bits must be >= 1. Given: {args.weight_bits}")
    bits: int = args.weight_bits
    return (params * bits + 7) // 8


def build_plan(args: argparse.Namespace) -> CapacityPlan:
    layout = _plan_layout(args)
    deployment = Deployment(
        layout=layout,
        cache_dtype=_cache_dtype(args, layout),
        tp=args.tp,
        pp=args.pp,
        block_size=args.block_size,
    )
    if args.overhead is not None and args.reserve_bytes is not None:
        raise CliError("give --overhead or --reserve-bytes, not both")
    budget = MemoryBudget(
        usable_bytes=parse_bytes(args.usable_memory, field="--usable-memory"),
        weights_bytes=_weights_bytes(args),
        gpu_memory_utilization=args.gpu_memory_utilization,
        reserve_bytes=(
            None
            if args.reserve_bytes is None
            else parse_bytes(args.reserve_bytes, field="--reserve-bytes")
        ),
        overhead=args.overhead,
    )
    tokens = parse_count(args.tokens, field="--tokens")
    return plan(deployment, budget, tokens=tokens, concurrency=args.concurrency)


def render_plan(result: CapacityPlan) -> str:
    scope = (
        f"per device (busiest of tp={result.tp} x pp={result.pp})"
        if result.tp * result.pp > 1
        else "one device"
    )
    lines = [
        f"kvgate capacity plan: {scope}, block size {result.block_size}",
        f"  KV cache per token      {result.kv_bytes_per_token:,} B",
        f"  KV cache per sequence   {format_bytes(result.kv_bytes_per_sequence)}"
        f"  ({result.tokens_per_sequence:,} resident tokens)",
        f"  weights (estimate)      {format_bytes(result.weights_bytes)}",
        f"  KV cache x {result.concurrency:<12,} {format_bytes(result.cache_bytes)}",
        f"  total needed            {format_bytes(result.total_bytes)}",
        f"  usable memory           {format_bytes(result.usable_bytes)}",
    ]
    if result.budget_bytes != result.usable_bytes:
        lines.append(f"  engine budget           {format_bytes(result.budget_bytes)}")
    lines += [
        f"  KV pool left            {format_bytes(result.capacity_bytes)}",
        f"  fits {result.concurrency} sequences       {'yes' if result.fits else 'NO'}",
        f"  max sequences           {result.max_sequences:,}",
        f"  token capacity          {result.token_capacity:,} tokens",
    ]
    assumptions = list(result.assumptions)
    if result.overhead is None and result.reserve_bytes is None:
        assumptions.append("no runtime reserve given: activations and graphs count as 0 bytes")
    for note in assumptions:
        lines.append(f"  assumption: {note}")
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    result = build_plan(args)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(render_plan(result))
    return 0


def add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="KV-cache and memory capacity note for a deployment")
    src = p.add_argument_group("model shape")
    src.add_argument("--model-config", help="a Hugging Face config.json")
    src.add_argument("--layers", type=int, help="number of layers")
    src.add_argument("--kv-heads", type=int, help="number of KV heads (not query heads)")
    src.add_argument("--head-dim", type=int, help="dimension of one head")
    p.add_argument("--params", help="parameter count, e.g. 70e9")
    p.add_argument("--weight-bits", type=int, default=16, help="bits per weight (default 16)")
    p.add_argument("--weights-bytes", help="measured weight bytes for the whole model (or 80GiB)")
    p.add_argument("--kv-bits", type=int, help="bits per cache element: 8, 16 or 32")
    p.add_argument("--kv-dtype", help="cache dtype: auto, bfloat16, float16, fp8, ...")
    p.add_argument(
        "--usable-memory", required=True, help="memory per device: 80GiB, 80GB or bytes"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=1.0)
    p.add_argument("--tokens", required=True, help="resident tokens per sequence")
    p.add_argument("--concurrency", type=int, default=1, help="sequences at once (default 1)")
    p.add_argument("--overhead", type=float, help="runtime overhead fraction (an assumption)")
    p.add_argument("--reserve-bytes", help="measured runtime reserve per device")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)


# ----------------------------------------------------------------------------- count
