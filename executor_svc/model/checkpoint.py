"""Reading a checkpoint: an HF directory or a built-in name.

Weights are not read here: `Checkpoint.tensors()` yields them one at a time
(safetensors files are opened lazily, shard by shard), so the model can be
filled without ever holding a second copy of them in host memory.
`Checkpoint.lazy_tensors()` goes further and reads nothing until asked, and
then only the part asked for: a tensor-parallel rank reads its own slices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from executor_svc.model.builtin import BUILTIN_MODELS, load_builtin
from executor_svc.model.pooling import PoolingConfig, read_pooling
from executor_svc.model.quantization import QUANTIZATION_FILES, legacy_quantization_config
from llmsched.errors import StartupError


@dataclass(frozen=True, slots=True)
class LazyTensor:
    """A checkpoint tensor not read yet. `rows()` narrows it without reading
    (families split fused tensors with it); `read()` reads it, or one
    [start, stop) range of one dim, and nothing else."""

    shape: tuple[int, ...]
    _read: Callable[[tuple[slice, ...] | None], torch.Tensor]  # None = the whole stored tensor
    row_offset: int = 0  # where this tensor's rows start in the stored one
    narrowed: bool = False  # made by rows(): a part of the stored tensor

    @staticmethod
    def of(t: torch.Tensor) -> LazyTensor:
        return LazyTensor(tuple(t.shape), lambda index: t if index is None else t[index])

    def rows(self, start: int, length: int) -> LazyTensor:
        return LazyTensor((length, *self.shape[1:]), self._read, self.row_offset + start, narrowed=True)

    def read(self, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim is None and not self.narrowed:
            return self._read(None)
        index = [slice(0, n) for n in self.shape]
        index[0] = slice(self.row_offset, self.row_offset + self.shape[0])
        if dim is not None:
            base = self.row_offset if dim == 0 else 0
            index[dim] = slice(base + start, base + stop)
        return self._read(tuple(index))


def _stored(f, name: str) -> LazyTensor:
    part = f.get_slice(name)
    return LazyTensor(tuple(part.get_shape()), lambda index: f.get_tensor(name) if index is None else part[index])


@dataclass(slots=True)
class Checkpoint:
    name: str
    hf_config: dict
    tokenizer_json: str
    generation_config: dict | None = None  # generation_config.json, when present
    shards: tuple[Path, ...] = ()  # safetensors files, read lazily
    in_memory: dict[str, torch.Tensor] | None = None  # built-ins: HF-named tensors
    # How embeddings pool (pooling.py); built-ins ship no pooling config.
    pooling: PoolingConfig = PoolingConfig(None, "a built-in model ships no sentence-transformers pooling config")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs, read one at a time."""
        for name, lazy in self.lazy_tensors():
            yield name, lazy.read()

    def lazy_tensors(self) -> Iterator[tuple[str, LazyTensor]]:
        """(HF name, unread tensor) pairs. Each must be read before the next
        is taken: a shard is closed (unmapped) before the next opens."""
        if self.in_memory is not None:
            for name, t in self.in_memory.items():
                yield name, LazyTensor.of(t)
            return
        for shard in self.shards:
            try:
                f = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise StartupError(f"{shard}: unreadable safetensors file ({exc})") from None
            with f:
                for name in f.keys():
                    yield name, _stored(f, name)

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once: for tests and tools, not for serving."""
        return dict(self.tensors())


def checkpoint_shards(path: Path, setting: str) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(read_config_file(index)["weight_map"].values()))
        return tuple(path / f for f in files)
    shards = tuple(sorted(path.glob("*.safetensors")))
    if not shards:
        raise StartupError(f"{setting}={str(path)!r}: no *.safetensors in {path}")
    return shards


def load_checkpoint(model: str, setting: str = "EXECUTOR_MODEL") -> Checkpoint:
    """`model` is a built-in name or a directory with config.json,
    *.safetensors (one file or shards), tokenizer.json and optionally
    generation_config.json; `setting` names it in errors."""
    if model in BUILTIN_MODELS:
        builtin = load_builtin(model)
        return Checkpoint(builtin.name, builtin.hf_config, builtin.tokenizer_json, in_memory=builtin.state_dict)
    path = Path(model)
    if not path.is_dir():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise StartupError(f"{setting}={model!r} is neither a directory nor a built-in model ({known})")
    # The small files first: a broken checkpoint then fails in a moment,
    # not after gigabytes of weights have loaded.
    hf_config = read_config_file(path / "config.json")
    for file, method in QUANTIZATION_FILES if "quantization_config" not in hf_config else ():
        if (path / file).exists():
            hf_config["quantization_config"] = legacy_quantization_config(read_config_file(path / file), file, method)
            break
    tokenizer_json = _read_tokenizer(path / "tokenizer.json")
    gen = path / "generation_config.json"
    return Checkpoint(
        name=path.name,
        hf_config=hf_config,
        tokenizer_json=tokenizer_json,
        generation_config=read_config_file(gen) if gen.exists() else None,
        shards=checkpoint_shards(path, setting),
        pooling=read_pooling(path),
    )


def tensor_names(shards: tuple[Path, ...]) -> set[str]:
    """Every tensor name in the shards, without reading a tensor."""
    names: set[str] = set()
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as exc:
            raise StartupError(f"{shard}: unreadable safetensors file ({exc})") from None
    return names


def read_config_file(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise StartupError(f"{file}: missing (the checkpoint needs its Hugging Face config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StartupError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise StartupError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def _read_tokenizer(file: Path) -> str:
    try:
        text = file.read_text()
        Tokenizer.from_str(text)  # the scheduler will load it: refuse a broken one here, by name
    except FileNotFoundError:
        raise StartupError(f"{file}: missing (the scheduler tokenizes with the checkpoint's tokenizer.json)") from None
    except Exception as exc:  # tokenizers raises a bare Exception on bad input
        raise StartupError(f"{file}: not a tokenizer.json the tokenizers library reads ({exc})") from None
    return text
