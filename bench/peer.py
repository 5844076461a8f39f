"""P24: ours against a CPU peer on the same weights, the same work, the same
threads, in interleaved rounds (docs/performance.md, P24).

    python -m bench.peer llama-cpp                   # stories260K, 5 rounds
    python -m bench.peer llama-cpp --rounds 9 --sdist /tmp/llama_cpp_python-0.3.36.tar.gz

The peer is llama.cpp's `llama-server`, built from the pinned
llama-cpp-python sdist and serving a GGUF of the same checkpoint
(bench/llama_cpp.py). Each round runs, in an order that rotates from round
to round, one system at a time (the others are stopped, so none competes
for the cores):

- **ours:** executor + scheduler launched with their default settings
  (`SCHEDULER_MAX_QUEUE_DELAY_MS=0` so that no offline request is shed),
  driven over gRPC by the bench client;
- **llama-server:** `-t`/`-tb` = our torch threads, one slot per stream
  (`-np`), each slot the model's whole context; greedy (top-k 1),
  `ignore_eos`, `n_predict` = the request's max tokens, no prompt cache;
- **HF static:** transformers' `generate` in static batches of 16 on the
  same weights and threads (bench/baselines.py), throughput only.

Two figures a round: the **mixed-64** workload's output tok/s (first
request sent to last token in), and one stream's ms per token (200 greedy
tokens after a 5-token prompt, first token's arrival to the last's, so
the prefill is left out; llama-server's own `predicted_per_token_ms` is
recorded beside it). Each run records its CPU steal (from /proc/stat), the
load average at its end and the CPU seconds of the serving processes
(ours: scheduler + executor; llama-server; HF: this process). Medians,
per-round ratios, and the greedy tokens of ours compared with the others'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench import llama_cpp as lc
from bench import peer_models as pm
from bench import workloads as wl
from bench.baselines import compare_outputs
from llmsched.assets import STORIES260K

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260K's tokenizer (bench/single_stream.py)
SYSTEMS = ("ours", "llama-server", "hf-static")
# --isa avx2 on an AVX-512 machine: ours limited to AVX2 as llama-server's
# build is (bench/llama_cpp.py, ISA_FLAGS): torch's kernels and inductor's
# generated code, oneDNN and MKL, and the bf16 weights packed for the avx2
# kernel. --executor-env overrides any of these.
OURS_ISA_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "EXECUTOR_CPU_BF16_PREPACK": "avx2"},
}
WARMUP_REQUESTS = 4


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- CPU accounting ---------------------------------------------------------


def parse_proc_stat(text: str) -> dict[str, int]:
    """The aggregate `cpu` line of /proc/stat, in clock ticks, by name."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            return dict(zip(names, (int(v) for v in parts[1:]))) | {k: 0 for k in names[len(parts) - 1:]}
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def steal_share(before: dict[str, int], after: dict[str, int]) -> float:
    """Stolen ticks over all ticks between two /proc/stat reads. guest and
    guest_nice are already counted in user and nice, so they are left out
    of the total."""
    keys = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    total = sum(after[k] - before[k] for k in keys)
    return (after["steal"] - before["steal"]) / total if total > 0 else 0.0


def parse_pid_stat(text: str, ticks_per_s: float) -> float:
    """CPU seconds (user + system) of a process from its /proc/<pid>/stat.
    The command name (field 2) may hold spaces and parentheses, so fields
    are counted from its closing parenthesis: utime and stime are fields
    14 and 15."""
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / ticks_per_s


