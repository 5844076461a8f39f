"""Roofline profiles: step costs estimated from published bandwidth and
FLOPs, for models and GPUs this machine cannot run. They are *uncalibrated*:
every report that uses one says so, and the first GPU that runs
`make gpu-check` replaces them with measured ones (`python -m simulator
calibrate`).

The estimate adds, per step, the time each resource needs on its own (a
sum, not a max: it over-states steps that are both memory- and
compute-heavy, which makes capacity estimates conservative):

- reading the weights once (HBM bandwidth), plus a fixed host time;
- per token: its share of the matmuls (2 FLOPs per weight, at the
  achievable fraction of peak) and, under tensor parallelism, two ring
  all-reduces of its hidden state per layer;
- per chunk x context position: attention's QK^T and PV FLOPs;
- per decode context token: reading its K and V (HBM bandwidth);
- per swapped block: its bytes over PCIe.

    python -m simulator roofline --write   # regenerates simulator/profiles/roofline/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simulator.cost_model import FEATURES, LinearCostModel
from simulator.profile import PROFILES_DIR, Geometry, HostCost, Profile

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    nvlink_bytes_per_s: float  # per direction
    pcie_bytes_per_s: float  # per direction


@dataclass(frozen=True, slots=True)
class LlamaShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_model_len: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate  # q, o; k, v; gate, up, down

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden  # + embedding and lm_head


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3 at 3.35 TB/s,
# 989 TFLOPS dense BF16 (1,979 with sparsity), NVLink 900 GB/s
# bidirectional, PCIe Gen5 128 GB/s bidirectional.
H100 = GPU("H100-SXM-80GB", 80e9, 3.35e12, 989e12, 450e9, 64e9)
# NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s;
# compute, NVLink and PCIe as the H100's.
H200 = GPU("H200-SXM-141GB", 141e9, 4.8e12, 989e12, 450e9, 64e9)
GPUS = {"h100": H100, "h200": H200}

# config.json of meta-llama/Llama-3.1-8B and Llama-3.1-70B on Hugging Face.
LLAMA_31_8B = LlamaShape("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, 131072)
LLAMA_31_70B = LlamaShape("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128256, 131072)
MODELS = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B}
TP_SIZES = (1, 2, 4, 8)

# Assumptions, not measurements: the share of the peaks a serving engine
# reaches (memory-bound kernels typically reach 70-90% of HBM bandwidth,
# large bf16 GEMMs 50-70% of peak FLOPs, attention less), NCCL's latency
# per all-reduce on NVLink, the host time per step with CUDA graphs, and
# the memory kept back from the KV pool for activations and the runtime.
BANDWIDTH_EFFICIENCY = 0.8
MATMUL_EFFICIENCY = 0.6
ATTENTION_EFFICIENCY = 0.4
LINK_EFFICIENCY = 0.8
ALLREDUCE_LATENCY_S = 8e-6
HOST_STEP_S = 1e-3
GPU_MEMORY_UTILISATION = 0.9
ACTIVATION_RESERVE_BYTES = 4 * GIB
DTYPE_BYTES = 2  # bf16 weights and KV cache
BLOCK_SIZE = 16


def kv_bytes_per_token(m: LlamaShape, tp: int) -> float:
    """K and V of every layer, this rank's share of the KV heads."""
    return 2 * m.layers * (m.kv_heads / tp) * m.head_dim * DTYPE_BYTES


