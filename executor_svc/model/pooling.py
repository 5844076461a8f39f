"""How an embedding checkpoint pools its hidden states, read from the
sentence-transformers files it ships beside the HF weights: `modules.json`
lists the pipeline (Transformer, Pooling, optionally Normalize) and
`1_Pooling/config.json` (the Pooling module's folder) says which pooling.

Qwen3-Embedding, gte-Qwen2 and e5-mistral are decoder checkpoints of this
kind: the model's final normed hidden states, pooled (the last token, the
mean over every token, or the first), then normalised to unit length.

What this server cannot reproduce exactly (max pooling, a Dense projection
after pooling, pooling without the prompt) leaves the checkpoint without
embeddings, with the reason in the executor's log: generation is unaffected,
and Embed is refused rather than answered with a different vector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ST = "sentence_transformers.models."
# The pipeline modules whose effect is reproduced here; Transformer is the
# model itself.
KNOWN_MODULES = {ST + "Transformer", ST + "Pooling", ST + "Normalize"}
# 1_Pooling/config.json's mode keys -> ours.
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str  # "last", "mean" or "cls"
    normalize: bool

    def describe(self) -> str:
        """As HandshakeResponse.pooling says it: "last+normalize"."""
        return self.mode + ("+normalize" if self.normalize else "")

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read hidden states the prefix cache does not
        keep, so such a request computes its whole prompt; last-token
        pooling reads only the last position, which is always computed."""
        return self.mode != "last"

    def finish(self, vector: torch.Tensor) -> list[float]:
        """The pooled vector ([hidden], float32) as the response carries it."""
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.tolist()


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """What a checkpoint directory says about embeddings: a Pooling, or why
    there is none."""

    pooling: Pooling | None
    why_not: str = ""


def read_pooling(path: Path) -> PoolingConfig:
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return PoolingConfig(None, "no modules.json (a sentence-transformers pooling config)")
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [m["type"] for m in modules]
    except (ValueError, TypeError, KeyError) as exc:
        return PoolingConfig(None, f"{modules_file} does not read as a sentence-transformers module list: {exc}")
    unknown = [k for k in kinds if k not in KNOWN_MODULES]
    if unknown:
        return PoolingConfig(None, f"{modules_file} names modules this server does not apply: {', '.join(unknown)} "
                                   f"(supported: {', '.join(sorted(KNOWN_MODULES))})")
    pooling_modules = [m for m in modules if m["type"] == ST + "Pooling"]
    if len(pooling_modules) != 1:
        return PoolingConfig(None, f"{modules_file} has {len(pooling_modules)} Pooling modules; one is needed")
    config_file = path / pooling_modules[0].get("path", "1_Pooling") / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return PoolingConfig(None, f"{config_file}: {exc}")
    on = [key for key in (*MODES, *UNSUPPORTED_MODES) if config.get(key)]
    if len(on) != 1:
        return PoolingConfig(None, f"{config_file} turns on {on or 'no pooling mode'}: one of "
                                   f"{', '.join(MODES)} is needed")
    if on[0] in UNSUPPORTED_MODES:
        return PoolingConfig(None, f"{config_file}: {on[0]} is not implemented (supported: {', '.join(MODES)})")
    if not config.get("include_prompt", True):
        return PoolingConfig(None, f"{config_file}: include_prompt=false is not implemented")
    normalize = ST + "Normalize" in kinds
    if normalize and kinds.index(ST + "Normalize") < kinds.index(ST + "Pooling"):
        return PoolingConfig(None, f"{modules_file}: Normalize before Pooling is not implemented")
    return PoolingConfig(Pooling(MODES[on[0]], normalize))