def process_cpu_s(pid: int) -> float:
    return parse_pid_stat(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def read_proc_stat() -> dict[str, int]:
    return parse_proc_stat(Path("/proc/stat").read_text())


@dataclass(slots=True)
class Meter:
    """Wall time, steal and per-process CPU seconds over one timed run.
    `pids` name the serving processes; 'self' is this process (HF's
    baseline runs in it)."""

    pids: dict[str, int]
    wall: float = 0.0
    stat: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    def _cpu_now(self) -> dict[str, float]:
        return {name: time.process_time() if pid == 0 else process_cpu_s(pid) for name, pid in self.pids.items()}

    def __enter__(self) -> Meter:
        self.stat, self.cpu, self.wall = read_proc_stat(), self._cpu_now(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        cpu, stat = self._cpu_now(), read_proc_stat()
        self.cpu = {name: cpu[name] - self.cpu[name] for name in cpu}
        # The load average says how much else wanted the cores meanwhile.
        self.stat = {"steal_share": steal_share(self.stat, stat), "load_1m": os.getloadavg()[0]}

    def record(self) -> dict:
        return {"wall_s": self.wall, "steal_share": self.stat["steal_share"], "load_1m": self.stat["load_1m"],
                "cpu_s": self.cpu, "cpu_s_total": sum(self.cpu.values())}


# ----- arithmetic -------------------------------------------------------------


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-round ratios, round by round."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} rounds against {len(denominators)}")
    return [a / b if b else float("nan") for a, b in zip(numerators, denominators)]


def summarize(rounds: Sequence[dict]) -> dict:
    """Medians of each system's figures over the rounds, and the ratios of
    ours to each other system's: per round, their median, and the ratio of
    the medians. Throughput ratios above 1 mean ours serves more; ms/token
    ratios above 1 mean ours is slower."""
    out: dict = {"rounds": len(rounds), "median": {}, "ratios": {}}
    systems = [s for s in SYSTEMS if all(s in r for r in rounds)]
    for s in systems:
        out["median"][s] = {
            key: statistics.median(r[s][fig][key] for r in rounds)
            for fig, key in (("throughput", "tok_per_s"), ("throughput", "steal_share"),
                             ("throughput", "cpu_s_total"), ("single", "ms_per_token"))
            if all(fig in r[s] and key in r[s][fig] for r in rounds)}
    for other in systems:
        if other == "ours":
            continue
        per = {}
        for key in ("tok_per_s", "ms_per_token"):
            fig = "throughput" if key == "tok_per_s" else "single"
            if not all(fig in r[other] and fig in r["ours"] for r in rounds):
                continue
            each = ratios([r["ours"][fig][key] for r in rounds], [r[other][fig][key] for r in rounds])
            per[key] = {"per_round": each, "median_of_rounds": statistics.median(each),
                        "of_medians": out["median"]["ours"][key] / out["median"][other][key],
                        "min": min(each), "max": max(each)}
        out["ratios"][f"ours/{other}"] = per
    return out


def round_order(round_index: int, systems: Sequence[str] = SYSTEMS) -> list[str]:
    """Who runs first rotates, so that none always meets a warmer machine."""
    k = round_index % len(systems)
    return list(systems[k:]) + list(systems[:k])


# ----- the systems ------------------------------------------------------------


@dataclass(slots=True)
class Work:
    requests: list[wl.BenchRequest]
    warmup: list[wl.BenchRequest]
    single_tokens: int

    @property
    def prompts(self) -> list[list[int]]:
        return [list(r.prompt_token_ids) for r in self.requests]

    @property
    def max_tokens(self) -> list[int]:
        return [r.max_tokens for r in self.requests]


def _throughput(meter: Meter, outputs: Sequence[Sequence[int]], wall_s: float) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {**meter.record(), "output_tokens": tokens, "run_s": wall_s, "tok_per_s": tokens / wall_s}


def run_ours(model: str, work: Work, log, env: dict[str, str]) -> dict:
    import grpc

    from bench.client import run_requests
    from llmsched.launch import launch
    from llmsched.v1 import scheduler_pb2 as spb
    from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

    services = launch(executor_env={"EXECUTOR_MODEL": model, **env},
                      scheduler_env={"SCHEDULER_MAX_QUEUE_DELAY_MS": "0"})
    services.stdout = log
    services.start()
    try:
        address = services.scheduler_address
        asyncio.run(run_requests(address, work.warmup, tag="warmup", show_progress=False))
        pids = {"executor": services.executor.pid, "scheduler": services.scheduler.pid}
        with Meter(pids) as meter:
            run = asyncio.run(run_requests(address, work.requests, tag=f"peer-{os.getpid()}", show_progress=False))
        failed = [r for r in run.results if not r.ok]
        if failed:
            raise RuntimeError(f"ours: {len(failed)} requests did not finish, first: {failed[0].error}")
        outputs = [r.output_ids for r in run.results]
        throughput = _throughput(meter, outputs, run.duration_s)

        with grpc.insecure_channel(address) as channel:
            stub = spb_grpc.SchedulerStub(channel)

            def stream(tokens: int) -> tuple[list[int], list[float]]:
                req = spb.GenerateRequest(prompt_token_ids=PROMPT, sampling=spb.SamplingParams(
                    max_tokens=tokens, temperature=0, ignore_eos=True))
                ids, times = [], []
                for resp in stub.Generate(req, timeout=600):
                    if resp.token_ids:
                        times.append(time.perf_counter())
                        ids += resp.token_ids
                return ids, times

            stream(16)  # warm-up
            with Meter(pids) as meter:
                ids, times = stream(work.single_tokens)
        single = {**meter.record(), "ms_per_token": (times[-1] - times[0]) * 1000 / (len(ids) - 1)}
        return {"throughput": throughput, "single": single, "outputs": outputs, "single_ids": ids}
    finally:
        services.stop()


def run_llama(server: lc.LlamaServer, work: Work, log) -> dict:
    server.log = log
    server.start()
    try:
        url = server.url
        with ThreadPoolExecutor(len(work.requests)) as pool:
            list(pool.map(lambda r: lc.complete(url, r.prompt_token_ids, r.max_tokens), work.warmup))
            with Meter({"llama-server": server.pid}) as meter:
                started = time.perf_counter()
                done = list(pool.map(lambda r: lc.complete(url, r.prompt_token_ids, r.max_tokens), work.requests))
                wall = max(d.end for d in done) - started
        outputs = [d.tokens for d in done]
        throughput = _throughput(meter, outputs, wall)
        lc.complete_streamed(url, PROMPT, 16)  # warm-up
        with Meter({"llama-server": server.pid}) as meter:
            one = lc.complete_streamed(url, PROMPT, work.single_tokens)
        single = {**meter.record(), "ms_per_token": one.client_ms_per_token(),
                  "predicted_per_token_ms": one.predicted_per_token_ms, "timings": one.timings}
        return {"throughput": throughput, "single": single, "outputs": outputs, "single_ids": one.tokens}
    finally:
        server.stop()


def run_hf(hf, work: Work) -> dict:
    from bench.baselines import hf_static

    with Meter({"self": 0}) as meter:
        b = hf_static(hf, work.prompts, work.max_tokens)
    return {"throughput": _throughput(meter, b.outputs, b.wall_s), "outputs": b.outputs}


# ----- the command ------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("peer", choices=["llama-cpp"])
    p.add_argument("--model", default=str(STORIES260K),
                   help=f"a checkpoint directory (convert_hf_to_gguf.py reads it), or {pm.QWEN3_SHAPE}: a random "
                        "Qwen3-0.6B-shaped checkpoint in bf16, built once into the cache")
    p.add_argument("--weights", choices=["as-is", "int8"], default="as-is",
                   help="int8: ours serves an int8 weight-only copy (compressed-tensors W8A16, per channel), "
                        "llama-server a Q8_0 GGUF")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=None,
                   help="concurrent requests, all sent at once: the mixed workload (default 64) on a directory, "
                        f"--stream-tokens each after a 16-token prompt (default 16) on {pm.QWEN3_SHAPE}")
    p.add_argument("--stream-tokens", type=int, default=32, help=f"{pm.QWEN3_SHAPE}: output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single-tokens", type=int, default=None,
                   help=f"greedy tokens of the single stream (default 200; {pm.QWEN3_SHAPE}: 32)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="threads for every system: EXECUTOR_NUM_THREADS, llama-server -t/-tb, HF's torch; "
                        "0 = our executor's default (torch's default thread count), given to the others")
    p.add_argument("--no-hf", action="store_true", help="skip the HF static baseline")
    p.add_argument("--outtype", default="f32", help="GGUF type for convert_hf_to_gguf.py (f32, bf16, q8_0)")
    p.add_argument("--sdist", type=Path, default=None, help=f"a local {lc.sdist_name(lc.SDIST_VERSION)} "
                   "instead of downloading it")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"build and GGUF cache (env {lc.CACHE_ENV}, default ~/.cache/llmsched/llama-cpp)")
    p.add_argument("--build-jobs", type=int, default=None, help="cmake --build -j (default: all cores)")
    p.add_argument("--isa", choices=sorted(OURS_ISA_ENV), default="native",
                   help="avx2: both systems limited to AVX2 (llama-server built with GGML_NATIVE off, ours with "
                        f"{', '.join(f'{k}={v}' for k, v in OURS_ISA_ENV['avx2'].items())}), a stand-in for an "
                        "AVX2 machine on an AVX-512 one")
    p.add_argument("--executor-env", action="append", default=[], metavar="K=V", help="extra executor env for ours")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "peer-llama-cpp.json")
    args = p.parse_args(argv)
    shape = args.model == pm.QWEN3_SHAPE
    args.num_requests = args.num_requests or (16 if shape else 64)
    args.single_tokens = args.single_tokens or (32 if shape else 200)
    if args.rounds < 1 or args.num_requests < 1 or args.single_tokens < 2 or args.stream_tokens < 1:
        p.error("--rounds, --num-requests and --stream-tokens must be at least 1, --single-tokens at least 2")
    if not shape and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: llama.cpp's converter needs a checkpoint directory")
    if shape and not args.no_hf:
        args.no_hf = True  # HF's bf16 generate on 0.6B parameters would take the rounds' whole time
    return args


