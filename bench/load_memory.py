"""Peak host memory while the executor loads a multi-shard checkpoint.

    python -m bench.load_memory                 # ~330 MB fp32 Llama in 50 MB shards
    python -m bench.load_memory --dtype bfloat16 --hidden 512 --layers 4

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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_checkpoint(directory: Path, *, hidden: int, layers: int, vocab: int, dtype: str, shard: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=2048, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(directory, max_shard_size=shard)
    # The loader checks the tokenizer before any weight: a minimal valid one.
    from tokenizers import Tokenizer, models

    (directory / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str())
    return directory


def _child(directory: str, dtype: str) -> None:
    """Runs in the measured process: load as the executor does, print JSON."""
    import dataclasses

    import torch

    from executor_svc.checkpoint import load_checkpoint
    from executor_svc.model import CausalLM, build_model
    from executor_svc.model_config import ModelConfig

    torch.set_num_threads(1)
    imports_kb = _status_kb("VmRSS")
    ckpt = load_checkpoint(directory)
    cfg = ModelConfig.from_hf(ckpt.hf_config, ckpt.generation_config)
    # The first module built on the meta device costs ~150 MB of torch
    # machinery whatever the model's size: pay it on a one-layer model
    # first, so that the ratio below counts copies of the weights only.
    tiny = dataclasses.replace(cfg, num_layers=1, layer_types=cfg.layer_types[:1], vocab_size=8, hidden_size=8,
                               intermediate_size=8, num_heads=1, num_kv_heads=1, head_dim=8)
    with torch.device("meta"):
        CausalLM(tiny, 8)
    before_kb = _status_kb("VmRSS")
    model = build_model(cfg, ckpt.tensors(), 64, torch.device("cpu"), getattr(torch, dtype))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak_kb = _status_kb("VmHWM")
    print(json.dumps({"rss_imports_mb": imports_kb / 1024, "rss_before_mb": before_kb / 1024,
                      "peak_mb": peak_kb / 1024, "weights_mb": weight_bytes / 2**20, "shards": len(ckpt.shards),
                      "ratio": (peak_kb - before_kb) * 1024 / weight_bytes}))


def measure(directory: Path, dtype: str) -> dict:
    """Loads `directory` in a fresh interpreter; returns the child's figures."""
    out = subprocess.run([sys.executable, "-m", "bench.load_memory", "--child", str(directory), "--dtype", dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shard", default="50MB", help="save_pretrained max_shard_size")
    p.add_argument("--checkpoint-dtype", choices=DTYPES, default="float32", help="dtype the checkpoint is stored in")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype the executor loads into")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.dtype)
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = make_checkpoint(Path(tmp) / "ckpt", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                                    dtype=args.checkpoint_dtype, shard=args.shard)
        r = measure(directory, args.dtype)
    print(f"checkpoint: {args.checkpoint_dtype}, {r['shards']} shards of <= {args.shard}; loaded as {args.dtype}")
    print(f"weights {r['weights_mb']:.0f} MiB; RSS after imports {r['rss_imports_mb']:.0f} MiB, before loading "
          f"{r['rss_before_mb']:.0f} MiB (fixed meta-device set-up included); peak {r['peak_mb']:.0f} MiB")
    print(f"peak RSS growth / weight bytes = {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
