"""CPU decode attention of the torch backend against dense SDPA (issue #11, item 4).

    python -m bench.attention [--contexts 512 2048 8192] [--rounds 5] [--no-step] [--out PATH]

* Decode attention, one layer: 256 requests, each one query token over ``context``
  cached tokens in scattered 16-token blocks. Three implementations, timed in
  interleaved rounds (medians), one torch thread:
  - ``ours``: TorchAttentionBackend.attend, with fresh step metadata every call (so
    its once-per-step planning is counted in full against a single layer);
  - ``dense``: ``F.scaled_dot_product_attention`` on the same K/V already contiguous
    per request, ``[256, kv_heads, context, head_dim]`` with GQA: what torch does
    when nothing is paged, the reference for this hardware;
  - ``gather``: the backend as it was before #11 (every layer gathers each decode
    group's blocks into a padded copy and masks), kept below as the baseline.
  Shapes: stories260K's attention (8 heads, 4 KV heads, head_dim 8) and
  bench-small's (8 heads, 4 KV heads, head_dim 32).
* Step: one whole decode step of stories260K through the ModelRunner, 256 requests
  x 8K context, with the gather backend and with ours (``--no-step`` skips it; it
  needs about 3 GB for the KV cache).

Prints a table and writes JSON (default bench_results/attention.json). Speed
figures are ratios against ``dense`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from llmsched.assets import STORIES260K

BLOCK_SIZE = 16
SHAPES = {  # name: (num_heads, num_kv_heads, head_dim)
    "stories260K": (8, 4, 8),
    "bench-small": (8, 4, 32),
}
STORIES = STORIES260K


class GatherBackend(TorchAttentionBackend):
    """The torch backend's decode path before #11, for comparison: decodes
    sorted by length in groups of 32, each group's blocks gathered into a
    fresh padded copy on every layer, with a padding mask."""

    name = "gather"
    group = 32

    def attend(self, query, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None, k_scale=1.0,
               v_scale=1.0):
        assert sliding_window is None and softcap is None, "the old backend had neither"
        assert k_cache.dtype == query.dtype, "nor an FP8 cache"
        assert all(q == 1 for q in meta.query_lens_host), "only the old decode path is kept here"
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        order = sorted(range(meta.num_reqs), key=meta.seq_lens_host.__getitem__)
        for g in range(0, len(order), self.group):
            reqs = torch.tensor(order[g : g + self.group], dtype=torch.long)  # decode r is row r
            max_seq = meta.seq_lens_host[order[min(g + self.group, len(order)) - 1]]
            tables = meta.block_tables[reqs, : -(-max_seq // block_size)]  # [n, nb]
            # index_select of whole blocks into a fresh [n, max_seq, kvh, d] copy
            k = k_cache.index_select(0, tables.reshape(-1)).view(len(reqs), -1, *k_cache.shape[2:])[:, :max_seq]
            v = v_cache.index_select(0, tables.reshape(-1)).view(len(reqs), -1, *v_cache.shape[2:])[:, :max_seq]
            mask = torch.arange(max_seq)[None, :] < meta.seq_lens[reqs].long()[:, None]  # [n, max_seq]
            out[reqs] = F.scaled_dot_product_attention(
                query[reqs].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
            ).squeeze(2)
        return out


@dataclass
class AttentionRow:
    shape: str
    num_reqs: int
    context: int
    ours_ms: float
    dense_ms: float
    gather_ms: float
    ours_vs_dense: float  # ours / dense: 1.0 means as fast as unpaged SDPA
    gather_vs_dense: float
    max_abs_err: float  # ours against dense


@dataclass
class StepRow:
    model: str
    num_reqs: int
    context: int
    gather_ms: float  # one decode step through the ModelRunner, wall time
    ours_ms: float
    speedup: float
    gather_forward_ms: float  # of which the model's forward pass (StepResult.forward_ns)
    ours_forward_ms: float
    forward_speedup: float


def decode_metadata(block_tables: torch.Tensor, context: int) -> AttentionMetadata:
    """A step of block_tables.shape[0] decodes, each at position context - 1."""
    n = block_tables.shape[0]
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),  # unused by attend
        cu_query_lens=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.full((n,), context, dtype=torch.int32),
        block_tables=block_tables,
        query_lens_host=[1] * n,
        seq_lens_host=[context] * n,
    )


def timed_rounds(impls: dict, rounds: int) -> dict[str, float]:
    """Median ms per implementation, interleaved round by round so that load
    from other processes falls on all of them alike."""
    for f in impls.values():
        f()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, f in impls.items():
            t = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_attention(shape: str, num_reqs: int, context: int, rounds: int, seed: int = 0) -> AttentionRow:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = math.ceil(context / BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req
    # Dense K/V, [num_reqs, kvh, context, d], and the same tokens in scattered blocks.
    k = torch.randn(num_reqs, num_kv_heads, context, head_dim, generator=g)
    v = torch.randn(num_reqs, num_kv_heads, context, head_dim, generator=g)
    block_tables = torch.randperm(num_blocks, generator=g).view(num_reqs, blocks_per_req).to(torch.int32)

    def paged(dense: torch.Tensor) -> torch.Tensor:  # -> [num_blocks, block_size, kvh, d]
        cache = dense.new_empty(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        tokens = F.pad(dense.transpose(1, 2), (0, 0, 0, 0, 0, blocks_per_req * BLOCK_SIZE - context))
        blocks = tokens.reshape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        cache[block_tables.flatten().long()] = blocks
        return cache

    k_cache, v_cache = paged(k), paged(v)
    query = torch.randn(num_reqs, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    ours, gather = TorchAttentionBackend(), GatherBackend()
    q_dense = query.unsqueeze(2)  # [num_reqs, h, 1, d]

    impls = {
        "ours": lambda: ours.attend(query, k_cache, v_cache, decode_metadata(block_tables, context), scale),
        "dense": lambda: F.scaled_dot_product_attention(q_dense, k, v, scale=scale, enable_gqa=True),
        "gather": lambda: gather.attend(query, k_cache, v_cache, decode_metadata(block_tables, context), scale),
    }
    err = (impls["ours"]() - impls["dense"]().squeeze(2)).abs().max().item()
    ms = timed_rounds(impls, rounds)
    return AttentionRow(
        shape, num_reqs, context, ms["ours"], ms["dense"], ms["gather"],
        ms["ours"] / ms["dense"], ms["gather"] / ms["dense"], err,
    )


def bench_step(num_reqs: int, context: int, rounds: int, model_path: Path = STORIES) -> StepRow:
    """One decode step of num_reqs requests at context tokens through the ModelRunner."""
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.step.kv_cache import KVCachePool
    from executor_svc.model.families import build_model, read_config
    from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
    from executor_svc.step.sampler import SamplingSettings

    ckpt = load_checkpoint(str(model_path))
    cfg = read_config(ckpt.hf_config)
    cpu = torch.device("cpu")
    model = build_model(cfg, ckpt.state_dict, context + 1, cpu, torch.float32)
    blocks_per_req = math.ceil(context / BLOCK_SIZE)
    pool = KVCachePool(cfg, num_reqs * blocks_per_req, BLOCK_SIZE, cpu, torch.float32)
    pool.storage.normal_()  # stands for the context's K/V
    runner = ModelRunner(model, pool, TorchAttentionBackend(), cpu)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (num_reqs, context), generator=g).tolist()
    tables = torch.randperm(num_reqs * blocks_per_req, generator=g).view(num_reqs, blocks_per_req).tolist()
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    step_id = 0

    def step() -> None:
        # Every request arrives with context - 1 tokens computed: the step decodes one
        # token each. The previous step's requests finish first, so the state is fresh.
        nonlocal step_id
        plan = StepPlan(step_id, finished_handles=list(range(num_reqs)), new_requests=[
            NewRequestData(h, tokens[h], tables[h], context - 1, 1, greedy, 0) for h in range(num_reqs)
        ])
        step_id += 1
        return runner.execute(plan)

    forward_ms: dict[str, list[float]] = {"gather": [], "ours": []}

    def with_backend(name, backend):
        def run() -> None:
            runner.backend = backend
            forward_ms[name].append(step().forward_ns / 1e6)
        return run

    impls = {"gather": with_backend("gather", GatherBackend()), "ours": with_backend("ours", TorchAttentionBackend())}
    ms = timed_rounds(impls, rounds)
    fwd = {name: statistics.median(ts[1:]) for name, ts in forward_ms.items()}  # [0] is the warm-up
    return StepRow(
        "stories260K", num_reqs, context, ms["gather"], ms["ours"], ms["gather"] / ms["ours"],
        fwd["gather"], fwd["ours"], fwd["gather"] / fwd["ours"],
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-reqs", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per point (median reported)")
    p.add_argument("--step-context", type=int, default=8192, help="context of the ModelRunner step")
    p.add_argument("--no-step", action="store_true", help="skip the ModelRunner step")
    p.add_argument("--model-path", type=Path, default=STORIES, help="stories260K (assets/models)")
    p.add_argument("--out", type=Path, default=Path("bench_results/attention.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    rows = []
    print(f"decode attention, {args.num_reqs} requests, block {BLOCK_SIZE}, 1 thread, medians of {args.rounds}")
    print(f"{'shape':12s} {'context':>7s} {'ours ms':>9s} {'dense ms':>9s} {'ours/dense':>10s} "
          f"{'gather ms':>10s} {'gather/dense':>12s}")
    for shape in args.shapes:
        for context in args.contexts:
            r = bench_attention(shape, args.num_reqs, context, args.rounds)
            rows.append(r)
            print(f"{r.shape:12s} {r.context:7d} {r.ours_ms:9.1f} {r.dense_ms:9.1f} {r.ours_vs_dense:9.2f}x "
                  f"{r.gather_ms:10.1f} {r.gather_vs_dense:11.2f}x", flush=True)
    step = None
    if not args.no_step:
        step = bench_step(args.num_reqs, args.step_context, max(3, args.rounds // 2), args.model_path)
        print(f"\ndecode step, {step.model}, {step.num_reqs} requests x {step.context} context, ModelRunner: "
              f"gather {step.gather_ms:.0f} ms, ours {step.ours_ms:.0f} ms ({step.speedup:.2f}x faster); "
              f"forward pass alone {step.gather_forward_ms:.0f} vs {step.ours_forward_ms:.0f} ms "
              f"({step.forward_speedup:.2f}x)")
    report = {
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "block_size": BLOCK_SIZE,
        "rounds": args.rounds,
        "attention": [asdict(r) for r in rows],
        "step": asdict(step) if step else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