def streams_work(num_requests: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int,
                 single_tokens: int) -> Work:
    """Equal requests: `prompt_tokens` random ids, `output_tokens` out."""
    import random

    rng = random.Random(seed)
    requests = [wl.BenchRequest(i, output_tokens, prompt_token_ids=wl.random_token_ids(rng, prompt_tokens, vocab))
                for i in range(num_requests)]
    return Work(requests, wl.warmup_requests(requests[:WARMUP_REQUESTS], vocab, seed), single_tokens)


def build_work(model: str, num_requests: int, seed: int, single_tokens: int) -> Work:
    from bench.common import context_for, vocab_size_for

    vocab = vocab_size_for(model, None)
    work = wl.mixed(num_requests, vocab, seed)
    if context := context_for(model, {}):
        wl.fit_to_context(work.requests, context)
    warmup = wl.warmup_requests(work.requests[:WARMUP_REQUESTS], vocab, seed)
    return Work(work.requests, warmup, single_tokens)


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict:
    differ = compare_outputs(range(len(ours)), ours, theirs)
    return {"compared": len(ours), "identical": len(ours) - len(differ),
            "first_diffs": [m.first_diff for m in differ[:20]]}


def ours_env(isa: str, executor_env: dict[str, str], num_threads: int) -> dict[str, str]:
    """Our executor's extra environment: the ISA's limits, then
    --executor-env (which wins), then the thread count if given."""
    env = {**OURS_ISA_ENV[isa], **executor_env}
    if num_threads:
        env["EXECUTOR_NUM_THREADS"] = str(num_threads)
    return env


