"""`kvgate simulate` speed: wall seconds to replay a trace, per reservation mode.

The target is an hour of trace in under 30 s on one core. The committed slice is
10 minutes; pass the full Azure conv hour where you have it:

    taskset -c 0 .venv/bin/python -m benchmarks.bench_simulate \
        [--trace /path/to/azure_llm_2023_conv.csv] [--kv-tokens 65536] [--backends 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from policies.reservation import ReservationMode
from proxy.replay import Scenario, load_trace, simulate

SLICE = Path(__file__).resolve().parent / "data" / "azure_llm_2023_conv_slice.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(SLICE))
    parser.add_argument("--kv-tokens", type=int, default=65536)
    parser.add_argument("--backends", type=int, default=2)
    args = parser.parse_args()
    requests = load_trace(args.trace)
    span = requests[-1].arrival_s
    for mode in ReservationMode:
        t0 = time.perf_counter()
        report = simulate(requests, Scenario(capacity_tokens=args.kv_tokens,
                                             backends=args.backends, reservation=mode))
        wall = time.perf_counter() - t0
        print(f"{mode:<9} {len(requests)} requests, {span:.0f} s of trace "
              f"({report.virtual_s:.0f} s virtual) in {wall:.2f} s wall: "
              f"{report.virtual_s / wall:.0f}x real time")


if __name__ == "__main__":
    main()
