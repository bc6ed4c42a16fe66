"""A simulated continuous-batching GPU engine whose KV pool runs out like vLLM's.

Memory model (vLLM v1, simplified):
* The pool has `num_blocks` blocks of `block_size` tokens (`proxy.sim.kv_cache`).
* A waiting request starts when blocks for its whole current sequence are free
  (prompt, plus tokens already generated if it was preempted and is recomputed)
  and fewer than `max_num_seqs` run. Waiting is FIFO and unbounded, as in vLLM.
* Prefix caching (on unless `prefix_caching=False`), as vLLM v1: full blocks are
  named by their hash chain; a starting sequence reuses the longest chain of its
  blocks still cached, at most `total_tokens - 1` tokens (the last token is always
  computed), rounded down to whole blocks. A reused block is referenced, not copied;
  one that was free (cached, unreferenced) leaves the free queue and so costs a block,
  but no compute. Freed blocks stay cached until a new block evicts them (LRU).
* Each step decodes one token for every running sequence. A sequence that crosses
  a block boundary needs one more block; when none is free the engine preempts
  the newest running sequence (drops its block references, puts it back at the head
  of the queue for recompute) and counts it, as vLLM's recompute preemption does.
  Its blocks stay cached, so its recompute hits whatever of them is not yet evicted.

A sequence's blocks are named by the hashes the caller gave (`block_hashes`, or
computed from `prompt_token_ids`); blocks past those (generated tokens, or a prompt
given by count only) get hashes private to the sequence: only its own recompute can
hit them.

Time model, documented so benchmarks can reason about it:
    step_s = decode_step_s + per_seq_s * running + prefill_tokens / prefill_tokens_per_s
where prefill_tokens are the tokens (re)computed for sequences started this step,
cache hits excluded.

The invariant `blocks_used <= num_blocks` is checked every step; a breach counts
in `invariant_violations` (exported as a metric) instead of passing silently.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.capacity import cdiv
from proxy.sim.kv_cache import (
    ROOT_HASH,
    Block,
    BlockHash,
    BlockPool,
    hash_prompt_blocks,
    private_block_hash,
)

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
    prefix_caching: bool = True

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
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    out: asyncio.Queue[tuple[int, int | None]]
    block_table: list[Block] = field(default_factory=list)
    # the hash chain known so far: the caller's, then private ones as blocks fill
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table that have a hash
    cached_tokens: int | None = None  # prompt tokens found cached when first scheduled

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def blocks(self) -> int:
        return len(self.block_table)


class SimEngine:
    """The engine loop; `submit` enqueues, `abort` frees, tokens arrive on `seq.out`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self.pool = BlockPool(config.num_blocks, enable_caching=config.prefix_caching)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # counters exported as metrics
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.peak_blocks_used = 0
        self.invariant_violations = 0
        self.finished = 0
        # vLLM's prefix cache stats, in tokens, counted when a sequence is scheduled:
        # sequences never preempted, and apart those recomputed after a preemption
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_preempted_queries = 0
        self.prefix_cache_preempted_hits = 0

    # ------------------------------------------------------------------ public
    @property
    def blocks_used(self) -> int:
        """Blocks referenced by running sequences (a shared block counts once)."""
        return self.config.num_blocks - self.pool.num_free

    @property
    def blocks_cached_free(self) -> int:
        """Blocks no sequence references that still hold a cached prefix (they count as
        free: the next allocation that needs them evicts them)."""
        return self.pool.num_cached_free

    @property
    def kv_cache_usage(self) -> float:
        """`vllm:kv_cache_usage_perc`: 1 - free / total, cached-but-free blocks free."""
        return self.pool.usage()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def fits_ever(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Could a sequence of this size ever complete in an empty pool?"""
        return cdiv(prompt_tokens + max_tokens, self.config.block_size) <= self.config.num_blocks

    def prompt_block_hashes(self, prompt_token_ids: Seq[int]) -> list[BlockHash]:
        """The hash chain of the prompt's full blocks, as `submit` computes it."""
        return hash_prompt_blocks(prompt_token_ids, self.config.block_size)

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
        prompt_token_ids: Seq[int] | None = None,
        block_hashes: Seq[BlockHash] | None = None,
    ) -> Sequence:
        """Queue one sequence; `(index, tokens so far)` then `(index, None)` arrive on `out`.

        `eos_after` replays a known output length: the model "samples EOS" after that
        many tokens. `ignore_eos` and `min_tokens` act on it as vLLM's sampling
        parameters act on a real EOS: the first runs to max_tokens, the second never
        stops before that many tokens.

        What the prompt's blocks share with other requests' (prefix caching): its token
        ids (`prompt_token_ids`, `prompt_tokens` of them), or, for a trace that has only
        hash ids, the hash chain of its first full blocks (`block_hashes`, at most
        `prompt_tokens // block_size`; see `proxy.sim.kv_cache`). Neither: nothing.
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
        hashes = self._prompt_hashes(prompt_tokens, prompt_token_ids, block_hashes)
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
            block_hashes=hashes,
        )
        self._next_id += 1
        self.prompt_tokens_total += prompt_tokens
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def _prompt_hashes(self, prompt_tokens: int, token_ids: Seq[int] | None,
                       block_hashes: Seq[BlockHash] | None) -> list[BlockHash]:
        if token_ids is not None and block_hashes is not None:
            raise ValueError("give prompt_token_ids or block_hashes, not both")
        if token_ids is not None:
            if len(token_ids) != prompt_tokens:
                raise ValueError(f"{len(token_ids)} prompt_token_ids for a prompt of "
                                 f"{prompt_tokens} tokens")
            return self.prompt_block_hashes(token_ids) if self.config.prefix_caching else []
        if block_hashes is not None:
            full = prompt_tokens // self.config.block_size
            if len(block_hashes) > full:
                raise ValueError(f"{len(block_hashes)} block_hashes for a prompt of {full} "
                                 f"full blocks of {self.config.block_size} tokens")
            return list(block_hashes) if self.config.prefix_caching else []
        return []

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

    # ------------------------------------------------------------------ blocks
    def _free(self, seq: Sequence) -> None:
        """Drop its references, tail first (vLLM: the tail is evicted before the head)."""
        self.pool.free_blocks(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _cache(self, seq: Sequence) -> None:
        """Name its blocks that are full of computed tokens (those of this step too)."""
        full = seq.total_tokens // self.config.block_size
        if not self.config.prefix_caching or full <= seq.num_cached_blocks:
            return
        hashes = seq.block_hashes
        for i in range(seq.num_cached_blocks, full):
            if i == len(hashes):
                parent = hashes[i - 1] if i else ROOT_HASH
                hashes.append(private_block_hash(parent, seq.seq_id, i))
            block = seq.block_table[i]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[i])
        seq.num_cached_blocks = full

    def _check(self) -> None:
        used = self.blocks_used
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        if used > self.config.num_blocks or self.pool.num_free < 0:
            self.invariant_violations += 1

    # ------------------------------------------------------------------ loop
    def _schedule(self) -> int:
        """Start waiting sequences that fit; return the tokens they prefill."""
        prefill = 0
        bs = self.config.block_size
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            total = seq.total_tokens
            need = cdiv(total, bs)
            hit = self.pool.find_longest_cache_hit(seq.block_hashes, (total - 1) // bs)
            # a hit on a free block takes it out of the free queue: it costs one too
            evictable = sum(1 for block in hit if block.ref_cnt == 0)
            if need - len(hit) + evictable > self.pool.num_free:
                break
            self._waiting.popleft()
            self.pool.touch(hit)
            seq.block_table = hit + self.pool.get_new_blocks(need - len(hit))
            seq.num_cached_blocks = len(hit)
            self._cache(seq)
            hit_tokens = len(hit) * bs
            self._record_lookup(seq, total, hit_tokens)
            self._running.append(seq)
            prefill += total - hit_tokens
        self._check()
        return prefill

    def _record_lookup(self, seq: Sequence, total: int, hit_tokens: int) -> None:
        if seq.cached_tokens is None:
            seq.cached_tokens = hit_tokens
        if not self.config.prefix_caching:
            return  # vLLM records no lookup it did not make
        if seq.preemptions:
            self.prefix_cache_preempted_queries += total
            self.prefix_cache_preempted_hits += hit_tokens
        else:
            self.prefix_cache_queries += total
            self.prefix_cache_hits += hit_tokens

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
        bs = self.config.block_size
        while i < len(self._running):
            seq = self._running[i]
            need = cdiv(seq.total_tokens + 1, bs) - len(seq.block_table)
            while need > 0 and self.pool.num_free < need:
                victim = self._preempt_newest()
                if victim is seq:
                    break
            if seq not in self._running:
                continue  # it was the newest and preempted itself
            if need > 0:
                seq.block_table += self.pool.get_new_blocks(need)
            self._cache(seq)
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
