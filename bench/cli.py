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
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import traces as tr
from bench import workloads as wl
from bench.baselines import BASELINES, cb_limits_from_env, compare_outputs, describe
from bench.client import RunResult, copy_prompts_from, drained_server_info, run_requests, run_sessions, server_info
from bench.common import (build_workload, context_for, decoded_prompts, environment, info_dict, parse_args,
                          parse_endpoint, parse_env_pairs, read_trace, resolve_rate, vocab_size_for)
from bench.openai_client import run_openai_requests, served_model
from bench.report import (baseline_record, format_speculative, format_table, pair_figures, request_record,
                          speculative_record, speculative_summary_line, summarize, write_json)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Setup:
    """What a run starts from, on one stack or on a --speculative pair."""

    args: argparse.Namespace
    executor_env: dict[str, str]
    scheduler_env: dict[str, str]
    num_threads: int
    mode: str
    rate: float | None
    vocab_size: int
    # None for --workload copy until a server answers: its prompts are the
    # served model's own text (_copy_prompts).
    work: wl.Workload | None
    out: Path
    stem: Path
    kind: str
    url: str | None


def main(argv: list[str] | None = None) -> int:
    setup = _setup(parse_args(argv))
    return _run_pair(setup) if setup.args.speculative else _run_one(setup)


def _setup(args: argparse.Namespace) -> Setup:
    executor_env, scheduler_env = parse_env_pairs(args.executor_env), parse_env_pairs(args.scheduler_env)
    if "EXECUTOR_MODEL" in executor_env:
        raise SystemExit("set the model with --model, not EXECUTOR_MODEL: the baselines and prompts need it too")
    if args.speculative and (own := sorted(k for k in executor_env if k.startswith("EXECUTOR_SPECULATIVE_"))):
        raise SystemExit(f"--speculative sets the speculating stack's {', '.join(own)}: do not pass them with "
                         "--executor-env, which applies to both stacks")
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
    elif args.workload == "copy":
        work = None
    else:
        work = build_workload(args, vocab_size, rate)
    if work is not None and not work.requests:
        raise SystemExit("the workload has no requests (overload: raise --duration or --request-rate)")
    out = args.out or Path("bench_results") / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kind, url = parse_endpoint(args)
    if kind == "openai" and args.baseline:
        raise SystemExit("--baseline needs --endpoint grpc: an OpenAI stream carries no token ids to compare")
    return Setup(args, executor_env, scheduler_env, num_threads, mode, rate, vocab_size, work, out,
                 out.with_suffix(""), kind, url)


