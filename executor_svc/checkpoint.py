"""Reading a Llama-family checkpoint: HF directory or built-in name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


@dataclass(slots=True)
class Checkpoint:
    name: str
    hf_config: dict
    state_dict: dict[str, torch.Tensor]  # HF parameter names
    tokenizer_json: str


def load_checkpoint(model: str) -> Checkpoint:
    """`model` is a built-in name or a directory with config.json,
    *.safetensors (one file or shards) and tokenizer.json."""
    from executor_svc.builtin import BUILTIN_MODELS, load_builtin

    if model in BUILTIN_MODELS:
        return load_builtin(model)
    path = Path(model)
    if not path.is_dir():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise FileNotFoundError(f"EXECUTOR_MODEL={model!r} is neither a directory nor a built-in model ({known})")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        state_dict.update(load_file(str(shard)))
    return Checkpoint(
        name=path.name,
        hf_config=json.loads((path / "config.json").read_text()),
        state_dict=state_dict,
        tokenizer_json=(path / "tokenizer.json").read_text(),
    )
