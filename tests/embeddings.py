"""An embedding checkpoint for tests, and HF transformers as the oracle of
pooled embeddings and prompt logprobs on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor_svc.model.pooling import Pooling
from tests.chat_templates import LLAMA3_STYLE
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


def hf_log_softmax(model: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at each position: [n, vocab]; row i is the
    distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(model)(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_prompt_logprobs(model: str, ids: list[int]) -> torch.Tensor:
    """Each prompt token's logprob given those before it: [n - 1]."""
    logp = hf_log_softmax(model, ids)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def embedding_checkpoint(stories: Path, into: Path) -> Path:
    """stories260K as an embedding model too: links to its files, a
    sentence-transformers pipeline (mean pooling, then Normalize), and a
    chat template."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (into / name).symlink_to(stories / name)
    config = json.loads((stories / "tokenizer_config.json").read_text())
    (into / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_STYLE}))
    return write_pooling(into)


def headless_checkpoint(stories: Path, into: Path) -> Path:
    """stories260K as Qwen3-Embedding-8B ships: saved from the bare decoder
    (no `model.` prefix), untied embeddings and no lm_head.weight, with a
    mean-pooling sentence-transformers pipeline. It can embed, not generate."""
    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(stories / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"},
              str(into / "model.safetensors"))
    config = json.loads((stories / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (into / "tokenizer.json").symlink_to(stories / "tokenizer.json")
    return write_pooling(into)
