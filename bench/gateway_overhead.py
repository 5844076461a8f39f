"""P3 through the gateway: the same offline workload sent straight to the
scheduler over gRPC and through the OpenAI gateway, alternating, against one
set of services, so both see the same machine at the same time.

    python -m bench.gateway_overhead --model bench-small --num-requests 256 --rounds 3

Prefix caching is off, so every round computes the same work. Reports each
round's output throughput and the median of each endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from bench import workloads as wl
from bench.client import run_requests
from bench.common import vocab_size_for
from bench.openai_client import run_openai_requests
from bench.report import summarize
from llmsched.launch import launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-small")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON of every round")
    args = p.parse_args(argv)

    work = wl.mixed(args.num_requests, vocab_size_for(args.model, None), args.seed, wl.MIXED_PROMPT, wl.MIXED_OUTPUT)
    services = launch(executor_env={"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads)},
                      scheduler_env={"SCHEDULER_ENABLE_PREFIX_CACHING": "false"}, with_gateway=True)
    log = open(Path(args.out or "bench_results/gateway_overhead.json").with_suffix(".services.log"), "w") \
        if args.out else None
    services.stdout = log
    rounds: list[dict] = []
    try:
        services.start()
        model = Path(args.model).name
        warm = wl.warmup_requests(work.requests[:8], vocab_size_for(args.model, None), args.seed)
        asyncio.run(run_requests(services.scheduler_address, warm, tag="warm", show_progress=False))
        asyncio.run(run_openai_requests(services.gateway_url, model, warm, tag="warm", show_progress=False))
        for r in range(args.rounds):
            # Alternate which goes first, so neither always runs on a warmer machine.
            order = ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")
            for kind in order:
                if kind == "grpc":
                    run = asyncio.run(run_requests(services.scheduler_address, work.requests, tag=f"g{r}",
                                                   show_progress=False))
                else:
                    run = asyncio.run(run_openai_requests(services.gateway_url, model, work.requests, tag=f"o{r}",
                                                          show_progress=False))
                s = summarize(run)
                rounds.append({"round": r, "endpoint": kind, "output_throughput": s["output_throughput"],
                               "completed": s["completed"], "ttft_p50_ms": s["ttft_ms"]["p50"]})
                print(f"round {r} {kind:6s}: {s['output_throughput']:8.1f} output tok/s, "
                      f"{s['completed']}/{len(work.requests)} completed, TTFT p50 {s['ttft_ms']['p50']:.0f} ms",
                      file=sys.stderr, flush=True)
    finally:
        services.stop()
        if log:
            log.close()
    med = {k: statistics.median(x["output_throughput"] for x in rounds if x["endpoint"] == k)
           for k in ("grpc", "openai")}
    loss = 1 - med["openai"] / med["grpc"]
    print(f"P3 {args.model}, mixed x{args.num_requests}, {args.rounds} rounds: median output throughput "
          f"gRPC {med['grpc']:.1f} tok/s, gateway {med['openai']:.1f} tok/s, loss through the gateway {loss:.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rounds": rounds, "median": med, "loss": loss}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
