"""P19: the simulator against the real services on this machine.

    python -m simulator.validate --profile PROFILE.json --out-dir DIR

With a profile from `python -m simulator calibrate` (on the same model and
machine), it replays trace slices through the real services
(`python -m bench --launch --workload trace`) and through the simulator,
with the same requests at the same arrival times, and prints predicted
against measured:

1. capacity: the Azure slice sent at once (--trace-offline), real and
   simulated; its request throughput sets the rates below;
2. predict: the slice at --factors x that capacity, --repeats real runs per
   point (their spread) and one simulation (it is deterministic):
   output throughput, TTFT and TPOT p50 and p99;
3. rank: --rank-setting over --rank-values at the last factor: whether the
   simulator orders TTFT p99 as the real runs do;
4. mooncake: a Mooncake slice, cached-token share real against simulated.

Every report is kept in DIR, so any figure can be checked or plotted
(python -m bench.plots). The verdicts follow issue 26's bounds: output
throughput within 5%, p50s within 10%, p99s within 20% or the real
run-to-run spread if that is wider, cached share within 2 points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmsched.assets import AZURE_CONV, MOONCAKE_CONV, STORIES260K

REPO = Path(__file__).resolve().parents[1]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def real(trace_args: list[str], out: Path, model: str, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "bench", "--launch", "--model", model, "--workload", "trace", *trace_args,
           *extra, "--no-plots", "--no-progress", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    _say(f"  real {out.name}: {time.perf_counter() - t0:.0f} s")
    return json.loads(out.read_text())


def simulated(profile: Path, trace_args: list[str], out: Path, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "simulator", "run", "--profile", str(profile), *trace_args, *extra,
           "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


FIGURES = (("output_throughput", None, 5.0), ("ttft_ms", "p50", 10.0), ("tpot_ms", "p50", 10.0),
           ("ttft_ms", "p99", 20.0), ("tpot_ms", "p99", 20.0))


def value(summary: dict, figure: str, stat: str | None) -> float:
    v = summary[figure]
    return float(v[stat] if stat else v)


def compare(sim: dict, reals: list[dict]) -> list[dict]:
    """Per figure: the simulated value, the real runs' mean and spread
    ((max - min) / mean, in percent), the error against the mean, and
    whether it is within the bound (p99: or within the spread)."""
    rows = []
    for figure, stat, bound in FIGURES:
        measured = [value(r["summary"], figure, stat) for r in reals]
        mean = statistics.fmean(measured)
        spread = 100.0 * (max(measured) - min(measured)) / mean if mean else 0.0
        predicted = value(sim["summary"], figure, stat)
        error = 100.0 * (predicted - mean) / mean if mean else float("nan")
        allowed = max(bound, spread) if stat == "p99" else bound
        rows.append({"figure": figure + (f".{stat}" if stat else ""), "simulated": predicted, "measured": measured,
                     "measured_mean": mean, "spread_pct": spread, "error_pct": error, "bound_pct": allowed,
                     "met": abs(error) <= allowed})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulator.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--model", default=str(STORIES260K))
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--azure", type=Path, default=AZURE_CONV)
    ap.add_argument("--window", default="1800:", help="the Azure slice (seconds from the trace's start)")
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=300, help="requests of the slice")
    ap.add_argument("--factors", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank-setting", default="SCHEDULER_MAX_NUM_BATCHED_TOKENS")
    ap.add_argument("--rank-values", nargs="*", default=["256", "1024", "2048"])
    ap.add_argument("--rank-factor", type=float, default=None, help="default: the last of --factors")
    ap.add_argument("--mooncake", type=Path, default=MOONCAKE_CONV)
    ap.add_argument("--mooncake-window", default="0:")
    ap.add_argument("--mooncake-length-scale", type=float, default=1 / 32)
    ap.add_argument("--mooncake-requests", type=int, default=200)
    ap.add_argument("--mooncake-factor", type=float, default=0.7)
    ap.add_argument("--skip", nargs="*", default=[], choices=["predict", "rank", "mooncake"])
    args = ap.parse_args(argv)
    d = args.out_dir
    d.mkdir(parents=True, exist_ok=True)
    profile = args.profile.resolve()
    results: dict = {"profile": str(profile), "model": args.model}

    azure = ["--trace", str(args.azure), "--trace-window", args.window, "--length-scale", repr(args.length_scale),
             "--clamp-context", "512", "--trace-max-requests", str(args.requests)]
    _say(f"capacity: {args.requests} requests of {args.azure.name} [{args.window}] at once")
    cap_real = real([*azure, "--trace-offline"], d / "capacity_real.json", args.model)
    cap_sim = simulated(profile, [*azure, "--trace-offline"], d / "capacity_sim.json")
    capacity = d / "capacity_real.json"
    results["capacity"] = {"real_request_throughput": cap_real["summary"]["request_throughput"],
                           "sim_request_throughput": cap_sim["summary"]["request_throughput"],
                           "real_output_throughput": cap_real["summary"]["output_throughput"],
                           "sim_output_throughput": cap_sim["summary"]["output_throughput"]}
    print(f"capacity (offline): real {cap_real['summary']['output_throughput']:.0f} output tok/s, "
          f"simulated {cap_sim['summary']['output_throughput']:.0f}", flush=True)

    if "predict" not in args.skip:
        results["predict"] = {}
        for f in args.factors:
            online = [*azure, "--capacity-from", str(capacity), "--rate-factor", repr(f)]
            _say(f"predict: {f} x capacity")
            reals = [real(online, d / f"predict_{f}_real{i}.json", args.model) for i in range(args.repeats)]
            sim = simulated(profile, online, d / f"predict_{f}_sim.json")
            rows = compare(sim, reals)
            results["predict"][str(f)] = rows
            print(f"\n{f} x capacity ({reals[0]['config']['request_rate']:.2f} req/s), {args.repeats} real runs:")
            for r in rows:
                print(f"  {r['figure']:<18} sim {r['simulated']:9.2f}  real {r['measured_mean']:9.2f} "
                      f"(spread {r['spread_pct']:5.1f}%)  error {r['error_pct']:+6.1f}%  bound {r['bound_pct']:.0f}%"
                      f"  {'met' if r['met'] else 'NOT met'}", flush=True)

    if "rank" not in args.skip and args.rank_values:
        f = args.rank_factor or args.factors[-1]
        online = [*azure, "--capacity-from", str(capacity), "--rate-factor", repr(f)]
        rows = []
        for v in args.rank_values:
            env = ["--scheduler-env", f"{args.rank_setting}={v}"]
            r = real(online, d / f"rank_{v}_real.json", args.model, env)
            s = simulated(profile, online, d / f"rank_{v}_sim.json", env)
            rows.append({"value": v, "real_ttft_p99_ms": r["summary"]["ttft_ms"]["p99"],
                         "sim_ttft_p99_ms": s["summary"]["ttft_ms"]["p99"]})
        real_order = [r["value"] for r in sorted(rows, key=lambda r: r["real_ttft_p99_ms"])]
        sim_order = [r["value"] for r in sorted(rows, key=lambda r: r["sim_ttft_p99_ms"])]
        results["rank"] = {"setting": args.rank_setting, "factor": f, "rows": rows, "real_order": real_order,
                           "sim_order": sim_order, "met": real_order == sim_order}
        print(f"\nrank {args.rank_setting} at {f} x capacity, TTFT p99 (ms):")
        for r in rows:
            print(f"  {r['value']:>6}: real {r['real_ttft_p99_ms']:9.1f}  sim {r['sim_ttft_p99_ms']:9.1f}")
        print(f"  order real {real_order}, sim {sim_order}: {'same' if real_order == sim_order else 'DIFFERENT'}",
              flush=True)

    if "mooncake" not in args.skip:
        moon = ["--trace", str(args.mooncake), "--trace-window", args.mooncake_window, "--length-scale",
                repr(args.mooncake_length_scale), "--clamp-context", "512", "--trace-max-requests",
                str(args.mooncake_requests)]
        cap = real([*moon, "--trace-offline"], d / "mooncake_capacity_real.json", args.model)
        online = [*moon, "--capacity-from", str(d / "mooncake_capacity_real.json"), "--rate-factor",
                  repr(args.mooncake_factor)]
        r = real(online, d / "mooncake_real.json", args.model)
        s = simulated(profile, online, d / "mooncake_sim.json")
        share = {"real_pct": 100 * r["summary"]["cached_prompt_fraction"],
                 "sim_pct": 100 * s["summary"]["cached_prompt_fraction"],
                 "offline_real_pct": 100 * cap["summary"]["cached_prompt_fraction"]}
        share["difference_points"] = share["sim_pct"] - share["real_pct"]
        share["met"] = abs(share["difference_points"]) <= 2.0
        results["mooncake"] = share
        print(f"\nmooncake cached-token share: real {share['real_pct']:.2f}%, sim {share['sim_pct']:.2f}% "
              f"({share['difference_points']:+.2f} points): {'met' if share['met'] else 'NOT met'}", flush=True)

    (d / "p19.json").write_text(json.dumps(results, indent=2))
    print(f"\nP19: {d / 'p19.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
