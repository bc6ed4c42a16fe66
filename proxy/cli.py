"""The `kvgate` command. Subcommands import their heavy parts lazily so `plan` stays instant."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.capacity import (
    AttentionLayout,
    CapacityPlan,
    Deployment,
    MemoryBudget,
    plan,
)
from proxy.units import format_bytes, parse_bytes, parse_count

if TYPE_CHECKING:
    import asyncio

__all__ = ["main"]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _load_json(path: str, *, what: str) -> dict[str, object]:
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
        return layout_from_hf_config(_load_json(args.model_config, what="--model-config"))
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


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _cmd_count(args: argparse.Namespace) -> int:
    from proxy.errors import KvgateError
    from proxy.tokenize import TemplateError, load_counter
    from proxy.validation import parse_chat_file

    counter = load_counter(args.model_dir, encoding=args.encoding)
    try:
        if args.chat is not None:
            chat = parse_chat_file(_load_json(args.chat, what="--chat file"))
            tokens = counter.count_chat(chat)
            kind = "chat"
        else:
            tokens = counter.count_prompt(args.prompt)
            kind = "prompt"
    except (KvgateError, TemplateError) as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        print(json.dumps({"prompt_tokens": tokens, "model": counter.name, "kind": kind}))
    else:
        print(tokens)
    return 0


def _add_count(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("count", help="exact prompt tokens, after the model's chat template")
    p.add_argument("--model-dir", required=True, help="model directory (tokenizer.json ...)")
    p.add_argument("--encoding", help="tiktoken encoding in the directory, e.g. o200k_harmony")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--chat", help='JSON file: {"messages": [...], "tools": [...]?}')
    what.add_argument("--prompt", help="plain completion prompt text")
    p.add_argument("--json", action="store_true", help='print {"prompt_tokens": N, ...}')
    p.set_defaults(func=_cmd_count)


# ----------------------------------------------------------------------------- sim


def _cmd_sim(args: argparse.Namespace) -> int:
    from proxy.sim.engine import EngineConfig, OutputLength
    from proxy.sim.server import SimSettings, run_sim

    engine = EngineConfig(
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_ms=args.decode_step_ms,
        per_seq_ms=args.per_seq_ms,
        output_length=OutputLength(args.output_len),
        median_output_tokens=args.median_output_tokens,
        seed=args.seed,
    )
    if args.model_dir is None:
        from proxy.bundled import bundled_model_dir

        model_dir = str(bundled_model_dir())  # exact usage with no files of one's own
    else:
        model_dir = args.model_dir
    settings = SimSettings(
        engine=engine, model=args.model, model_dir=model_dir,
        max_model_len=args.max_model_len,
    )
    run_sim(settings, args.host, args.port)
    return 0


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="one simulated GPU inference backend (OpenAI-compatible)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-tokens", type=int, required=True, help="KV pool size in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="0 = instant")
    p.add_argument("--decode-step-ms", type=float, default=0.0, help="base time of one step")
    p.add_argument("--per-seq-ms", type=float, default=0.0, help="added per running sequence")
    p.add_argument("--output-len", choices=["lognormal", "max"], default="lognormal")
    p.add_argument("--median-output-tokens", type=int, default=64)
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--model-dir", help="tokenizer directory for exact prompt_tokens "
                   "(default: the bundled Qwen3 tokenizer and chat template)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sim)


# ----------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import logging

    from proxy.config import load_config
    from proxy.server import start_proxy
    from proxy.sim.server import serve_forever

    config = load_config(args.config)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    async def serve() -> None:
        runner = await start_proxy(config)
        # What start-up loaded (tokenizer tables, compiled templates, config) lives as
        # long as the process: out of the collector's generations, so the full
        # collections that request garbage triggers stop walking it again and again.
        gc.freeze()
        await serve_forever(runner, f"kvgate: listening on http://{config.server.host}:{{port}}")

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve())
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop, aiohttp's documented fast loop, where installed; `KVGATE_LOOP=asyncio`
    keeps the standard loop. None means asyncio's default."""
    import os

    if os.environ.get("KVGATE_LOOP", "uvloop").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the admission proxy")
    p.add_argument("--config", required=True, help="TOML configuration file")
    p.set_defaults(func=_cmd_serve)