def server_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return (done.stdout + done.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench.common import context_for, environment, parse_env_pairs

    threads = args.num_threads or torch.get_num_threads()
    env = ours_env(args.isa, parse_env_pairs(args.executor_env), args.num_threads)
    paths = lc.Paths.make(lc.SDIST_VERSION, args.cache_dir, args.isa)
    binary = lc.build_server(paths, args.sdist, args.build_jobs)
    if args.model == pm.QWEN3_SHAPE:
        _say(f"building {pm.QWEN3_SHAPE} (random, bf16) in the cache unless there")
        plain = pm.make_qwen3_shape(paths.root.parent / "checkpoints" / pm.QWEN3_SHAPE, args.seed)
        # bf16 on both sides; a KV pool of 4,096 tokens is plenty for the
        # short requests and keeps memory modest.
        env = {"EXECUTOR_DTYPE": "bfloat16", "EXECUTOR_NUM_KV_BLOCKS": "256", **env}
        work = streams_work(args.num_requests, 16, args.stream_tokens, pm.QWEN3_06B["vocab_size"], args.seed,
                            args.single_tokens)
        context = 16 + max(args.stream_tokens, args.single_tokens) + 64
        outtype = "q8_0" if args.weights == "int8" else "bf16"
    else:
        plain = Path(args.model)
        work = build_work(args.model, args.num_requests, args.seed, args.single_tokens)
        context = context_for(args.model, {}) or 4096
        outtype = "q8_0" if args.weights == "int8" else args.outtype
    ours_model = str(plain)
    if args.weights == "int8":
        ours_model = str(pm.write_int8(plain, paths.root.parent / "checkpoints" / f"{plain.name}-int8"))
    args.outtype = outtype
    gguf = lc.convert(paths, plain, outtype, args.sdist)
    server = lc.LlamaServer.make(binary, gguf, threads, args.num_requests, context)
    hf = None
    if not args.no_hf:
        from bench.baselines import load_hf_model

        hf = load_hf_model(args.model, threads)
    systems = [s for s in SYSTEMS if not (s == "hf-static" and hf is None)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".services.log")
    runs: dict[str, Callable[[], dict]] = {
        "ours": lambda: run_ours(ours_model, work, log, env),
        "llama-server": lambda: run_llama(server, work, log),
        "hf-static": lambda: run_hf(hf, work),
    }
    rounds, checks = [], {}
    report = {"peer": "llama-cpp", "model": args.model, "ours_checkpoint": ours_model, "weights": args.weights,
              "threads": threads, "isa": args.isa, "ours_env": env,
              "llama_cpp": {"sdist_version": lc.SDIST_VERSION, "server_version": server_version(binary),
                            "server_args": server.args[1:], "gguf": str(gguf), "outtype": args.outtype},
              "workload": {"name": "equal" if args.model == pm.QWEN3_SHAPE else "mixed",
                           "num_requests": args.num_requests, "seed": args.seed,
                           "output_tokens": sum(work.max_tokens), "single_prompt": PROMPT,
                           "single_tokens": args.single_tokens},
              "environment": environment(threads), "summary": {}, "greedy_agreement": checks, "rounds": rounds}
    with log_path.open("w") as log:
        for r in range(args.rounds):
            this: dict = {"order": round_order(r, systems)}
            for name in this["order"]:
                _say(f"round {r + 1}/{args.rounds}: {name}")
                this[name] = runs[name]()
            for other in systems[1:]:
                checks.setdefault(other, []).append(agreement(this["ours"]["outputs"], this[other]["outputs"]))
            checks.setdefault("single-llama-server", []).append(
                agreement([this["ours"]["single_ids"]], [this["llama-server"]["single_ids"]]))
            for name in systems:
                this[name].pop("outputs")
                this[name].pop("single_ids", None)
            rounds.append(this)
            # Written after every round, so that a run cut short keeps what it measured.
            report["summary"] = summarize(rounds)
            args.out.write_text(json.dumps(report, indent=2))
            _say("  tok/s " + ", ".join(f"{s} {this[s]['throughput']['tok_per_s']:.0f}" for s in systems)
                 + "; ms/token " + ", ".join(f"{s} {this[s]['single']['ms_per_token']:.3f}" for s in systems
                                             if "single" in this[s]))
    print(format_table(report))
    _say(f"report: {args.out}; logs: {log_path}")
    return 0


def format_table(report: dict) -> str:
    s = report["summary"]
    lines = [f"P24: {Path(report['model']).name}, {report['workload']['num_requests']} {report['workload']['name']} requests and one "
             f"{report['workload']['single_tokens']}-token stream, {report['threads']} threads, "
             f"llama-cpp-python {report['llama_cpp']['sdist_version']} ({report['llama_cpp']['outtype']} GGUF), "
             f"medians of {s['rounds']} interleaved rounds",
             f"{'':14} {'tok/s':>9} {'ms/token':>9} {'CPU s':>7} {'steal':>6}"]
    for name, m in s["median"].items():
        ms = f"{m['ms_per_token']:9.3f}" if "ms_per_token" in m else f"{'-':>9}"
        lines.append(f"{name:14} {m['tok_per_s']:9.1f} {ms} {m['cpu_s_total']:7.2f} {m['steal_share']:6.1%}")
    for pair, per in s["ratios"].items():
        for key, r in per.items():
            what = "throughput" if key == "tok_per_s" else "ms/token"
            rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
            lines.append(f"{pair} {what}: {r['median_of_rounds']:.2f}x median of rounds ({rounds})")
    for other, per_round in report["greedy_agreement"].items():
        same = sum(c["identical"] for c in per_round)
        total = sum(c["compared"] for c in per_round)
        lines.append(f"greedy tokens, ours vs {other}: {same}/{total} identical")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
