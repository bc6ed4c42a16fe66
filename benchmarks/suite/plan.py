"""The suite's scenarios: the requests of each, drawn from the traces and generators of
`workloads` and timed so that a load factor means the same on every pool (`rate_for`:
Little's law at the recorded lengths on the pool's step time).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from benchmarks.suite.cluster import SimParams, Target
from benchmarks.suite.engine_run import DEADLINE_S, SLO_TTFT_S, Scenario
from benchmarks.suite.workloads import (
    RequestSpec,
    TraceRow,
    burst,
    bursty_long_prompts,
    group_prompts,
    hol_mix,
    load_azure,
    load_mooncake,
    mooncake_conversations,
    replay,
    synthetic_mix,
)

HOL_STARVATION_S = 1.0  # below the deadline: a long waiter does reach the head's protection
MAX_PROMPT, MAX_OUTPUT = 6000, 1000
SCENARIOS = ("S1", "S2", "S2s", "S3", "S4", "B", "G", "Gz", "M", "overhead")
BURSTY_MAX_OUTPUT = 200  # code completion: short answers
PREFIX_TARGETS = (Target.DIRECT, Target.DIRECT_TIMEOUT, Target.AFFINITY_TIMEOUT,
                  Target.ADAPTIVE_PREFIX_OFF, Target.ADAPTIVE)
PREFIX_BACKENDS = 4
GROUPS, SYSTEM_TOKENS, QUESTION_TOKENS = 8, 2048, 256
ZIPF_S = 1.2  # Gz: the hot group takes 43% of the requests, the coldest 3.5%
# M: the Mooncake conversation trace's first MOONCAKE_WINDOW_S seconds, one 512-token
# block of it MOONCAKE_BLOCK_TOKENS tokens here
MOONCAKE_WINDOW_S, MOONCAKE_BLOCK_TOKENS = 600.0, 64


def rate_for(load: float, specs: list[RequestSpec], params: SimParams,
             backends: int = 2) -> float:
    """Arrival rate at which offered resident tokens are `load` x the KV capacity.

    Little's law: resident = rate x service time x tokens per request. Service time is
    the output length times the step time at the concurrency the pool allows. Recorded
    lengths are used whatever the client behaviour: the load is what the requests really
    use, not what they announce. Every prompt token counts, shared or not: for the
    shared-prefix scenarios this is the footprint of a prefix-blind pool.
    """
    capacity: float = backends * params.kv_tokens
    per_request = statistics.mean(s.prompt_tokens + s.output_tokens for s in specs)
    running_per_backend = params.kv_tokens / per_request
    if params.max_num_seqs is not None:  # slots bound the concurrency before the pool
        running_per_backend = min(running_per_backend, params.max_num_seqs)
        capacity = backends * running_per_backend * per_request
    service_s = statistics.mean(s.output_tokens for s in specs) * params.step_s(
        running_per_backend)
    return load * capacity / (per_request * service_s)


def rate_for_shared(load: float, specs: list[RequestSpec], params: SimParams,
                    backends: int, groups: int) -> float:
    """`rate_for` on the footprint of a pool that holds each group's system prompt once:
    `groups / backends` prompts resident per backend, and per request only what follows
    the system prompt (its question, the template, its output). The ceiling of a perfect
    prefix-aware placement on a uniform group mix."""
    system = statistics.mean(s.system_tokens for s in specs)
    room = params.kv_tokens - groups / backends * system
    if room <= 0:
        raise ValueError("the groups' system prompts alone fill the pool")
    per_request = statistics.mean(s.prompt_tokens - s.system_tokens + s.output_tokens
                                  for s in specs)
    service_s = statistics.mean(s.output_tokens for s in specs) * params.step_s(
        room / per_request)
    return load * backends * room / (per_request * service_s)


def rescale(specs: list[RequestSpec], factor: float) -> list[RequestSpec]:
    return [replace(s, arrival_s=s.arrival_s / factor) for s in specs]


def plan_scenarios(duration_s: float, params: SimParams,
                   wanted: set[str], s4_orderings: tuple[str, ...],
                   starvation_s: float | None = None,
                   group_overhead: int = 13,
                   prefix_calibration: str = "shared", max_prompt: int = MAX_PROMPT,
                   max_output: int = MAX_OUTPUT,
                   user_overhead: int = 8,
                   group_load: float = 2.0) -> tuple[list[Scenario], str]:
    conv = load_azure("azure_llm_2023_conv_slice.csv")
    lengths = replay(conv, rate_per_s=1.0, duration_s=10**6, max_prompt=max_prompt,
                     max_output=max_output)
    one_x = rate_for(1.0, lengths, params)

    # The slice's first minute is sparse (the trace starts mid-stream): skip it.
    def conv_at(load: float, start: int = 300, span: float = duration_s) -> list[RequestSpec]:
        return replay(conv, rate_per_s=load * one_x, duration_s=span, max_prompt=max_prompt,
                      max_output=max_output, start=start)

    out: list[Scenario] = []
    if "S1" in wanted:
        out.append(Scenario("S1", "Under capacity (0.5x), Azure conversation trace",
                            conv_at(0.5)))
    if "S2" in wanted:
        out.append(Scenario("S2", "2x overload, Azure conversation trace", conv_at(2.0)))
    if "S2s" in wanted:
        synth = synthetic_mix(rate_per_s=1.0, duration_s=duration_s * 40, seed=3,
                              max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT)
        synth = rescale(synth, 2.0 * rate_for(1.0, synth, params))
        out.append(Scenario("S2s", "2x overload, synthetic mix (lognormal, 2% very long)",
                            [s for s in synth if s.arrival_s < duration_s]))
    if "S3" in wanted:
        extra = [replace(s, arrival_s=s.arrival_s + 3.0)
                 for s in conv_at(5.0, start=1500, span=4.0)]
        out.append(Scenario(
            "S3", "5x burst for 4 s on a 0.5x base, then recovery, Azure conversation lengths",
            burst(conv_at(0.5), extra)))
    if "B" in wanted:
        out.append(_bursty(duration_s, params, max_prompt))
    if "S4" in wanted:
        hol = hol_mix(rate_per_s=1.0, duration_s=duration_s * 20, seed=11)
        hol = [s for s in rescale(hol, 1.5 * rate_for(1.0, hol, params))
               if s.arrival_s < duration_s]
        out.append(Scenario(
            "S4", "Mixed short and very long requests (1.5x), head-of-line blocking", hol,
            s4_orderings, HOL_STARVATION_S))
    prefix_header = ""
    if wanted & {"G", "Gz"}:
        shared, prefix_header = _group_scenarios(conv, duration_s, params, wanted,
                                                 group_overhead, prefix_calibration,
                                                 group_load)
        out += shared
    if "M" in wanted:
        mooncake, mooncake_header = _mooncake_scenario(duration_s, params, user_overhead,
                                                       max_prompt, max_output)
        out.append(mooncake)
        prefix_header += mooncake_header
    if starvation_s is not None:
        out = [replace(s, starvation_s=starvation_s) for s in out]
    seqs = ("" if params.max_num_seqs is None
            else f"at most {params.max_num_seqs} running sequences each; ")
    header = (
        f"Pool: 2 simulated backends x {params.kv_tokens:,} KV tokens; {seqs}decode step "
        f"{params.decode_step_ms} ms + {params.per_seq_ms} ms per running sequence; prefill "
        f"{params.prefill_tokens_per_s:,.0f} tokens/s; max_model_len {params.max_model_len:,} "
        f"(kvgate and engines). 1x = {one_x:.2f} req/s on the Azure conversation lengths "
        f"(prompts clipped to {max_prompt}, outputs to {max_output}), calibrated at the "
        "recorded output lengths whatever the client sends. Every request carries "
        "`sim_output_tokens` = its recorded output length (the simulated EOS). "
        f"TTFT SLO for goodput: {SLO_TTFT_S} s. kvgate: queue deadline {DEADLINE_S} s, depth "
        "256, output_policy `fill`, starvation_s per scenario; `direct+timeout` clients "
        f"give up after {DEADLINE_S} s without a first token. Each run stops at the arrival "
        "window + drain; `cut_at_benchmark_end` counts requests still open then.")
    return out, header + prefix_header


def _bursty(duration_s: float, params: SimParams, max_prompt: int) -> Scenario:
    """B: code-completion shaped, long prompts and short answers in on-off bursts.

    1x is `rate_for` on a long draw of the same lengths; each on-phase arrives at 2x,
    each off-phase sends nothing; on and off phases each last 1 to 4 s (uniform), so
    the mean over the window is about 1x."""
    long = bursty_long_prompts(rate_per_s=1.0, duration_s=2000.0, seed=31,
                               max_prompt=max_prompt, max_output=BURSTY_MAX_OUTPUT)
    one_x = rate_for(1.0, long, params)
    specs = bursty_long_prompts(rate_per_s=2.0 * one_x, duration_s=duration_s, seed=32,
                                max_prompt=max_prompt, max_output=BURSTY_MAX_OUTPUT)
    prompts = statistics.mean(s.prompt_tokens for s in long)
    outputs = statistics.mean(s.output_tokens for s in long)
    title = (f"Bursty long prompts (code-completion shape): on-off bursts at 2x "
             f"({2 * one_x:.2f} req/s during a burst, {len(specs) / duration_s:.2f} req/s "
             f"over the window), prompts lognormal median 3,000 (mean {prompts:,.0f}, "
             f"clipped to {max_prompt:,}), answers lognormal median 60 (mean "
             f"{outputs:.0f}, 8 to {BURSTY_MAX_OUTPUT}), synthetic, seeded")
    return Scenario("B", title, specs)


def _mooncake_scenario(duration_s: float, params: SimParams, overhead: int,
                       max_prompt: int, max_output: int) -> tuple[Scenario, str]:
    """M: whole conversations of the Mooncake conversation trace, at 2x.

    2x is `rate_for` on every request's whole prompt + output (a prefix-blind pool's
    footprint, as S1-S4), over all the window's requests at the same scaling; the
    conversations are then taken until that many requests arrive in the window."""
    sim = replace(params, prefix_caching=True)
    rows = load_mooncake("mooncake_conversation_slice.jsonl")

    def draw(count: int) -> list[RequestSpec]:
        return mooncake_conversations(
            rows, count=count, window_s=MOONCAKE_WINDOW_S, duration_s=duration_s,
            block_tokens=MOONCAKE_BLOCK_TOKENS, prompt_overhead=overhead,
            max_prompt=max_prompt, max_output=max_output)

    every = draw(len(rows))
    one_x = rate_for(1.0, every, sim, PREFIX_BACKENDS)
    specs = draw(round(2.0 * one_x * duration_s))
    reused = _leading_reuse(specs)
    title = (f"Mooncake conversation trace, whole conversations, 2x ({len(specs)} requests, "
             f"{len(specs) / duration_s:.2f} req/s)")
    header = (
        f"\n\nM: the first {MOONCAKE_WINDOW_S:.0f} s of the Mooncake (FAST'25) conversation "
        f"trace ({len(rows):,} requests), whole conversations (a conversation: requests "
        "with the same second block id) taken in a fixed pseudo-random order until the "
        f"count for 2x is in, time compressed {MOONCAKE_WINDOW_S / duration_s:.0f}x into "
        f"the window; each 512-token trace block is {MOONCAKE_BLOCK_TOKENS} tokens of "
        "text here (the same text for the same id; prompts scaled by "
        f"{MOONCAKE_BLOCK_TOKENS}/512 and clipped to {max_prompt:,} after the template; "
        f"outputs as recorded, clipped to {max_output:,}: mean prompt "
        f"{statistics.mean(s.prompt_tokens for s in specs):,.0f}, mean output "
        f"{statistics.mean(s.output_tokens for s in specs):.0f}); {reused:.0%} of the "
        "prompt tokens repeat an earlier request's leading blocks. 2x by Little's law on "
        "the whole prompt + output of every request (a prefix-blind pool); "
        f"{PREFIX_BACKENDS} backends with prefix caching, as G. `one-engine` is a "
        f"yardstick, not a contender: one engine holding all {PREFIX_BACKENDS} pools "
        f"({PREFIX_BACKENDS} x {params.kv_tokens:,} KV tokens, one decode loop), clients "
        "straight to it giving up at 3 s; its hit rate is what one cache of the whole "
        "fleet's size hits on the same arrivals.")
    return Scenario("M", title, specs, params=sim, backends=PREFIX_BACKENDS,
                    targets=(*PREFIX_TARGETS, Target.ONE_ENGINE)), header


def _leading_reuse(specs: list[RequestSpec]) -> float:
    """Share of the prompts' block tokens that repeat blocks an earlier request led
    with: what one engine with an unbounded cache would hit."""
    seen: set[int] = set()
    total = hit = 0
    for s in sorted(specs, key=lambda s: s.arrival_s):
        left = s.prompt_tokens
        leading = True
        for block in s.blocks:
            n = min(s.block_tokens, left)
            left -= n
            total += n
            leading = leading and block in seen
            hit += n if leading else 0
        seen.update(s.blocks)
    return hit / total if total else 0.0


def _group_scenarios(conv: list[TraceRow], duration_s: float, params: SimParams,
                     wanted: set[str], overhead: int,
                     calibration: str = "shared",
                     load: float = 2.0) -> tuple[list[Scenario], str]:
    """G and Gz: 8 groups sharing a system prompt each, 4 backends with prefix caching,
    at `load` (2x unless asked).

    2x is calibrated with Little's law (`calibration`):

    * "shared" (the default): on a pool that holds each group's system prompt once,
      2 per backend, and per request only its question, template and output
      (`rate_for_shared`): the ceiling of the best prefix-aware placement. 2x then
      overloads every target, the prefix-aware one included, so its KV use at
      saturation and its preemptions are measured under pressure, as in S2.
    * "unshared": on every request's whole prompt + output (`rate_for`, as S1-S4): 2x
      for a prefix-blind pool, but only about 0.55x of the prefix-aware ceiling, which
      then never saturates.

    One copy of each group's prompt per backend is degenerate at this scale: 8 x 2,048
    tokens fill a whole 16,384-token backend before any question.
    """
    sim = replace(params, prefix_caching=True)
    outputs = [max(1, min(r.output_tokens, MAX_OUTPUT)) for r in conv]

    def make(zipf_s: float, seed: int) -> list[RequestSpec]:
        def at(rate: float, span: float) -> list[RequestSpec]:
            return group_prompts(rate_per_s=rate, duration_s=span, seed=seed, outputs=outputs,
                                 prompt_overhead=overhead, groups=GROUPS,
                                 system_tokens=SYSTEM_TOKENS, question_tokens=QUESTION_TOKENS,
                                 zipf_s=zipf_s)
        # calibrate on a long draw of the same workload, then draw the window at `load`
        long = at(1.0, 2000.0)
        one_x = (rate_for(1.0, long, sim, PREFIX_BACKENDS) if calibration == "unshared"
                 else rate_for_shared(1.0, long, sim, PREFIX_BACKENDS, GROUPS))
        return at(load * one_x, duration_s)

    out = []
    rates = []
    for key, zipf_s, seed, title in (
            ("G", 0.0, 21, f"8 groups sharing a system prompt, uniform popularity, {load:g}x"),
            ("Gz", ZIPF_S, 22, f"8 groups sharing a system prompt, Zipf s={ZIPF_S} "
                               f"popularity (one hot group), {load:g}x")):
        if key not in wanted:
            continue
        specs = make(zipf_s, seed)
        rates.append(f"{key} {len(specs) / duration_s:.2f} req/s offered")
        out.append(Scenario(key, title, specs, params=sim, backends=PREFIX_BACKENDS,
                            targets=PREFIX_TARGETS))
    prompt = SYSTEM_TOKENS + QUESTION_TOKENS + overhead
    mean_out = statistics.mean(outputs)
    blind = params.kv_tokens / (prompt + mean_out)
    aware = (params.kv_tokens - GROUPS // PREFIX_BACKENDS * SYSTEM_TOKENS) / (
        QUESTION_TOKENS + overhead + mean_out)
    load_blind = load if calibration == "unshared" else load * aware / blind
    load_aware = load if calibration == "shared" else load * blind / aware
    header = (
        f"\n\nShared-prefix scenarios (G, Gz): {PREFIX_BACKENDS} simulated backends x "
        f"{params.kv_tokens:,} KV tokens with vLLM v1 prefix caching ON (the Azure "
        f"scenarios keep it off); {GROUPS} groups, each a {SYSTEM_TOKENS:,}-token system "
        "prompt (distinct text per group, byte-identical within a group) and a "
        f"{QUESTION_TOKENS}-token question of its own ({prompt:,} tokens after the "
        f"template); output lengths drawn from the Azure conversation slice's recorded "
        f"outputs (clipped to {MAX_OUTPUT}, mean {mean_out:.0f}); Poisson arrivals. "
        + (f"1x is calibrated with Little's law on the shared footprint: a pool that "
           f"holds each group's system prompt once ({GROUPS // PREFIX_BACKENDS} per "
           "backend) and per request only its question, template and output, the ceiling "
           f"of the best prefix-aware placement; {load:g}x overloads every target, the "
           "prefix-aware one included, so that its KV use at saturation and preemptions "
           "are measured under pressure. "
           if calibration == "shared" else
           "1x is calibrated with Little's law on the unshared footprint (whole prompt + "
           "output per request, as in S1-S4), a prefix-blind pool's. ")
        + f"({'; '.join(rates)}). At the mean lengths a backend holds {blind:.1f} requests "
        f"unshared, {aware:.1f} with {GROUPS // PREFIX_BACKENDS} groups' prompts held once "
        f"there: the offered load is {load_blind:.1f}x of a prefix-blind pool's capacity "
        f"and {load_aware:.2f}x of the prefix-aware ceiling. Calibrating on one copy of each "
        f"group's prompt per backend is degenerate here ({GROUPS} x {SYSTEM_TOKENS:,} "
        f"tokens fill a {params.kv_tokens:,}-token backend). `affinity+timeout`: clients "
        "hash the first 2,048 characters of the messages (role and content; here the "
        "system prompt's opening) onto a consistent-hash ring of the backends (64 "
        "points each, BLAKE2b), and give up at 3 s without a first token like "
        "`direct+timeout`. `kvgate adaptive` is `prefix_sharing = \"auto\"` (shared "
        "blocks charged once, placement follows the prefix); `kvgate adaptive-prefix-off` "
        "is `prefix_sharing = \"off\"` (every prompt charged in full, prefix-blind "
        "placement; the engines still cache prefixes).")
    return out, header
