"""The host KV tier against none, on the same work in the same run
(alternating, fresh services each time), through `python -m bench`:

    python -m bench.host_tier p16            # multi-turn: prefill computed on turns >= 2, mean TTFT, outputs
    python -m bench.host_tier p17            # Mooncake trace replay: cached-token share, TTFT p50/p99
    python -m bench.host_tier no-regression  # a working set that fits the device pool: throughput, medians

Every run is a `python -m bench --launch` run whose JSON report lands
under --out-dir; this prints the comparison and writes it as JSON too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import cli
from llmsched.assets import MOONCAKE_CONV, STORIES260K

STORIES = str(STORIES260K)

# Sized for stories260K (20 KiB per 16-token block): 128 device blocks hold
# 4 of the 32 multi-turn histories (of up to 31 blocks each), 64 MiB of
# host tier (3,276 blocks) holds them all.
P16 = dict(device_blocks=128, host_mb=64, args=["--workload", "multi-turn"])
# Mooncake conversation trace: 1,000 requests at 10x speed, each 512-token
# hash block as 16 tokens (lengths x 1/32), clamped to 512 positions
# (bench/traces.py, the reader the simulator shares).
P17 = dict(device_blocks=256, host_mb=64,
           args=["--workload", "trace", "--trace", str(MOONCAKE_CONV), "--trace-max-requests", "1000",
                 "--rate-scale", "10", "--length-scale", repr(16 / 512)])
# mixed-64, whose working set fits the default device pool (512 MiB).
NO_REGRESSION = dict(device_blocks=0, host_mb=64,
                     args=["--num-requests", "64", "--scheduler-env", "SCHEDULER_MAX_QUEUE_DELAY_MS=0"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.host_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=["p16", "p17", "no-regression"])
    p.add_argument("--model", default=STORIES)
    p.add_argument("--rounds", type=int, default=None, help="off/on pairs (p16, p17: 1; no-regression: 5)")
    p.add_argument("--device-blocks", type=int, default=None, help="EXECUTOR_NUM_KV_BLOCKS (0 = from memory)")
    p.add_argument("--host-mb", type=int, default=None, help="EXECUTOR_HOST_KV_CACHE_MEMORY_MB when on")
    p.add_argument("--out-dir", type=Path, default=Path("bench_results/host_tier"))
    p.epilog = "Arguments after -- go to every `python -m bench` run, e.g. -- --num-sessions 8"
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.bench_args = extra
    return args


def run_once(args: argparse.Namespace, setup: dict, host_mb: int, out: Path) -> dict:
    argv = ["--launch", "--model", args.model, "--no-plots", "--no-progress", "--out", str(out),
            "--executor-env", f"EXECUTOR_HOST_KV_CACHE_MEMORY_MB={host_mb}", *setup["args"], *args.bench_args]
    device_blocks = setup["device_blocks"] if args.device_blocks is None else args.device_blocks
    if device_blocks:
        argv += ["--executor-env", f"EXECUTOR_NUM_KV_BLOCKS={device_blocks}"]
    print(f"--- host tier {'on (' + str(host_mb) + ' MiB)' if host_mb else 'off'}: python -m bench "
          + " ".join(argv), file=sys.stderr, flush=True)
    if cli.main(argv) != 0:
        raise SystemExit(f"the bench run failed; report: {out}")
    return json.loads(out.read_text())


def outputs(report: dict) -> dict[int, list[int]]:
    return {r["index"]: r["output_ids"] for r in report["requests"]}


def figures(report: dict) -> dict:
    s, server = report["summary"], report["server"]
    f = {"output_throughput": s["output_throughput"], "ttft_mean_ms": s["ttft_ms"]["mean"],
         "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
         "cached_prompt_fraction": s["cached_prompt_fraction"], "completed": s["completed"],
         "preemptions": server["preemptions"], "recomputed_tokens": server.get("recomputed_tokens"),
         "prefix_hit_tokens_host": server.get("prefix_hit_tokens_host"),
         "swapped_blocks_out": server.get("swapped_blocks_out"), "swapped_blocks_in": server.get("swapped_blocks_in")}
    if turns := s.get("turns"):
        later = turns["turns_2_on"]
        f.update(computed_prompt_tokens_turns_2_on=later["computed_prompt_tokens"],
                 ttft_mean_ms_turns_2_on=later["ttft_mean_ms"])
    return f


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = {"p16": P16, "p17": P17, "no-regression": NO_REGRESSION}[args.figure]
    host_mb = setup["host_mb"] if args.host_mb is None else args.host_mb
    rounds = args.rounds or (5 if args.figure == "no-regression" else 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    reference = None
    identical = []
    for i in range(rounds):
        # Alternating, off first in even rounds and on first in odd ones, so
        # a drift of the machine's speed weighs on both alike.
        for tier in (("off", "on") if i % 2 == 0 else ("on", "off")):
            out = args.out_dir / f"{args.figure}-{tier}-{i}.json"
            report = run_once(args, setup, host_mb if tier == "on" else 0, out)
            runs[tier].append(figures(report))
            if reference is None:
                reference = outputs(report)
            else:
                identical.append(outputs(report) == reference)
    med = {tier: {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
           for tier, rs in runs.items()}
    off, on = med["off"], med["on"]
    result = {"figure": args.figure, "rounds": rounds, "host_mb": host_mb, "setup": setup, "runs": runs,
              "medians": med, "outputs_identical_across_runs": all(identical),
              "ratios": {"output_throughput_on_over_off": on["output_throughput"] / off["output_throughput"],
                         "ttft_mean_off_over_on": off["ttft_mean_ms"] / on["ttft_mean_ms"]}}
    if "computed_prompt_tokens_turns_2_on" in on:
        result["ratios"]["computed_prompt_tokens_turns_2_on_off_over_on"] = (
            off["computed_prompt_tokens_turns_2_on"] / max(1, on["computed_prompt_tokens_turns_2_on"]))
        result["ratios"]["ttft_mean_turns_2_on_off_over_on"] = (
            off["ttft_mean_ms_turns_2_on"] / on["ttft_mean_ms_turns_2_on"])
    out = args.out_dir / f"{args.figure}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'':<44}{'off':>12}{'on':>12}")
    for k in off:
        if k in on:
            print(f"{k:<44}{off[k]:>12.4g}{on[k]:>12.4g}")
    for k, v in result["ratios"].items():
        print(f"{k:<44}{v:>24.3f}")
    print(f"{'greedy outputs identical in every run':<44}{str(all(identical)):>24}")
    print(f"report: {out}", file=sys.stderr)
    return 0 if all(identical) else 1


if __name__ == "__main__":
    sys.exit(main())
