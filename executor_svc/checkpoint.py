"""Reading a checkpoint: an HF directory or a built-in name.

Weights are not read here: `Checkpoint.tensors()` yields them one at a time
(safetensors files are opened lazily, shard by shard), so the model can be
filled without ever holding a second copy of them in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass(slots=True)
class Checkpoint:
    name: str
    hf_config: dict
    tokenizer_json: str
    generation_config: dict | None = None  # generation_config.json, when present
    shards: tuple[Path, ...] = ()  # safetensors files, read lazily
    in_memory: dict[str, torch.Tensor] | None = None  # built-ins: HF-named tensors

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs; each shard is closed (unmapped) before
        the next opens."""
        if self.in_memory is not None:
            yield from self.in_memory.items()
            return
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once: for tests and tools, not for serving."""
        return dict(self.tensors())


def _shards(path: Path) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return tuple(path / f for f in files)
    shards = tuple(sorted(path.glob("*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return shards


def load_checkpoint(model: str) -> Checkpoint:
    """`model` is a built-in name or a directory with config.json,
    *.safetensors (one file or shards), tokenizer.json and optionally
    generation_config.json."""
    from executor_svc.builtin import BUILTIN_MODELS, load_builtin

    if model in BUILTIN_MODELS:
        return load_builtin(model)
    path = Path(model)
    if not path.is_dir():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise FileNotFoundError(f"EXECUTOR_MODEL={model!r} is neither a directory nor a built-in model ({known})")
    gen = path / "generation_config.json"
    return Checkpoint(
        name=path.name,
        hf_config=json.loads((path / "config.json").read_text()),
        tokenizer_json=(path / "tokenizer.json").read_text(),
        generation_config=json.loads(gen.read_text()) if gen.exists() else None,
        shards=_shards(path),
    )
