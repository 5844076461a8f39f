"""`python -m bench`: a serving benchmark for the llmsched.v1.Scheduler API
(or, with --endpoint openai, any OpenAI-compatible endpoint: our gateway, a
router in front of replicas), in the spirit of `vllm bench serve`. See
bench/README.md."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import grpc

from bench import traces as tr
from bench import workloads as wl
from bench.baselines import BASELINES, cb_limits_from_env, compare_outputs, describe
from bench.client import drained_server_info, run_requests, run_sessions, server_info
from bench.common import (build_workload, context_for, decoded_prompts, environment, info_dict, parse_args,
                          parse_endpoint, parse_env_pairs, read_trace, resolve_rate, vocab_size_for)
from bench.openai_client import run_openai_requests, served_model
from bench.report import baseline_record, format_table, request_record, summarize, write_json


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
        "environment": environment(num_threads),
        "started_unix": run.started_unix,
        "summary": summary,
        "server": {
            "before": info_dict(info_before), "after": info_dict(info_after), "drained": drained,
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
