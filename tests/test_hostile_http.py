"""The hostile bodies, over real HTTP, per tokenizer path: every answer from the contract.

Each body is one an attacker would send (a megabyte of one whitespace class or symbol
in a row, gaps, a million prompts, a megabyte of tools, unique words), to kvgate with
a count worker in front of two simulated backends that count every prompt themselves
with the same tokenizer. What must hold, per model:

- every answer is a 200 or an error of the contract (its code, its status), never a 5xx
  of kvgate's own, and the connection is never dropped;
- what reached the backends is exactly what kvgate counted: each answered request's
  count (`x-kvgate-prompt-tokens`) is the engine's own (its usage), and the engines
  were given no other prompt (`vllm:prompt_tokens_total`);
- nothing is held at the end: no lease, no byte of the body budget, no worker lost.

The models are three fast byte-level paths with different patterns and their own
long-run rules (Qwen3; gpt-oss, o200k; DeepSeek V3, whose pattern leaves gaps).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from proxy.errors import ERROR_TABLE
from tests.support.metrics import samples
from tests.support.stack import Stack, running_stack

RUN = 1_100_000  # past the regex core's limit of 999,999 whitespace characters
MODELS = ["qwen3-14b", "gpt-oss-20b", "deepseek-v3"]


def bodies(model: str) -> dict[str, tuple[str, bytes]]:
    """name -> (route, body), each under the 4 MiB body limit."""

    def chat(content: str, **extra: Any) -> tuple[str, bytes]:
        body = {"model": model, "max_tokens": 4,
                "messages": [{"role": "user", "content": content}], **extra}
        return "/v1/chat/completions", json.dumps(body, ensure_ascii=False).encode()

    tool = {"type": "function", "function": {
        "name": "lookup", "description": "look a thing up " * 20,
        "parameters": {"type": "object", "properties": {
            f"p{i}": {"type": "string", "description": "a field"} for i in range(20)}}}}
    words = " ".join(f"w{i * 7919 % 1_000_003:x}" for i in range(300_000))
    return {
        "spaces": chat("x" + " " * RUN + "x"),
        "spaces, streamed": chat("y" + " " * RUN + "y", stream=True,
                                 stream_options={"include_usage": True}),
        "spaces and tabs": chat((" " * 63 + "\t") * (RUN // 64)),
        "tabs": chat("\t" * RUN),
        "nbsp": chat("\u00a0" * RUN),
        "ideographic space": chat("\u3000" * RUN),
        "mixed whitespace": chat(" \t\u00a0\u3000\u2003\x0b\x85" * (RUN // 7)),
        "newlines": chat("\n" * RUN),
        "bang": chat("!" * RUN),
        "controls": chat("\x01" * 200_000),
        "zero-width spaces": chat("\u200b" * 200_000),
        "unique words": chat(words),
        "tools": chat("hi", tools=[tool] * 3000),
        "a million prompts": ("/v1/completions", (
            '{"model": "' + model + '", "max_tokens": 1, "prompt": ['
            + ",".join(['"a"'] * 900_000) + "]}").encode()),
        "small chat": chat("hello"),
    }


async def metric_sum(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        return sum(v for _, v in samples(await resp.text()).get(name, []))


async def send(session: aiohttp.ClientSession, stack: Stack, route: str,
               body: bytes) -> tuple[int, dict[str, Any]]:
    """-> (status, the error) or (200, {"counted": kvgate's count, "given": the
    engine's, from its usage})."""
    async with session.post(f"{stack.url}{route}", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.status != 200:
            error: dict[str, Any] = json.loads(raw)["error"]
            return resp.status, error
        counted = int(resp.headers["x-kvgate-prompt-tokens"])
    if raw.startswith(b"data: "):
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = json.loads(raw)["usage"]
    return 200, {"counted": counted, "given": usage["prompt_tokens"]}


@pytest.mark.parametrize("model", MODELS)
def test_hostile_bodies_get_contract_answers_and_the_engine_gets_what_was_counted(
        model: str) -> None:
    async def scenario() -> None:
        async with running_stack(model_name=model, max_model_len=16384, kv_tokens=65536,
                                 server={"count_workers": 1},
                                 queue={"default_deadline_s": 60.0}) as stack, \
                aiohttp.ClientSession() as session:
            answers: dict[str, tuple[int, dict[str, Any] | None]] = {}
            for name, (route, body) in bodies(model).items():
                async with asyncio.timeout(120):
                    answers[name] = await send(session, stack, route, body)
            for name, (status, answer) in answers.items():
                assert status < 500, (name, status, answer)
                if status == 200:  # the engine was given what kvgate counted
                    assert answer["counted"] == answer["given"], (name, answer)
                else:
                    assert answer["code"] in ERROR_TABLE, (name, answer)
                    assert ERROR_TABLE[answer["code"]].status == status, (name, answer)
            # a fit: one run of spaces is a few thousand tokens; the chat of nothing
            assert answers["spaces"][0] == 200 and answers["spaces, streamed"][0] == 200
            assert answers["small chat"][0] == 200
            assert answers["bang"][1]["code"] == "context_length_exceeded"
            # and nothing else reached the engines
            given = 0.0
            for sim in stack.sims:
                given += await metric_sum(session, sim, "vllm:prompt_tokens_total")
            assert given == sum(a["given"] for status, a in answers.values() if status == 200)
            assert await metric_sum(session, stack.url, "kvgate_count_worker_exits_total") == 0
            assert await metric_sum(session, stack.url, "kvgate_count_failures_total") == 0
            async with asyncio.timeout(10):
                while any(stack.resident().values()) or await metric_sum(
                        session, stack.url, "kvgate_body_budget_held_bytes"):
                    await asyncio.sleep(0.05)

    asyncio.run(scenario())
