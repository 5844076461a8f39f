"""P18: fair share between two tenants. Tenant A floods (400 requests)
while tenant B sends 50, all at t=0 in one shuffled order, every request
with the same prompt and output lengths, through API keys `A:...` and
`B:...`. One set of services per configuration (the policy is a scheduler
setting):

    python -m bench.fairness --model assets/models/stories260K

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
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmsched.assets import STORIES260K
from llmsched.launch import launch
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}
DEFAULT_MODEL = str(STORIES260K)


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


def ideal_wave_ratio(n: int, slots: int, share: float) -> float | None:
    """B's TTFT p99 under the flood over alone, for n requests of equal
    length all sent at once, when B holds `share` of `slots` under the flood
    and all of them alone: requests run in waves, and B's last one starts
    after (waves - 1) full waves. None when B fits one wave alone (its
    TTFT alone is then a prefill, not a wave)."""
    alone = math.ceil(n / slots)
    shared = math.ceil(n / max(1, math.floor(slots * share)))
    return (shared - 1) / (alone - 1) if alone > 1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-a", type=int, default=400)
    p.add_argument("--num-b", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="SCHEDULER_MAX_NUM_SEQS: what makes tenants wait (16: B waits for about 6 waves at 1:1)")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every configuration, interleaved; medians")
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
    rounds: list[dict[str, Run]] = []
    for i in range(args.rounds):
        runs = {}
        # Each round starts one configuration later, so that a drift of the
        # machine's speed does not always fall on the same one.
        for name, env, tenants in configs[i % len(configs):] + configs[:i % len(configs)]:
            runs[name] = serve_and_run(name, args.model, {**base, **env}, tenants, prompt, args.max_tokens,
                                       args.num_threads)
            print(f"round {i + 1}, {name}: {runs[name].duration_s:.1f} s", file=sys.stderr, flush=True)
        rounds.append(runs)

    per_round = [figures_of(runs) for runs in rounds]
    report = {"model": args.model, "num_a": args.num_a, "num_b": args.num_b, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs, "rounds": per_round,
              "medians": {name: {k: median_of([r[name][k] for r in per_round]) for k, v in per_round[0][name].items()
                                 if not isinstance(v, dict)}
                          for name, _, _ in configs},
              "ideal_b_ttft_p99_vs_alone": {"fair 1:1": ideal_wave_ratio(args.num_b, args.max_num_seqs, 1 / 2),
                                            "fair 2:1": ideal_wave_ratio(args.num_b, args.max_num_seqs, 1 / 3)}}
    print(f"P18 {Path(args.model).name}: A {args.num_a} and B {args.num_b} requests at once, {args.prompt_len} + "
          f"{args.max_tokens} tokens each, max_num_seqs {args.max_num_seqs}; medians of {args.rounds} rounds "
          f"(each round's value in brackets)")
    print(f"{'run':10s} {'A/B service (both backlogged)':>30s} {'B TTFT p99 vs alone':>30s} {'ideal':>6s} "
          f"{'output tok/s vs fcfs':>30s}")

    def cell(name: str, key: str) -> str:
        values = [r[name][key] for r in per_round]
        med = report["medians"][name][key]
        if med is None:
            return "-"
        return f"{med:.2f} [" + " ".join("-" if v is None else f"{v:.2f}" for v in values) + "]"

    for name, _, _ in configs:
        ideal = report["ideal_b_ttft_p99_vs_alone"].get(name)
        print(f"{name:10s} {cell(name, 'a_over_b_service'):>30s} {cell(name, 'b_ttft_p99_vs_alone'):>30s} "
              f"{'-' if ideal is None else f'{ideal:.2f}':>6s} {cell(name, 'throughput_vs_fcfs'):>30s}")
    print("ideal: B's TTFT p99 ratio of an exact slot split, for waves of equal requests (the best a policy "
          "giving B that share can do)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 0


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def figures_of(runs: dict[str, Run]) -> dict[str, dict]:
    """One round's figures per configuration; ratios against the same
    round's fcfs and B alone."""
    fcfs_tput = runs["fcfs"].output_tokens / runs["fcfs"].duration_s
    b_alone = p99(runs["B alone"].ttft["B"])
    out = {}
    for name, run in runs.items():
        ratio, got = share_while_both_backlogged(run.samples)
        tput = run.output_tokens / run.duration_s
        b99 = p99(run.ttft["B"])
        out[name] = {"a_over_b_service": ratio, "service_while_both_backlogged": got,
                     "b_ttft_p99_s": b99, "b_ttft_p99_vs_alone": b99 / b_alone,
                     "a_ttft_p99_s": p99(run.ttft["A"]) if run.ttft["A"] else None,
                     "output_throughput": tput, "throughput_vs_fcfs": tput / fcfs_tput,
                     "duration_s": run.duration_s}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