def check_config_report(path: str) -> dict[str, object]:
    """Validate a config fully (tokenizers included) and derive per-backend capacities."""
    from proxy.config import load_config
    from proxy.tokenize import load_counter

    config = load_config(path)
    models: list[dict[str, object]] = []
    for m in config.models:
        counter = load_counter(m.path, name=m.name)
        per_token = m.deployment.kv_bytes_per_token if m.deployment else None
        full_seq = m.deployment.ledger_tokens(m.max_model_len) if m.deployment else None
        models.append({
            "name": m.name,
            "path": str(m.path),
            "max_model_len": m.max_model_len,
            "output_policy": str(m.output.name),
            "encoder": counter.encoder_description,
            "admission_bound": counter.bound_description,
            "capacity_source": m.capacity_source,
            "kv_bytes_per_token": per_token,
            "full_context_sequences": (m.capacity_tokens // full_seq) if full_seq else None,
            "backends": [
                {"name": b.name, "url": b.url, "capacity_tokens": m.capacity_tokens}
                for b in m.backends
            ],
        })
    return {"config": path, "ledger": config.ledger.kind, "listen":
            f"{config.server.host}:{config.server.port}", "models": models}


def _cmd_check_config(args: argparse.Namespace) -> int:
    report = check_config_report(args.config)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.config}: valid (listen {report['listen']}, ledger {report['ledger']})")
    models = report["models"]
    assert isinstance(models, list)
    for m in models:
        print(f"  model {m['name']}: max_model_len {m['max_model_len']:,}, output policy "
              f"{m['output_policy']}, capacity: {m['capacity_source']}")
        print(f"    counting: {m['encoder']}")
        print(f"    prompt bound for admission: {m['admission_bound']}")
        if m["kv_bytes_per_token"]:
            print(f"    KV cache per token {m['kv_bytes_per_token']:,} B per device; "
                  f"{m['full_context_sequences']} full-context sequences fit per backend")
        for b in m["backends"]:
            print(f"    backend {b['name']:<12} {b['url']:<32} "
                  f"{b['capacity_tokens']:>10,} KV tokens")
    return 0


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check-config", help="validate a config and print derived capacities")
    p.add_argument("config", help="TOML configuration file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_check_config)


def _cmd_local_stack(args: argparse.Namespace) -> int:
    import tempfile

    from proxy.stack import run_local_stack

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvgate-"))
    try:
        run_local_stack(base_port=args.base_port, workdir=workdir.resolve(),
                        kv_tokens=args.kv_tokens, decode_step_ms=args.decode_step_ms)
    except RuntimeError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _add_local_stack(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("local-stack",
                       help="compose's stack as processes: redis, 2 sims, 2 replicas, nginx")
    p.add_argument("--base-port", type=int, default=8080)
    p.add_argument("--workdir", help="configs and logs (default: a new temp folder)")
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--decode-step-ms", type=float, default=20.0)
    p.set_defaults(func=_cmd_local_stack)


def _cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from proxy.demo import run_demo

    asyncio.run(run_demo(port=args.port, kv_tokens=args.kv_tokens))
    return 0


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="proxy + two simulated GPU backends + bundled tokenizer")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--kv-tokens", type=int, default=16384, help="KV pool of each backend")
    p.set_defaults(func=_cmd_demo)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate", description="Token-aware admission proxy for LLM inference servers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_count(sub)
    _add_sim(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_check_config(sub)
    _add_local_stack(sub)
    from proxy.simulate_cli import add_simulate

    add_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (CliError, ValueError, OSError) as exc:
        print(f"kvgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
