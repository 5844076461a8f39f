"""P1 and P2: the scheduler's CPU cost per step and the step plan's size.

Runs the scheduler core alone against a fake executor (no processes, no
model), with N requests all decoding, block size 16, prefix caching on.
A step is what the engine does per step on the scheduler side: schedule(),
encode the plan to bytes, decode a StepResult and update_from_output().

    python -m bench.scheduler_cost [--steps 500] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from llmsched.v1 import executor_pb2 as epb
from scheduler_svc.convert import plan_to_proto, sampled_from_proto
from scheduler_svc.core.request import Request, SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig

BLOCK_SIZE = 16


def make_running_scheduler(num_requests: int, prompt_len: int) -> Scheduler:
    """N distinct requests, prefilled, all decoding, each one token into a
    fresh block so the next block boundary is BLOCK_SIZE - 1 steps away."""
    max_tokens = 4096
    blocks_per_req = -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(
        num_kv_blocks=num_requests * blocks_per_req, block_size=BLOCK_SIZE, max_model_len=prompt_len + max_tokens,
        max_num_seqs=num_requests, max_num_batched_tokens=max(num_requests * prompt_len, 2048),
        max_prefill_chunk=prompt_len, enable_prefix_caching=True,
    ))
    for i in range(num_requests):
        sched.add_request(Request(
            request_id=f"r{i}", prompt_token_ids=[3 + (i * 7919 + j) % 500 for j in range(prompt_len)],
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            eos_token_ids=frozenset({2}),
        ))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()) or sched.waiting:
        step(sched)
    return sched


def fake_result(out) -> bytes:
    """What the executor would send back: one token per sampling request."""
    handles = out.sampling_handles()
    return epb.StepResult(step_id=out.step_id, sampled_handles=handles,
                          sampled_token_ids=[7] * len(handles)).SerializeToString()


def step(sched: Scheduler, result_bytes: bytes | None = None) -> tuple[int, int, bool]:
    """One scheduler-side step; returns (ns, plan bytes, plan added blocks)."""
    t0 = time.perf_counter_ns()
    out = sched.schedule()
    plan = plan_to_proto(out).SerializeToString()
    # The executor's answer is made outside the timed region below.
    t1 = time.perf_counter_ns()
    raw = result_bytes if result_bytes is not None else fake_result(out)
    t2 = time.perf_counter_ns()
    result = epb.StepResult.FromString(raw)
    sched.update_from_output(out, sampled_from_proto(result))
    t3 = time.perf_counter_ns()
    return (t1 - t0) + (t3 - t2), len(plan), bool(out.new_block_ids)


def measure(num_requests: int, steps: int, prompt_len: int) -> dict:
    sched = make_running_scheduler(num_requests, prompt_len)
    times, steady, with_block = [], [], []
    for _ in range(steps):
        ns, nbytes, added = step(sched)
        times.append(ns / 1000)
        (with_block if added else steady).append(nbytes)
    times.sort()
    return {
        "running": num_requests,
        "prompt_len": prompt_len,
        "median_us": statistics.median(times),
        "p90_us": times[int(0.9 * (len(times) - 1))],
        "median_us_per_request": statistics.median(times) / num_requests,
        "steady_plan_bytes_per_request": statistics.median(steady) / num_requests if steady else None,
        "block_step_plan_bytes_per_request": statistics.median(with_block) / num_requests if with_block else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024],
                    help="context lengths, to show plan size does not depend on them")
    ap.add_argument("--out", default="bench_results/scheduler_cost.json")
    args = ap.parse_args()
    rows = [measure(n, args.steps, p) for p in args.prompt_lens for n in args.sizes]
    print(f"{'running':>8} {'ctx':>6} {'median us':>10} {'p90 us':>10} {'us/req':>8} {'B/req steady':>13} {'B/req +block':>13}")
    for r in rows:
        print(f"{r['running']:>8} {r['prompt_len']:>6} {r['median_us']:>10.0f} {r['p90_us']:>10.0f} "
              f"{r['median_us_per_request']:>8.2f} {r['steady_plan_bytes_per_request']:>13.2f} "
              f"{r['block_step_plan_bytes_per_request'] or float('nan'):>13.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"figures": ["P1", "P2"], "block_size": BLOCK_SIZE, "steps": args.steps, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
