"""`python -m simulator`: the real scheduler in virtual time against a
calibrated model of the executor (docs/capacity-planning.md).

    python -m simulator calibrate --model M [--executor-env K=V ...] --out PROFILE.json
    python -m simulator run --profile PROFILE --trace FILE [trace options] [--scheduler-env K=V ...] --out REPORT.json
    python -m simulator sweep --profile PROFILE --trace FILE --setting NAME --values V ... --target ttft_ms.p99<=2000
    python -m simulator roofline [--write]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from bench.common import add_trace_arguments, parse_env_pairs, read_trace
from bench.common import parse_args as bench_parse_args
from bench.report import format_table, write_json
from scheduler_svc.config import SchedulerSettings
from simulator.profile import Profile, load_profile
from simulator.report import banner, build_report
from simulator.sim import simulate

TARGET = re.compile(r"^\s*([a-z_]+)(?:\.([a-z0-9_]+))?\s*(<=|>=)\s*([0-9.eE+-]+)\s*$")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scheduler_settings(pairs: dict[str, str]) -> SchedulerSettings:
    """SCHEDULER_* settings from the given pairs only (not this process's
    environment). An unknown name is refused, naming what exists."""
    values = {}
    for key, value in pairs.items():
        name = key.removeprefix("SCHEDULER_").lower()
        if not key.startswith("SCHEDULER_") or name not in SchedulerSettings.model_fields:
            known = ", ".join(f"SCHEDULER_{n.upper()}" for n in SchedulerSettings.model_fields)
            raise SystemExit(f"unknown scheduler setting {key!r}; known: {known}")
        values[name] = value
    return _ExplicitSettings(**values)


class _ExplicitSettings(SchedulerSettings):
    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings,)


def _trace_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True,
                   help="a profile JSON (python -m simulator calibrate) or a shipped one, e.g. "
                        "roofline/llama-3.1-8b_h100_tp1")
    add_trace_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="token ids of the trace's prompts")
    p.add_argument("--scheduler-env", action="append", default=[], metavar="K=V",
                   help="SCHEDULER_* settings, as the real scheduler reads them")
    p.add_argument("--capacity-from", type=Path, default=None,
                   help="a report (real or simulated): the trace's mean rate = --rate-factor x its request "
                        "throughput")
    p.add_argument("--rate-factor", type=float, default=None, help="with --capacity-from (default 0.7)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="measure a real executor and fit a profile")
    c.add_argument("--model", required=True, help="as EXECUTOR_MODEL: a built-in name or a checkpoint directory")
    c.add_argument("--executor-env", action="append", default=[], metavar="K=V")
    c.add_argument("--address", default=None, help="an executor already serving (default: start one)")
    c.add_argument("--rounds", type=int, default=10, help="passes over the grid, each in a new order")
    c.add_argument("--steps", type=int, default=3, help="steps measured per grid point and round")
    c.add_argument("--host", action="store_true",
                   help="also start the scheduler and measure its own time per step (HostCost)")
    c.add_argument("--name", default=None, help="the profile's name (default: model-device)")
    c.add_argument("--out", type=Path, required=True)

    r = sub.add_parser("run", help="replay a trace through the real scheduler in virtual time")
    _trace_parser(r)
    r.add_argument("--out", type=Path, default=None, help="JSON report (default bench_results/sim-<timestamp>.json)")
    r.add_argument("--no-plots", action="store_true")

    s = sub.add_parser("sweep", help="one setting over several values: the highest rate that meets a target")
    _trace_parser(s)
    s.add_argument("--setting", required=True, help="e.g. SCHEDULER_MAX_NUM_BATCHED_TOKENS")
    s.add_argument("--values", nargs="+", required=True)
    s.add_argument("--target", default="ttft_ms.p99<=2000",
                   help="FIGURE[.STAT]<=X or >=X over the report's summary, e.g. ttft_ms.p99<=2000, "
                        "tpot_ms.p50<=50, output_throughput>=1000")
    s.add_argument("--iterations", type=int, default=7, help="bisection steps on the rate scale per value")
    s.add_argument("--allow-rejections", action="store_true",
                   help="count a rate as met even when admission control refused requests")
    s.add_argument("--out", type=Path, default=None)

    f = sub.add_parser("roofline", help="list (or --write) the shipped roofline profiles")
    f.add_argument("--write", action="store_true", help="regenerate simulator/profiles/roofline/")
    return ap.parse_args(argv)


def bench_equivalent(args: argparse.Namespace, profile: Profile, out: Path | None) -> argparse.Namespace:
    """What `python -m bench` parses for the real run this simulates."""
    argv = ["--launch", "--workload", "trace", "--trace", str(args.trace), "--trace-window", args.trace_window,
            "--rate-scale", repr(args.rate_scale), "--length-scale", repr(args.length_scale), "--seed", str(args.seed),
            "--no-progress", "--model", str(profile.provenance.get("model") or profile.name)]
    for flag, value in (("--clamp-context", args.clamp_context), ("--trace-max-requests", args.trace_max_requests),
                        ("--capacity-from", args.capacity_from), ("--rate-factor", args.rate_factor),
                        ("--out", out)):
        if value is not None:
            argv += [flag, str(value)]
    if args.trace_offline:
        argv.append("--trace-offline")
    for pair in args.scheduler_env:
        argv += ["--scheduler-env", pair]
    for key, value in (profile.provenance.get("executor_env") or {}).items():
        argv += ["--executor-env", f"{key}={value}"]
    return bench_parse_args(argv)


def run_once(args: argparse.Namespace, profile: Profile, env: dict[str, str], trace=None):
    settings = scheduler_settings(env)
    trace = trace or read_trace(args, profile.geometry.max_model_len)
    return simulate(profile, settings, trace)


def cmd_run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    env = parse_env_pairs(args.scheduler_env)
    out = args.out or Path("bench_results") / f"sim-{time.strftime('%Y%m%d-%H%M%S')}.json"
    _say(banner(profile))
    t0 = time.perf_counter()
    result = run_once(args, profile, env)
    took = time.perf_counter() - t0
    report = build_report(result, bench_equivalent(args, profile, out), str(args.profile), env)
    write_json(report, out)
    print(banner(profile))
    print(format_table(report))
    n = len(result.trace.records)
    _say(f"simulated {n} requests, {result.server.num_steps} steps, {result.run.duration_s:.1f} s of virtual time "
         f"in {took:.1f} s; report: {out}")
    if not args.no_plots:
        from bench.plots import write_plots

        paths, why = write_plots(report, out.with_suffix(""))
        _say(why or "plots: " + ", ".join(str(p) for p in paths))
    return 0


def parse_target(text: str) -> tuple[str, str | None, str, float]:
    m = TARGET.match(text)
    if not m:
        raise SystemExit(f"--target {text!r}: expected FIGURE[.STAT]<=X or >=X, e.g. ttft_ms.p99<=2000")
    return m.group(1), m.group(2), m.group(3), float(m.group(4))


def figure_of(summary: dict, figure: str, stat: str | None) -> float | None:
    if figure not in summary:
        raise SystemExit(f"--target: no figure {figure!r} in a report's summary; known: "
                         f"{', '.join(k for k in summary if k != 'timeline')}")
    value = summary[figure]
    if isinstance(value, dict):
        if stat is None or stat not in value:
            raise SystemExit(f"--target: {figure} needs one of .{', .'.join(value)}")
        value = value[stat]
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def cmd_sweep(args: argparse.Namespace) -> int:
    from bench import traces as tr
    from bench.report import summarize

    profile = load_profile(args.profile)
    base_env = parse_env_pairs(args.scheduler_env)
    figure, stat, op, bound = parse_target(args.target)
    _say(banner(profile))
    base_trace = read_trace(args, profile.geometry.max_model_len)
    native_rate = tr.mean_rate(base_trace)
    rows = []

    def evaluate(env: dict[str, str], scale: float) -> tuple[bool, dict]:
        trace = tr.read_trace(args.trace, _scaled(base_trace.options, scale))
        summary = summarize(run_once(args, profile, env, trace).run)
        value = figure_of(summary, figure, stat)
        ok = value is not None and (value <= bound if op == "<=" else value >= bound)
        if not args.allow_rejections and (summary["rejected"] or summary["failed"]):
            ok = False
        return ok, {"rate_scale": scale, "request_rate": native_rate * scale / base_trace.options.rate_scale,
                    "figure": value, "rejected": summary["rejected"], "completed": summary["completed"],
                    "output_throughput": summary["output_throughput"]}

    for value in args.values:
        env = {**base_env, args.setting: value}
        scheduler_settings(env)  # refuse a bad name before simulating
        base = base_trace.options.rate_scale
        tried = []
        ok, info = evaluate(env, base)
        tried.append(info)
        lo, hi = (base, None) if ok else (None, base)
        factor = 2.0
        for _ in range(12):  # bracket: double up or halve down
            if lo is not None and hi is not None:
                break
            scale = (lo * factor) if hi is None else (hi / factor)
            ok, info = evaluate(env, scale)
            tried.append(info)
            if ok:
                lo = scale
            else:
                hi = scale
        best = max((t for t in tried if t["rate_scale"] == lo), key=lambda t: t["rate_scale"], default=None)
        for _ in range(args.iterations if lo is not None and hi is not None else 0):
            mid = math.sqrt(lo * hi)
            ok, info = evaluate(env, mid)
            tried.append(info)
            if ok:
                lo, best = mid, info
            else:
                hi = mid
        # Met even at the highest rate tried: the window's requests then
        # arrive as one burst, so a longer window is needed to load it.
        unbounded = hi is None
        rows.append({"value": value, "best": best, "met_at_every_rate_tried": unbounded,
                     "tried": sorted(tried, key=lambda t: t["rate_scale"])})
        shown = "none met the target" if best is None else (
            f"{best['request_rate']:.3g} req/s (rate scale {best['rate_scale']:.3g}), "
            f"{figure}{'.' + stat if stat else ''} {best['figure']:.1f}, {best['output_throughput']:.0f} output tok/s"
            + (" (met at every rate tried: use a longer window)" if unbounded else ""))
        print(f"{args.setting}={value}: {shown}", flush=True)
    result = {"profile": profile.to_dict() | {"label": profile.label}, "calibrated": profile.calibrated,
              "setting": args.setting, "target": args.target, "trace": base_trace.params(), "results": rows,
              "scheduler_env": base_env}
    if args.out:
        write_json(result, args.out)
        _say(f"sweep: {args.out}")
    return 0


def _scaled(options, scale: float):
    from dataclasses import replace

    return replace(options, rate_scale=scale)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from simulator.calibrate import _print_fit, calibrate

    env = parse_env_pairs(args.executor_env)
    profile = calibrate(args.model, env, args.out, address=args.address, rounds=args.rounds, steps=args.steps,
                        name=args.name,
                        host=args.host, log=_say)
    _print_fit(profile)
    if profile.host.per_step_s or profile.host.per_token_s:
        h = profile.host
        print(f"scheduler host time per step: {h.per_step_s * 1e3:.3f} ms + {h.per_token_s * 1e6:.1f} us per token; "
              f"stream latency {h.stream_latency_s * 1e3:.3f} ms")
    print(f"profile: {args.out}")
    return 0


def cmd_roofline(args: argparse.Namespace) -> int:
    from simulator import roofline

    if args.write:
        for path in roofline.write_all():
            print(path)
        return 0
    for name, profile in roofline.all_profiles().items():
        if profile is None:
            print(f"{name}: does not fit (weights + one full-context request exceed the GPUs' memory)")
        else:
            g = profile.geometry
            print(f"roofline/{name}: {g.num_kv_blocks} KV blocks of {g.block_size}, "
                  f"step {profile.step_cost.coefficients[0] * 1e3:.2f} ms + ... (UNCALIBRATED)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"calibrate": cmd_calibrate, "run": cmd_run, "sweep": cmd_sweep, "roofline": cmd_roofline}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
