"""Which tensor-parallel sizes a model allows, and which heads, units and
vocabulary rows each rank holds (Megatron-style):

  q, k, v, gate, up     split by output rows (heads, intermediate units)
  o, down               split by input columns; their outputs are summed
                        over ranks (an all-reduce)
  embed, lm_head        split by vocabulary rows, the vocabulary padded to
                        a multiple of the size; padding rows are zero and
                        padding logits are cut off before sampling
  experts               each expert's gate/up rows and down columns, like a
                        dense MLP (the router is replicated)
  MLA (DeepSeek-V3)     heads split (q_b, kv_b rows, o columns); the latent
                        projection, its norm and the latent cache replicated
  norms (incl. q/k)     replicated

With fewer KV heads than ranks, each KV head is replicated on the ranks
whose query heads use it, which needs the size to be a multiple of the KV
head count. Each layer reads its own part of the checkpoint from these
sizes (executor_svc/model/layers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from executor_svc.model.model_config import ModelConfig
from llmsched.errors import StartupError


def size_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why `size` ranks cannot split this model; empty when they can.
    A quantized checkpoint's size must also keep every block or group whole."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.mla is None and cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (the size must divide them, or be a multiple to replicate them)")
    dense_layers = cfg.moe is None or not all(cfg.moe.sparse_layers)
    if dense_layers and cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.moe is not None:
        # Experts split like a dense MLP: every expert's units over the ranks.
        if cfg.moe.intermediate_size % size:
            problems.append(f"expert intermediate size {cfg.moe.intermediate_size}")
        if cfg.moe.shared_intermediate_size % size:
            problems.append(f"shared expert intermediate size {cfg.moe.shared_intermediate_size}")
    if not problems and size > 1:
        problems += quantization_cuts(cfg, size)
    return problems


def quantization_units(cfg: ModelConfig) -> tuple[int, int]:
    """The rows and columns that a rank's part of every quantized weight
    must be a multiple of (LinearScheme.split_units, over the schemes)."""
    rows = cols = 1
    for _, scheme in (cfg.quantization.schemes if cfg.quantization is not None else ()):
        r, c = scheme.split_units()
        rows, cols = math.lcm(rows, r), math.lcm(cols, c)
    return rows, cols


def quantization_cuts(cfg: ModelConfig, size: int) -> list[str]:
    """A quantized checkpoint's blocks or groups that `size` ranks would cut:
    each rank must hold whole ones of every weight it splits, by rows (q,
    k, v, gate, up; q_b and kv_b) or by columns (o, down)."""
    rows, cols = quantization_units(cfg)
    if rows == cols == 1:
        return []
    heads = cfg.num_heads // size
    split: list[tuple[str, int, int]] = []
    if cfg.mla is None:
        kv = max(1, cfg.num_kv_heads // size) * cfg.head_dim  # a replicated KV head is one whole head
        split += [("q rows", heads * cfg.head_dim, rows), ("k/v rows", kv, rows),
                  ("o columns", heads * cfg.head_dim, cols)]
    else:
        m = cfg.mla
        split += [("q rows", heads * m.qk_head_dim, rows), ("kv_b rows", heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                            rows), ("o columns", heads * m.v_head_dim, cols)]
    units = [cfg.intermediate_size // size] if cfg.moe is None or not all(cfg.moe.sparse_layers) else []
    if cfg.moe is not None:
        units += [cfg.moe.intermediate_size // size]
        if cfg.moe.shared_intermediate_size:
            units.append(cfg.moe.shared_intermediate_size // size)
    for n in units:
        split += [("gate/up rows", n, rows), ("down columns", n, cols)]
    return [f"quantization blocks or groups of {unit} ({what} per rank: {n})" for what, n, unit in split if n % unit]


def valid_sizes(cfg: ModelConfig) -> list[int]:
    # A valid size divides the head count, so none is larger.
    return [n for n in range(1, cfg.num_heads + 1) if not size_problems(cfg, n)]


def check_size(cfg: ModelConfig, size: int) -> None:
    problems = size_problems(cfg, size)
    if problems:
        raise StartupError(
            f"EXECUTOR_TENSOR_PARALLEL_SIZE={size} does not divide {cfg.architecture}'s "
            f"{', '.join(problems)}; sizes that work: {', '.join(map(str, valid_sizes(cfg)))}")


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of the model this rank holds."""

    rank: int = 0
    size: int = 1

    def num_heads(self, cfg: ModelConfig) -> int:
        return cfg.num_heads // self.size

    def num_kv_heads(self, cfg: ModelConfig) -> int:
        return max(1, cfg.num_kv_heads // self.size)

    def first_kv_head(self, cfg: ModelConfig) -> int:
        if cfg.num_kv_heads >= self.size:
            return self.rank * self.num_kv_heads(cfg)
        # Replicated: ranks r*k .. r*k+k-1 (k = size / kv heads) share head r.
        return self.rank // (self.size // cfg.num_kv_heads)

    def padded_vocab(self, cfg: ModelConfig) -> int:
        return -(-cfg.vocab_size // self.size) * self.size

    def vocab_range(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's vocabulary rows, padding included."""
        per_rank = self.padded_vocab(cfg) // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank
