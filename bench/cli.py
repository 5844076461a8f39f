"""`python -m bench`: a serving benchmark for the llmsched.v1.Scheduler API
(or, with --endpoint openai, any OpenAI-compatible endpoint: our gateway, a
router in front of replicas), in the spirit of `vllm bench serve`. See
bench/README.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench import traces as tr
from bench import workloads as wl
from bench.baselines import BASELINES, STATIC_BATCH_SIZE, cb_limits_from_env, compare_outputs, describe
from bench.client import drained_server_info, run_requests, run_sessions, server_info
from bench.openai_client import run_openai_requests, served_model
from bench.report import baseline_record, format_table, request_record, summarize, write_json

DEFAULT_ADDRESS = "127.0.0.1:50051"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--address", default=DEFAULT_ADDRESS, help="scheduler host:port (ignored with --launch)")
    g.add_argument("--endpoint", nargs="+", default=["grpc"], metavar="KIND [URL]",
                   help="grpc (default: the scheduler at --address) or `openai URL`: streamed /v1/completions "
                        "at URL, e.g. the gateway or a router (with --launch, the launched gateway)")
    g.add_argument("--text-prompts", action="store_true",
                   help="openai: send token-id prompts as their decoded text (routers refuse token ids)")
    g.add_argument("--launch", action="store_true",
                   help="start executor + scheduler (+ gateway with --endpoint openai) for the run, stop them after")
    g.add_argument("--model", default="bench-small",
                   help="built-in model name or checkpoint directory: served with --launch, used for prompt "
                        "token ids and the baselines")
    g.add_argument("--executor-env", action="append", default=[], metavar="K=V", help="extra executor env (--launch)")
    g.add_argument("--scheduler-env", action="append", default=[], metavar="K=V", help="extra scheduler env (--launch)")
    g.add_argument("--num-threads", type=int, default=1,
                   help="torch intra-op threads, for the launched executor and the baselines alike")
    g.add_argument("--vocab-size", type=int, default=None, help="override the vocab the random prompts draw from")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["mixed", "shared-prefix", "overload", "multi-turn", "trace"], default="mixed",
                   help="multi-turn: sessions whose every turn re-sends the history and a new question; trace: "
                        "replay --trace (assets/README.md) at its own arrival times")
    g.add_argument("--dataset", type=Path, default=None, help="JSONL of {prompt | prompt_token_ids, max_tokens}")
    g.add_argument("--num-requests", type=int, default=None, help="mixed: 256, shared-prefix: 128, dataset: all")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-len-scale", type=float, default=1.0, help="scale every prompt length (median and clip)")
    g.add_argument("--output-len-scale", type=float, default=1.0, help="scale every output length (median and clip)")
    for kind in ("prompt", "output"):
        for what in ("median", "min", "max"):
            g.add_argument(f"--{kind}-{what}", type=float if what == "median" else int, default=None,
                           help=f"override the {kind} length {what} (after scaling)")
    g.add_argument("--len-sigma", type=float, default=wl.DEFAULT_SIGMA, help="sigma of the log-normal lengths")
    g.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: prefix tokens (512)")
    g.add_argument("--suffix-len", type=int, default=None, help="shared-prefix: unique suffix tokens (32)")
    g.add_argument("--shared-output-len", type=int, default=None, help="shared-prefix: output tokens (64)")
    g.add_argument("--num-sessions", type=int, default=None, help="multi-turn: sessions (32)")
    g.add_argument("--num-turns", type=int, default=None, help="multi-turn: turns per session (4)")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="multi-turn: mean seconds (exponential) a session waits after an answer before its next turn; "
                   "0 sends it at once")

    add_trace_arguments(p)

    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals at this many requests/s (seeded); inf = offline, all at t=0")
    g.add_argument("--capacity-from", type=Path, default=None,
                   help="a previous offline report: request rate = --rate-factor x its request throughput")
    g.add_argument("--rate-factor", type=float, default=None, help="with --capacity-from; overload 2.0, else 0.7")
    g.add_argument("--duration", type=float, default=60.0, help="overload: seconds of arrivals")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--request-timeout", type=float, default=None, help="per-request gRPC deadline, seconds")

    g = p.add_argument_group("baselines")
    g.add_argument("--baseline", action="append", choices=sorted(BASELINES), default=[],
                   help="HF transformers baseline on the same weights and work (repeatable)")
    g.add_argument("--hf-static-batch-size", type=int, default=STATIC_BATCH_SIZE)
    g.add_argument("--check-requests", type=int, default=4,
                   help="K warm-up requests before timing, and greedy outputs of the first K requests compared "
                        "with each baseline's (0 = neither)")
    g.add_argument("--strict-check", action="store_true", help="exit 1 when greedy outputs differ")

    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="JSON report (default bench_results/<timestamp>.json)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    if args.check_requests < 0:
        p.error("--check-requests must be 0 or more")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.dataset is not None and args.workload == "overload":
        p.error("--dataset replaces the workload; use --request-rate for online arrivals")
    if (args.workload == "trace") != (args.trace is not None):
        p.error("--workload trace and --trace FILE go together")
    if args.workload == "trace" and (args.dataset is not None or not math.isinf(args.request_rate)):
        p.error("a trace brings its own requests and arrival times: scale them with --rate-scale or "
                "--capacity-from, not --dataset or --request-rate")
    if args.workload in ("multi-turn", "trace") and args.baseline:
        p.error(f"--baseline is not implemented for --workload {args.workload}: its prompts are "
                + ("the answers of earlier turns" if args.workload == "multi-turn" else "timed by the trace"))
    if args.workload == "multi-turn" and args.endpoint != ["grpc"]:
        p.error("--workload multi-turn needs --endpoint grpc: each turn sends the previous answers' token ids")
    if args.think_time < 0 or (args.think_time and args.workload != "multi-turn"):
        p.error(f"--think-time must be >= 0 and is for --workload multi-turn only, got {args.think_time}")
    return args


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace options, shared with `python -m simulator` (bench/traces.py)."""
    g = p.add_argument_group("trace (--workload trace)")
    g.add_argument("--trace", type=Path, default=None,
                   help="an Azure LLM inference CSV or a Mooncake JSONL (format from the suffix)")
    g.add_argument("--trace-window", default="0:", metavar="START:END",
                   help="seconds from the trace's first arrival, e.g. 600:900 (END empty: to the end)")
    g.add_argument("--rate-scale", type=float, default=1.0,
                   help="arrivals come this many times as fast (with --capacity-from: set from it instead)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="prompt and output lengths (and Mooncake's 512-token blocks) times this")
    g.add_argument("--clamp-context", type=int, default=None, metavar="N",
                   help="shrink prompt + output to fit N tokens, keeping their ratio (default: the server's "
                        "max_model_len)")
    g.add_argument("--trace-max-requests", type=int, default=None, help="at most this many requests of the window")
    g.add_argument("--trace-offline", action="store_true",
                   help="send every request of the window at t=0 (to measure capacity)")


def trace_options(args: argparse.Namespace, max_model_len: int | None, rate_scale: float | None = None
                  ) -> tr.TraceOptions:
    return tr.TraceOptions(window=tr.parse_window(args.trace_window), rate_scale=rate_scale or args.rate_scale,
                           length_scale=args.length_scale, max_model_len=args.clamp_context or max_model_len,
                           max_requests=args.trace_max_requests, seed=args.seed)


def read_trace(args: argparse.Namespace, max_model_len: int | None) -> tr.Trace:
    """The trace as the options say. With --capacity-from, the rate scale
    makes the window's mean arrival rate --rate-factor (default 0.7) x the
    capacity that report measured."""
    trace = tr.read_trace(args.trace, trace_options(args, max_model_len))
    if args.trace_offline:
        for rec in trace.records:
            rec.arrival_s = 0.0
        return trace
    if args.capacity_from is not None:
        capacity = json.loads(args.capacity_from.read_text())["summary"]["request_throughput"]
        native = tr.mean_rate(trace) * args.rate_scale
        target = capacity * (args.rate_factor or 0.7)
        trace = tr.read_trace(args.trace, trace_options(args, max_model_len, rate_scale=target / native))
    return trace


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected K=V, got {pair!r}")
        env[key] = value
    return env


def vocab_size_for(model: str, override: int | None) -> int:
    if override is not None:
        return override
    path = Path(model)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text())["vocab_size"])
    try:
        from executor_svc.builtin import BUILTIN_MODELS
    except ImportError as exc:  # a scheduler-only install has no torch
        raise SystemExit(f"cannot look up the vocab of {model!r} ({exc}); pass --vocab-size") from None
    if model not in BUILTIN_MODELS:
        raise SystemExit(f"--model {model!r} is neither a directory nor a built-in ({', '.join(BUILTIN_MODELS)})")
    return BUILTIN_MODELS[model].vocab_size


def context_for(model: str, executor_env: dict[str, str]) -> int | None:
    """The context the launched executor will serve (its max_model_len),
    as far as it is known before it starts: EXECUTOR_MAX_MODEL_LEN, else
    the checkpoint's max_position_embeddings. None when unknown; the
    server's own figure then shortens what does not fit (fit_to_context)."""
    if int(executor_env.get("EXECUTOR_MAX_MODEL_LEN", "0") or 0):
        return int(executor_env["EXECUTOR_MAX_MODEL_LEN"])
    path = Path(model)
    if path.is_dir():
        return json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    try:
        from executor_svc.builtin import BUILTIN_MODELS
    except ImportError:  # a scheduler-only install has no torch
        return None
    spec = BUILTIN_MODELS.get(model)
    return spec.max_position_embeddings if spec is not None else None


def _lengths(args: argparse.Namespace, kind: str, base: wl.LengthDist) -> wl.LengthDist:
    d = base.scaled(getattr(args, f"{kind}_len_scale"))
    median = getattr(args, f"{kind}_median") or d.median
    lo = getattr(args, f"{kind}_min") or d.lo
    hi = getattr(args, f"{kind}_max") or d.hi
    return wl.LengthDist(median, lo, max(lo, hi), args.len_sigma)


def resolve_rate(args: argparse.Namespace) -> float | None:
    """Requests/s for online mode, None for offline. A trace's rate is
    known once it is read (trace_rate)."""
    if args.workload == "trace":
        return None
    if args.capacity_from is not None:
        capacity = json.loads(args.capacity_from.read_text())["summary"]["request_throughput"]
        factor = args.rate_factor or (2.0 if args.workload == "overload" else 0.7)
        return capacity * factor
    if math.isinf(args.request_rate):
        if args.workload == "overload":
            raise SystemExit("overload needs --request-rate or --capacity-from (BENCHMARKS.md: twice capacity)")
        return None
    return args.request_rate


def build_workload(args: argparse.Namespace, vocab_size: int, rate: float | None) -> wl.Workload:
    prompt, output = _lengths(args, "prompt", wl.MIXED_PROMPT), _lengths(args, "output", wl.MIXED_OUTPUT)
    if args.dataset is not None:
        work = wl.from_jsonl(args.dataset, args.num_requests)
    elif args.workload == "mixed":
        work = wl.mixed(args.num_requests or 256, vocab_size, args.seed, prompt, output)
    elif args.workload == "multi-turn":
        spec = wl.MultiTurnSpec(num_sessions=args.num_sessions or 32, num_turns=args.num_turns or 4,
                                think_time_s=args.think_time)
        return wl.multi_turn(vocab_size, args.seed, spec.scaled(args.prompt_len_scale, args.output_len_scale))
    elif args.workload == "shared-prefix":
        spec = wl.SharedPrefixSpec(num_requests=args.num_requests or 128)
        spec = spec.scaled(args.prompt_len_scale, args.output_len_scale)
        spec = wl.SharedPrefixSpec(spec.num_requests, args.prefix_len or spec.prefix_len,
                                   args.suffix_len or spec.suffix_len, args.shared_output_len or spec.output_len)
        work = wl.shared_prefix(vocab_size, args.seed, spec)
    else:
        work = wl.overload(rate, args.duration, vocab_size, args.seed, prompt, output)
        if args.num_requests is not None:
            del work.requests[args.num_requests:]
        return work
    if rate is not None:
        wl.with_poisson_arrivals(work, rate, args.seed)
    return work


def parse_endpoint(args: argparse.Namespace) -> tuple[str, str | None]:
    kind, rest = args.endpoint[0], args.endpoint[1:]
    if kind == "grpc" and not rest:
        return kind, None
    if kind == "openai" and len(rest) <= 1:
        if not rest and not args.launch:
            raise SystemExit("--endpoint openai needs a URL (or --launch, which starts a gateway)")
        return kind, rest[0].rstrip("/") if rest else None
    raise SystemExit(f"--endpoint {' '.join(args.endpoint)}: expected `grpc` or `openai URL`")


def decoded_prompts(requests: list[wl.BenchRequest], model: str) -> list[str]:
    """Token-id prompts as text, for endpoints that take text only. The
    server re-tokenizes it, so prompt lengths can shift a little; shared
    prefixes stay shared."""
    from tokenizers import Tokenizer

    path = Path(model)
    if path.is_dir():
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        from executor_svc.builtin import BUILTIN_MODELS, byte_level_tokenizer_json

        tok = Tokenizer.from_str(byte_level_tokenizer_json(BUILTIN_MODELS[model].vocab_size))
    return [r.prompt_text if r.prompt_token_ids is None else tok.decode(list(r.prompt_token_ids)) for r in requests]


def _info_dict(info) -> dict:
    # Field by field rather than MessageToDict, which writes uint64 as text.
    return {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}


