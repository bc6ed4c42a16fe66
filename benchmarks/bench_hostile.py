"""An attacker beside a legitimate client: how much of its small-chat throughput and
latency the client keeps, one run, with and without the attacker, alternating phases.

kvgate (`kvgate serve`) fronts one simulated backend (`kvgate sim`) with room to
spare, each its own process on 127.0.0.1; this process is both clients. The client
sends small chats in a closed loop (`--concurrency`). The attacker holds two
connections and sends, as fast as kvgate answers, the worst bodies found so far, each
just under the 4 MiB body limit, one kind per phase:

- `unique-text`: one chat of ~4 MB of fresh words, cycling through 24 such bodies
  (counting-bound: more than the count cache holds, and the prompt is far past the
  context, so it ends in a 400);
- `spaces`: one chat of ~4 MB of spaces and tabs (the tokenizer's worst regex path);
- `many-prompts`: a completions body of ~1M one-character prompts (refused at once
  from parsing: more prompts than any backend could hold);
- `tools`: a chat with ~4 MB of tool definitions (template rendering).

Reported per kind: the client's requests/s and p50/p99 latency with the attacker,
each as a ratio to the phases without it run just before. Acceptance (the hostile
clients issue): >= 80% of the throughput kept and p99 under 50 ms.

Then what the defence (large bodies' CPU work in a bounded lane,
`proxy.tokenize.cpu_lane`) costs a legitimate client of large bodies: one ~400 KB
prompt of fresh text at a time (it fits a 131,072 context and is counted whole),
its latency alone, beside the small chats, beside the attacker (`--large-kind`),
and beside both (`--large-client off` skips it).

    .venv/bin/python -m benchmarks.bench_hostile [--seconds 8] [--concurrency 4] \
        [--prefix-sharing auto|off] [--kinds unique-text,spaces,many-prompts,tools] \
        [--max-model-len 131072] [--large-client on|off] [--large-kind tools]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time

import aiohttp

from benchmarks.bench_proxy import kvgate_before_sim, ms

LIMIT = 4 * 2**20 - 4096  # under kvgate's default body limit (4 MiB)
KINDS = ("unique-text", "spaces", "many-prompts", "tools")
UNIQUE_BODIES = 24


def attack_body(kind: str, rng: random.Random) -> bytes:
    if kind == "unique-text":
        words = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(LIMIT // 12))
        return json.dumps({"model": "qwen3-14b", "max_tokens": 1,
                           "messages": [{"role": "user", "content": words[:LIMIT - 200]}]}
                          ).encode()
    if kind == "spaces":
        text = (" " * 63 + "\t") * ((LIMIT - 200) // 65)  # JSON writes a tab as two bytes
        return json.dumps({"model": "qwen3-14b", "max_tokens": 1,
                           "messages": [{"role": "user", "content": text}]}).encode()
    if kind == "many-prompts":
        n = (LIMIT - 200) // 4
        return ('{"model": "qwen3-14b", "max_tokens": 1, "prompt": [' + ",".join(['"a"'] * n)
                + "]}").encode()
    tool = {"type": "function", "function": {
        "name": "lookup", "description": "look a thing up " * 20,
        "parameters": {"type": "object", "properties": {
            f"p{i}": {"type": "string", "description": "a field"} for i in range(20)}}}}
    one = len(json.dumps(tool)) + 2
    tools = [tool] * ((LIMIT - 300) // one)
    return json.dumps({"model": "qwen3-14b", "max_tokens": 1, "tools": tools,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


async def victim(url: str, seconds: float, concurrency: int) -> tuple[list[float], float]:
    body = {"model": "qwen3-14b", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Summarise the KV cache in one line."}]}
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"the client got {resp.status}: "
                                           f"{(await resp.text())[:300]}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with asyncio.timeout(seconds + 60):
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, len(latencies) / (time.perf_counter() - t0)


async def settled(url: str, most_s: float = 60.0) -> float:
    """Wait until a small chat is answered 200 again; -> seconds waited. The simulated
    backend counts an admitted 4 MB prompt itself, on its event loop, and can miss
    kvgate's health probes meanwhile (then kvgate answers 503 no_backend a while)."""
    body = {"model": "qwen3-14b", "max_tokens": 1,
            "messages": [{"role": "user", "content": "ready?"}]}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    return time.perf_counter() - t0
            if time.perf_counter() - t0 > most_s:
                raise RuntimeError(f"kvgate still answers {resp.status} after {most_s} s")
            await asyncio.sleep(0.25)


