"""Adaptive reservation at run time: follow each admitted request as it generates.

One `ReservationTracker` per served model. At admission it sizes the lease from
the model's output history (`policies.reservation.OutputHistory`); while the
request runs it estimates the tokens generated so far and resizes the lease to
prompt + generated + expected remainder; at the end it records the output length.

Progress is what kvgate can see without changing the answer:
* streams: the SSE `data:` events forwarded so far (one per decode step in vLLM,
  SGLang and the simulator; the role and finish events count too, which only
  errs on the safe side);
* non-streamed answers: time since forwarding x the decode rate per sequence
  learnt from finished requests (`usage.completion_tokens` / duration).

Requests that set `ignore_eos`, or several prompts in one completions call, are
reserved as `strict`: nothing learnt about EOS applies to them.

No aiohttp here; the server feeds chunks and calls `tick` on a timer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.reservation import AdmissionTarget, OutputHistory
from proxy.admission import AdmissionController, Backend, Demand, Lease

__all__ = [
    "WARMUP_FACTOR",
    "Progress",
    "ReservationTracker",
    "apply_engine_report",
    "follow_adaptively",
    "output_tokens_from_tail",
]

WARMUP_FACTOR = 0.75
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096


def output_tokens_from_tail(tail: bytes) -> int | None:
    """`usage.completion_tokens` from the end of an answer, if the backend sent it."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else None


@dataclass(slots=True, kw_only=True)
class Progress:
    """One admitted request's view: what it asked for and what it has produced."""

    lease: Lease
    prompt_tokens: int
    max_tokens: int
    n: int
    min_tokens: int
    stream: bool
    chat: bool
    started_s: float
    first_event_s: float | None = None
    events: int = 0
    tail: bytearray = field(default_factory=bytearray)

    @property
    def strict(self) -> bool:
        """Sized as prompt + max_tokens and never resized: the lease's demand says so."""
        return not self.lease.demand.follow

    def feed(self, chunk: bytes) -> None:
        """Called for every chunk forwarded to the client; cheap on purpose."""
        if self.stream:
            found = chunk.count(b"data:")
            if found and self.first_event_s is None:
                self.first_event_s = time.monotonic()  # the event loop's clock
            self.events += found
        self.tail += chunk
        if len(self.tail) > 2 * _TAIL_BYTES:
            del self.tail[:-_TAIL_BYTES]

    def streamed_tokens(self) -> int:
        """Output tokens per choice seen in the stream (role and finish events excluded)."""
        overhead = (2 if self.chat else 1) * self.n + 1  # + the final [DONE]
        return max(0, self.events - overhead) // self.n


