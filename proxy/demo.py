"""`kvgate demo`: the embedded default, with no services at all.

Two simulated GPU backends on loopback, each with a small KV pool, behind one proxy
with the in-memory ledger and the bundled Qwen3 tokenizer and chat template.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxy.bundled import BUNDLED_MODEL_NAME, bundled_model_dir
from proxy.config import parse_config
from proxy.server import start_proxy
from proxy.sim.engine import EngineConfig
from proxy.sim.server import SimSettings, bound_port, start_sim

__all__ = ["demo_config", "run_demo"]

MODEL_NAME = BUNDLED_MODEL_NAME


def demo_config(port: int, backend_urls: list[str], kv_tokens: int) -> dict[str, Any]:
    return {
        "server": {"listen": f"127.0.0.1:{port}", "health_interval_s": 1.0},
        "queue": {"max_depth": 64, "default_deadline_s": 10.0, "max_deadline_s": 30.0,
                  "ordering": "fifo"},
        "models": [{
            "name": MODEL_NAME,
            "path": str(bundled_model_dir()),
            "max_model_len": 8192,
            "output_policy": "fill",
            "deployment": {"kv_tokens": kv_tokens, "block_size": 16},
            "backends": [{"name": f"sim-{chr(97 + i)}", "url": url}
                         for i, url in enumerate(backend_urls)],
        }],
    }


async def run_demo(*, port: int, kv_tokens: int) -> None:
    sims = []
    for i in range(2):
        settings = SimSettings(
            engine=EngineConfig(kv_tokens=kv_tokens, decode_step_ms=20.0, per_seq_ms=0.2,
                                prefill_tokens_per_s=20000.0, seed=i),
            model=MODEL_NAME, model_dir=str(bundled_model_dir()), max_model_len=8192,
        )
        sims.append(await start_sim(settings, "127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{bound_port(r)}" for r in sims]
    config = parse_config(demo_config(port, urls, kv_tokens), base=Path.cwd())
    proxy = await start_proxy(config)
    base = f"http://127.0.0.1:{port}"
    print(f"""kvgate demo: proxy on {base}
  backends: {', '.join(urls)} (simulated GPUs, {kv_tokens} KV tokens each)
  model:    {MODEL_NAME} (bundled tokenizer and chat template)
  state:    curl -s {base}/admin/state
  metrics:  curl -s {base}/metrics | grep ^kvgate_

Try it:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{MODEL_NAME}", "max_tokens": 64,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

With the openai SDK:
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  r = client.chat.completions.create(model="{MODEL_NAME}", max_tokens=64,
      messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].finish_reason, r.usage)

Ctrl-C stops everything.""", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.cleanup()
        for runner in sims:
            await runner.cleanup()
