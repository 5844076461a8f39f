"""P14: throughput with part of the streams constrained by a JSON Schema,
against the same run with none constrained, alternating on one set of
services, so both see the same machine at the same time.

    python -m bench.structured --model bench-small --num-requests 64 --fraction 0.5 --rounds 3

Every request is greedy with ignore_eos, so it generates exactly its
max_tokens in both runs (checked): a constrained request's EOS is masked
while its grammar allows anything else, and the schema (an array of at
least 100,000 records) cannot end sooner. Each run checks its outputs: a constrained one must be a
valid prefix of the schema's language (an llguidance matcher accepts every
token), and an unconstrained one must equal the same request's output in
the unconstrained run. Reports the median output throughput of each, their
ratio, and from the executor's metrics the mask cost per constrained row
and per step, and how long steps waited for their masks after the forward.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from llguidance import LLMatcher

from bench import workloads as wl
from bench.client import run_requests
from bench.common import vocab_size_for
from bench.report import summarize
from bench.server_metrics import scrape
from llmsched.launch import launch
from llmsched.llguidance_tokenizer import make_tokenizer
from llmsched.v1 import scheduler_pb2 as spb

# Records of a few kinds of field, as an agent's tool output might hold;
# so many of them that no request reaches the end of the array (both runs
# then generate every request's max_tokens: equal work).
SCHEMA = {
    "type": "array",
    "minItems": 100_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "kind": {"enum": ["order", "refund", "query", "complaint"]},
            "amount": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "urgent": {"type": "boolean"},
        },
        "required": ["id", "kind", "amount", "tags", "urgent"],
        "additionalProperties": False,
    },
}
MASK_METRICS = ("llmsched_executor_constraint_mask_seconds_sum", "llmsched_executor_constraint_mask_seconds_count",
                "llmsched_executor_constraint_mask_rows_total", "llmsched_executor_constraint_mask_wait_seconds_total")


def constrained(work: wl.Workload, fraction: float) -> list[wl.BenchRequest]:
    """The same requests, every k-th one constrained so that `fraction` of
    them are, spread evenly."""
    structured = spb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    n = len(work.requests)
    chosen = {round(i / fraction) for i in range(round(n * fraction))} if fraction > 0 else set()
    return [dataclasses.replace(r, structured=structured if r.index in chosen else None) for r in work.requests]


def check(run, requests: list[wl.BenchRequest], tokenizer, grammar: str, plain_outputs: dict[int, list[int]] | None):
    """Raises when a constrained output leaves its grammar or an unconstrained
    one differs from the unconstrained run's."""
    for req, res in zip(requests, run.results):
        if not res.ok:
            raise SystemExit(f"request {req.index} failed: {res.error}")
        if len(res.output_ids) != req.max_tokens:
            raise SystemExit(f"request {req.index} generated {len(res.output_ids)} tokens, not {req.max_tokens}: "
                             "the runs would not compare equal work")
        if req.structured is not None:
            m = LLMatcher(tokenizer, grammar)
            if not m.consume_tokens(res.output_ids):
                raise SystemExit(f"request {req.index}: its output leaves the schema: {m.get_error()}")
        elif plain_outputs is not None and res.output_ids != plain_outputs[req.index]:
            raise SystemExit(f"request {req.index}: unconstrained output differs beside constrained ones")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-small")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.5, help="share of the requests constrained")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--len-scale", type=float, default=1.0, help="scale prompt and output lengths (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("bench_results/p14_structured.json"))
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error("--fraction must be in (0, 1]")

    vocab = vocab_size_for(args.model, None)
    work = wl.mixed(args.num_requests, vocab, args.seed, wl.MIXED_PROMPT.scaled(args.len_scale),
                    wl.MIXED_OUTPUT.scaled(args.len_scale))
    mixed = constrained(work, args.fraction)
    services = launch(executor_env={"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads)},
                      scheduler_env={"SCHEDULER_ENABLE_PREFIX_CACHING": "false", "SCHEDULER_MAX_QUEUE_DELAY_MS": "0"})
    rounds: list[dict] = []
    try:
        services.start()
        tokenizer = _tokenizer(args.model, vocab)
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        warm = wl.warmup_requests(work.requests[:8], vocab, args.seed)
        asyncio.run(run_requests(services.scheduler_address, constrained(wl.Workload("warm", warm, {}), 0.5),
                                 tag="warm", show_progress=False))
        plain_outputs: dict[int, list[int]] | None = None
        for r in range(args.rounds):
            # Alternate which goes first, so neither always runs on a warmer machine.
            for kind in ("plain", "constrained") if r % 2 == 0 else ("constrained", "plain"):
                requests = work.requests if kind == "plain" else mixed
                before = scrape(services.executor_metrics_port)
                run = asyncio.run(run_requests(services.scheduler_address, requests, tag=f"{kind[0]}{r}",
                                               show_progress=False))
                after = scrape(services.executor_metrics_port)
                if kind == "plain":
                    check(run, requests, tokenizer, grammar, None)
                    plain_outputs = plain_outputs or {q.index: res.output_ids for q, res in zip(requests, run.results)}
                s = summarize(run)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in MASK_METRICS}
                rounds.append({"round": r, "kind": kind, "output_throughput": s["output_throughput"],
                               "completed": s["completed"], "output_tokens": s["total_output_tokens"],
                               "duration_s": s["duration_s"], **delta, "_run": run, "_requests": requests})
                print(f"round {r} {kind:11s}: {s['output_throughput']:8.1f} output tok/s, "
                      f"{s['completed']}/{len(requests)} completed", file=sys.stderr, flush=True)
        for x in rounds:  # every unconstrained output is checked against the plain run's
            if x["kind"] == "constrained":
                check(x["_run"], x["_requests"], tokenizer, grammar, plain_outputs)
    finally:
        services.stop()
    for x in rounds:
        del x["_run"], x["_requests"]
    med = {k: statistics.median(x["output_throughput"] for x in rounds if x["kind"] == k)
           for k in ("plain", "constrained")}
    masked = [x for x in rounds if x["kind"] == "constrained"]
    seconds = sum(x["llmsched_executor_constraint_mask_seconds_sum"] for x in masked)
    steps = sum(x["llmsched_executor_constraint_mask_seconds_count"] for x in masked)
    rows = sum(x["llmsched_executor_constraint_mask_rows_total"] for x in masked)
    wait = sum(x["llmsched_executor_constraint_mask_wait_seconds_total"] for x in masked)
    summary = {
        "model": args.model, "num_requests": args.num_requests, "fraction": args.fraction, "rounds": rounds,
        "median_output_throughput": med, "ratio": med["constrained"] / med["plain"],
        "mask_us_per_row": 1e6 * seconds / rows if rows else None,
        "mask_us_per_step": 1e6 * seconds / steps if steps else None,
        "mask_wait_us_per_step": 1e6 * wait / steps if steps else None,
    }
    print(f"P14 {args.model}, mixed x{args.num_requests}, {args.fraction:.0%} constrained by a JSON Schema, "
          f"{args.rounds} rounds: median output throughput {med['plain']:.1f} tok/s unconstrained, "
          f"{med['constrained']:.1f} constrained: {summary['ratio']:.2f}x")
    if rows:
        print(f"masks: {summary['mask_us_per_row']:.0f} us per constrained row, {summary['mask_us_per_step']:.0f} us "
              f"per step (on a worker thread beside the forward); steps waited {summary['mask_wait_us_per_step']:.0f} "
              "us each for them after the forward")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"report: {args.out}")
    return 0


def _tokenizer(model: str, vocab: int):
    """llguidance's tokenizer for the served model, as the executor builds it."""
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.families import read_config

    ckpt = load_checkpoint(model)
    eos = read_config(ckpt.hf_config, ckpt.generation_config).eos_token_ids
    return make_tokenizer(ckpt.tokenizer_json, vocab, list(eos))


if __name__ == "__main__":
    raise SystemExit(main())
