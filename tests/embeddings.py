"""An embedding checkpoint for tests, and HF transformers as the oracle of
pooled embeddings and prompt logprobs on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from executor_svc.model.pooling import Pooling
from tests.oracle import hf_model

ST = "sentence_transformers.models."


def write_pooling(path: Path, mode_key: str = "pooling_mode_mean_tokens", normalize: bool = True,
                  modules: list[str] | None = None, **pooling) -> Path:
    """A sentence-transformers pipeline over the checkpoint: modules.json
    and 1_Pooling/config.json, as Qwen3-Embedding ships them."""
    kinds = modules or ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": {"Pooling": "1_Pooling"}.get(k, f"{i}_{k}" if i else ""), "type": ST + k}
        for i, k in enumerate(kinds)]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode_key: True,
                                                                **pooling}))
    return path


def hf_pooled(model: str, ids: list[int], pooling: Pooling) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model(model).model(torch.tensor([ids])).last_hidden_state[0].float()  # [n, hidden]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling.mode]
    return torch.nn.functional.normalize(vector, dim=-1) if pooling.normalize else vector


def hf_prompt_logprobs(model: str, ids: list[int]) -> torch.Tensor:
    """log_softmax at each position for the next prompt token: [n - 1]."""
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(model)(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def embedding_checkpoint(stories: Path, into: Path) -> Path:
    """stories260K with a sentence-transformers pipeline: mean pooling, then
    Normalize."""
    into.mkdir(parents=True, exist_ok=True)
    for f in stories.iterdir():
        if f.is_file():
            shutil.copy(f, into / f.name)
    return write_pooling(into)
