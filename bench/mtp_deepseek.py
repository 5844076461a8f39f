"""Speculative decoding with DeepSeek-V3's multi-token-prediction (MTP)
layer end to end: a random DeepSeek-V3 at bench.fp8_deepseek's shape,
saved with one MTP layer (num_nextn_predict_layers: 1), served by two
stacks, one with EXECUTOR_SPECULATIVE_METHOD=mtp and one without, through

    python -m bench --launch --model <it> --workload copy --speculative K --speculative-method mtp ...

    python -m bench.mtp_deepseek                                  # the default shape (a GPU)
    python -m bench.mtp_deepseek --tiny -- --rounds 1 --executor-env EXECUTOR_ATTENTION_BACKEND=torch

Arguments after `--` go to `python -m bench` as they are (--out, --rounds,
--executor-env ...). The MTP layer's weights are random like the rest of
the model, so its drafts are seldom accepted: the run shows that the path
works on this machine (greedy outputs equal on both stacks, no block
leaked) and what a step with MTP costs, not the speedup a trained MTP
layer gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

MTP_EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def add_mtp_layer(directory: Path, seed: int = 5) -> Path:
    """A checkpoint saved with one decoder layer more than it will claim
    becomes one with that last layer as its MTP layer: config.json gets
    num_hidden_layers - 1 and num_nextn_predict_layers 1, and the layer
    gets the MTP module's own tensors (random, at a trained model's scale)
    plus the copies of the embedding and head that real checkpoints carry."""
    import torch
    from safetensors.torch import load_file, save_file

    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    mtp = config["num_hidden_layers"] - 1
    config.update(num_hidden_layers=mtp, num_nextn_predict_layers=1)
    config_path.write_text(json.dumps(config, indent=2))
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(file)
    dtype, hidden = tensors["lm_head.weight"].dtype, config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{mtp}."
    new = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": tensors["lm_head.weight"],
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
    }
    tensors |= {prefix + k: v.to(dtype).clone() for k, v in new.items()}
    save_file(tensors, file, metadata={"format": "pt"})
    return directory


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.mtp_deepseek", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="bench.fp8_deepseek's CPU test shape, not the default")
    p.add_argument("--tokens", type=int, default=2, help="EXECUTOR_SPECULATIVE_TOKENS (default 2)")
    args = p.parse_args(ours)
    from bench.cli import main as bench_main
    from bench.fp8_deepseek import TINY, Shape, make_bf16

    shape = TINY if args.tiny else Shape()
    with tempfile.TemporaryDirectory(prefix="mtp_deepseek_") as tmp:
        directory = Path(tmp) / "deepseek-v3-mtp"
        make_bf16(directory, dataclasses.replace(shape, num_hidden_layers=shape.num_hidden_layers + 1))
        add_mtp_layer(directory)
        return bench_main(["--launch", "--model", str(directory), "--workload", "copy", "--speculative",
                           str(args.tokens), "--speculative-method", "mtp", *bench_args])


if __name__ == "__main__":
    sys.exit(main())
