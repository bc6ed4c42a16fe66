"""The `kvgate` command. Subcommands import their heavy parts lazily so `plan` stays instant."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.plan_cli import CliError, add_plan, load_json

if TYPE_CHECKING:
    import asyncio

__all__ = ["main"]


def _cmd_count(args: argparse.Namespace) -> int:
    from proxy.errors import KvgateError
    from proxy.tokenize import TemplateError, load_counter
    from proxy.validation import parse_chat_file

    counter = load_counter(args.model_dir, encoding=args.encoding)
    try:
        if args.chat is not None:
            chat = parse_chat_file(load_json(args.chat, what="--chat file"))
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
        prefix_caching=args.prefix_caching,
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
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn off vLLM-style prefix caching (on by default, as in vLLM v1)")
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
    from policies.engines import counts_as_llama_cpp, unsafe_for_adaptive
    from proxy.config import load_config
    from proxy.tokenize import load_counter

    config = load_config(path)
    models: list[dict[str, object]] = []
    for m in config.models:
        counter = load_counter(m.path, name=m.name, unicode_normalizer=not counts_as_llama_cpp(
            b.kind for b in m.backends))
        per_token = m.deployment.kv_bytes_per_token if m.deployment else None
        full_seq = m.deployment.ledger_tokens(m.max_model_len) if m.deployment else None
        models.append({
            "name": m.name,
            "path": str(m.path),
            "max_model_len": m.max_model_len,
            "output_policy": str(m.output.name),
            "reservation": m.reservation.value,
            "unsafe_for_adaptive": [str(k) for k in unsafe_for_adaptive(
                b.kind for b in m.backends)],
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
        unsafe = m["unsafe_for_adaptive"]
        why = (f" (only strict is safe: {', '.join(unsafe)} cannot preempt)" if unsafe
               else "")
        print(f"    reservation: {m['reservation']}{why}")
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
    add_plan(sub)
    _add_count(sub)
    _add_sim(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_check_config(sub)
    _add_local_stack(sub)
    from proxy.replay_cli import add_simulate

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