def _run_one(s: Setup) -> int:
    """The run on one server: launched, or at --address / --endpoint."""
    args, kind, url = s.args, s.kind, s.url
    services, log_file = None, None
    if args.launch:
        from llmsched.launch import launch

        log_path = s.stem.with_name(s.stem.name + ".services.log")
        log_file = log_path.open("w")
        services = launch(executor_env={"EXECUTOR_MODEL": args.model, **s.executor_env},
                          scheduler_env=s.scheduler_env, with_gateway=kind == "openai")
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
        info_before, served, max_model_len = _served(address, url, args.model)
        work = s.work if s.work is not None else _copy_workload(_copy_prompts(address, args, max_model_len), s)
        requests = work.requests
        _fit(work, max_model_len)
        # Greedy checks compare token ids, which only the gRPC stream carries.
        k = min(args.check_requests, len(requests)) if kind == "grpc" else 0
        prompt_texts = decoded_prompts(requests, args.model) if kind == "openai" and args.text_prompts else None
        if k:
            _warm_up(address, wl.warmup_requests(requests[:k], s.vocab_size, args.seed), args)
        elif kind == "openai":
            warm = wl.warmup_requests(requests[:min(4, len(requests))], s.vocab_size, args.seed)
            asyncio.run(run_openai_requests(url, served, warm, tag="warmup", show_progress=False,
                                            prompt_texts=decoded_prompts(warm, args.model) if prompt_texts else None))
        if args.baseline:
            from bench.baselines import load_hf_model, prompt_token_ids

            hf = load_hf_model(args.model, s.num_threads)
            prompts = prompt_token_ids(requests, hf.tokenizer_json)
            # Each baseline's greedy outputs on the first k requests, before
            # anything is timed: a baseline that fails here fails in seconds.
            checks = {name: BASELINES[name](hf, prompts[:k], [r.max_tokens for r in requests[:k]],
                                            **_baseline_kwargs(args, s.scheduler_env)).outputs
                      for name in (args.baseline if k else [])}

        metrics_before = _scrape_services(services)
        _say(f"timed run: {len(requests)} requests, {_mode_text(s)}")
        run = _timed_run(s, work, address, url, served, prompt_texts, tag=f"bench-{os.getpid()}", desc=work.name)
        info_after, drained = asyncio.run(drained_server_info(address)) if address else (None, None)
        server_figures = _server_figures(metrics_before, _scrape_services(services))
    finally:
        if services is not None:
            services.stop()
            log_file.close()

    correctness = _check(run, checks, k)
    summary = summarize(run)
    report = {
        "mode": s.mode,
        "workload": {"name": work.name, **work.params},
        "config": _config(s, address, url),
        "environment": environment(s.num_threads),
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
        write_json(report, s.out)
        _say_none_completed(run, s.out)
        return 1
    # Baselines run after the services stopped, so neither side competes
    # with the other for the CPU.
    for name in args.baseline:
        _say(f"baseline {name}: {len(requests)} requests, {s.num_threads} torch threads")
        b = BASELINES[name](hf, prompts, [r.max_tokens for r in requests], **_baseline_kwargs(args, s.scheduler_env))
        done = [r for r in run.results if r.ok]
        differ = compare_outputs([r.index for r in done], [r.output_ids for r in done],
                                 [b.outputs[r.index] for r in done])
        agreement = {"compared": len(done), "identical": len(done) - len(differ),
                     "mismatches": [describe(m) for m in differ[:20]]}
        report["baselines"].append(baseline_record(b, summary, agreement))

    write_json(report, s.out)
    print(format_table(report))
    _say(f"report: {s.out}")
    if not args.no_plots:
        from bench.plots import write_plots

        paths, why = write_plots(report, s.stem)
        _say(why or "plots: " + ", ".join(str(p) for p in paths))
    mismatched = any(c["mismatches"] for c in correctness["per_baseline"].values())
    return 1 if args.strict_check and mismatched else 0


def _run_pair(s: Setup) -> int:
    """--speculative K: the same work on a stack that speculates and one
    that does not, both launched, in --rounds rounds of alternating order."""
    from bench.server_metrics import scrape, speculative_acceptance
    from bench.stack_pair import launch_pair, names, round_order, start_pair, stop_pair

    args = s.args
    method = args.speculative_method
    stack_names = names(method)
    pair = launch_pair({"EXECUTOR_MODEL": args.model, **s.executor_env}, s.scheduler_env, args.speculative, method,
                       args.draft_model or "")
    log_paths = {spec: s.stem.with_name(f"{s.stem.name}.{stack_names[spec]}.services.log") for spec in pair}
    log_files = {spec: path.open("w") for spec, path in log_paths.items()}
    for spec, services in pair.items():
        services.stdout = log_files[spec]
    _say(f"launching two stacks of executor + scheduler ({args.model}), one speculating "
         f"({method}, K={args.speculative}); logs in {log_paths[False]} and {log_paths[True]}")
    runs: list[tuple[int, str, RunResult]] = []
    try:
        try:
            start_pair(pair)
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(f"error: the launched services did not start: {exc} "
                             f"(logs: {log_paths[False]}, {log_paths[True]})") from None
        address = {spec: services.scheduler_address for spec, services in pair.items()}
        _, served, max_model_len = _served(address[False], None, args.model)
        work, sources_equal = s.work, None
        if work is None:
            # Built on both stacks, so that each holds the stories in its
            # prefix cache before the first round, not only the one that
            # generated them; greedy, both stacks must tell the same ones.
            built = {spec: _copy_prompts(address[spec], args, max_model_len) for spec in pair}
            work, sources_equal = _copy_workload(built[False], s), built[False] == built[True]
        requests = work.requests
        _fit(work, max_model_len)
        if k := min(args.check_requests, len(requests)):
            for spec in pair:
                _warm_up(address[spec], wl.warmup_requests(requests[:k], s.vocab_size, args.seed), args)
        # From here on, every speculative step is a timed one.
        spec_before = scrape(pair[True].scheduler_metrics_port)
        _say(f"timed runs: {args.rounds} round(s) of {len(requests)} requests on each stack, {_mode_text(s)}")
        for r in range(args.rounds):
            for spec in round_order(r):
                run = _timed_run(s, work, address[spec], None, served, None, tag=f"bench-{os.getpid()}-r{r}",
                                 desc=f"{stack_names[spec]} round {r}")
                runs.append((r, stack_names[spec], run))
                figures = pair_figures(summarize(run))
                _say(f"round {r} {stack_names[spec]}: {figures['output_throughput']:.1f} output tok/s, "
                     f"{figures['ms_per_output_token']:.2f} ms/token")
        acceptance = speculative_acceptance(spec_before, scrape(pair[True].scheduler_metrics_port))
        after = {stack_names[spec]: asyncio.run(drained_server_info(address[spec])) for spec in pair}
    finally:
        stop_pair(pair)
        for f in log_files.values():
            f.close()

    record = speculative_record(runs, acceptance, sources_equal, method)
    report = {
        "mode": s.mode,
        "workload": {"name": work.name, **work.params},
        "config": _config(s, None, None),
        "environment": environment(s.num_threads),
        "speculative": {
            "method": method, "tokens": args.speculative, "rounds": args.rounds, **record,
            "server": {name: {"after": info_dict(info), "drained": drained,
                              "kv_blocks_held_after": info.num_kv_blocks - info.num_free_kv_blocks}
                       for name, (info, drained) in after.items()},
        },
    }
    write_json(report, s.out)
    if empty := next(((r, name, run) for r, name, run in runs if not any(x.ok for x in run.results)), None):
        _say_none_completed(empty[2], s.out, where=f" in round {empty[0]} on the {empty[1]} stack")
        return 1
    print(format_speculative(report))
    print(speculative_summary_line(report))
    _say(f"report: {s.out}")
    greedy = record["greedy"]
    if not greedy["equal"]:
        _say(f"\n!!! GREEDY MISMATCH: the stacks' outputs differ on {greedy['compared'] - greedy['identical']} of "
             f"{greedy['compared']} requests compared"
             + ("" if sources_equal is None else f"; the copy stories they generated equal: {sources_equal}") + ":")
        for m in greedy["mismatches"]:
            _say(f"!!!   {m}")
    return 1 if args.strict_check and not greedy["equal"] else 0


def _served(address: str | None, url: str | None, model: str):
    """(ServerInfo or None, the served model's name, its max_model_len),
    from the scheduler at address, else from the OpenAI endpoint at url."""
    if address is not None:
        try:
            info = asyncio.run(server_info(address))
        except grpc.RpcError as exc:
            raise SystemExit(f"error: no llmsched scheduler answers at {address}: {exc.code().name} "
                             f"{exc.details()!r} (start one with `make serve`, or pass --launch)") from None
        served, max_model_len = info.model, info.max_model_len
    else:
        info = None
        served, max_model_len = asyncio.run(served_model(url))
    if served != Path(model).name:
        _say(f"warning: the server serves {served!r}, not {Path(model).name!r}: prompts and baselines assume --model")
    return info, served, max_model_len


def _fit(work: wl.Workload, max_model_len: int) -> None:
    """Refuses a multi-turn workload whose last turn cannot fit the context;
    shortens other requests that cannot, and says how many."""
    if work.name == "multi-turn":
        longest = work.params["last_prompt_len"] + work.params["answer_len"]
        if longest > max_model_len:
            raise SystemExit(f"error: a session's last turn ends at {longest} tokens, past max_model_len="
                             f"{max_model_len}: fewer --num-turns, or lower --prompt-len-scale / "
                             "--output-len-scale")
        return
    # A trace is clamped to the context as it is read (bench/traces.py), to
    # the model's figure; the server's then shortens what still does not
    # fit. Copy prompts were built to fit (_copy_prompts).
    if clipped := wl.fit_to_context(work.requests, max_model_len):
        _say(f"note: {clipped} requests shortened to fit max_model_len={max_model_len}")


def _copy_prompts(address: str, args: argparse.Namespace, max_model_len: int) -> list[list[int]]:
    """The copy workload's prompts, generated by the scheduler at address
    before anything is timed; refused when one would not leave room for
    --copy-output-tokens."""
    openings = wl.copy_openings(args.num_requests or wl.COPY_NUM_REQUESTS)
    _say(f"copy prompts: {len(set(openings))} openings, each followed by the served model's greedy continuation "
         f"({args.copy_source_tokens} tokens, generated at {address}) and the opening again")
    room = max_model_len - args.copy_output_tokens
    try:
        return copy_prompts_from(address, openings, args.copy_source_tokens, max_prompt_len=room)
    except ValueError as exc:
        raise SystemExit(f"error: --workload copy: {exc} (max_model_len={max_model_len} less --copy-output-tokens "
                         f"{args.copy_output_tokens}): lower --copy-source-tokens or --copy-output-tokens") from None


def _copy_workload(prompts: list[list[int]], s: Setup) -> wl.Workload:
    work = wl.copy_workload(prompts, s.args.copy_source_tokens, s.args.copy_output_tokens)
    if s.rate is not None:
        wl.with_poisson_arrivals(work, s.rate, s.args.seed)
    return work


def _timed_run(s: Setup, work: wl.Workload, address: str | None, url: str | None, served: str,
               prompt_texts: list[str] | None, tag: str, desc: str) -> RunResult:
    args = s.args
    if work.name == "multi-turn":
        return asyncio.run(run_sessions(address, work.requests, tag=tag, timeout_s=args.request_timeout,
                                        show_progress=not args.no_progress, desc=desc))
    if s.kind == "grpc":
        return asyncio.run(run_requests(address, work.requests, tag=tag, max_concurrency=args.max_concurrency,
                                        timeout_s=args.request_timeout, show_progress=not args.no_progress,
                                        desc=desc))
    return asyncio.run(run_openai_requests(url, served, work.requests, prompt_texts=prompt_texts,
                                           max_concurrency=args.max_concurrency, timeout_s=args.request_timeout,
                                           show_progress=not args.no_progress, desc=desc))


def _mode_text(s: Setup) -> str:
    return (s.mode + (f" at {s.rate:.3g} req/s" if s.rate else "")
            + (f", max concurrency {s.args.max_concurrency}" if s.args.max_concurrency else ""))


def _config(s: Setup, address: str | None, url: str | None) -> dict:
    return {**{key: (str(v) if isinstance(v, Path) else v) for key, v in vars(s.args).items()},
            "request_rate": s.rate, "address": address, "endpoint": s.kind, "url": url,
            "executor_env": s.executor_env, "scheduler_env": s.scheduler_env}


def _say_none_completed(run: RunResult, out: Path, where: str = "") -> None:
    first = next((r.error for r in run.results if r.error), "no error recorded")
    _say(f"error: none of the {len(run.results)} requests completed{where}; the first failed with: "
         f"{' '.join(first.split())[:300]} (report: {out})")


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