async def attacker(url: str, bodies: list[bytes], stop: asyncio.Event,
                   statuses: dict[int, int]) -> None:
    path = "/v1/completions" if b'"prompt"' in bodies[0][:200] else "/v1/chat/completions"
    sent = itertools.count()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as s:

        async def one_connection() -> None:
            while not stop.is_set():
                body = bodies[next(sent) % len(bodies)]
                async with s.post(url + path, data=body,
                                  headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1

        await asyncio.gather(one_connection(), one_connection())


LARGE_CHARS = 400_000


_VOCABULARY = ("the of and to in is that for it as was with be by on not he this are or "
               "his from at which but have an they you were her she there been one all "
               "would their we him has when who will more no if out so said what up its "
               "about into than them can only other new some could time these two may "
               "then do first any my now such like our over man me even most made after "
               "also did many before must through back years where much your way well "
               "down should because each just those people how too little state good very "
               "make world still own see men work long get here between both life being "
               "under never day same another know while last might us great old year off "
               "come since against go came right used take three").split()


def large_body(rng: random.Random) -> bytes:
    """A retrieval-style prompt: ~400 KB of English words in a fresh order (no count
    cache helps), about 90,000 tokens."""
    words = " ".join(rng.choice(_VOCABULARY) for _ in range(LARGE_CHARS // 4))
    return json.dumps({"model": "qwen3-14b", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Answer from these notes.\n" + words[:LARGE_CHARS]}]}
                      ).encode()


async def large_client(url: str, seconds: float, rng: random.Random,
                       most: int = 40) -> list[float]:
    """One large prompt at a time for `seconds` (at most `most`); -> latencies."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    async with aiohttp.ClientSession() as s, asyncio.timeout(seconds + 120):
        while time.perf_counter() < stop and len(latencies) < most:
            body = large_body(rng)
            t0 = time.perf_counter()
            async with s.post(f"{url}/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"the large-body client got {resp.status}")
            latencies.append(time.perf_counter() - t0)
    return latencies


async def large_cost(url: str, args: argparse.Namespace) -> None:
    """The large-body client alone, beside the small chats, the attacker, both."""
    rng = random.Random(1)
    attack = [attack_body(args.large_kind, rng)]
    print(f"\na legitimate client of ~{LARGE_CHARS // 1000} KB prompts, one at a time; "
          f"attacker: {args.large_kind}; latencies in ms")
    print(f"{'beside':<22}{'prompts':>8}{'p50':>9}{'max':>9}  small chats req/s, p99")
    for small, attacked in ((False, False), (True, False), (False, True), (True, True)):
        await settled(url)
        stop = asyncio.Event()
        statuses: dict[int, int] = {}
        attacking = (asyncio.ensure_future(attacker(url, attack, stop, statuses))
                     if attacked else None)
        if attacked:
            await asyncio.sleep(0.5)
        chats = (asyncio.ensure_future(victim(url, args.seconds, args.concurrency))
                 if small else None)
        lat = await large_client(url, args.seconds, rng)
        note = ""
        if chats is not None:
            chat_lat, tp = await chats
            note = f"{tp:.1f}, {ms(chat_lat, 0.99):.1f}"
        stop.set()
        if attacking is not None:
            async with asyncio.timeout(120):
                await attacking
        name = " + ".join(n for n, on in (("small chats", small), ("attacker", attacked))
                          if on) or "alone"
        print(f"{name:<22}{len(lat):>8}{ms(lat, 0.5):>9.0f}{max(lat) * 1000:>9.0f}  {note}")


async def compare(url: str, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    print(f"client: {args.concurrency} connections of small chats; attacker: 2 connections; "
          f"{args.seconds:.0f} s phases, alternating; latencies in ms")
    print(f"{'attack':<14}{'alone req/s':>12}{'with req/s':>12}{'kept':>7}"
          f"{'alone p99':>11}{'with p50':>10}{'with p99':>10}  attacker answers")
    await victim(url, 2.0, args.concurrency)  # warm up
    for kind in filter(None, args.kinds.split(",")):  # --kinds "": the large client only
        # fresh text per request defeats the count cache (64 MiB: about 8 such bodies)
        bodies = [attack_body(kind, rng)
                  for _ in range(UNIQUE_BODIES if kind == "unique-text" else 1)]
        alone_tp: list[float] = []
        with_tp: list[float] = []
        alone_lat: list[float] = []
        with_lat: list[float] = []
        statuses: dict[int, int] = {}
        for _ in range(args.rounds):
            waited = await settled(url)
            if waited > 1:
                print(f"  (kvgate answered small chats again after {waited:.1f} s)")
            lat, tp = await victim(url, args.seconds, args.concurrency)
            alone_lat += lat
            alone_tp.append(tp)
            stop = asyncio.Event()
            attack = asyncio.ensure_future(attacker(url, bodies, stop, statuses))
            await asyncio.sleep(0.5)  # the attack under way
            lat, tp = await victim(url, args.seconds, args.concurrency)
            stop.set()
            async with asyncio.timeout(120):
                await attack
            with_lat += lat
            with_tp.append(tp)
        a, w = statistics.mean(alone_tp), statistics.mean(with_tp)
        answers = ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items()))
        print(f"{kind:<14}{a:>12.1f}{w:>12.1f}{w / a:>7.2f}{ms(alone_lat, 0.99):>11.1f}"
              f"{ms(with_lat, 0.5):>10.1f}{ms(with_lat, 0.99):>10.1f}  {answers}")
    if args.large_client == "on":
        await large_cost(url, args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefix-sharing", choices=["auto", "off"], default="auto")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--max-model-len", type=int, default=131072,
                        help="the context (8192 refuses every 4 MB prompt from its length "
                        "alone, before counting; 131072 makes kvgate count some of it)")
    parser.add_argument("--large-client", choices=["on", "off"], default="on")
    parser.add_argument("--large-kind", choices=KINDS, default="tools")
    args = parser.parse_args()
    print(f"max_model_len {args.max_model_len}, prefix sharing {args.prefix_sharing}")
    with kvgate_before_sim(decode_step_ms=1.0, model={"prefix_sharing": args.prefix_sharing},
                           max_model_len=args.max_model_len) as (_, proxy_url):
        asyncio.run(compare(proxy_url, args))

if __name__ == "__main__":
    main()
