"""How a model splits over tensor-parallel ranks, in one place for every
family (Megatron-style):

  q, k, v, gate, up     split by output rows (heads, intermediate units)
  o, down               split by input columns; their outputs are summed
                        over ranks (an all-reduce)
  embed, lm_head        split by vocabulary rows, the vocabulary padded to
                        a multiple of the size; padding rows are zero and
                        padding logits are cut off before sampling
  norms (incl. q/k)     replicated

With fewer KV heads than ranks, each KV head is replicated on the ranks
whose query heads use it, which needs the size to be a multiple of the KV
head count. Rules are keyed by the decoder's parameter names (HF names,
after a family's rename), so a new family gets them for free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.model_config import ModelConfig
from llmsched.errors import StartupError

ROW_SPLIT_HEADS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
ROW_SPLIT_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")
ROW_SPLIT_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
COL_SPLIT_HEADS = ("self_attn.o_proj.weight",)
COL_SPLIT_MLP = ("mlp.down_proj.weight",)
VOCAB_SPLIT = ("embed_tokens.weight", "lm_head.weight")


def size_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why `size` ranks cannot split this model; empty when they can."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (the size must divide them, or be a multiple to replicate them)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    return problems


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

    def intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.intermediate_size // self.size

    def padded_vocab(self, cfg: ModelConfig) -> int:
        return -(-cfg.vocab_size // self.size) * self.size

    def vocab_range(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's vocabulary rows, padding included."""
        per_rank = self.padded_vocab(cfg) // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def split(self, name: str, cfg: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of parameter `name` (in
        the full tensor's coordinates); None when it is replicated. The
        vocabulary split's stop may pass the real vocabulary: see read()."""
        d = cfg.head_dim
        if name.endswith(ROW_SPLIT_HEADS) or name.endswith(COL_SPLIT_HEADS):
            n = self.num_heads(cfg) * d
            return (0 if name.endswith(ROW_SPLIT_HEADS) else 1), self.rank * n, (self.rank + 1) * n
        if name.endswith(ROW_SPLIT_KV):
            first = self.first_kv_head(cfg) * d
            return 0, first, first + self.num_kv_heads(cfg) * d
        if name.endswith(ROW_SPLIT_MLP) or name.endswith(COL_SPLIT_MLP):
            n = self.intermediate_size(cfg)
            return (0 if name.endswith(ROW_SPLIT_MLP) else 1), self.rank * n, (self.rank + 1) * n
        if name.endswith(VOCAB_SPLIT):
            return (0, *self.vocab_range(cfg))
        return None

    def read(self, name: str, weight, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (a checkpoint.LazyTensor),
        reading only that part from disk."""
        if self.size == 1:
            return weight.read()
        split = self.split(name, cfg)
        if split is None:
            return weight.read()
        dim, start, stop = split
        real_stop = min(stop, weight.shape[dim])
        part = weight.read(dim, start, real_stop)
        if real_stop < stop:  # vocabulary padding: zero rows, never sampled
            pad = list(part.shape)
            pad[dim] = stop - real_stop
            part = torch.cat((part, part.new_zeros(pad)), dim=dim)
        return part
