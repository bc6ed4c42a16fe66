"""A simulated continuous-batching GPU engine whose KV pool runs out like vLLM's.

Memory model (vLLM v1, simplified):
* The pool has `num_blocks` blocks of `block_size` tokens.
* A waiting request starts when blocks for its whole current sequence are free
  (prompt, plus tokens already generated if it was preempted and is recomputed)
  and fewer than `max_num_seqs` run. Waiting is FIFO and unbounded, as in vLLM.
* Each step decodes one token for every running sequence. A sequence that crosses
  a block boundary needs one more block; when none is free the engine preempts
  the newest running sequence (frees all its blocks, puts it back at the head of
  the queue for recompute) and counts it, as vLLM's recompute preemption does.

Time model, documented so benchmarks can reason about it:
    step_s = decode_step_s + per_seq_s * running + prefill_tokens / prefill_tokens_per_s
where prefill_tokens are the tokens (re)computed for sequences started this step.

The invariant `blocks_used <= num_blocks` is checked every step; a breach counts
in `invariant_violations` (exported as a metric) instead of passing silently.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from proxy.capacity import cdiv

__all__ = ["EngineConfig", "FinishReason", "OutputLength", "Sequence", "SimEngine"]


class OutputLength(StrEnum):
    """How many tokens a sequence generates before it stops by itself."""

    LOGNORMAL = "lognormal"  # median 64 tokens, sigma 1.0, capped at max_tokens
    MAX = "max"  # always runs to max_tokens


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    kv_tokens: int
    block_size: int = 16
    max_num_seqs: int = 256
    prefill_tokens_per_s: float = 0.0  # 0 = free prefill
    decode_step_ms: float = 0.0
    per_seq_ms: float = 0.0
    output_length: OutputLength = OutputLength.LOGNORMAL
    median_output_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_tokens < self.block_size:
            raise ValueError(
                f"`kv_tokens` must hold at least one block of {self.block_size}. "
                f"Given: {self.kv_tokens}"
            )
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("`block_size` and `max_num_seqs` must be >= 1")
        for name in ("prefill_tokens_per_s", "decode_step_ms", "per_seq_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be >= 0. Given: {value}")

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // self.block_size


@dataclass(eq=False, slots=True, kw_only=True)
class Sequence:
    """One output choice of one request, as the engine schedules it."""

    seq_id: int
    index: int
    prompt_tokens: int
    max_tokens: int
    target_tokens: int
    stops_by_eos: bool = False  # reaching target_tokens means EOS ("stop"), not the cap
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    out: asyncio.Queue[tuple[int, int | None]]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


class SimEngine:
    """The engine loop; `submit` enqueues, `abort` frees, tokens arrive on `seq.out`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._free_blocks = config.num_blocks
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # counters exported as metrics
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.peak_blocks_used = 0
        self.invariant_violations = 0
        self.finished = 0

    # ------------------------------------------------------------------ public
    @property
    def blocks_used(self) -> int:
        return self.config.num_blocks - self._free_blocks

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def fits_ever(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Could a sequence of this size ever complete in an empty pool?"""
        return cdiv(prompt_tokens + max_tokens, self.config.block_size) <= self.config.num_blocks

    def submit(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        out: asyncio.Queue[tuple[int, int | None]],
        index: int = 0,
        eos_after: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> Sequence:
        """Queue one sequence; `(index, tokens so far)` then `(index, None)` arrive on `out`.

        `eos_after` replays a known output length: the model "samples EOS" after that
        many tokens. `ignore_eos` and `min_tokens` act on it as vLLM's sampling
        parameters act on a real EOS: the first runs to max_tokens, the second never
        stops before that many tokens.
        """
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if eos_after is not None and eos_after < 1:
            raise ValueError("eos_after must be >= 1")
        if min_tokens < 0 or min_tokens > max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if not self.fits_ever(prompt_tokens, max_tokens):
            raise ValueError(
                f"{prompt_tokens} prompt + {max_tokens} output tokens exceed the KV pool of "
                f"{self.config.num_blocks * self.config.block_size} tokens"
            )
        eos: int | None = eos_after
        if eos is None and self.config.output_length is OutputLength.LOGNORMAL:
            mu = math.log(self.config.median_output_tokens)
            eos = max(1, round(self._rng.lognormvariate(mu, 1.0)))
            if eos >= max_tokens:
                eos = None  # the draw reaches the cap: "length", as before
        if ignore_eos or eos is None:
            target, stops_by_eos = max_tokens, False
        else:
            eos = max(eos, min_tokens)
            target, stops_by_eos = min(eos, max_tokens), eos <= max_tokens
        seq = Sequence(
            seq_id=self._next_id,
            index=index,
            out=out,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            target_tokens=target,
            stops_by_eos=stops_by_eos,
        )
        self._next_id += 1
        self.prompt_tokens_total += prompt_tokens
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Client gone: free its blocks now. Idempotent."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = FinishReason.ABORT
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._free(seq)
        seq.out.put_nowait((seq.index, None))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------------ loop
    def _free(self, seq: Sequence) -> None:
        self._free_blocks += seq.blocks
        seq.blocks = 0

    def _check(self) -> None:
        used = self.blocks_used
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        if used > self.config.num_blocks or self._free_blocks < 0:
            self.invariant_violations += 1

    def _schedule(self) -> int:
        """Start waiting sequences that fit; return the tokens they prefill."""
        prefill = 0
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            need = cdiv(seq.total_tokens, self.config.block_size)
            if need > self._free_blocks:
                break
            self._waiting.popleft()
            seq.blocks = need
            self._free_blocks -= need
            self._running.append(seq)
            prefill += seq.total_tokens
        self._check()
        return prefill

    def _preempt_newest(self) -> Sequence:
        victim = self._running.pop()
        self._free(victim)
        victim.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(victim)
        return victim

    def _grow(self) -> None:
        """Give every running sequence room for its next token, preempting if needed."""
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            need = cdiv(seq.total_tokens + 1, self.config.block_size)
            while seq.blocks < need and self._free_blocks < need - seq.blocks:
                victim = self._preempt_newest()
                if victim is seq:
                    break
            if seq not in self._running:
                continue  # it was the newest and preempted itself
            self._free_blocks -= need - seq.blocks
            seq.blocks = need
            i += 1
        self._check()

    def _emit(self) -> None:
        still: list[Sequence] = []
        for seq in self._running:
            seq.generated += 1
            self.generation_tokens_total += 1
            seq.out.put_nowait((seq.index, seq.generated))
            if seq.generated >= seq.target_tokens:
                seq.finish_reason = (
                    FinishReason.STOP if seq.stops_by_eos else FinishReason.LENGTH
                )
                self._free(seq)
                self.finished += 1
                seq.out.put_nowait((seq.index, None))
            else:
                still.append(seq)
        self._running = still

    async def _loop(self) -> None:
        cfg = self.config
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            prefill = self._schedule()
            if not self._running:
                # Head of queue does not fit an empty pool: submit() refuses those,
                # so only an abort race lands here; wait for news.
                self._wake.clear()
                await self._wake.wait()
                continue
            self._grow()
            step_s = (cfg.decode_step_ms + cfg.per_seq_ms * len(self._running)) / 1000
            if prefill and cfg.prefill_tokens_per_s > 0:
                step_s += prefill / cfg.prefill_tokens_per_s
            await asyncio.sleep(step_s)
            self._emit()
