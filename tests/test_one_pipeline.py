"""`kvgate serve` and `kvgate simulate` run one pipeline: the same request log, served
over real HTTP and replayed in virtual time, reserves the same tokens per request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tomli_w

from proxy.cli import build_parser
from proxy.replay import _Replay, load_trace
from proxy.replay_cli import build_scenario
from proxy.virtual_time import VirtualClockLoop
from tests.support.stack import MODEL, MODELS, running_stack

KV_TOKENS = 16384


def _chat(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about token budgets. " * (1 + 7 * i)}]


async def _serve(reservation: str, max_tokens: int | None, n: int) -> list[tuple[int, int]]:
    """(prompt tokens, reserved tokens) of each request, as kvgate's headers say."""
    out: list[tuple[int, int]] = []
    async with running_stack(backends=1, kv_tokens=KV_TOKENS,
                             model={"reservation": reservation}) as stack, \
            aiohttp.ClientSession() as s:
        for i in range(n):
            body: dict[str, Any] = {"model": MODEL, "messages": _chat(i)}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                out.append((int(resp.headers["x-kvgate-prompt-tokens"]),
                            int(resp.headers["x-kvgate-reserved-tokens"])))
    return out


def _replay(tmp_path: Path, reservation: str, client: str,
            served: list[tuple[int, int]]) -> list[int | None]:
    """The served requests' log replayed by `kvgate simulate` with the same config."""
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps({"ts": 30.0 * i, "prompt_tokens": p, "output_tokens": 8})
                           + "\n" for i, (p, _) in enumerate(served)))
    config = tmp_path / "kvgate.toml"
    config.write_text(tomli_w.dumps({"models": [{
        "name": MODEL, "path": str(MODELS / MODEL), "max_model_len": 8192,
        "reservation": reservation, "deployment": {"kv_tokens": KV_TOKENS, "block_size": 16},
        "backends": [{"name": "sim-0", "url": "http://127.0.0.1:9"}]}]}))
    args = build_parser().parse_args(["simulate", "--trace", str(log), "--config", str(config),
                                      "--client", client])
    loop = VirtualClockLoop()
    try:
        replay = _Replay(build_scenario(args), loop)
        loop.run_until_complete(replay.run(load_trace(log)))
    finally:
        loop.close()
    return [r.reserved_tokens for r in replay.records]


@pytest.mark.parametrize(("reservation", "max_tokens", "client"), [
    ("strict", 300, "cap-300"),
    ("strict", None, "none"),       # the engine's default: the context's end
    ("adaptive", 300, "cap-300"),   # cold start: the prompt and a first output block
])
def test_served_and_replayed_requests_reserve_the_same(
    tmp_path: Path, reservation: str, max_tokens: int | None, client: str
) -> None:
    served = asyncio.run(_serve(reservation, max_tokens, n=5))
    assert len({p for p, _ in served}) == 5  # five different prompt lengths
    replayed = _replay(tmp_path, reservation, client, served)
    assert replayed == [r for _, r in served]
    if reservation == "strict":
        blocks = [(p + (max_tokens or 8192 - p) + 15) // 16 * 16 for p, _ in served]
        assert replayed == blocks
