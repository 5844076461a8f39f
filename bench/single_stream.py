"""P12: single-stream time per output token, against HF `generate` on the
same weights, measured in the same run (docs/performance.md, P12).

    python -m bench.single_stream                      # stories260K, 200 greedy tokens
    python -m bench.single_stream --model bench-small --repeats 3

Ours: both services are launched (one torch thread for the executor), one
greedy request streams `--tokens` tokens with ignore_eos; time per output
token is (last token's arrival - first token's arrival) / (tokens - 1), so
the prefill is left out. It runs once per SCHEDULER_MAX_PLANS_IN_FLIGHT
and EXECUTOR_TORCH_COMPILE value given (and SCHEDULER_MULTI_STEP_DECODE
with --multi-step; without it, the scheduler's default). HF: `generate` with max_new_tokens
= tokens on the same prompt (one thread, KV cache on), timed the same way:
a stopping criterion stamps each token as it is produced, and time per
token = (last stamp - first stamp) / (tokens - 1). (Subtracting a separate
one-token run's time, as before, went negative on a contended host.) The
greedy tokens of both sides are compared. Medians over --repeats runs; the
JSON report goes to bench_results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import grpc

from llmsched.assets import STORIES260K
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

DEFAULT_MODEL = str(STORIES260K)
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260K's tokenizer; any ids work


def ours_per_token_ms(model: str, in_flight: int, torch_compile: str, tokens: int, repeats: int,
                      threads: int, multi_step: int | None = None,
                      step_socket: str | None = None) -> tuple[list[float], list[int], float]:
    """(ms/token of each run, the last run's tokens, the executor's mean
    idle time between steps in µs, from its own counters)."""
    from bench.server_metrics import scrape
    from llmsched.launch import launch

    services = launch(
        executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": str(threads),
                      "EXECUTOR_TORCH_COMPILE": torch_compile},
        scheduler_env={"SCHEDULER_MAX_PLANS_IN_FLIGHT": str(in_flight),
                       **({} if multi_step is None else {"SCHEDULER_MULTI_STEP_DECODE": str(multi_step)}),
                       **({} if step_socket is None else {"SCHEDULER_EXECUTOR_STEP_SOCKET": step_socket})},
    ).start()
    try:
        before = scrape(services.executor_metrics_port)
        times, out = stream_per_token_ms(services.scheduler_address, tokens, repeats)
        after = scrape(services.executor_metrics_port)
        idle, plans = (after.get(k, 0.0) - before.get(k, 0.0) for k in (
            "llmsched_executor_idle_between_steps_seconds_total", "llmsched_executor_forward_seconds_count"))
        return times, out, idle * 1e6 / max(plans, 1)
    finally:
        services.stop()


def stream_per_token_ms(address: str, tokens: int, repeats: int) -> tuple[list[float], list[int]]:
    """(ms/token of each measured run, the last run's greedy tokens): one
    greedy stream of PROMPT at a time through the scheduler at address,
    repeats + 1 times (the first warms both processes up); prefill is left
    out by timing from the first token's arrival to the last's."""
    with grpc.insecure_channel(address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        req = spb.GenerateRequest(prompt_token_ids=PROMPT, sampling=spb.SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True))
        times, out = [], []
        for i in range(repeats + 1):
            ids, first, last = [], None, None
            for resp in stub.Generate(req, timeout=600):
                now = time.perf_counter()
                if resp.token_ids:
                    first = first or now
                    last = now
                ids += resp.token_ids
            if i:
                times.append((last - first) * 1000 / (len(ids) - 1))
            out = ids
        return times, out


def hf_per_token_ms(model: str, tokens: int, repeats: int, threads: int) -> tuple[list[float], list[int]]:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from bench.baselines import load_hf_model

    hf = load_hf_model(model, threads).model
    ids = torch.tensor([PROMPT])

    class Stamps(StoppingCriteria):
        """Records when each new token is produced; never stops generation."""

        def __init__(self) -> None:
            self.at: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.at.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run() -> tuple[float, list[int]]:
        stamps = Stamps()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamps]))
        assert len(stamps.at) == tokens, f"{len(stamps.at)} stamps for {tokens} tokens"
        return (stamps.at[-1] - stamps.at[0]) * 1000 / (tokens - 1), out[0, len(PROMPT):].tolist()

    run()  # warm-up
    times, out = [], []
    for _ in range(repeats):
        ms, out = run()
        times.append(ms)
    return times, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.single_stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--plans-in-flight", type=int, action="append", default=None,
                   help="SCHEDULER_MAX_PLANS_IN_FLIGHT values to run (default: 1 and 2)")
    p.add_argument("--torch-compile", choices=["off", "on"], action="append", default=None,
                   help="EXECUTOR_TORCH_COMPILE values to run (default: off and on)")
    p.add_argument("--multi-step", type=int, action="append", default=None,
                   help="SCHEDULER_MULTI_STEP_DECODE values to run (default: the scheduler's default)")
    p.add_argument("--step-socket", choices=["auto", "off"], action="append", default=None,
                   help="SCHEDULER_EXECUTOR_STEP_SOCKET values to run (default: the scheduler's default)")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "single_stream.json")
    args = p.parse_args(argv)
    configs = [(k, c, m, sock) for c in args.torch_compile or ["off", "on"] for k in args.plans_in_flight or [1, 2]
               for m in args.multi_step or [None] for sock in args.step_socket or [None]]

    hf_times, hf_tokens = hf_per_token_ms(args.model, args.tokens, args.repeats, args.num_threads)
    hf_ms = statistics.median(hf_times)
    report = {"model": args.model, "tokens": args.tokens, "repeats": args.repeats,
              "hf_generate_ms_per_token": hf_ms, "hf_runs_ms": hf_times, "ours": {}}
    print(f"P12 single stream, {args.tokens} greedy tokens, {Path(args.model).name}, medians of {args.repeats}")
    print(f"{'':58} {'ms/token':>9} {'vs HF generate':>15} {'executor idle/plan':>19}")
    print(f"{'HF generate':58} {hf_ms:9.3f} {'1.00x':>15}")
    mismatch = False
    for k, compiled, multi, sock in configs:
        times, tokens, idle_us = ours_per_token_ms(args.model, k, compiled, args.tokens, args.repeats,
                                                   args.num_threads, multi, sock)
        ms = statistics.median(times)
        same = tokens == hf_tokens
        mismatch |= not same
        key = (f"{k}-in-flight-compile-{compiled}" + (f"-multi-step-{multi}" if multi else "")
               + (f"-step-socket-{sock}" if sock else ""))
        report["ours"][key] = {
            "plans_in_flight": k, "torch_compile": compiled, "multi_step": multi, "step_socket": sock,
            "ms_per_token": ms, "runs_ms": times, "ratio_to_hf": ms / hf_ms, "tokens_equal_hf": same,
            "executor_idle_us_per_plan": idle_us}
        label = f"llmsched, {k} plan{'s' if k > 1 else ''} in flight, compile {compiled}" + (
            f", multi-step {multi}" if multi else "") + (f", step socket {sock}" if sock else "")
        print(f"{label:58} {ms:9.3f} {ms / hf_ms:14.2f}x {idle_us:16.0f} µs"
              f"{'' if same else '  (tokens differ from HF!)'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
