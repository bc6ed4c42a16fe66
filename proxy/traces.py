"""Request traces to replay: Azure LLM inference CSVs, Mooncake JSONL, kvgate's own log.

Each becomes arrival time, prompt tokens and recorded output tokens per request.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["HASH_ID_TOKENS", "TraceRequest", "load_trace"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request as replayed: arrival (s from the slice start), prompt, recorded output."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # Mooncake's: one id per `HASH_ID_TOKENS` tokens of the prompt, chained (equal ids
    # at equal positions mean byte-identical prefixes); () where the trace has none
    hash_ids: tuple[int, ...] = ()


HASH_ID_TOKENS = 512  # tokens per Mooncake hash id
_Row = tuple[float, int, int, tuple[int, ...]]


def _azure(path: Path) -> list[_Row]:
    rows: list[_Row] = []
    first: datetime | None = None
    with path.open(newline="") as f:
        for i, rec in enumerate(csv.DictReader(f), start=2):
            try:
                stamp = datetime.strptime(rec["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
                first = first or stamp
                rows.append(((stamp - first).total_seconds(), int(rec["ContextTokens"]),
                             int(rec["GeneratedTokens"]), ()))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not an Azure LLM trace row ({exc})") from None
    return rows


def _stamp_s(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    raise ValueError(f"unreadable timestamp {value!r}")


def _jsonl(path: Path) -> list[_Row]:
    """Mooncake (`timestamp` ms, `input_length`, `output_length`) or kvgate's request log.

    kvgate's `kvgate.request` lines carry `prompt_tokens`; the arrival is `ts`,
    `time` or `timestamp` (epoch seconds or ISO 8601, as a log formatter adds it) and
    the output `output_tokens` or `completion_tokens`. Lines whose `outcome` is not
    `completed` are replayed too: they are demand the deployment must answer.
    """
    rows: list[_Row] = []
    with path.open() as f:
        for i, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            brace = line.find("{")  # a log line may carry a formatter's prefix
            try:
                rec = json.loads(line[brace:] if brace > 0 else line)
                if "input_length" in rec:  # Mooncake
                    ids = tuple(int(h) for h in rec.get("hash_ids") or ())
                    rows.append((float(rec["timestamp"]) / 1000, int(rec["input_length"]),
                                 int(rec["output_length"]), ids))
                    continue
                stamp = next((rec[k] for k in ("ts", "time", "timestamp") if k in rec), None)
                out = next((rec[k] for k in ("output_tokens", "completion_tokens") if k in rec),
                           None)
                if stamp is None or out is None or rec.get("prompt_tokens") is None:
                    raise ValueError("needs prompt_tokens, output_tokens (or completion_tokens) "
                                     "and ts (or time, timestamp)")
                rows.append((_stamp_s(stamp), int(rec["prompt_tokens"]), int(out), ()))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not a trace line ({exc})") from None
    return rows


def load_trace(path: str | Path, *, start_s: float = 0.0, duration_s: float | None = None,
               speed: float = 1.0) -> list[TraceRequest]:
    """The trace's requests in arrival order, sliced and time-compressed by `speed`.

    `start_s` and `duration_s` are in trace time (before compression). Rows with a
    prompt of 0 tokens are dropped (no engine accepts them); output 0 becomes 1.
    """
    p = Path(path)
    if not speed > 0:
        raise ValueError(f"`speed` must be > 0. Given: {speed}")
    rows = _azure(p) if p.suffix.lower() == ".csv" else _jsonl(p)
    if not rows:
        raise ValueError(f"{p}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out: list[TraceRequest] = []
    for t, prompt, output, hash_ids in rows:
        rel = t - t0 - start_s
        if rel < 0 or (duration_s is not None and rel >= duration_s) or prompt < 1:
            continue
        out.append(TraceRequest(arrival_s=rel / speed, prompt_tokens=prompt,
                                output_tokens=max(1, output), hash_ids=hash_ids))
    return out
