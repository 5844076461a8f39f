"""P11: the executor's host time per decode step, and sampling on its own.

The model runner alone, driven by synthetic plans: N requests all decoding
at a given context length, one token each per step, block size 16, their
lengths staggered so about N/16 of them take a new block every step (as in
a real decode). The model is replaced by a stand-in whose forward returns
at once and whose logits are real stories260K next-token distributions, so
the figure is everything but the forward pass: applying the plan, building
the step's inputs, sampling and building the result (the runner's
prepare_ns + sample_ns).

Sampling on its own: 256 rows at temperature 0.8, top-p 0.9, each with its
own seed, on the same logits (vocabulary of stories260K, 512).

    python -m bench.executor_cost [--requests 256] [--contexts 512 2048 8192] [--steps 200]

Works against older runners with the same StepPlan/StepResult shapes, so
another commit's executor_svc can be measured with this same bench, run
from that copy's directory (python -m puts the current directory first):

    git archive main executor_svc | tar -x -C /tmp/old
    cd /tmp/old && PYTHONPATH=/tmp/old:REPO python -m bench.executor_cost --out REPO/bench_results/...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

from executor_svc.step import sampler as sampler_mod
from executor_svc.attention import TorchAttentionBackend
from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from llmsched.assets import STORIES260K

BLOCK_SIZE = 16
STORIES = STORIES260K
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, she saw a big red ball under a tree. She wanted to play with it, but it was too high. "
        "Her mom said, \"Let's ask the man for help.\" The man was kind and gave Lily the ball. ")

GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)


def sampled_settings(i: int) -> SamplingSettings:
    return SamplingSettings(temperature=0.8, top_p=0.9, top_k=0, seed=1000 + i, logprobs=0)


def real_logits(rows: int) -> torch.Tensor:
    """[rows, vocab] next-token logits of stories260K over a short story, or
    random logits of the same vocabulary size when the checkpoint is absent."""
    if not STORIES.is_dir():
        return torch.randn(rows, 512, generator=torch.Generator().manual_seed(0)) * 4
    from tokenizers import Tokenizer

    from executor_svc.attention import AttentionMetadata
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.step.kv_cache import KVCachePool
    from executor_svc.model.families import build_model, read_config

    ckpt = load_checkpoint(str(STORIES))
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    ids = Tokenizer.from_str(ckpt.tokenizer_json).encode(TEXT * 8).ids[: min(rows, cfg.max_position_embeddings)]
    n = len(ids)
    pool = KVCachePool(cfg, -(-n // BLOCK_SIZE), BLOCK_SIZE, torch.device("cpu"), torch.float32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), cu_query_lens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(pool.num_blocks, dtype=torch.int32)[None], query_lens_host=[n], seq_lens_host=[n],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), pool.layer_caches(), meta, TorchAttentionBackend())
        logits = model.compute_logits(hidden)  # [n, vocab]
    return logits.repeat(-(-rows // n), 1)[:rows].contiguous()


class StandInModel(nn.Module):
    """The runner's model interface with no compute: forward returns at
    once, compute_logits hands out real logits rows."""

    def __init__(self, logits: torch.Tensor, max_len: int):
        super().__init__()
        self.logits = logits  # [rows, vocab]
        self.cfg = type("Cfg", (), {"vocab_size": logits.shape[1]})()
        # Where runners read max_model_len from: max_len (multi-family
        # models) or the RoPE table's length (the Llama-only model before).
        self.max_len = max_len
        self.register_buffer("rope_cos", torch.empty(max_len, 0), persistent=False)

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        return torch.empty(input_ids.shape[0], 0)  # [num_tokens, 0]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]  # [num_sampled, vocab]


class NoCache:
    block_size = BLOCK_SIZE

    def layer_caches(self):
        return []


def make_runner(logits: torch.Tensor, max_len: int) -> ModelRunner:
    return ModelRunner(StandInModel(logits, max_len), NoCache(), TorchAttentionBackend(), torch.device("cpu"))


def decode_steps(logits: torch.Tensor, num_requests: int, context: int, steps: int, warmup: int,
                 sampling) -> list[tuple[int, int, int]]:
    """(prepare_ns, sample_ns, thread CPU ns of the whole execute) of each
    measured decode step. The stand-in forward costs next to nothing, so the
    CPU time is the host cost too, less exposed to other processes on a
    shared machine than wall time."""
    max_len = context + steps + warmup + BLOCK_SIZE + 1
    runner = make_runner(logits, max_len)
    blocks_per_req = -(-max_len // BLOCK_SIZE)
    lengths, blocks = [], []
    new = []
    for i in range(num_requests):
        # Staggered so a sixteenth of the requests cross a block boundary each step.
        n = context - (i % BLOCK_SIZE)
        base = i * blocks_per_req
        blocks.append(-(-n // BLOCK_SIZE))
        lengths.append(n)
        prompt = [3 + (i * 7919 + j) % 500 for j in range(n)]
        new.append(NewRequestData(i, prompt, list(range(base, base + blocks[-1])), n - 1, 1, sampling(i), 0))
    runner.execute(StepPlan(0, new_requests=new))
    handles = list(range(num_requests))
    out = []
    for s in range(1, warmup + steps + 1):
        plan = StepPlan(s, cached_handles=handles, cached_num_scheduled_tokens=[1] * num_requests)
        for i in range(num_requests):
            lengths[i] += 1  # the token sampled last step is computed now
            if lengths[i] > blocks[i] * BLOCK_SIZE:
                plan.new_block_handles.append(i)
                plan.new_block_ids.append(i * blocks_per_req + blocks[i])
                blocks[i] += 1
        c0 = time.thread_time_ns()
        res = runner.execute(plan)
        cpu = time.thread_time_ns() - c0
        assert len(res.sampled_handles) == num_requests
        if s > warmup:
            out.append((res.prepare_ns, res.sample_ns, cpu))
    return out


def sample_once(logits: torch.Tensor, settings: list[SamplingSettings], positions: list[int]):
    if hasattr(sampler_mod, "SamplingBatch"):
        batch = sampler_mod.SamplingBatch.from_settings(settings, positions, vocab_size=logits.shape[1])
        return sampler_mod.sample(logits, batch)
    return sampler_mod.sample(logits, settings, positions)  # the per-row sampler before issue 11


def sampling_times(logits: torch.Tensor, rows: int, reps: int) -> list[tuple[int, int]]:
    """(wall ns, thread CPU ns) of each call."""
    settings = [sampled_settings(i) for i in range(rows)]
    x = logits[:rows]
    times = []
    for r in range(reps + 3):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        sample_once(x, settings, [r] * rows)
        if r >= 3:
            times.append((time.perf_counter_ns() - t0, time.thread_time_ns() - c0))
    return times


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sample-rows", type=int, default=256)
    ap.add_argument("--sample-reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, as the executor runs them")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before/after)")
    ap.add_argument("--out", default="bench_results/executor_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logits = real_logits(max(args.requests, args.sample_rows))

    rows = []
    for mode, sampling in (("greedy", lambda i: GREEDY), ("T0.8 top-p0.9 seeded", sampled_settings)):
        for ctx in args.contexts:
            steps = decode_steps(logits, args.requests, ctx, args.steps, args.warmup, sampling)
            host = [(p + s) / 1e6 for p, s, _ in steps]
            cpu = [c / 1e6 for _, _, c in steps]
            rows.append({
                "sampling": mode, "running": args.requests, "context": ctx, "steps": len(steps),
                "host_ms_median": statistics.median(host), "host_ms_p90": pct(host, 90),
                "prepare_ms_median": statistics.median(p / 1e6 for p, _, _ in steps),
                "sample_ms_median": statistics.median(s / 1e6 for _, s, _ in steps),
                "cpu_ms_median": statistics.median(cpu), "cpu_ms_p90": pct(cpu, 90),
            })
    samp = sampling_times(logits, args.sample_rows, args.sample_reps)
    wall, cpu = [w / 1e6 for w, _ in samp], [c / 1e6 for _, c in samp]
    sampling = {"rows": args.sample_rows, "vocab": logits.shape[1], "temperature": 0.8, "top_p": 0.9, "seeded": True,
                "median_ms": statistics.median(wall), "p90_ms": pct(wall, 90),
                "cpu_median_ms": statistics.median(cpu), "cpu_p90_ms": pct(cpu, 90)}

    print(f"P11 executor host time per decode step ({args.requests} running, block size {BLOCK_SIZE}, "
          f"{args.threads} thread{'s' if args.threads > 1 else ''}){' — ' + args.label if args.label else ''}")
    print("host = prepare_ns + sample_ns (wall); cpu = the step's thread CPU time")
    print(f"{'sampling':>22} {'context':>8} {'host p50':>9} {'host p90':>9} {'prepare':>8} {'sample':>8} "
          f"{'cpu p50':>8} {'cpu p90':>8}   (ms)")
    for r in rows:
        print(f"{r['sampling']:>22} {r['context']:>8} {r['host_ms_median']:>9.3f} {r['host_ms_p90']:>9.3f} "
              f"{r['prepare_ms_median']:>8.3f} {r['sample_ms_median']:>8.3f} {r['cpu_ms_median']:>8.3f} "
              f"{r['cpu_ms_p90']:>8.3f}")
    ratios = {}
    for mode in dict.fromkeys(r["sampling"] for r in rows):
        by_ctx = {r["context"]: r for r in rows if r["sampling"] == mode}
        lo, hi = min(by_ctx), max(by_ctx)
        ratios[mode] = {"host": by_ctx[hi]["host_ms_median"] / by_ctx[lo]["host_ms_median"],
                        "cpu": by_ctx[hi]["cpu_ms_median"] / by_ctx[lo]["cpu_ms_median"]}
        print(f"{mode}: median at {hi} / {lo} context = {ratios[mode]['host']:.2f}x host, "
              f"{ratios[mode]['cpu']:.2f}x cpu")
    print(f"sampling {sampling['rows']} rows (vocab {sampling['vocab']}, T 0.8, top-p 0.9, seeded): "
          f"median {sampling['median_ms']:.3f} ms (p90 {sampling['p90_ms']:.3f}), "
          f"cpu median {sampling['cpu_median_ms']:.3f} ms")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"figure": "P11", "label": args.label, "block_size": BLOCK_SIZE, "threads": args.threads,
                   "host": platform.node(), "decode": rows, "context_ratio": ratios, "sampling": sampling},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
