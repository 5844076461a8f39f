"""P10: two replicas behind the SGLang Model Gateway, cache_aware against
round_robin, on a shared-prefix workload with more distinct prefixes than
one replica's KV pool holds.

    python -m bench.replicas --model assets/models/stories260K --rounds 2

Each policy gets fresh replicas (empty prefix caches). The prompts are text
(the router refuses token ids): random token ids decoded with the model's
tokenizer, so prompts sharing a prefix share its text. Reports, per policy
and round, the cached share of prompt tokens, output throughput and TTFT
p50/p99, measured by the bench client through the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from bench import workloads as wl
from bench.common import decoded_prompts, vocab_size_for
from bench.openai_client import run_openai_requests
from bench.report import summarize
from llmsched.assets import STORIES260K
from llmsched.router import Router, launch_replicas


def multi_prefix_workload(num_prefixes: int, per_prefix: int, prefix_len: int, suffix_len: int, output_len: int,
                          vocab_size: int, seed: int) -> list[wl.BenchRequest]:
    """num_prefixes x per_prefix requests, each a prefix plus its own
    suffix, in a seeded random order."""
    rng = random.Random(seed)
    prefixes = [wl.random_token_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    pairs = [(p, wl.random_token_ids(rng, suffix_len, vocab_size)) for p in range(num_prefixes)
             for _ in range(per_prefix)]
    rng.shuffle(pairs)
    return [wl.BenchRequest(i, output_len, prompt_token_ids=prefixes[p] + suffix) for i, (p, suffix) in enumerate(pairs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(STORIES260K))
    p.add_argument("--num-prefixes", type=int, default=12)
    p.add_argument("--per-prefix", type=int, default=8)
    # Random ids decoded to text re-tokenize to ~1.7x as many tokens
    # (stories260K): 128 + 16 ids become ~250 prompt tokens, within 512.
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=160,
                   help="KV blocks per replica (16 tokens each): fewer than all prefixes plus the running requests need")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    requests = multi_prefix_workload(args.num_prefixes, args.per_prefix, args.prefix_len, args.suffix_len,
                                     args.output_len, vocab_size_for(args.model, None), args.seed)
    texts = decoded_prompts(requests, args.model)
    model = Path(args.model).name
    print(f"P10: {len(requests)} requests over {args.num_prefixes} prefixes of {args.prefix_len} token ids "
          f"(as text); {args.kv_blocks} KV blocks per replica", file=sys.stderr)
    rows = []
    for r in range(args.rounds):
        policies = ("cache_aware", "round_robin") if r % 2 == 0 else ("round_robin", "cache_aware")
        for policy in policies:
            replicas = launch_replicas(2, {"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": "1",
                                           "EXECUTOR_NUM_KV_BLOCKS": str(args.kv_blocks)},
                                       stdout=open("/dev/null", "w"))
            router = None
            try:
                router = Router([s.gateway_url for s in replicas], policy=policy).start()
                run = asyncio.run(run_openai_requests(router.url, model, requests, prompt_texts=texts,
                                                      max_concurrency=args.max_concurrency, show_progress=False,
                                                      tag=f"{policy}-{r}"))
            finally:
                if router is not None:
                    router.stop()
                for s in replicas:
                    s.stop()
            s = summarize(run)
            row = {"round": r, "policy": policy, "completed": s["completed"], "failed": s["failed"],
                   "cached_prompt_fraction": s["cached_prompt_fraction"], "output_throughput": s["output_throughput"],
                   "mean_prompt_tokens": s["total_prompt_tokens"] / max(1, s["completed"]),
                   "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"]}
            rows.append(row)
            print(f"round {r} {policy:11s}: cached {row['cached_prompt_fraction']:.1%}, "
                  f"{row['output_throughput']:.1f} output tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                  f"p99 {row['ttft_p99_ms']:.0f} ms, {row['completed']}/{len(requests)} completed "
                  f"(mean prompt {row['mean_prompt_tokens']:.0f} tokens)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