def _environment(num_threads: int) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "num_threads": num_threads}
    # Every key in every report (None: not loaded by this run), so that
    # reports compare key for key (a simulated one too).
    for mod in ("torch", "transformers", "grpc"):
        env[f"{mod}_version"] = getattr(sys.modules[mod], "__version__", "?") if mod in sys.modules else None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["git_commit"] = None
    return env


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    executor_env, scheduler_env = parse_env_pairs(args.executor_env), parse_env_pairs(args.scheduler_env)
    if "EXECUTOR_MODEL" in executor_env:
        raise SystemExit("set the model with --model, not EXECUTOR_MODEL: the baselines and prompts need it too")
    # The executor's thread count is what the baselines must match.
    num_threads = int(executor_env.setdefault("EXECUTOR_NUM_THREADS", str(args.num_threads)))
    rate = resolve_rate(args)
    mode = "offline" if rate is None else "online"
    vocab_size = vocab_size_for(args.model, args.vocab_size)
    if args.workload == "trace":
        trace = read_trace(args, context_for(args.model, executor_env))
        work = tr.trace_workload(trace, vocab_size)
        if not args.trace_offline:
            mode, rate = "online", tr.mean_rate(trace)
    else:
        work = build_workload(args, vocab_size, rate)
    requests = work.requests
    if not requests:
        raise SystemExit("the workload has no requests (overload: raise --duration or --request-rate)")
    out = args.out or Path("bench_results") / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    stem = out.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    kind, url = parse_endpoint(args)
    if kind == "openai" and args.baseline:
        raise SystemExit("--baseline needs --endpoint grpc: an OpenAI stream carries no token ids to compare")
    # Greedy checks compare token ids, which only the gRPC stream carries.
    k = min(args.check_requests, len(requests)) if kind == "grpc" else 0
    prompt_texts = decoded_prompts(requests, args.model) if kind == "openai" and args.text_prompts else None

    services, log_file = None, None
    if args.launch:
        from llmsched.launch import launch

        log_path = stem.with_name(stem.name + ".services.log")
        log_file = log_path.open("w")
        services = launch(executor_env={"EXECUTOR_MODEL": args.model, **executor_env}, scheduler_env=scheduler_env,
                          with_gateway=kind == "openai")
        services.stdout = log_file  # their logs would bury the summary table
        _say(f"launching executor + scheduler{' + gateway' if kind == 'openai' else ''} ({args.model}); "
             f"logs in {log_path}")
    hf, prompts, checks = None, None, {}
    try:
        if services is not None:
            try:
                services.start()
            except (RuntimeError, TimeoutError) as exc:
                raise SystemExit(f"error: the launched services did not start: {exc} (logs: {log_path})") from None
        # The scheduler's gRPC address, when known: server figures come from it.
        address = services.scheduler_address if services else (args.address if kind == "grpc" else None)
        if kind == "openai" and services is not None:
            url = services.gateway_url
        if address is not None:
            try:
                info_before = asyncio.run(server_info(address))
            except grpc.RpcError as exc:
                raise SystemExit(f"error: no llmsched scheduler answers at {address}: {exc.code().name} "
                                 f"{exc.details()!r} (start one with `make serve`, or pass --launch)") from None
            served, max_model_len = info_before.model, info_before.max_model_len
        else:
            info_before = None
            served, max_model_len = asyncio.run(served_model(url))
        expected = Path(args.model).name
        if served != expected:
            _say(f"warning: the server serves {served!r}, not {expected!r}: prompts and baselines assume --model")
        if work.name == "multi-turn":
            longest = work.params["last_prompt_len"] + work.params["answer_len"]
            if longest > max_model_len:
                raise SystemExit(f"error: a session's last turn ends at {longest} tokens, past max_model_len="
                                 f"{max_model_len}: fewer --num-turns, or lower --prompt-len-scale / "
                                 "--output-len-scale")
            clipped = 0
        else:
            # A trace is clamped to the context as it is read (bench/traces.py),
            # to the model's figure; the server's then shortens what still
            # does not fit.
            clipped = wl.fit_to_context(requests, max_model_len)
        if clipped:
            _say(f"note: {clipped} requests shortened to fit max_model_len={max_model_len}")
        if k:
            _warm_up(address, wl.warmup_requests(requests[:k], vocab_size, args.seed), args)
        elif kind == "openai":
            warm = wl.warmup_requests(requests[:min(4, len(requests))], vocab_size, args.seed)
            asyncio.run(run_openai_requests(url, served, warm, tag="warmup", show_progress=False,
                                            prompt_texts=decoded_prompts(warm, args.model) if prompt_texts else None))
        if args.baseline:
            from bench.baselines import load_hf_model, prompt_token_ids

            hf = load_hf_model(args.model, num_threads)
            prompts = prompt_token_ids(requests, hf.tokenizer_json)
            # Each baseline's greedy outputs on the first k requests, before
            # anything is timed: a baseline that fails here fails in seconds.
            checks = {name: BASELINES[name](hf, prompts[:k], [r.max_tokens for r in requests[:k]],
                                            **_baseline_kwargs(args, scheduler_env)).outputs
                      for name in (args.baseline if k else [])}

        metrics_before = _scrape_services(services)
        _say(f"timed run: {len(requests)} requests, {mode}"
             + (f" at {rate:.3g} req/s" if rate else "")
             + (f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""))
        if work.name == "multi-turn":
            run = asyncio.run(run_sessions(address, requests, tag=f"bench-{os.getpid()}",
                                           timeout_s=args.request_timeout, show_progress=not args.no_progress,
                                           desc=work.name))
        elif kind == "grpc":
            run = asyncio.run(run_requests(address, requests, tag=f"bench-{os.getpid()}",
                                           max_concurrency=args.max_concurrency, timeout_s=args.request_timeout,
                                           show_progress=not args.no_progress, desc=work.name))
        else:
            run = asyncio.run(run_openai_requests(url, served, requests, prompt_texts=prompt_texts,
                                                  max_concurrency=args.max_concurrency, timeout_s=args.request_timeout,
                                                  show_progress=not args.no_progress, desc=work.name))
        info_after, drained = asyncio.run(drained_server_info(address)) if address else (None, None)
        server_figures = _server_figures(metrics_before, _scrape_services(services))
    finally:
        if services is not None:
            services.stop()
            log_file.close()

    correctness = _check(run, checks, k)
    summary = summarize(run)
    report = {
        "mode": mode,
        "workload": {"name": work.name, **work.params},
        "config": {**{key: (str(v) if isinstance(v, Path) else v) for key, v in vars(args).items()},
                   "request_rate": rate, "address": address, "endpoint": kind, "url": url,
                   "executor_env": executor_env,
                   "scheduler_env": scheduler_env},
        "environment": _environment(num_threads),
        "started_unix": run.started_unix,
        "summary": summary,
        "server": {
            "before": _info_dict(info_before), "after": _info_dict(info_after), "drained": drained,
            "kv_blocks_held_after": info_after.num_kv_blocks - info_after.num_free_kv_blocks,
            "preemptions": info_after.num_preemptions - info_before.num_preemptions,
            **server_figures,
        } if info_after is not None else {"url": url, **server_figures},
        "correctness": correctness,
        "baselines": [],
        "requests": [request_record(r) for r in run.results],
    }
    if not summary["completed"]:
        # Throughput of nothing is no result: say why and fail the command.
        write_json(report, out)
        first = next((r.error for r in run.results if r.error), "no error recorded")
        _say(f"error: none of the {len(run.results)} requests completed; the first failed with: "
             f"{' '.join(first.split())[:300]} (report: {out})")
        return 1
    # Baselines run after the services stopped, so neither side competes
    # with the other for the CPU.
    for name in args.baseline:
        _say(f"baseline {name}: {len(requests)} requests, {num_threads} torch threads")
        b = BASELINES[name](hf, prompts, [r.max_tokens for r in requests], **_baseline_kwargs(args, scheduler_env))
        done = [r for r in run.results if r.ok]
        differ = compare_outputs([r.index for r in done], [r.output_ids for r in done],
                                 [b.outputs[r.index] for r in done])
        agreement = {"compared": len(done), "identical": len(done) - len(differ),
                     "mismatches": [describe(m) for m in differ[:20]]}
        report["baselines"].append(baseline_record(b, summary, agreement))

    write_json(report, out)
    print(format_table(report))
    _say(f"report: {out}")
    if not args.no_plots:
        from bench.plots import write_plots

        paths, why = write_plots(report, stem)
        _say(why or "plots: " + ", ".join(str(p) for p in paths))
    mismatched = any(c["mismatches"] for c in correctness["per_baseline"].values())
    return 1 if args.strict_check and mismatched else 0


