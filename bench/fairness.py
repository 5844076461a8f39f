"""P18: fair share between two tenants. Tenant A floods (400 requests)
while tenant B sends 50, all at t=0 in one shuffled order, every request
with the same prompt and output lengths, through API keys `A:...` and
`B:...`. One set of services per configuration (the policy is a scheduler
setting):

    python -m bench.fairness --model ../shared/models/stories260K

- fair, weights 1:1; fcfs; fair with A weighing 2;
- B's 50 alone (under fair), for B's TTFT without the flood.

While both tenants have requests waiting, the scheduler's per-tenant
counters of tokens served are read every 50 ms: service is prompt tokens +
2 x output tokens (VTC's default weights), and the report gives A's share
over B's. Also B's TTFT p99 under the flood against alone, and total output
throughput against fcfs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmsched.launch import launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K")


@dataclass
class Sample:
    at: float
    served: dict[str, float]  # prompt + 2 x output, per tenant
    waiting: dict[str, float]


@dataclass
class Run:
    name: str
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"A": [], "B": []})
    output_tokens: int = 0
    duration_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)


def _labelled(metrics_text_port: int, name: str) -> dict[str, dict[str, float]]:
    """{tenant: {kind or "": value}} of a per-tenant metric."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_text_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, value = line[len(name) + 1:].rsplit("} ", 1)
        parts = dict(p.split("=", 1) for p in labels.split(","))
        tenant = parts.get("tenant", "").strip('"')
        out.setdefault(tenant, {})[parts.get("kind", '""').strip('"')] = float(value)
    return out


def sample(port: int) -> Sample:
    served = _labelled(port, "llmsched_tenant_served_tokens_total")
    waiting = _labelled(port, "llmsched_tenant_requests_waiting")
    return Sample(time.perf_counter(),
                  {t: served.get(t, {}).get("prompt", 0) + 2 * served.get(t, {}).get("output", 0) for t in KEYS},
                  {t: waiting.get(t, {}).get("", 0) for t in KEYS})


async def send(address: str, tenants: list[str], prompt: list[int], max_tokens: int, run: Run) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        t0 = time.perf_counter()

        async def one(tenant: str) -> None:
            req = spb.GenerateRequest(prompt_token_ids=prompt, sampling=spb.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True))
            first = None
            async for resp in stub.Generate(req, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),),
                                            timeout=600):
                if resp.token_ids and first is None:
                    first = time.perf_counter() - t0
                run.output_tokens += len(resp.token_ids)
            run.ttft[tenant].append(first)

        await asyncio.gather(*(one(t) for t in tenants))
        run.duration_s = time.perf_counter() - t0


def serve_and_run(name: str, model: str, scheduler_env: dict[str, str], tenants: list[str], prompt: list[int],
                  max_tokens: int, threads: int) -> Run:
    services = launch(executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": str(threads)},
                      scheduler_env={"SCHEDULER_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items()),
                                     "SCHEDULER_MAX_QUEUE_DELAY_MS": "0", **scheduler_env})
    run = Run(name)
    try:
        services.start()
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.05):  # a sampling period, not a wait for an event
                run.samples.append(sample(services.scheduler_metrics_port))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        asyncio.run(send(services.scheduler_address, tenants, prompt, max_tokens, run))
        stop.set()
        poller.join()
    finally:
        services.stop()
    return run


def share_while_both_backlogged(samples: list[Sample]) -> tuple[float | None, dict[str, float]]:
    """A's service over B's, summed over the polling intervals that begin and
    end with both tenants waiting."""
    got = {t: 0.0 for t in KEYS}
    for before, after in zip(samples, samples[1:]):
        if all(before.waiting[t] > 0 and after.waiting[t] > 0 for t in KEYS):
            for t in KEYS:
                got[t] += after.served[t] - before.served[t]
    return (got["A"] / got["B"] if got["B"] else None), got


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-a", type=int, default=400)
    p.add_argument("--num-b", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32, help="SCHEDULER_MAX_NUM_SEQS: what makes tenants wait")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/p18_fairness.json"))
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    prompt = [1] + [rng.randrange(3, 500) for _ in range(args.prompt_len - 1)]
    mixed = ["A"] * args.num_a + ["B"] * args.num_b
    rng.shuffle(mixed)
    base = {"SCHEDULER_MAX_NUM_SEQS": str(args.max_num_seqs), "SCHEDULER_ENABLE_PREFIX_CACHING": "false"}
    configs = [("fair 1:1", {"SCHEDULER_POLICY": "fair"}, mixed),
               ("fcfs", {"SCHEDULER_POLICY": "fcfs"}, mixed),
               ("fair 2:1", {"SCHEDULER_POLICY": "fair", "SCHEDULER_TENANT_WEIGHTS": "A=2,B=1"}, mixed),
               ("B alone", {"SCHEDULER_POLICY": "fair"}, ["B"] * args.num_b)]
    runs = {}
    for name, env, tenants in configs:
        runs[name] = serve_and_run(name, args.model, {**base, **env}, tenants, prompt, args.max_tokens,
                                   args.num_threads)
        print(f"{name}: {runs[name].duration_s:.1f} s", file=sys.stderr, flush=True)

    report = {"model": args.model, "num_a": args.num_a, "num_b": args.num_b, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs, "runs": {}}
    fcfs_tput = runs["fcfs"].output_tokens / runs["fcfs"].duration_s
    b_alone = p99(runs["B alone"].ttft["B"])
    print(f"P18 {Path(args.model).name}: A {args.num_a} and B {args.num_b} requests at once, {args.prompt_len} + "
          f"{args.max_tokens} tokens each, max_num_seqs {args.max_num_seqs}")
    print(f"{'run':10s} {'A/B service (both backlogged)':>30s} {'B TTFT p99':>11s} {'vs alone':>9s} "
          f"{'output tok/s':>13s} {'vs fcfs':>8s}")
    for name, run in runs.items():
        ratio, got = share_while_both_backlogged(run.samples)
        tput = run.output_tokens / run.duration_s
        b99 = p99(run.ttft["B"])
        report["runs"][name] = {"a_over_b_service": ratio, "service_while_both_backlogged": got,
                                "b_ttft_p99_s": b99, "b_ttft_p99_vs_alone": b99 / b_alone,
                                "a_ttft_p99_s": p99(run.ttft["A"]) if run.ttft["A"] else None,
                                "output_throughput": tput, "throughput_vs_fcfs": tput / fcfs_tput,
                                "duration_s": run.duration_s}
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"{name:10s} {shown:>30s} {b99 * 1e3:9.0f} ms {b99 / b_alone:8.2f}x {tput:13.1f} {tput / fcfs_tput:7.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
