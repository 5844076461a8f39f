"""Reading a Llama-family checkpoint: HF directory or built-in name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from llmsched.errors import StartupError


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
        raise StartupError(f"EXECUTOR_MODEL={model!r} is neither a directory nor a built-in model ({known})")
    # The small files first: a broken checkpoint then fails in a moment,
    # not after gigabytes of weights have loaded.
    hf_config = _read_config(path / "config.json")
    tokenizer_json = _read_tokenizer(path / "tokenizer.json")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise StartupError(f"EXECUTOR_MODEL={model!r}: no *.safetensors in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state_dict.update(load_file(str(shard)))
        except (SafetensorError, OSError) as exc:
            raise StartupError(f"{shard}: unreadable safetensors file ({exc})") from None
    return Checkpoint(name=path.name, hf_config=hf_config, state_dict=state_dict, tokenizer_json=tokenizer_json)


def _read_config(file: Path) -> dict:
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
