"""P22: what EXECUTOR_BATCH_INVARIANT=on costs, against off, in the same run,
through the real services.

    python -m bench.batch_invariant                  # stories260K, 64 streams, 5 rounds
    python -m bench.batch_invariant --rounds 7 --model bench-small

Two stacks serve the same checkpoint, one with the mode on and one
without, started together. Each round runs the same --streams requests
(the mixed workload's laws scaled to stories260K's 512 positions, greedy,
all sent at once) on both, in alternating order so that neither always
meets a warmer or busier machine. The figure is output tokens per second;
the report gives each side's median and the ratio of the medians (on /
off), which the issue wants at 0.85 or more.

It also says whether each stack gave every request the same tokens in
every round: the mode's promise is that it does, whatever the arrival
timing did to the batches; without it, a round may differ.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from bench.speculative import STORIES, Stack, run_mixed
from bench.stack_pair import round_order, start_pair, stop_pair
from bench.workloads import MIXED_OUTPUT, MIXED_PROMPT, mixed
from llmsched.launch import launch

REPO = Path(__file__).resolve().parents[1]
NAMES = {False: "off", True: "on"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64, help="requests sent at once")
    p.add_argument("--max-len", type=int, default=512, help="the model's positions, to scale the lengths to")
    p.add_argument("--num-threads", type=int, default=1, help="EXECUTOR_NUM_THREADS of each stack")
    p.add_argument("--executor-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an executor setting for both stacks (repeatable), e.g. EXECUTOR_ATTENTION_BACKEND=triton")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "p22_batch_invariant.json")
    args = p.parse_args(argv)

    common = {"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads),
              **dict(pair.split("=", 1) for pair in args.executor_env)}
    pair = {on: launch(executor_env={**common, "EXECUTOR_BATCH_INVARIANT": NAMES[on]},
                       scheduler_env={"SCHEDULER_MAX_QUEUE_DELAY_MS": "0"}) for on in (False, True)}
    start_pair(pair)
    stacks = {on: Stack(services) for on, services in pair.items()}
    scale = args.max_len / 2048
    work = mixed(args.streams, 512, seed=0, prompt=MIXED_PROMPT.scaled(scale), output=MIXED_OUTPUT.scaled(2 * scale))
    requests = [(r.prompt_token_ids, r.max_tokens) for r in work.requests]
    random.Random(0).shuffle(requests)
    tps: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[list[int]]]] = {False: [], True: []}
    try:
        for r in range(args.rounds):
            for on in round_order(r):
                rate, out = run_mixed(stacks[on], requests)
                tps[on].append(rate)
                outputs[on].append(out)
                print(f"round {r} mode {NAMES[on]}: x{args.streams} {rate:.0f} tok/s", file=sys.stderr, flush=True)
    finally:
        for stack in stacks.values():
            stack.channel.close()
        stop_pair(pair)

    med = {on: statistics.median(v) for on, v in tps.items()}
    ratio = med[True] / med[False]
    # Requests whose tokens were the same in every round, per stack.
    stable = {on: sum(all(rnd[i] == runs[0][i] for rnd in runs) for i in range(len(requests)))
              for on, runs in outputs.items()}
    same_as_off = sum(a == b for a, b in zip(outputs[True][0], outputs[False][0]))
    print(f"P22 {Path(args.model).name}, x{args.streams} streams, {args.rounds} rounds: mode off "
          f"{med[False]:.0f} tok/s, on {med[True]:.0f} tok/s ({ratio:.2f}x); per-round ratios "
          + ", ".join(f"{b / a:.2f}" for a, b in zip(tps[False], tps[True]))
          + f"; requests with the same tokens in every round: on {stable[True]}/{len(requests)}, "
          f"off {stable[False]}/{len(requests)}; on's tokens equal to off's: {same_as_off}/{len(requests)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tokens_per_s": {NAMES[on]: v for on, v in tps.items()}, "median_ratio": ratio,
        "stable_requests": {NAMES[on]: v for on, v in stable.items()}, "on_equal_to_off": same_as_off}, indent=2))
    print(f"summary: {args.out}", file=sys.stderr)
    # The mode's promise, through the whole stack: the same tokens every round.
    return 0 if stable[True] == len(requests) else 1


if __name__ == "__main__":
    raise SystemExit(main())
