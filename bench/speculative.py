"""P21: speculative decoding (EXECUTOR_SPECULATIVE_METHOD=ngram) against
none, in the same run, through the real services.

    python -m bench.speculative                      # stories260K, K=4, 3 rounds
    python -m bench.speculative --tokens 2 --rounds 5

Two stacks serve the same checkpoint, one speculating and one not; each
round runs both, in alternating order, on:

- `copy`, one stream: prompts whose answers repeat their input, as a code
  edit's answer does. stories260K does not follow an instruction to
  repeat, so each prompt is built from text the model itself produces: a
  story opening, the model's own greedy continuation of it
  (--story-tokens), then the opening again; the model goes on copying its
  story for a while. These are the first eight prompts of `python -m bench
  --workload copy` (bench/workloads.py). Requests are sent one after
  another; the figure is milliseconds per output token.
- `mixed`, --streams at once: random token prompts and lengths (the mixed
  workload's laws, scaled to fit the model's context), greedy, all sent at
  once; the figure is output tokens per second.

Prints the medians, the ratios (speculating / not), the mean acceptance
length (tokens per speculative step, from the scheduler's metrics) and
whether every request's greedy tokens are equal on both stacks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.client import copy_prompts_from
from bench.server_metrics import scrape, speculative_acceptance
from bench.stack_pair import NAMES, launch_pair, round_order, start_pair, stop_pair
from bench.workloads import COPY_OPENINGS, MIXED_OUTPUT, MIXED_PROMPT, mixed
from llmsched.launch import Services
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "assets" / "models" / "stories260K"
# P21's copy prompts: the first eight openings of the copy workload (eight
# rather than four keep a round's copy part long enough to time on a noisy
# machine: about 2 s).
NUM_OPENINGS = 8


class Stack:
    """A started stack and a blocking client of its scheduler."""

    def __init__(self, services: Services):
        self.services = services
        self.channel = grpc.insecure_channel(services.scheduler_address)
        self.stub = spb_grpc.SchedulerStub(self.channel)

    def generate(self, prompt: list[int], max_tokens: int, adapter: str = "") -> list[int]:
        req = spb.GenerateRequest(prompt_token_ids=prompt, adapter=adapter, sampling=spb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return [t for resp in self.stub.Generate(req, timeout=600) for t in resp.token_ids]


def run_copy(stack: Stack, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """ms per output token over the prompts sent one after another."""
    started, outputs = time.perf_counter(), []
    for p in prompts:
        outputs.append(stack.generate(p, max_tokens))
    return (time.perf_counter() - started) * 1000 / sum(map(len, outputs)), outputs


def run_mixed(stack: Stack, requests: list[tuple]) -> tuple[float, list[list[int]]]:
    """Output tokens per second with every request sent at once; each
    request is Stack.generate's arguments (prompt, max_tokens[, adapter])."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        outputs = list(pool.map(lambda r: stack.generate(*r), requests))
    return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--tokens", type=int, default=4, help="EXECUTOR_SPECULATIVE_TOKENS")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--story-tokens", type=int, default=120, help="the model's own story placed in each copy prompt")
    p.add_argument("--copy-tokens", type=int, default=100, help="output tokens per copy request")
    p.add_argument("--streams", type=int, default=64, help="mixed requests sent at once")
    p.add_argument("--num-threads", type=int, default=1, help="EXECUTOR_NUM_THREADS of each stack")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "p21_speculative.json")
    args = p.parse_args(argv)

    pair = launch_pair({"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads)},
                       {"SCHEDULER_MAX_QUEUE_DELAY_MS": "0", "SCHEDULER_SPECULATIVE_MAX_BATCH": "16"}, args.tokens)
    start_pair(pair)
    stacks = {spec: Stack(services) for spec, services in pair.items()}
    try:
        # Built on both stacks, so both hold the prompts' stories in their
        # prefix caches before the first round, and both must tell the same.
        built = [copy_prompts_from(pair[spec].scheduler_address, list(COPY_OPENINGS[:NUM_OPENINGS]),
                                   args.story_tokens) for spec in (False, True)]
        if built[0] != built[1]:
            raise SystemExit("the two stacks generated different stories for the copy prompts")
        prompts = built[0]
        # Mixed lengths scaled to stories260K's 512 positions.
        work = mixed(args.streams, 512, seed=0, prompt=MIXED_PROMPT.scaled(0.25), output=MIXED_OUTPUT.scaled(0.5))
        rng = random.Random(0)
        requests = [(r.prompt_token_ids, r.max_tokens) for r in work.requests]
        rng.shuffle(requests)
        results = {"copy": {False: [], True: []}, "mixed": {False: [], True: []}}
        outputs = {}
        for r in range(args.rounds):
            for spec in round_order(r):
                ms, copied = run_copy(stacks[spec], prompts, args.copy_tokens)
                tps, mixed_out = run_mixed(stacks[spec], requests)
                results["copy"][spec].append(ms)
                results["mixed"][spec].append(tps)
                outputs.setdefault(spec, (copied, mixed_out))
                print(f"round {r} {NAMES[spec]}: copy {ms:.2f} ms/token, mixed x{args.streams} "
                      f"{tps:.0f} tok/s", file=sys.stderr, flush=True)
        # Since the stack started: every speculative step it has taken is in a timed round.
        acceptance = speculative_acceptance({}, scrape(pair[True].scheduler_metrics_port))
    finally:
        for stack in stacks.values():
            stack.channel.close()
        stop_pair(pair)

    med = {kind: {spec: statistics.median(v) for spec, v in by.items()} for kind, by in results.items()}
    copy_speedup = med["copy"][False] / med["copy"][True]
    mixed_ratio = med["mixed"][True] / med["mixed"][False]
    equal = outputs[False] == outputs[True]
    mean_acceptance = acceptance["mean_acceptance_length"] or 0.0
    accepted, drafted = acceptance["accepted"], acceptance["drafted"]
    print(f"P21 {Path(args.model).name}, ngram K={args.tokens}, {args.rounds} round(s): copy single stream "
          f"{med['copy'][False]:.2f} -> {med['copy'][True]:.2f} ms/token ({copy_speedup:.2f}x faster), "
          f"mean acceptance length {mean_acceptance:.2f} ({accepted:.0f} of {drafted:.0f} drafts accepted); "
          f"mixed x{args.streams} {med['mixed'][False]:.0f} -> {med['mixed'][True]:.0f} tok/s ({mixed_ratio:.2f}x); "
          f"greedy tokens equal with and without: {equal}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "copy_ms_per_token": {str(k): v for k, v in results["copy"].items()},
        "mixed_tokens_per_s": {str(k): v for k, v in results["mixed"].items()},
        "copy_speedup": copy_speedup, "mixed_ratio": mixed_ratio, "mean_acceptance_length": mean_acceptance,
        "drafts": drafted, "accepted": accepted, "greedy_equal": equal}, indent=2))
    print(f"summary: {args.out}", file=sys.stderr)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
