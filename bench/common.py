"""What `python -m bench` and the tools beside it share: the options (the
simulator parses them to describe the real run it stands for), reading
a trace by them, workloads, model facts and the environment record. The
command itself is bench/cli.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench import traces as tr
from bench import workloads as wl
from bench.baselines import BASELINES, STATIC_BATCH_SIZE

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
    g.add_argument("--workload", choices=["mixed", "shared-prefix", "overload", "multi-turn", "trace", "copy"],
                   default="mixed",
                   help="multi-turn: sessions whose every turn re-sends the history and a new question; trace: "
                        "replay --trace (assets/README.md) at its own arrival times; copy: answers that repeat "
                        "their prompt, each prompt a story opening, the served model's own greedy continuation of "
                        "it and the opening again, sent one at a time (--max-concurrency 1) unless "
                        "--max-concurrency says otherwise")
    g.add_argument("--dataset", type=Path, default=None, help="JSONL of {prompt | prompt_token_ids, max_tokens}")
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"mixed: 256, shared-prefix: 128, copy: {wl.COPY_NUM_REQUESTS} (past "
                        f"{len(wl.COPY_OPENINGS)}, its openings, and so its prompts, repeat), dataset: all")
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
    g.add_argument("--copy-source-tokens", type=int, default=None,
                   help=f"copy: tokens of the model's own continuation in each prompt, generated through the server "
                        f"(greedy, ignore_eos) before anything is timed ({wl.COPY_SOURCE_TOKENS})")
    g.add_argument("--copy-output-tokens", type=int, default=None,
                   help=f"copy: output tokens per request ({wl.COPY_OUTPUT_TOKENS})")

    add_trace_arguments(p)

    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals at this many requests/s (seeded); inf = offline, all at t=0")
    g.add_argument("--capacity-from", type=Path, default=None,
                   help="a previous offline report: request rate = --rate-factor x its request throughput")
    g.add_argument("--rate-factor", type=float, default=None, help="with --capacity-from; overload 2.0, else 0.7")
    g.add_argument("--duration", type=float, default=60.0, help="overload: seconds of arrivals")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (unset: no limit, but 1 for --workload copy)")
    g.add_argument("--request-timeout", type=float, default=None, help="per-request gRPC deadline, seconds")

    g = p.add_argument_group("baselines")
    g.add_argument("--baseline", action="append", choices=sorted(BASELINES), default=[],
                   help="HF transformers baseline on the same weights and work (repeatable)")
    g.add_argument("--hf-static-batch-size", type=int, default=STATIC_BATCH_SIZE)
    g.add_argument("--check-requests", type=int, default=4,
                   help="K warm-up requests before timing, and greedy outputs of the first K requests compared "
                        "with each baseline's (0 = neither)")
    g.add_argument("--strict-check", action="store_true", help="exit 1 when greedy outputs differ")

    g = p.add_argument_group("speculative decoding (--launch)")
    g.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="start two stacks, one with EXECUTOR_SPECULATIVE_METHOD=ngram (or --speculative-method) and "
                        "EXECUTOR_SPECULATIVE_TOKENS=K and one without, run the same work on both in --rounds "
                        "rounds, alternating which goes first, and report each, their ratio, the mean acceptance "
                        "length and whether their greedy outputs are identical")
    g.add_argument("--speculative-method", choices=("ngram", "draft", "mtp", "eagle3"), default="ngram",
                   help="--speculative: the speculating stack's EXECUTOR_SPECULATIVE_METHOD (default ngram)")
    g.add_argument("--draft-model", default=None, metavar="CHECKPOINT",
                   help="--speculative-method draft or eagle3: the speculating stack's "
                        "EXECUTOR_SPECULATIVE_DRAFT_MODEL (the draft model, or the EAGLE-3 head)")
    g.add_argument("--rounds", type=int, default=None, help="--speculative: rounds (3)")

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
    _check_copy(p, args)
    _check_speculative(p, args)
    return args


def _check_copy(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("copy_source_tokens", "copy_output_tokens"):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is not None and args.workload != "copy":
            p.error(f"{flag} is for --workload copy only")
        if value is not None and value < 1:
            p.error(f"{flag} must be at least 1")
    if args.workload != "copy":
        return
    if args.dataset is not None:
        p.error("--dataset replaces the workload; drop it or --workload copy")
    if args.endpoint != ["grpc"]:
        p.error("--workload copy needs --endpoint grpc: its prompts are the served model's token ids")
    if args.baseline:
        p.error("--baseline is not implemented for --workload copy: its requests go one at a time and the "
                "baselines batch them")
    args.copy_source_tokens = args.copy_source_tokens or wl.COPY_SOURCE_TOKENS
    args.copy_output_tokens = args.copy_output_tokens or wl.COPY_OUTPUT_TOKENS
    # One stream: a code-edit agent waits for its answer before its next edit.
    args.max_concurrency = args.max_concurrency or 1


def _check_speculative(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.speculative is None:
        if args.rounds is not None:
            p.error("--rounds is for --speculative only")
        if args.speculative_method != "ngram" or args.draft_model:
            p.error("--speculative-method and --draft-model choose the speculating stack of --speculative K")
        return
    if (args.speculative_method in ("draft", "eagle3")) != bool(args.draft_model):
        p.error("--draft-model goes with --speculative-method draft or eagle3, and those methods need it")
    if args.speculative < 1:
        p.error(f"--speculative K: K must be at least 1, got {args.speculative}")
    if not args.launch:
        p.error("--speculative needs --launch: it starts the two stacks it compares")
    if args.endpoint != ["grpc"]:
        p.error("--speculative needs --endpoint grpc: it compares the two stacks' greedy token ids")
    if args.baseline:
        p.error("--speculative compares two stacks with each other, not with --baseline")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.rounds = args.rounds or 3


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
        from executor_svc.model.builtin import BUILTIN_MODELS
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
        from executor_svc.model.builtin import BUILTIN_MODELS
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
        from executor_svc.model.builtin import BUILTIN_MODELS, byte_level_tokenizer_json

        tok = Tokenizer.from_str(byte_level_tokenizer_json(BUILTIN_MODELS[model].vocab_size))
    return [r.prompt_text if r.prompt_token_ids is None else tok.decode(list(r.prompt_token_ids)) for r in requests]


def info_dict(info) -> dict:
    # Field by field rather than MessageToDict, which writes uint64 as text.
    # Repeated fields (the LoRA adapters) as lists: protobuf's containers are not JSON.
    values = {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}
    return {k: v if isinstance(v, (bool, int, float, str, bytes)) else list(v) for k, v in values.items()}


def environment(num_threads: int) -> dict:
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
