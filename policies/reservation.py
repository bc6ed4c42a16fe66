"""Output reservation modes: how many output tokens a lease holds, and for how long.

`strict` reserves prompt + max_tokens at admission and never changes it: no
preemption while the configured capacity is right, but real clients send a fixed
cap (or nothing) and stop at EOS far below it, so most of the pool stays empty.

`adaptive` reserves the prompt exactly plus what the model has been *observed* to
produce, and follows each request as it generates (after LightLLM's Past-Future
scheduler and the "adaptively robust" refinement of 2508.14544: start from the
history, refine from the request's own progress). A request that has generated
`g` tokens holds

    prompt + min(max_tokens, g + q-quantile of (L - g | L > g))

where L is an observed output length. The conditional quantile shrinks as a
request outlives short answers and grows for the long tail, so the sum of leases
tracks what the engine will hold. Admission is by that sum against a target that
engine feedback moves (`AdmissionTarget`).

Pure: no clock reads, no I/O. Callers pass `now`.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["AdmissionTarget", "OutputHistory", "ReservationMode"]


# products of floats: a hair of slack so that an exact quantile is not missed
_SLACK = 1e-12


class ReservationMode(StrEnum):
    STRICT = "strict"
    ADAPTIVE = "adaptive"


def _kaplan_meier(events: list[int], censored: list[int]) -> tuple[list[int], list[float]]:
    """The Kaplan-Meier curve of `events` (ended lengths) and `censored` (lengths
    still growing), both sorted: the distinct event lengths, ascending, and minus
    P(L > length) at each (ascending too, for bisect). A censored length leaves the
    risk set before the events longer than it."""
    lengths: list[int] = []
    minus_survival: list[float] = []
    at_risk = len(events) + len(censored)
    survival = 1.0
    i = c = 0
    n_events, n_censored = len(events), len(censored)
    while i < n_events:
        length = events[i]
        while c < n_censored and censored[c] < length:
            c += 1
            at_risk -= 1  # it has run past every length up to here, no further
        ended = bisect.bisect_right(events, length, i) - i
        survival *= 1.0 - ended / at_risk
        lengths.append(length)
        minus_survival.append(-survival)
        at_risk -= ended
        i += ended
    return lengths, minus_survival


class OutputHistory:
    """The last `size` observed output lengths (tokens per choice) of one model,
    and what the requests still running say about them (`censor`).

    Below `min_samples` observations `ready` is False and callers use their
    cold-start rule instead (see `proxy.reservation.ReservationTracker.output_budget`).
    All three are required: their defaults are `[models.adaptive]`'s, in
    `proxy.config.AdaptiveConfig` (`history`, `min_samples`, `quantile`).
    """

    def __init__(self, *, size: int, min_samples: int, quantile: float):
        if size < 1 or min_samples < 1:
            raise ValueError("`size` and `min_samples` must be >= 1")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"`quantile` must be in (0, 1]. Given: {quantile}")
        self._recent: deque[int] = deque(maxlen=size)
        self._sorted: list[int] = []
        self.min_samples = min_samples
        self.quantile = quantile
        # the prompts of the answers in the window, as (observation number, tokens),
        # decreasing: the first is the longest (a sliding maximum, O(1) per answer)
        self._observed = 0
        self._longest: deque[tuple[int, int]] = deque()
        # The Kaplan-Meier curve of the last `censor`: the distinct observed lengths,
        # ascending, and minus P(L > length) at each (ascending too, for bisect).
        # Empty while nothing runs: then the plain empirical quantiles hold.
        self._km_lengths: list[int] = []
        self._km_minus_survival: list[float] = []
        self.running_counted = 0  # the running requests the last `censor` was given

    def __len__(self) -> int:
        return len(self._recent)

    @property
    def ready(self) -> bool:
        return len(self._recent) >= self.min_samples

    def censor(self, running: Iterable[int]) -> None:
        """Count the requests still running: one that has generated `g` tokens will
        end past `g` (a right-censored observation of its length).

        Why: the history holds only answers that have ended, and short answers end
        first. Early in a burst the window holds the short answers while the long ones
        still run, so its quantiles are those of the short ones, and leases sized on
        them are outgrown. In virtual time (`kvgate simulate`, G-shaped traces whose
        outputs come in regimes of a few seconds, median ~375 then ~180): ten answers
        in, the history's median was 52 while the 64 running had generated 60 each
        and were to reach ~375; 31 preemptions over twelve runs, all in the first 10 s.
        The Kaplan-Meier estimate of P(L > t) keeps each running request at risk up
        to its `g`, so the quantiles move up by what the running show and no more;
        with nothing running it is the empirical one.

        When the running outlive the seen answers so often that the q-quantile is past
        all of them, each stream past the longest answer is taken to end at twice what
        it has generated (the guess a cold start makes for each lease) and the curve is
        drawn again with those ends. Falling back to the cold-start rule instead (a
        quarter of each pool kept back, new leases at their prompt) cost the suite's S2
        7% of its goodput in virtual time (99 -> 92 of 142) and gave G no fewer
        preemptions; with the guess, 98 (see benchmarks/README).

        Called once per resize tick (O(window + running)); `remaining` and `ready` read
        the curve until the next call. An answer observed in between is missing from
        it for at most a tick, during which it stays at risk as it was when running.
        """
        events = self._sorted
        censored = sorted(running)
        self.running_counted = len(censored)
        if not events or not censored or censored[-1] < events[0]:
            # every running request is behind every answer: the empirical curve
            self._km_lengths, self._km_minus_survival = [], []
            return
        lengths, minus_survival = _kaplan_meier(events, censored)
        if -minus_survival[-1] >= self._below(1.0):
            # the quantile lies past every answer seen: guess the ends of the streams
            # that outran them all (`censored` is sorted: they are its tail)
            past = bisect.bisect_left(censored, events[-1])
            guessed = sorted(events + [2 * c + 1 for c in censored[past:]])
            lengths, minus_survival = _kaplan_meier(guessed, censored[:past])
        self._km_lengths = lengths
        self._km_minus_survival = minus_survival

    def observe(self, output_tokens: int, prompt_tokens: int | None = None) -> None:
        """Record one answer's length, and the length of its prompt where known."""
        if output_tokens < 0:
            raise ValueError(f"`output_tokens` must be >= 0. Given: {output_tokens}")
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(output_tokens)
        bisect.insort(self._sorted, output_tokens)
        self._observed += 1
        longest = self._longest
        if prompt_tokens is not None:
            while longest and longest[-1][1] <= prompt_tokens:
                longest.pop()
            longest.append((self._observed, prompt_tokens))
        while longest and longest[0][0] <= self._observed - len(self._recent):
            longest.popleft()  # its answer has left the window

    @property
    def longest_prompt(self) -> int | None:
        """The longest prompt among the answers in the window; None if none was given."""
        return self._longest[0][1] if self._longest else None

    def remaining(self, generated: int) -> int:
        """Tokens still to come for a request that has produced `generated` tokens.

        The q-quantile of L - generated over observed lengths L > generated. Past
        the observed tail (fewer longer samples than `tail_samples`: 8, or fewer
        while the history is short) the request is assumed to go on as long again
        as it has run, the usual heavy-tail guess; callers cap the result at
        max_tokens. Example, history [10, 20, 30, ..., 1000] and
        q = 0.9: at 0 generated -> 900; at 500 generated (50 longer samples,
        510..1000) -> 950 - 500 = 450.
        """
        start = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - start
        if longer < self.tail_samples or longer == 0:
            return max(generated, 1)
        if self._km_lengths:
            return self._censored_remaining(generated)
        index = start + min(longer - 1, int(self.quantile * longer))
        return self._sorted[index] - generated

    def _below(self, survival: float) -> float:
        """P(L > t) must fall below this for t to be the q-quantile of L | L > g, where
        `survival` is P(L > g); at q = 1, to zero (the longest answer seen)."""
        if self.quantile >= 1.0:
            return _SLACK
        return (1.0 - self.quantile) * survival - _SLACK

    def _censored_remaining(self, generated: int) -> int:
        """`remaining` on the Kaplan-Meier curve: the least observed length t > g with
        P(L > t | L > g) < 1 - q (with nothing running, the same answer as the empirical
        index int(q x n)); past the curve, as long again as it has run."""
        lengths, minus_survival = self._km_lengths, self._km_minus_survival
        at = bisect.bisect_right(lengths, generated)
        survival = 1.0 if at == 0 else -minus_survival[at - 1]
        index = bisect.bisect_right(minus_survival, -self._below(survival), lo=at)
        if index == len(lengths):
            return max(generated, 1)
        return lengths[index] - generated

    @property
    def tail_samples(self) -> int:
        return max(1, min(8, len(self._sorted) // 10))

    def quantile_of(self, q: float) -> int:
        if not self._sorted:
            return 0
        return self._sorted[min(len(self._sorted) - 1, int(q * len(self._sorted)))]


@dataclass(slots=True, kw_only=True)
class AdmissionTarget:
    """The fraction of a backend's capacity that new admissions may fill.

    Closes the loop with the engine's own figures: a preemption, or the engine
    holding more than kvgate has reserved, tightens at once (x `tighten`); each
    quiet second loosens by `loosen_per_s` back towards 1.0. Growth of live leases
    may still use the whole capacity, so a lower target leaves them room.
    """

    factor: float = 1.0
    floor: float = 0.5
    tighten: float = 0.85
    loosen_per_s: float = 0.02
    last_s: float | None = None
    preemptions_seen: int | None = None
    usage_ratio: float | None = None  # the engine's last report, for display

    def observe(
        self, *, now: float, preemptions_total: int | None, engine_tokens: int | None,
        reserved_tokens: int, capacity_tokens: int,
    ) -> float:
        """Update from one scrape of the engine; -> the new factor."""
        elapsed = 0.0 if self.last_s is None else max(0.0, now - self.last_s)
        self.last_s = now
        pressure = False
        if preemptions_total is not None:
            if self.preemptions_seen is not None and preemptions_total > self.preemptions_seen:
                pressure = True
            self.preemptions_seen = preemptions_total
        # The engine holds more than every lease could: traffic kvgate does not see,
        # or a count that is off. One block of slack per 64 absorbs rounding.
        if engine_tokens is not None and engine_tokens > reserved_tokens + capacity_tokens // 64:
            pressure = True
        if pressure:
            self.factor = max(self.floor, self.factor * self.tighten)
        else:
            self.factor = min(1.0, self.factor + self.loosen_per_s * elapsed)
        return self.factor
