"""P13: throughput at EXECUTOR_TENSOR_PARALLEL_SIZE=N against N=1, in the
same run, through the real services.

    python -m bench.tensor_parallel                        # bench-small, TP=2 vs TP=1, 128 requests, 2 rounds
    python -m bench.tensor_parallel --size 4 --rounds 3
    python -m bench.tensor_parallel --executor-env EXECUTOR_CUDA_GRAPHS=off -- --num-requests 64

Each run is one `python -m bench --launch` (fresh services, the offline
mixed workload, greedy), with the tensor-parallel size as executor env; the
rounds alternate which size goes first, so neither always meets a warmer
machine. Options after `--` go to `python -m bench` unchanged. Prints each
run, the median output throughput of each size and their ratio, and how
many requests' greedy tokens at size N equal those at size 1 in the same
round (the all-reduce sums in another order, so a near-tie can flip).

On the CPU the ranks talk gloo and each takes EXECUTOR_NUM_THREADS threads
(--num-threads, 1 by default), so size N uses N cores where size 1 uses
one: on a machine with few cores shared with the scheduler and the client,
the figure proves the group serves, not that it is faster. On CUDA each
rank takes its own GPU (NCCL); the bench's usual executor defaults apply
to both sizes alike, except that a group runs decode steps without CUDA
graphs (executor_svc/loading.py): pass `--executor-env
EXECUTOR_CUDA_GRAPHS=off` to compare like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_command(args: argparse.Namespace, size: int, out: Path, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "bench", "--launch", "--model", args.model, "--num-requests", str(args.num_requests),
           "--num-threads", str(args.num_threads), "--scheduler-env", "SCHEDULER_MAX_QUEUE_DELAY_MS=0",
           "--executor-env", f"EXECUTOR_TENSOR_PARALLEL_SIZE={size}", "--no-plots", "--no-progress", "--out", str(out)]
    for pair in args.executor_env:
        cmd += ["--executor-env", pair]
    return cmd + extra


def same_outputs(a: dict, b: dict) -> tuple[int, int]:
    """(requests with identical token ids, requests both completed)."""
    ids_a = {r["index"]: r["output_ids"] for r in a["requests"] if r["status"] == "ok"}
    ids_b = {r["index"]: r["output_ids"] for r in b["requests"] if r["status"] == "ok"}
    both = ids_a.keys() & ids_b.keys()
    return sum(ids_a[i] == ids_b[i] for i in both), len(both)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-small")
    p.add_argument("--size", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--executor-env", action="append", default=[], metavar="K=V", help="for both sizes")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "p13_tensor_parallel.json",
                   help="summary JSON; each run's report and services log lie beside it")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.size < 2:
        p.error("--size must be at least 2 (it is compared with size 1)")
    if any(pair.startswith("EXECUTOR_TENSOR_PARALLEL_SIZE=") for pair in args.executor_env):
        p.error("set the size with --size, not EXECUTOR_TENSOR_PARALLEL_SIZE")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stem = args.out.with_suffix("")

    runs: list[dict] = []
    agreement: list[dict] = []
    for r in range(args.rounds):
        reports = {}
        for size in ((1, args.size) if r % 2 == 0 else (args.size, 1)):
            out = stem.with_name(f"{stem.name}.r{r}.tp{size}.json")
            cmd = bench_command(args, size, out, extra)
            print(f"round {r} TP={size}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            with open(out.with_suffix(".log"), "w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                print(f"error: round {r} TP={size} failed with exit code {rc}; see {out.with_suffix('.log')}",
                      file=sys.stderr)
                return 1
            report = json.loads(out.read_text())
            reports[size] = report
            s = report["summary"]
            runs.append({"round": r, "size": size, "report": str(out), "output_throughput": s["output_throughput"],
                         "completed": s["completed"], "num_requests": s["num_requests"],
                         "tpot_ms_p50": s["tpot_ms"]["p50"], "ttft_ms_p50": s["ttft_ms"]["p50"]})
            print(f"round {r} TP={size}: {s['output_throughput']:.1f} output tok/s, {s['completed']}/"
                  f"{s['num_requests']} completed, TPOT p50 {s['tpot_ms']['p50']:.1f} ms", flush=True)
            if s["completed"] != s["num_requests"]:
                print(f"error: round {r} TP={size} completed {s['completed']} of {s['num_requests']}; "
                      f"see {out.with_suffix('.log')}", file=sys.stderr)
                return 1
        same, compared = same_outputs(reports[1], reports[args.size])
        agreement.append({"round": r, "identical": same, "compared": compared})

    median = {size: statistics.median(x["output_throughput"] for x in runs if x["size"] == size)
              for size in (1, args.size)}
    ratio = median[args.size] / median[1]
    same = sum(a["identical"] for a in agreement)
    compared = sum(a["compared"] for a in agreement)
    print(f"P13 {args.model}, mixed x{args.num_requests}, {args.rounds} round(s): median output throughput "
          f"TP=1 {median[1]:.1f} tok/s, TP={args.size} {median[args.size]:.1f} tok/s, "
          f"TP{args.size}/TP1 = {ratio:.2f}x; greedy tokens identical on {same}/{compared} requests")
    args.out.write_text(json.dumps({
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "bench_args": extra},
        "runs": runs, "median_output_throughput": {str(k): v for k, v in median.items()},
        "ratio": ratio, "greedy_agreement": agreement}, indent=2))
    print(f"summary: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
