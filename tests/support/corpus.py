"""A deterministic corpus of chat requests for exact-count comparisons."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "capacity", "cache", "token", "GPU", "memory", "latency", "naïve", "café", "résumé", "Zürich", "東京", "数学", "北京", "안녕하세요", "مرحبا", "שלום", "Привет", "🌅", "🚀", "👩\u200d💻", "é", "ä", "∑", "x²", "π≈3.14159", "<tag>", "{json:", "1}", "`code`", "\\n", "tab\tend"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(*, tools: bool, system: bool = True) -> list[dict[str, Any]]:
    """At least 30 requests: each a dict of messages (+ tools) for apply_chat_template."""
    rng = random.Random(1234)
    out: list[dict[str, Any]] = []
    out.append({"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    out.append({"messages": [{"role": "user", "content": ""}]})
    out.append({"messages": [{"role": "user", "content": " "}]})
    out.append({"messages": [{"role": "user", "content": "数学 ∑ x² 🌅 naïve café 東京 👩‍💻"}]})
    out.append({"messages": [{"role": "user", "content": "e\u0301a\u0308o\u0302 combining marks"}]})
    out.append({"messages": [{"role": "user", "content": "line one\nline two\n\n\ttabbed"}]})
    if system:
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Hello!"},
                ]
            }
        )
        out.append(
            {
                "messages": [
                    {"role": "system", "content": ""},
                    {"role": "user", "content": "Empty system prompt."},
                ]
            }
        )
    for turns in range(1, 9):
        msgs: list[dict[str, Any]] = []
        if system and turns % 2:
            msgs.append({"role": "system", "content": words(rng, 12)})
        for _ in range(turns):
            msgs.append({"role": "user", "content": words(rng, rng.randint(1, 60))})
            msgs.append({"role": "assistant", "content": words(rng, rng.randint(1, 60))})
        msgs.append({"role": "user", "content": words(rng, rng.randint(1, 40))})
        out.append({"messages": msgs})
    for n in (3000, 3500, 5000):
        out.append({"messages": [{"role": "user", "content": words(rng, n)}]})
    out.append(
        {
            "messages": [
                {"role": "user", "content": words(rng, 3200)},
                {"role": "assistant", "content": words(rng, 200)},
                {"role": "user", "content": "Summarise the above."},
            ]
        }
    )
    for _ in range(10):
        out.append({"messages": [{"role": "user", "content": words(rng, rng.randint(1, 300))}]})
    out.append({"messages": [{"role": "user", "content": "ends with assistant"},
                             {"role": "assistant", "content": "ok"}],
                "add_generation_prompt": False})
    if tools:
        out.append(
            {
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER_TOOL],
            }
        )
        out.append(
            {
                "messages": [
                    {"role": "user", "content": "Weather in 東京?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather",
                                             "arguments": {"city": "東京", "unit": "celsius"}},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
                ],
                "tools": [WEATHER_TOOL],
            }
        )
    return out
