"""P23: many LoRA adapters on one base model, against the base model alone,
in the same run, through the real services.

    python -m bench.lora                      # stories260K, 8 adapters of rank 16, 64 streams, 5 rounds
    python -m bench.lora --rank 8 --rounds 7

Two stacks serve the same checkpoint (stories260K unless --model says
otherwise), started together: `base` with no adapters, `lora` with
--adapters random PEFT adapters on all seven projections and as many
device slots (EXECUTOR_MAX_LORAS), so that the figure is the cost of
computing the adapters, not of swapping them (the thrash test in
tests/integration/test_lora.py covers fewer slots than adapters). Each
round sends, in alternating order:

- `base`: --streams requests (the mixed workload's laws scaled to the
  model's positions, greedy, all at once) on the stack with no adapters;
- `mixed`: the same requests on the `lora` stack, request i naming adapter
  i mod --adapters;
- `lora-base`: the same requests on the `lora` stack naming no adapter:
  what serving adapters costs the requests that use none.

The figure is output tokens per second; the issue wants `mixed` at 0.7x
`base` or more. The adapters are written by this command with random A
and B (B scaled so that each adapter changes the tokens: PEFT's default B
is zero, which would change nothing and cost nothing worth measuring).

Cold load, per adapter: reading it from disk and checking it (timed here
by the executor's own reader, in this process), and the executor's time to
put it into a device slot (its llmsched_lora_load_seconds counter over the
loads it made, read from the scheduler's metrics).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.server_metrics import scrape
from bench.speculative import Stack, run_mixed
from bench.stack_pair import start_pair, stop_pair
from bench.workloads import MIXED_OUTPUT, MIXED_PROMPT, mixed
from llmsched.launch import launch

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "assets" / "models" / "stories260K"
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
RUNS = ("base", "mixed", "lora-base")


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT adapter (adapter_config.json and adapter_model.safetensors,
    PEFT's key names) on all seven projections of a Llama-shaped model."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
              "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) / rank ** 0.5
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "use_rslora": False,
        "target_modules": list(PROJECTIONS), "lora_dropout": 0.0, "bias": "none"}))


def disk_read_ms(name: str, path: Path, max_rank: int) -> float:
    """The executor's own reader and checks, timed in this process."""
    from executor_svc.model.lora import read_adapter

    started = time.perf_counter()
    read_adapter(name, str(path), max_rank, torch.device("cpu"), torch.float32)
    return (time.perf_counter() - started) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--adapters", type=int, default=8, help="adapters served, each in a device slot of its own")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64, help="requests sent at once")
    p.add_argument("--max-len", type=int, default=512, help="the model's positions, to scale the lengths to")
    p.add_argument("--num-threads", type=int, default=1, help="EXECUTOR_NUM_THREADS of each stack")
    p.add_argument("--executor-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an executor setting for both stacks (repeatable), e.g. EXECUTOR_TORCH_COMPILE=off")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "p23_lora.json")
    args = p.parse_args(argv)

    config = json.loads((Path(args.model) / "config.json").read_text())
    workdir = Path(tempfile.mkdtemp(prefix="llmsched-p23-"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = {name: workdir / name for name in names}
    for i, name in enumerate(names):
        write_adapter(paths[name], config, args.rank, seed=i)
    read_ms = [disk_read_ms(name, paths[name], args.rank) for name in names]

    common = {"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads),
              **dict(pair.split("=", 1) for pair in args.executor_env)}
    lora_env = {"EXECUTOR_LORA_ADAPTERS": ",".join(f"{n}={paths[n]}" for n in names),
                "EXECUTOR_MAX_LORAS": str(args.adapters), "EXECUTOR_MAX_LORA_RANK": str(args.rank)}
    sched = {"SCHEDULER_MAX_QUEUE_DELAY_MS": "0"}
    pair = {False: launch(executor_env=common, scheduler_env=sched),
            True: launch(executor_env={**common, **lora_env}, scheduler_env=sched)}
    start_pair(pair)
    stacks = {lora: Stack(services) for lora, services in pair.items()}
    scale = args.max_len / 2048
    work = mixed(args.streams, config["vocab_size"], seed=0, prompt=MIXED_PROMPT.scaled(scale),
                 output=MIXED_OUTPUT.scaled(2 * scale))
    plain = [(r.prompt_token_ids, r.max_tokens) for r in work.requests]
    random.Random(0).shuffle(plain)
    runs = {"base": (False, [(pr, mt, "") for pr, mt in plain]),
            "mixed": (True, [(pr, mt, names[i % len(names)]) for i, (pr, mt) in enumerate(plain)]),
            "lora-base": (True, [(pr, mt, "") for pr, mt in plain])}
    tps: dict[str, list[float]] = {run: [] for run in RUNS}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for r in range(args.rounds):
            order = RUNS if r % 2 == 0 else RUNS[::-1]
            for run in order:
                lora, requests = runs[run]
                rate, out = run_mixed(stacks[lora], requests)
                tps[run].append(rate)
                outputs.setdefault(run, out)
                print(f"round {r} {run}: x{args.streams} {rate:.0f} tok/s", file=sys.stderr, flush=True)
        metrics = scrape(pair[True].scheduler_metrics_port)
    finally:
        for stack in stacks.values():
            stack.channel.close()
        stop_pair(pair)

    med = {run: statistics.median(v) for run, v in tps.items()}
    loads = metrics.get("llmsched_lora_loads_total", 0.0)
    slot_ms = metrics.get("llmsched_lora_load_seconds_total", 0.0) * 1000 / loads if loads else None
    differ = sum(a != b for a, b in zip(outputs["mixed"], outputs["base"]))
    base_equal = outputs["lora-base"] == outputs["base"]
    print(f"P23 {Path(args.model).name}, {args.adapters} adapters of rank {args.rank}, x{args.streams} streams, "
          f"{args.rounds} rounds: base {med['base']:.0f} tok/s, mixed adapters {med['mixed']:.0f} tok/s "
          f"({med['mixed'] / med['base']:.2f}x), no adapter on the LoRA stack {med['lora-base']:.0f} tok/s "
          f"({med['lora-base'] / med['base']:.2f}x); per-round mixed/base "
          + ", ".join(f"{m / b:.2f}" for b, m in zip(tps["base"], tps["mixed"]))
          + f"; cold load per adapter: disk read and checks {statistics.median(read_ms):.1f} ms (median), "
          + (f"into a device slot {slot_ms:.2f} ms ({loads:.0f} loads)" if slot_ms is not None else "no slot loads")
          + f"; requests whose adapter changed their tokens: {differ}/{len(plain)}; "
          f"no-adapter tokens equal to the base stack's: {base_equal}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tokens_per_s": tps, "median_ratio_mixed": med["mixed"] / med["base"],
        "median_ratio_lora_base": med["lora-base"] / med["base"], "disk_read_ms": read_ms,
        "slot_load_ms": slot_ms, "slot_loads": loads, "adapter_changed_tokens": differ,
        "no_adapter_equal_to_base": base_equal}, indent=2))
    print(f"summary: {args.out}", file=sys.stderr)
    # The adapters must matter and the base requests must not notice them.
    return 0 if base_equal and differ > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