def _scrape_services(services):
    """Both services' counters, when this run launched them (their metrics
    ports are known then); None otherwise."""
    if services is None:
        return None
    from bench.server_metrics import scrape

    return scrape(services.scheduler_metrics_port), scrape(services.executor_metrics_port)


def _server_figures(before, after) -> dict:
    if before is None or after is None:
        return {"p6_kv_utilisation": None, "p7_executor_idle_fraction": None}
    from bench.server_metrics import derived_figures

    return derived_figures(before[0], after[0], before[1], after[1])


def _warm_up(address: str, requests: list[wl.BenchRequest], args: argparse.Namespace) -> None:
    _say(f"warm-up: {len(requests)} requests (prompts unlike the workload's, so the prefix cache stays cold)")
    run = asyncio.run(run_requests(address, requests, tag=f"warmup-{os.getpid()}", timeout_s=args.request_timeout,
                                   show_progress=False))
    if bad := [r for r in run.results if not r.ok]:
        _say(f"warning: {len(bad)} warm-up requests did not complete: {bad[0].error}")


def _check(run, checks: dict[str, list[list[int]]], k: int) -> dict:
    """Our greedy outputs of the first k requests (from the timed run, so
    the outputs checked are the outputs timed) against each baseline's,
    computed before any timing. Mismatches are shouted on stderr."""
    per_baseline = {}
    ours = run.results[:k]
    for name, theirs in checks.items():
        mismatches = compare_outputs([r.index for r in ours], [r.output_ids for r in ours], theirs)
        per_baseline[name] = {"checked": k, "mismatches": [describe(m) for m in mismatches]}
        if mismatches:
            _say(f"\n!!! GREEDY MISMATCH: ours vs {name} differ on {len(mismatches)} of the first {k} requests:")
            for m in mismatches:
                _say(f"!!!   {describe(m)}")
            _say("!!! the throughput ratio compares different outputs\n")
        else:
            _say(f"greedy check vs {name}: first {k} requests identical")
    return {"checked": k, "per_baseline": per_baseline}


def _baseline_kwargs(args: argparse.Namespace, scheduler_env: dict[str, str]) -> dict:
    return {"batch_size": args.hf_static_batch_size, **cb_limits_from_env(scheduler_env)}