def num_kv_blocks(m: LlamaShape, gpu: GPU, tp: int) -> int:
    free = gpu.hbm_bytes * GPU_MEMORY_UTILISATION - m.params * DTYPE_BYTES / tp - ACTIVATION_RESERVE_BYTES
    return int(free // (kv_bytes_per_token(m, tp) * BLOCK_SIZE)) if free > 0 else 0


def step_cost(m: LlamaShape, gpu: GPU, tp: int) -> LinearCostModel:
    flops = gpu.bf16_flops * MATMUL_EFFICIENCY
    bandwidth = gpu.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY
    # Ring all-reduce moves 2 (tp - 1) / tp of the message per rank.
    link = gpu.nvlink_bytes_per_s * LINK_EFFICIENCY
    allreduce_per_token = 0.0 if tp == 1 else 2 * m.layers * 2 * (tp - 1) / tp * m.hidden * DTYPE_BYTES / link
    allreduce_latency = 0.0 if tp == 1 else 2 * m.layers * ALLREDUCE_LATENCY_S
    layer_flops_per_token = 2 * m.layers * m.layer_params / tp
    lm_head_flops = 2 * m.vocab * m.hidden / tp  # only rows that sample: every decode row
    attention_flops_per_pair = 4 * m.layers * (m.heads / tp) * m.head_dim
    coefficients = {
        "step": m.params * DTYPE_BYTES / tp / bandwidth + allreduce_latency + HOST_STEP_S,
        "prefill_tokens": layer_flops_per_token / flops + allreduce_per_token,
        "prefill_attention": attention_flops_per_pair / (gpu.bf16_flops * ATTENTION_EFFICIENCY),
        "decode_rows": (layer_flops_per_token + lm_head_flops) / flops + allreduce_per_token,
        "decode_context": kv_bytes_per_token(m, tp) / bandwidth,
        "swapped_blocks": kv_bytes_per_token(m, tp) * BLOCK_SIZE / (gpu.pcie_bytes_per_s * LINK_EFFICIENCY),
        "prefill_rows": 0.0,  # the extended model's; a roofline has no per-row term
    }
    return LinearCostModel(tuple(coefficients[f] for f in FEATURES))


def profile_name(model: str, gpu: str, tp: int) -> str:
    return f"{model}_{gpu}_tp{tp}"


def roofline_profile(model: str, gpu: str, tp: int) -> Profile | None:
    """None when the weights and one full-context request do not fit."""
    m, g = MODELS[model], GPUS[gpu]
    blocks = num_kv_blocks(m, g, tp)
    if blocks * BLOCK_SIZE < m.max_model_len:
        return None
    provenance = {
        "source": "roofline", "model": m.name, "device": g.name, "dtype": "bfloat16", "tensor_parallel_size": tp,
        "commit": None,
        "assumptions": {"bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "matmul_efficiency": MATMUL_EFFICIENCY,
                        "attention_efficiency": ATTENTION_EFFICIENCY, "link_efficiency": LINK_EFFICIENCY,
                        "allreduce_latency_s": ALLREDUCE_LATENCY_S, "host_step_s": HOST_STEP_S,
                        "gpu_memory_utilisation": GPU_MEMORY_UTILISATION,
                        "activation_reserve_gib": ACTIVATION_RESERVE_BYTES / GIB},
        "sources": "NVIDIA H100/H200 datasheets; meta-llama/Llama-3.1 config.json (simulator/roofline.py)",
    }
    return Profile(profile_name(model, gpu, tp), False, provenance,
                   Geometry(BLOCK_SIZE, blocks, m.max_model_len, m.vocab), step_cost(m, g, tp), HostCost())


def all_profiles() -> dict[str, Profile | None]:
    return {profile_name(m, g, tp): roofline_profile(m, g, tp) for m in MODELS for g in GPUS for tp in TP_SIZES}


def write_all(directory: Path = PROFILES_DIR / "roofline") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, profile in all_profiles().items():
        if profile is not None:
            path = directory / f"{name}.json"
            profile.write(path)
            written.append(path)
    return written


def profiles_table(profiles: dict[str, Profile | None] | None = None) -> str:
    """The shipped profiles as a Markdown table (docs/capacity-planning.md,
    rendered by devtools.docgen so that it cannot drift from this file)."""
    profiles = all_profiles() if profiles is None else profiles
    lines = ["| profile | KV tokens | step (ms) | per decode row (µs) | per prefill token (µs) "
             "| per decode context token (ns) |", "|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        if p is None:
            lines.append(f"| `roofline/{name}` | does not fit: the weights and one full context exceed the GPUs' "
                         "memory | | | | |")
            continue
        c = p.step_cost.as_dict()
        g = p.geometry
        lines.append(f"| `roofline/{name}` | {g.num_kv_blocks * g.block_size:,} | {c['step'] * 1e3:.2f} "
                     f"| {c['decode_rows'] * 1e6:.1f} | {c['prefill_tokens'] * 1e6:.1f} "
                     f"| {c['decode_context'] * 1e9:.1f} |")
    return "\n".join(lines) + "\n"
