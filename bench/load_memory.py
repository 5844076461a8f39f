"""Peak host memory while the executor loads a multi-shard checkpoint.

    python -m bench.load_memory                 # ~340 MB fp32 Llama in 50 MB shards
    python -m bench.load_memory --dtype bfloat16 --hidden 512 --layers 4
    python -m bench.load_memory --tensor-parallel-size 2   # each rank's shard

Builds a random LlamaForCausalLM with transformers, saves it with
save_pretrained(max_shard_size=...) into a temporary directory, then loads
it the way the executor does (load_checkpoint -> ModelConfig -> build_model)
in a fresh subprocess that reports its VmRSS before loading and its VmHWM
(peak resident set) after. The figure of merit is

    (VmHWM - VmRSS before loading) / bytes of the loaded weights

i.e. how many copies of the weights the host held at the peak; the
interpreter, torch, the executor's modules and torch's one-off meta-device
set-up (~150 MB, whatever the model's size; printed) are in the baseline.

Weights are copied out of the mmapped shards (build_model), so they are
anonymous memory that is resident as soon as it is loaded. The
checkpoint can be stored in another dtype than the one loaded, as a bf16
checkpoint served in fp32 on CPU is.

With --tensor-parallel-size N, N processes load at once, each as one rank
of a real gloo group (torchrun's variables set, tensor_parallel.join), and
build only their shard from slices of the shards on disk. Each rank reports
the same figure against the whole model's weight bytes, which should be
about 1/N (its shard) plus the allocator's constant slack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_checkpoint(directory: Path, *, hidden: int, layers: int, vocab: int, dtype: str, shard: str,
                    family: str = "llama") -> Path:
    """A random checkpoint saved by transformers: Llama, or DeepSeek-V3 (MLA,
    8 experts of the dense MLP's width on every layer but the first)."""
    import torch
    import transformers

    # Rounded to a multiple of 64 so that tensor-parallel sizes divide it.
    intermediate = (hidden * 8 // 3 + 63) // 64 * 64
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=max(1, hidden // 64), max_position_embeddings=2048, tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=max(1, hidden // 128))
        model_cls = transformers.LlamaForCausalLM
    elif family == "deepseek-v3":
        heads = common["num_attention_heads"]
        cfg = transformers.DeepseekV3Config(
            **common, num_key_value_heads=heads, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=intermediate // 2, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64)
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    cfg.architectures = [model_cls.__name__]
    model = model_cls(cfg).to(getattr(torch, dtype))
    model.save_pretrained(directory, max_shard_size=shard)
    # The loader checks the tokenizer before any weight: a minimal valid one.
    from tokenizers import Tokenizer, models

    (directory / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str())
    return directory


def _child(directory: str, dtype: str) -> None:
    """Runs in the measured process: load as the executor does, print JSON.
    With torchrun's variables set, as one rank of a tensor-parallel group."""
    import dataclasses

    import torch

    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.config import ExecutorSettings
    from executor_svc.model.cpu_int_linear import use_cpu_int_kernels
    from executor_svc.model.families import build_model, family_of, read_config
    from executor_svc.model.model import CausalLM
    from executor_svc.model.sharding import Shard
    from executor_svc.tensor_parallel import join

    torch.set_num_threads(1)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    imports_kb = _status_kb("VmRSS")
    ckpt = load_checkpoint(directory)
    cfg = read_config(ckpt.hf_config, ckpt.generation_config)
    # The group's own buffers (gloo) are in the baseline, as torch's are.
    tp = join(ExecutorSettings(tensor_parallel_size=size), cfg, torch.device("cpu"))
    shard = tp.shard if tp else Shard()
    # The first module built on the meta device costs ~150 MB of torch
    # machinery whatever the model's size: pay it on a one-layer model
    # first, so that the ratio below counts copies of the weights only.
    tiny = dataclasses.replace(cfg, num_layers=1, layer_types=cfg.layer_types[:1], vocab_size=8, hidden_size=8,
                               intermediate_size=8, num_heads=1, num_kv_heads=1, head_dim=8, moe=None, mla=None)
    with torch.device("meta"):
        CausalLM(tiny, 8)
        whole = family_of(cfg).model_cls(cfg, 64)
    element_size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    whole_bytes = sum(p.numel() for p in whole.parameters()) * element_size
    before_kb = _status_kb("VmRSS")
    model = build_model(cfg, ckpt.lazy_tensors(), 64, torch.device("cpu"), getattr(torch, dtype), shard, tp)
    if cfg.quantization is not None:  # as executor_svc.loading does, EXECUTOR_CPU_INT_KERNELS at its default
        use_cpu_int_kernels(model, getattr(torch, dtype))
    peak_kb, after_kb = _status_kb("VmHWM"), _status_kb("VmRSS")
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"rank": shard.rank, "size": shard.size, "rss_imports_mb": imports_kb / 1024,
                      "rss_before_mb": before_kb / 1024, "peak_mb": peak_kb / 1024,
                      "rss_after_mb": after_kb / 1024, "weights_mb": whole_bytes / 2**20,
                      "shard_mb": shard_bytes / 2**20, "shards": len(ckpt.shards),
                      "ratio": (peak_kb - before_kb) * 1024 / whole_bytes}), flush=True)
    if tp:
        # As the service's ranks stop: together, without destroy_process_group
        # (gloo aborts a rank whose peers tear down first).
        tp.leave()


def measure_ranks(directory: Path, dtype: str, size: int = 1, timeout_s: float = 600) -> list[dict]:
    """Loads `directory` in `size` fresh interpreters at once, one rank of a
    gloo group each (one plain process at size 1); returns each rank's
    figures, by rank."""
    from executor_svc.tensor_parallel import TORCHRUN_VARS
    from llmsched.server import free_port

    cmd = [sys.executable, "-m", "bench.load_memory", "--child", str(directory), "--dtype", dtype]
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(size),
             "LOCAL_WORLD_SIZE": str(size)}
    plain = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    envs = [plain] if size == 1 else \
        [dict(plain, **group, RANK=str(r), LOCAL_RANK=str(r)) for r in range(size)]
    outs = [tempfile.TemporaryFile("w+") for _ in envs]
    errs = [tempfile.TemporaryFile("w+") for _ in envs]
    procs = [subprocess.Popen(cmd, env=env, stdout=o, stderr=e, text=True) for env, o, e in zip(envs, outs, errs)]
    deadline = time.monotonic() + timeout_s
    try:
        # A rank that fails leaves the others waiting on the group: stop
        # them at once rather than after the group's timeout.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for f in outs + errs:
        f.seek(0)
    texts = [(o.read(), e.read()) for o, e in zip(outs, errs)]
    for f in outs + errs:
        f.close()
    # The rank that failed first, not one killed because of it.
    bad = sorted((p.returncode == -9, r) for r, p in enumerate(procs) if p.returncode != 0)
    if bad:
        r = bad[0][1]
        raise RuntimeError(f"rank {r} of {size} exited with {procs[r].returncode}"
                           f"{' (killed: a rank failed or the time ran out)' if bad[0][0] else ''}: "
                           f"{texts[r][1][-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in texts]


def measure(directory: Path, dtype: str) -> dict:
    """Loads `directory` in a fresh interpreter; returns the child's figures."""
    return measure_ranks(directory, dtype)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 16 heads, 8 KV heads, intermediate 2752: tensor-parallel sizes 1, 2, 4, 8 and 16 split it.
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shard", default="50MB", help="save_pretrained max_shard_size")
    p.add_argument("--family", choices=("llama", "deepseek-v3"), default="llama",
                   help="deepseek-v3: MLA and 8 experts per layer (all but the first)")
    p.add_argument("--checkpoint-dtype", choices=DTYPES, default="float32", help="dtype the checkpoint is stored in")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype the executor loads into")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="load as this many ranks at once, each its shard (gloo, one process per rank)")
    p.add_argument("--out", type=Path, default=None, help="JSON of every rank's figures")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.dtype)
        return
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be at least 1")
    size = args.tensor_parallel_size
    with tempfile.TemporaryDirectory() as tmp:
        directory = make_checkpoint(Path(tmp) / "ckpt", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                                    dtype=args.checkpoint_dtype, shard=args.shard, family=args.family)
        ranks = measure_ranks(directory, args.dtype, size)
    r = ranks[0]
    print(f"checkpoint: {args.checkpoint_dtype}, {r['shards']} shards of <= {args.shard}; loaded as {args.dtype}"
          + (f"; tensor-parallel size {size} (gloo, one process per rank, loading at once)" if size > 1 else ""))
    if size == 1:
        print(f"weights {r['weights_mb']:.0f} MiB; RSS after imports {r['rss_imports_mb']:.0f} MiB, before loading "
              f"{r['rss_before_mb']:.0f} MiB (fixed meta-device set-up included); peak {r['peak_mb']:.0f} MiB")
        print(f"peak RSS growth / weight bytes = {r['ratio']:.2f}x")
    else:
        print(f"whole model's weights {r['weights_mb']:.0f} MiB; 1/{size} = {1 / size:.2f}")
        for r in ranks:
            print(f"rank {r['rank']}: shard {r['shard_mb']:.0f} MiB; RSS before loading {r['rss_before_mb']:.0f} MiB "
                  f"(imports, group and meta-device set-up included); peak {r['peak_mb']:.0f} MiB; "
                  f"peak RSS growth / whole weight bytes = {r['ratio']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "ranks": ranks},
                                       indent=2))


if __name__ == "__main__":
    main()
