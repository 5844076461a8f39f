"""Single-stream ms/token through the services under the CPU settings that
decide it on a small machine: torch threads, how idle OpenMP threads wait,
whether the executor and the scheduler share cores (LLMSCHED_PIN_CPUS) and
the compiled decode step (EXECUTOR_TORCH_COMPILE). Each configuration is
its own launch of both services; rounds interleave the configurations, so
that a noisy machine weighs on all of them alike, and every ratio is to
the first configuration of the same round.

    python -m bench.cpu_placement                 # stories260K, 3 rounds
    python -m bench.cpu_placement --rounds 5 --tokens 200

The first configuration is the executor as it ran before these settings
existed: torch's default threads (one per core), libgomp's default wait
(spin, then sleep), no pinning, eager. The last is today's defaults.
Greedy tokens must be equal across all of them; a difference exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

from bench.single_stream import DEFAULT_MODEL, stream_per_token_ms

# name -> environment of both services (the launcher reads LLMSCHED_PIN_CPUS).
# OMP_WAIT_POLICY="" is not a value libgomp knows, so it keeps its default.
CONFIGS: dict[str, dict[str, str]] = {
    "eager, threads=cores, OpenMP default, unpinned": {
        "EXECUTOR_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_WAIT_POLICY": "",
        "LLMSCHED_PIN_CPUS": "off", "EXECUTOR_TORCH_COMPILE": "off"},
    "eager, 1 thread, OpenMP passive, unpinned": {
        "EXECUTOR_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "LLMSCHED_PIN_CPUS": "off",
        "EXECUTOR_TORCH_COMPILE": "off"},
    "eager, 1 thread, OpenMP passive, pin auto": {
        "EXECUTOR_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "LLMSCHED_PIN_CPUS": "auto",
        "EXECUTOR_TORCH_COMPILE": "off"},
    "defaults (pin auto, auto threads, compile auto)": {
        "EXECUTOR_NUM_THREADS": "0", "LLMSCHED_PIN_CPUS": "auto", "EXECUTOR_TORCH_COMPILE": "auto"},
}


def per_token_ms(model: str, env: dict[str, str], tokens: int, repeats: int) -> tuple[list[float], list[int]]:
    """(ms/token of each measured run, the greedy tokens) through a fresh
    launch of both services; the first run warms them up."""
    from llmsched.launch import launch

    with mock.patch.dict(os.environ, env):  # the launcher and both children read them
        services = launch(executor_env={"EXECUTOR_MODEL": model}).start()
    try:
        return stream_per_token_ms(services.scheduler_address, tokens, repeats)
    finally:
        services.stop()


def round_ratios(by_round: list[dict[str, float]], baseline: str) -> dict[str, list[float]]:
    """Each configuration's ms/token over the baseline's, round by round."""
    return {name: [r[name] / r[baseline] for r in by_round] for name in by_round[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="measured streams per launch (median taken)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_results") / "cpu_placement.json")
    args = p.parse_args(argv)
    names = list(CONFIGS)
    by_round: list[dict[str, float]] = []
    runs: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    load = []
    for r in range(args.rounds):
        medians = {}
        for name in names:
            times, ids = per_token_ms(args.model, CONFIGS[name], args.tokens, args.repeats)
            runs[name] += times
            medians[name] = statistics.median(times)
            tokens[name] = ids
            print(f"round {r}: {name:48} {medians[name]:7.3f} ms/token", flush=True)
        by_round.append(medians)
        load.append(os.getloadavg()[0])
    ratios = round_ratios(by_round, names[0])
    print(f"\nsingle stream, {args.tokens} greedy tokens, {Path(args.model).name}, {args.rounds} rounds, "
          f"{len(os.sched_getaffinity(0))} cores, 1-min load average {min(load):.1f}-{max(load):.1f}")
    print(f"{'':48} {'ms/token':>9} {'vs first':>9}  per round")
    for name in names:
        ms = statistics.median(m[name] for m in by_round)
        print(f"{name:48} {ms:9.3f} {statistics.median(ratios[name]):8.2f}x  "
              + " ".join(f"{x:.2f}" for x in ratios[name]))
    equal = all(ids == tokens[names[0]] for ids in tokens.values())
    if not equal:
        print("greedy tokens differ between configurations!")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": args.model, "tokens": args.tokens, "rounds": by_round, "runs_ms": runs, "ratios": ratios,
        "load_average": load, "configs": CONFIGS, "tokens_equal": equal}, indent=2))
    print(f"report: {args.out}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
