"""`kvgate plan`: the worksheet through the command line, JSON and text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import main

CONFIGS = Path(__file__).parent / "data" / "configs"
WORKSHEET = [
    "plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--kv-bits", "16",
    "--params", "70e9", "--usable-memory", "80GiB", "--tokens", "8192", "--overhead", "0.12",
]


def run_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main([*WORKSHEET, *extra, "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


@pytest.mark.parametrize(("bits", "max_seqs"), [("16", 0), ("8", 2), ("4", 15)])
def test_plan_json_worksheet_16_sequences(
    capsys: pytest.CaptureFixture[str], bits: str, max_seqs: int
) -> None:
    out = run_json(capsys, "--weight-bits", bits, "--concurrency", "16")
    assert out["kv_bytes_per_token"] == 327_680
    assert out["kv_bytes_per_sequence"] == 2_684_354_560
    assert out["weights_bytes"] == 70_000_000_000 * int(bits) // 8
    assert out["fits"] is False
    assert out["max_sequences"] == max_seqs


def test_plan_json_4bit_15_fits_and_decimal_gb(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--weight-bits", "4", "--concurrency", "15")
    assert out["total_bytes"] == 84_297_156_608
    assert out["fits"] is True
    assert out["capacity_bytes"] == 85_899_345_920 * 25 // 28 - 35_000_000_000
    out = run_json(capsys, "--weight-bits", "4", "--usable-memory", "80GB")
    assert out["usable_bytes"] == 80_000_000_000
    assert out["max_sequences"] == 13
    out = run_json(capsys, "--weight-bits", "4", "--tokens", "32768")
    assert out["kv_bytes_per_sequence"] == 10 * 2**30
    assert out["max_sequences"] == 3
    out8 = run_json(capsys, "--weight-bits", "4", "--kv-bits", "8")
    assert out8["weights_bytes"] == 35_000_000_000
    assert out8["kv_bytes_per_token"] == 163_840


def test_plan_json_zero_weights_zero_overhead_is_the_pool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([
        "plan", "--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--kv-bits", "16",
        "--weights-bytes", "0", "--overhead", "0", "--usable-memory", "4026531840",
        "--tokens", "4096", "--concurrency", "6", "--json",
    ]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity_bytes"] == 4_026_531_840
    assert out["token_capacity"] == 24_576
    assert out["max_sequences"] == 6
    assert out["fits"] is True


def test_plan_json_tp_is_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([
        "plan", "--model-config", str(CONFIGS / "llama-3.1-70b.json"), "--params", "70e9",
        "--usable-memory", "80GiB", "--tokens", "8192", "--tp", "4", "--overhead", "0.1",
        "--json",
    ]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 81_920
    assert out["weights_bytes"] == 35_000_000_000
    assert out["per_device"] is True


def test_plan_text_shows_bytes_gib_and_gb(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKSHEET, "--weight-bits", "4", "--concurrency", "15"]) == 0
    text = capsys.readouterr().out
    assert "84,297,156,608 B (78.51 GiB, 84.30 GB)" in text
    assert "35,000,000,000 B (32.60 GiB, 35.00 GB)" in text
    assert "weights (estimate)" in text
    assert "assumption: runtime overhead assumed at 0.12" in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--usable-memory", "80XB"], "--usable-memory` has unknown unit 'XB'"),
        (["--tokens", "0"], "`tokens` must be an integer >= 1. Given: 0"),
        (["--concurrency", "-2"], "`concurrency` must be an integer >= 0. Given: -2"),
        (["--overhead", "nan"], "`overhead` must be a finite fraction"),
        (["--kv-bits", "12"], "--kv-bits must be one of 8, 16, 32. Given: 12"),
        (["--layers", "0"], "`layers` must be an integer >= 1. Given: 0"),
        (["--tp", "3"], "tensor parallel size 3 does not divide 8 KV heads"),
    ],
)
def test_plan_bad_input_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], change: list[str], message: str
) -> None:
    args = list(WORKSHEET)
    flag = change[0]
    if flag in args:
        idx = args.index(flag)
        args[idx + 1] = change[1]
    else:
        args += change
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_plan_runs_as_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", *WORKSHEET, "--weight-bits", "4", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(proc.stdout)["max_sequences"] == 15