class ReservationTracker:
    """Sizes, follows and learns from the leases of one model in `adaptive` mode."""

    def __init__(
        self,
        *,
        history: OutputHistory,
        ledger_tokens: Callable[[int], int],
        block_size: int,
        resize_interval_s: float = 0.1,
        decode_tokens_per_s: float = 100.0,
    ) -> None:
        self.history = history
        self._ledger_tokens = ledger_tokens
        self._block = block_size
        self._interval_s = resize_interval_s
        self.on_ready: Callable[[], None] | None = None
        # Decode rate per sequence, for non-streamed answers. Starts high on purpose:
        # overestimating progress grows a lease early, which is the safe side.
        self.decode_tokens_per_s = decode_tokens_per_s
        self._live: dict[str, Progress] = {}
        # the followed leases whose prompts were longer than the history's longest when
        # they were tracked (all of them at a cold start): the only ones that can be
        # `beyond_history`, so `growth_reserve` does not walk every live lease (one whose
        # prompt becomes the longest only when a longer one leaves the window is not
        # added: it was admitted while the history knew such prompts)
        self._long: dict[str, Progress] = {}
        # per backend, the leases `overlap_credit` counts (followed, streamed, not
        # `_long`): fixed when tracked, so the credit walks no other lease (a walk of
        # every live lease twice an admission cost ~4% of the loop at 64 at once)
        self._overlapping: dict[str, dict[str, Progress]] = {}

    def beyond_history(self, prompt_tokens: int) -> bool:
        """Whether a request's prompt is longer than every prompt whose answer is in the
        history: then the history says nothing about its answer, and it is followed as
        at a cold start (held at its output so far twice over, with room kept for it to
        grow into; `growth_reserve`).

        Measured in the suite's S4 (short chats and 15% of 5,000-token prompts with
        1,200-token answers, 1.5x): with the history of short answers (median 54) each
        backend admitted three long requests at ~5,050 tokens each; they grew to
        ~6,200 each, 18,600 of 16,384, so the engines filled, preempted one each and
        kvgate admitted next to nothing for 20 s (29 of 151 completed, against 38 for
        clients going straight to the engines).
        """
        longest = self.history.longest_prompt
        return self.history.ready and longest is not None and prompt_tokens > longest

    # ------------------------------------------------------------------ sizing
    def output_budget(self, *, max_tokens: int, min_tokens: int, strict: bool,
                      generated: int = 0, prompt_tokens: int = 0) -> int:
        """Output tokens to hold for a request that has generated `generated`.

        Without history (a cold start) nothing is known about where EOS falls: each
        lease holds its output so far twice over ("as long again as it has run") and
        new requests leave up to 1 - `WARMUP_FACTOR` of each pool free for the leases
        to grow into (`growth_reserve`).
        Reserving max_tokens instead turned 0.5x traffic without max_tokens into 18
        timeouts out of 43 in the first 20 s.
        """
        if strict:
            return max_tokens
        if not self.history.ready or self.beyond_history(prompt_tokens):
            expected = 2 * generated + 1
        else:
            expected = generated + self.history.remaining(generated)
        return min(max_tokens, max(min_tokens, expected))

    def growth_reserve(self, backend: Backend, demand: Demand | None) -> int:
        """Cold start: tokens kept free on `backend` for followed leases to grow into.

        Without history a followed lease holds its output so far twice over, so it
        may grow up to its prompt + max_tokens; the reserve is what the live followed
        leases there (and `demand`, if it follows) could still grow by, at most
        1 - `WARMUP_FACTOR` of the capacity. A lease that cannot grow (strict-sized:
        `ignore_eos`, several prompts) needs none: strict-sized requests alone may fill
        the whole pool from the first request on. Once the history is ready, the same
        for the leases whose prompts are longer than any it was learnt on
        (`beyond_history`), and none for the others.
        """
        if not self._long and (demand is None or not demand.follow):
            return 0
        ready = self.history.ready
        most = int(backend.capacity_tokens * (1 - WARMUP_FACTOR))
        grow = 0
        if demand is not None and demand.follow and (
                not ready or self.beyond_history(demand.prompt_tokens)):
            grow = demand.n * self._ledger_tokens(demand.prompt_tokens + demand.max_tokens)
            grow -= demand.tokens
        for p in self._long.values():
            if grow >= most:
                break
            lease = p.lease
            if lease.backend is backend and not lease.released and (
                    not ready or self.beyond_history(p.prompt_tokens)):
                grow += max(0, p.n * self._ledger_tokens(p.prompt_tokens + p.max_tokens)
                            - lease.tokens)
        return min(most, max(0, grow))

    def overlap_credit(self, backend: Backend, demand: Demand | None) -> int:
        """Tokens by which the leases followed on `backend` (and `demand`, if it
        follows) are charged more than the most they will hold at any one time.

        A lease holds what its request will hold at its end: prompt + output so far +
        the expected rest. In the engine each request grows one token a step and lets
        go of everything when it ends, and they end at different steps, so the sum of
        the leases is more than the engine will ever hold for them. After LightLLM's
        Past-Future scheduler: with the leases sorted by expected rest r (longest
        first), the most held at once is the largest, over each r_k, of what those
        still running hold then (sum of (held now + n x r_k) over the leases with
        r >= r_k). Admission may fill the difference.

        With shared prefixes each lease is taken at its charge (less the blocks other
        leases hold for it), and a lease that ends leaves behind the blocks it brought,
        for as long as others still use them: those (at most its prompt less what it
        shared) stay in the peak of every r_k after its end. Taking each lease at its
        whole prompt instead counts a shared prefix once per lease and left no credit
        where a 2,048-token system prompt outweighs the rest of every answer.

        Only the leases whose rest is predicted from the history count, and only
        streamed ones (their progress is seen, not guessed from time); strict-sized
        leases, those of a cold start or beyond the history, and other replicas'
        leases count at their full charge; so does a demand that may share a prefix
        on `backend` (what it will be charged is the ledger's to say).

        Measured in the suite's S2 (Azure conversation, 2x), the engines held 80-90%
        of the pool while kvgate's leases filled it; with this credit 99 and 102 of
        142 completed (2,048 cap, no max_tokens) against 95 and 96 without, mean KV
        use 65% against 59%, one preemption in all.
        """
        if not self.history.ready:
            return 0
        # One pass in plain locals (at 64 streamed leases on a backend: 46 -> 33 us an
        # admission; it runs once per backend per admission, ~3% of the loop at 64).
        # (expected rest per choice, charged and held now, n, blocks it may leave behind)
        ends: list[tuple[int, int, int, int]] = []
        total = left_behind = 0
        shares = backend.shares_prefixes
        if demand is not None and demand.follow and not (
                demand.blocks and shares) and not self.beyond_history(
                demand.prompt_tokens):
            rest = max(0, demand.tokens // demand.n - demand.prompt_tokens)
            own = demand.prompt_tokens if shares else 0
            ends.append((rest, demand.tokens - demand.n * rest, demand.n, own))
            total += demand.tokens
            left_behind += own
        append = ends.append
        for p in self._overlapping.get(backend.name, {}).values():
            lease = p.lease
            if lease.released:
                continue
            n, tokens, shared = p.n, lease.tokens, lease.shared_tokens
            rest = tokens // n - p.prompt_tokens - p.streamed_tokens()
            if rest < 0:
                rest = 0
            own = p.prompt_tokens - shared if shares and p.prompt_tokens > shared else 0
            append((rest, tokens - shared - n * rest, n, own))
            total += tokens - shared
            left_behind += own
        if len(ends) < 2:
            return 0
        ends.sort(reverse=True)
        peak = running_held = running_n = 0
        for rest, held, n, own in ends:
            running_held += held
            running_n += n
            left_behind -= own  # what the leases ended by r_k may have left behind
            at = running_held + running_n * rest + left_behind
            if at > peak:
                peak = at
        # one block per lease: each holds whole blocks as it grows
        peak += self._block * running_n
        return max(0, total - peak)

    def lease_tokens(self, *, prompt_tokens: int, max_tokens: int, n: int, min_tokens: int,
                     strict: bool, generated: int = 0) -> int:
        out = self.output_budget(max_tokens=max_tokens, min_tokens=min_tokens, strict=strict,
                                 generated=generated, prompt_tokens=prompt_tokens)
        return n * self._ledger_tokens(prompt_tokens + out)

    # ------------------------------------------------------------------ tracking
    def track(self, progress: Progress) -> None:
        lease_id = progress.lease.lease_id
        self._live[lease_id] = progress
        if progress.strict:
            return
        longest = self.history.longest_prompt
        if not self.history.ready or longest is None or progress.prompt_tokens > longest:
            self._long[lease_id] = progress
        elif progress.stream:
            self._overlapping.setdefault(progress.lease.backend.name, {})[lease_id] = progress

    def generated(self, progress: Progress, now: float) -> int:
        if progress.stream:
            return progress.streamed_tokens()
        # From the moment it was forwarded: prefill and the engine's own queue count
        # as decoding, which overestimates progress, the safe side.
        return int(max(0.0, now - progress.started_s) * self.decode_tokens_per_s)

    def lookahead_tokens(self) -> int:
        """Tokens a request generates before the next resize: the lease stays ahead."""
        return int(2 * self._interval_s * self.decode_tokens_per_s) + 1

    def finish(self, progress: Progress, now: float, *, completed: bool) -> None:
        """Stop following; learn the output length of an answer that ended normally.

        Cut answers (client gone, upstream error) would bias the history short, so
        only complete ones count.
        """
        lease_id = progress.lease.lease_id
        self._live.pop(lease_id, None)
        self._long.pop(lease_id, None)
        overlapping = self._overlapping.get(progress.lease.backend.name)
        if overlapping is not None:
            overlapping.pop(lease_id, None)
        if not completed or progress.strict:
            return
        out = output_tokens_from_tail(bytes(progress.tail))
        if out is not None:
            out //= progress.n
        elif progress.stream:
            out = progress.streamed_tokens()
        if out is None:
            return
        was_ready = self.history.ready
        self.history.observe(min(out, progress.max_tokens), progress.prompt_tokens)
        if not was_ready and self.history.ready and self.on_ready is not None:
            self.on_ready()
        # The decode rate per sequence, from streams only: there the first token's
        # time is seen. A non-streamed answer's duration includes prefill and queueing,
        # which would make the rate look slow and progress estimates short.
        started = progress.first_event_s
        if progress.stream and started is not None and out >= 16 and now > started:
            rate = out / (now - started)
            self.decode_tokens_per_s = 0.9 * self.decode_tokens_per_s + 0.1 * rate

    def engine_estimate_tokens(self, backend: str, now: float) -> int:
        """What this replica's requests on `backend` hold in the engine now (estimate)."""
        return sum(
            p.n * self._ledger_tokens(p.prompt_tokens + min(p.max_tokens, self.generated(p, now)))
            for p in self._live.values() if p.lease.backend.name == backend
        )

    async def tick(self, controller: AdmissionController, now: float) -> None:
        """Resize every live lease to what its progress says it will still need,
        after telling the history how far each stream has run (`OutputHistory.censor`).

        Growth happens as soon as the estimate rises; shrinking waits for two blocks
        of slack so a lease does not flap on every decode step.
        """
        followed = [p for p in self._live.values() if not p.strict]
        # streams only: their progress is counted, where a non-streamed answer's is
        # time x a decode rate that starts high on purpose and would read as length
        self.history.censor(min(p.max_tokens, p.streamed_tokens())
                            for p in followed if p.stream)
        for progress in followed:
            lease = progress.lease
            if lease.released:
                continue
            wanted = self.lease_tokens(
                prompt_tokens=progress.prompt_tokens, max_tokens=progress.max_tokens,
                n=progress.n, min_tokens=progress.min_tokens, strict=False,
                generated=self.generated(progress, now) + self.lookahead_tokens(),
            )
            if wanted > lease.tokens or wanted < lease.tokens - 2 * self._block * progress.n:
                await controller.resize(lease, wanted)
            else:
                controller.note_wanted(lease, wanted)


def follow_adaptively(
    controller: AdmissionController,
    *,
    quantile: float,
    min_samples: int,
    history: int,
    resize_interval_s: float,
    ledger_tokens: Callable[[int], int],
    block_size: int,
) -> tuple[ReservationTracker, dict[str, AdmissionTarget]]:
    """The adaptive mode of one model: its tracker, one admission target per backend,
    and waiters sized anew from the history at each dispatch. The proxy and
    `kvgate simulate` both build it here, so they follow leases the same way."""
    tracker = ReservationTracker(
        history=OutputHistory(size=history, min_samples=min_samples, quantile=quantile),
        ledger_tokens=ledger_tokens, block_size=block_size,
        resize_interval_s=resize_interval_s,
    )

    def size(d: Demand) -> int:
        return tracker.lease_tokens(prompt_tokens=d.prompt_tokens, max_tokens=d.max_tokens,
                                    n=d.n, min_tokens=d.min_tokens, strict=False)

    controller.sizer = size
    controller.growth_reserve = tracker.growth_reserve
    controller.overlap_credit = tracker.overlap_credit

    def ready() -> None:  # the cold start is over: its reserve is free for admissions
        controller.kick()

    tracker.on_ready = ready
    targets = {b.name: AdmissionTarget() for b in controller.backends}
    return tracker, targets


def apply_engine_report(
    controller: AdmissionController, backend: Backend, target: AdmissionTarget, *,
    now: float, preemptions_total: int | None, usage_ratio: float | None,
    reserved_tokens: int,
) -> float:
    """One scrape of a backend's engine moves its admission target; -> the factor before.

    The gate's engine poll calls this for `kvgate serve` and `kvgate simulate` alike,
    so a simulated deployment tightens and loosens exactly as a served one.
    """
    before = backend.target_factor
    controller.set_target_factor(backend, target.observe(
        now=now, preemptions_total=preemptions_total,
        engine_tokens=(None if usage_ratio is None
                       else int(usage_ratio * backend.capacity_tokens)),
        reserved_tokens=reserved_tokens, capacity_tokens=backend.capacity_tokens,
    ))
    target.usage_ratio = usage_ratio
    return before
