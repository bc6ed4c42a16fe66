"""The benchmark suite's parts: exact prompts, calibrated loads, and a tiny real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import rate_for
from benchmarks.suite.cluster import SimParams
from benchmarks.suite.workloads import (
    PromptBuilder,
    RequestSpec,
    hol_mix,
    load_azure,
    replay,
    synthetic_mix,
)
from proxy.tokenize import ChatRequest, load_counter

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tokens", [10, 374, 1024, 6000])
def test_prompt_builder_gives_exactly_the_recorded_tokens(tokens: int) -> None:
    counter = load_counter(ROOT / "models" / "qwen3-14b")
    body = PromptBuilder(counter).body(RequestSpec(arrival_s=0, prompt_tokens=tokens,
                                                   max_tokens=5))
    assert counter.count_chat(ChatRequest(messages=body["messages"])) == tokens


def test_trace_replay_keeps_lengths_and_compresses_time() -> None:
    rows = load_azure("azure_llm_2023_conv_slice.csv")
    assert len(rows) == 3000
    assert (rows[0].prompt_tokens, rows[0].output_tokens) == (374, 44)
    specs = replay(rows, rate_per_s=20.0, duration_s=30.0, max_prompt=6000, max_output=1000,
                   start=300)
    assert all(s.arrival_s < 30.0 for s in specs)
    assert 400 < len(specs) < 800  # about 20 req/s; the trace's own bursts remain
    assert specs[0].prompt_tokens == min(6000, rows[300].prompt_tokens)


def test_load_calibration_follows_littles_law() -> None:
    params = SimParams()
    specs = [RequestSpec(arrival_s=0, prompt_tokens=1000, max_tokens=200)] * 10
    # 32,768 / 1,200 tokens = 27.3 running, 13.65 per backend: step 22.73 ms;
    # service 200 x 22.73 ms = 4.546 s; 1x = 27.3 / 4.546 = 6.01 req/s
    assert rate_for(1.0, specs, params) == pytest.approx(6.006, abs=0.01)
    assert rate_for(2.0, specs, params) == pytest.approx(2 * rate_for(1.0, specs, params))


def test_synthetic_and_hol_mixes_are_seeded_and_bounded() -> None:
    a = synthetic_mix(rate_per_s=5, duration_s=20, seed=1, max_prompt=6000, max_output=1000)
    assert a == synthetic_mix(rate_per_s=5, duration_s=20, seed=1, max_prompt=6000,
                              max_output=1000)
    assert max(s.prompt_tokens for s in a) <= 6000
    hol = hol_mix(rate_per_s=5, duration_s=40, seed=2)
    assert {s.kind for s in hol} == {"short", "long"}


def test_suite_tiny_run_writes_report_and_plots(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--only", "S2", "--duration", "3",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "| direct |" in report and "| kvgate fifo |" in report
    assert (tmp_path / "S2.png").stat().st_size > 10_000
    kvgate_row = next(line for line in report.splitlines() if line.startswith("| kvgate"))
    assert kvgate_row.split("|")[10].strip() == "0"  # zero preemptions through kvgate
