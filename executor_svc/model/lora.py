"""LoRA adapters (PEFT format) on the base model's seven dense projections.

An adapter adds, to projection p's output for the tokens of requests that
use it, scale * (x A_p^T) B_p^T, with A_p [rank, in] and B_p [out, rank]
as PEFT stores them and scale = lora_alpha / rank (lora_alpha / sqrt(rank)
with use_rslora). The order of operations is PEFT's (shrink, expand, then
scale), so fp32 runs match it.

The scheduler owns the adapter slots (scheduler_svc/core/lora_slots.py):
EXECUTOR_MAX_LORAS device slots, each holding one adapter or none, and
each plan's evictions and loads (StepPlan.lora_*) applied before its
forward. A slot's weights live in buffers allocated once per base layer at
start-up: A [slots, parts, max rank, in] and B^T [slots, max rank, out], zero
past each adapter's rank, with its rank and scale beside them; nothing is
allocated per step or per load, which CUDA graphs and the kernels need. A
load zeroes every row of its slot before writing the adapter's (a part the
adapter does not target stays zero), so a slot never serves its previous
adapter's weights. Every configured adapter is read and checked at
start-up; EXECUTOR_MAX_CPU_LORAS of them stay in host memory (least
recently loaded dropped first) and the others are read from disk again
when loaded. A token's slot (-1: the base model) comes from its request
(LoraBatch, set by the runner before each forward).

Compute, either way a loop over adapters, never over requests; a batch
with no adapter tokens does nothing here, and a model with no adapters
configured has no LoRA state at all (Linear.lora is None):
- torch (the CPU's): the tokens of each adapter present are gathered and
  run through views of its slot's A and B cut at its rank;
- triton (with the triton attention backend, as on CUDA): llmsched_kernels/lora.py's
  shrink and expand, one launch each per layer for every adapter, rank and
  fused part at once; base tokens are in no adapter's run and cost nothing.

Anything in an adapter that would change the math beyond that (DoRA,
modules_to_save, embedding or lm_head weights, a trained bias, per-module
rank or alpha patterns, ...) is refused by name at start-up.

Runtime adapters (RegisterLoraAdapter, EXECUTOR_RUNTIME_LORA_DIR) are read
and checked by the same code, under a key the scheduler makes unique per
load; their path must resolve (symlinks and `..` followed) inside the
directory. Ids (indices in LoraSet.names) are never reused: an
unregistered adapter leaves a None behind, so request rows keep theirs.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from executor_svc.model.layers import ColumnLinear, RowLinear
from executor_svc.step.host_memory import to_device
from llmsched.errors import StartupError

# PEFT module name -> (our fused layer under a decoder layer, part index in it).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0),
}
SUPPORTED = "LoRA on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"

# adapter_config.json keys that do not change inference, or whose value is
# checked below; any other key set to something truthy is refused by name.
HARMLESS_KEYS = {
    "peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "lora_dropout", "bias",
    "modules_to_save", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "base_model_name_or_path",
    "revision", "inference_mode", "init_lora_weights", "layers_to_transform", "layers_pattern", "auto_mapping",
    "exclude_modules", "peft_version", "qalora_group_size", "megatron_core", "runtime_config",
    # initialisation methods that leave the base weights alone: they decide
    # the saved weights, not how they are applied
    "eva_config", "lora_ga_config",
}
# init_lora_weights methods that rewrite the base weights the adapter is
# trained against; PEFT saves such an adapter as plain LoRA (and sets
# init_lora_weights back to true) only when asked to convert it.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass(slots=True)
class LoraWeights:
    """One adapter's A and B for one projection: whole on the host (Adapter),
    this rank's share on the device (a slot of LoraLinear)."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    # "model.layers.0.self_attn.q_proj" -> weights
    weights: dict[str, LoraWeights] = field(default_factory=dict)


def parse_adapters(setting: str) -> list[tuple[str, str]]:
    """EXECUTOR_LORA_ADAPTERS `name=path,...` -> [(name, path)]."""
    pairs = []
    for item in filter(None, (s.strip() for s in setting.split(","))):
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise StartupError(f"EXECUTOR_LORA_ADAPTERS: {item!r} is not name=path")
        if any(name == n for n, _ in pairs):
            raise StartupError(f"EXECUTOR_LORA_ADAPTERS: adapter {name!r} is named twice")
        pairs.append((name, path))
    return pairs


def _refuse(where: str, why: str) -> StartupError:
    return StartupError(f"{where}: {why}; supported: {SUPPORTED}, rank up to EXECUTOR_MAX_LORA_RANK, "
                        "lora_alpha and use_rslora scaling")


class LoraRefused(Exception):
    """A runtime adapter refused (RegisterLoraAdapter): `code` is the gRPC
    status name the executor answers with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def resolve_runtime_path(directory: str, path: str) -> str:
    """A runtime adapter's path, absolute or relative to the runtime
    directory (already resolved), with symlinks and `..` followed; refused
    unless it lies inside the directory."""
    if not path:
        raise LoraRefused("INVALID_ARGUMENT", "lora_path: must not be empty")
    resolved = os.path.realpath(os.path.join(directory, path))
    if os.path.commonpath([resolved, directory]) != directory:
        raise LoraRefused("PERMISSION_DENIED", f"lora_path: {path!r} resolves to {resolved}, outside "
                                               f"EXECUTOR_RUNTIME_LORA_DIR ({directory})")
    if not os.path.isdir(resolved):
        raise LoraRefused("NOT_FOUND", f"lora_path: {resolved} is not a directory")
    return resolved


def read_adapter(name: str, path: str, max_rank: int, device: torch.device, dtype: torch.dtype,
                 setting: str = "EXECUTOR_LORA_ADAPTERS") -> Adapter:
    """Reads and checks one PEFT adapter directory; `setting` names where it
    came from in a refusal."""
    from safetensors.torch import load_file

    where = f"{setting}: adapter {name!r} ({path})"
    directory = Path(path)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise StartupError(f"{where}: expected adapter_config.json and adapter_model.safetensors (PEFT's format)")
    cfg = json.loads(config_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(where, f"peft_type {cfg.get('peft_type')} is not implemented")
    if cfg.get("use_dora"):
        raise _refuse(where, "DoRA (use_dora) is not implemented")
    if cfg.get("modules_to_save"):
        raise _refuse(where, f"modules_to_save {cfg['modules_to_save']} is not implemented")
    if cfg.get("bias", "none") != "none":
        raise _refuse(where, f"bias={cfg['bias']!r} is not implemented (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(where, "fan_in_fan_out (Conv1D layouts) is not implemented")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS) or cfg.get("loftq_config"):
        raise _refuse(where, f"init_lora_weights={init!r} (or loftq_config) rewrites the base weights the adapter "
                             "was trained against, which is not implemented; save it converted to plain LoRA "
                             "(PEFT's path_initial_model_for_weight_conversion)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(where, f"{key} (per-module rank or alpha) is not implemented")
    for key, value in cfg.items():
        if key not in HARMLESS_KEYS and value not in (None, False, {}, [], "", 0):
            raise _refuse(where, f"adapter_config.json sets {key}={value!r}, which is not implemented")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank > max_rank:
        raise StartupError(f"{where}: rank {rank} exceeds EXECUTOR_MAX_LORA_RANK={max_rank}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    adapter = Adapter(name, path, rank, scale)
    tensors = load_file(str(weights_path))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, leaf = key.removeprefix("base_model.model.").rpartition(".lora_")
        short = module.rpartition(".")[2]
        if leaf not in ("A.weight", "B.weight"):
            raise _refuse(where, f"tensor {key} is not a LoRA A/B weight (embedding, bias or DoRA weights are not "
                                 "implemented)")
        if short not in TARGETS:
            raise _refuse(where, f"tensor {key}: LoRA on {short} is not implemented (embedding and lm_head included)")
        pending.setdefault(module, {})[leaf[0]] = value
    for module, ab in pending.items():
        if set(ab) != {"A", "B"}:
            raise StartupError(f"{where}: {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise StartupError(f"{where}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} are not of rank {rank}")
        adapter.weights[module] = LoraWeights(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return adapter


IMPLS = ("torch", "triton")


@dataclass(slots=True)
class LoraBatch:
    """Which adapter each token of the running step uses: the runner sets it
    before each forward (the linear layers' call sites take no metadata).
    groups (torch): (slot, token indices) per adapter present; order and
    starts (triton): llmsched_kernels.lora.sort_by_slot's. Both empty (None) when
    the batch is base-model only."""

    num_slots: int
    impl: str = "torch"
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    padded: PaddedGroups | None = None  # torch: the groups as one batch, when padding them costs little
    order: torch.Tensor | None = None  # [num_tokens] int32: token indices slot by slot
    starts: torch.Tensor | None = None  # [num_slots + 1] int32: where each slot's tokens start in order
    # Each slot's adapter's scale (LoraLinear.write keeps it), for `padded`.
    slot_scales: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slot_scales = [1.0] * self.num_slots

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups) or self.order is not None

    def set(self, token_slots: np.ndarray | None, device: torch.device) -> None:
        # token_slots: [num_tokens] host int64, -1 = no adapter; None: no token has one.
        # Grouped on the host (torch) or sorted on the device (triton), so the device never waits for a sync.
        self.groups, self.padded, self.order, self.starts = [], None, None, None
        if token_slots is None:
            return
        if self.impl == "triton":
            from llmsched_kernels.lora import sort_by_slot

            self.order, self.starts = sort_by_slot(to_device(token_slots, device), self.num_slots)
            return
        members = [(int(s), np.flatnonzero(token_slots == s)) for s in np.unique(token_slots) if s >= 0]
        self.groups = [(s, to_device(idx, device)) for s, idx in members]
        self.padded = PaddedGroups.of(members, self.slot_scales, device)


@dataclass(slots=True)
class PaddedGroups:
    """The adapters' token groups as one [groups, longest group] batch, so
    that a layer's deltas take a few batched matmuls instead of a handful
    of ops per adapter (on a small model each op costs more than its
    arithmetic: stories260K, 8 adapters, 64 streams). A group shorter than
    the longest is padded with token 0 at scale 0, so its padding adds
    exact zeros. Used only while padding at most doubles the rows, as in
    decode batches; a long prompt beside a few decodes takes the per-adapter
    loop instead."""

    slots: torch.Tensor  # [groups] int64
    tokens: torch.Tensor  # [groups * longest] int64: each group's token indices, then padding (0)
    scales: torch.Tensor  # [groups, longest, 1]: the group's adapter's scale, 0 on padding
    longest: int
    slot_list: list[int]

    @classmethod
    def of(cls, members: list[tuple[int, np.ndarray]], slot_scales: list[float],
           device: torch.device) -> PaddedGroups | None:
        longest = max(len(idx) for _, idx in members)
        num_tokens = sum(len(idx) for _, idx in members)
        if len(members) < 2 or len(members) * longest > 2 * num_tokens:
            return None
        tokens = np.zeros((len(members), longest), dtype=np.int64)
        scales = np.zeros((len(members), longest, 1), dtype=np.float32)
        for g, (slot, idx) in enumerate(members):
            tokens[g, :len(idx)] = idx
            scales[g, :len(idx)] = slot_scales[slot]
        slot_list = [s for s, _ in members]
        return cls(to_device(np.array(slot_list, dtype=np.int64), device), to_device(tokens.reshape(-1), device),
                   to_device(scales, device), longest, slot_list)


@dataclass(slots=True)
class LoraLinear:
    """The adapters' deltas of one base linear layer (ColumnLinear with
    fused parts, or RowLinear), in buffers made once on the device. Not an
    nn.Module: the layer's `lora` stays a plain attribute."""

    batch: LoraBatch
    part_rows: list[int]  # the base output's columns per part (q, k, v; gate, up; or one)
    a: torch.Tensor  # [num_slots, num_parts, max_rank, in], zero past each slot's rank
    b: torch.Tensor  # [num_slots, max_rank, out]: B^T, the parts' columns side by side, zero past each slot's rank
    ranks: torch.Tensor  # [num_slots] int32 on the device: 0 where the slot's adapter targets no part here
    scales: torch.Tensor  # [num_slots] float32 on the device
    # The same on the host, for the torch path: rank and scale per slot, and
    # which parts its adapter targets ([slot][part]).
    slot_ranks: list[int]
    slot_scales: list[float]
    targets: list[list[bool]]

    @classmethod
    def make_empty(cls, batch: LoraBatch, part_rows: list[int], in_features: int, max_rank: int,
                   device: torch.device, dtype: torch.dtype) -> LoraLinear:
        n = batch.num_slots
        return cls(batch, part_rows, torch.zeros(n, len(part_rows), max_rank, in_features, device=device, dtype=dtype),
                   torch.zeros(n, max_rank, sum(part_rows), device=device, dtype=dtype),
                   torch.zeros(n, dtype=torch.int32, device=device), torch.ones(n, dtype=torch.float32, device=device),
                   [0] * n, [1.0] * n, [[False] * len(part_rows) for _ in range(n)])

    def write(self, slot: int, weights: list[LoraWeights | None], scale: float) -> None:
        """The slot's weights, per part (None: a part the adapter does not
        target): every row of the slot is zeroed first, so nothing of its
        previous adapter stays, past the new rank or in an untargeted part."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank, offset = 0, 0
        for part, (rows, w) in enumerate(zip(self.part_rows, weights)):
            if w is not None:
                rank = w.a.shape[0]
                self.a[slot, part, :rank].copy_(w.a)  # [rank, in]
                self.b[slot, :rank, offset:offset + rows].copy_(w.b.T)  # [rank, rows]
            offset += rows
        self.targets[slot] = [w is not None for w in weights]
        self.slot_ranks[slot], self.slot_scales[slot] = rank, scale
        self.ranks[slot], self.scales[slot] = rank, scale
        self.batch.slot_scales[slot] = scale

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in]; y: [num_tokens, out] (the base output, parts side by side)
        batch = self.batch
        if not batch.has_adapters:
            return y
        if batch.impl == "triton":
            from llmsched_kernels.lora import lora_expand, lora_shrink

            s = lora_shrink(x, self.a, batch.order, batch.starts, self.ranks)  # [num_tokens, parts, max_rank]
            return lora_expand(y, s, self.b, batch.order, batch.starts, self.ranks, self.scales,
                               tuple(self.part_rows))
        if batch.padded is not None:
            return self._add_padded(x, y, batch.padded)
        for slot, idx in batch.groups:
            rank = self.slot_ranks[slot]
            if rank == 0:
                continue
            xs = x[idx]  # [m, in]
            ys = y[idx]  # [m, out]
            parts, offset = [], 0
            for part, (rows, target) in enumerate(zip(self.part_rows, self.targets[slot])):
                ys_part = ys[:, offset:offset + rows]
                if target:
                    a = self.a[slot, part, :rank]  # [rank, in]
                    bt = self.b[slot, :rank, offset:offset + rows]  # [rank, rows]
                    ys_part = ys_part + (xs @ a.T) @ bt * self.slot_scales[slot]  # PEFT's order
                parts.append(ys_part)
                offset += rows
            y = y.index_copy(0, idx, torch.cat(parts, dim=1))
        return y

    def _add_padded(self, x: torch.Tensor, y: torch.Tensor, g: PaddedGroups) -> torch.Tensor:
        """The per-adapter loop's deltas in batched matmuls over the padded
        groups, in PEFT's order (shrink, expand, then scale)."""
        rank = max(self.slot_ranks[s] for s in g.slot_list)  # past it every group's rows are zero
        if rank == 0:
            return y
        groups, parts = len(g.slot_list), len(self.part_rows)
        a = self.a.index_select(0, g.slots)[:, :, :rank].reshape(groups, parts * rank, -1)  # [G, P*r, in]
        bt = self.b.index_select(0, g.slots)[:, :rank]  # [G, r, out]
        xs = x.index_select(0, g.tokens).view(groups, g.longest, -1)  # [G, M, in]
        s = torch.bmm(xs, a.transpose(1, 2))  # [G, M, P*r]
        if parts == 1:
            delta = torch.bmm(s, bt)
        else:
            deltas, offset = [], 0
            for part, rows in enumerate(self.part_rows):
                deltas.append(torch.bmm(s[:, :, part * rank:(part + 1) * rank], bt[:, :, offset:offset + rows]))
                offset += rows
            delta = torch.cat(deltas, dim=2)  # [G, M, out]
        # Padding rows have scale 0: they add exact zeros to token 0.
        scales = g.scales if g.scales.dtype == delta.dtype else g.scales.to(delta.dtype)
        return y.index_add_(0, g.tokens, (delta * scales).view(groups * g.longest, -1))


@dataclass(slots=True)
class _Site:
    """One base layer the adapters may target, and how a rank's share of an
    adapter's A and B is cut for it."""

    linear: ColumnLinear | RowLinear
    lora: LoraLinear
    # PEFT module name per part ("model.layers.0.self_attn.q_proj", ...)
    modules: list[str]
    whole_in: int
    whole_out: list[int]  # per part

    def shard(self, part: int, w: LoraWeights) -> LoraWeights:
        """This rank's share (layers.py): a ColumnLinear's rows of B (each
        part's [start, start + rows), so replicated KV heads come out
        right), a RowLinear's columns of A. A row-split layer's delta,
        (x_rank A_rank^T) B^T, is then this rank's share of the whole,
        summed by the same all-reduce as the base output."""
        linear = self.linear
        if isinstance(linear, ColumnLinear):
            p = linear.parts[part]
            return LoraWeights(w.a, w.b[p.start:p.start + p.rows])
        return LoraWeights(w.a[:, linear.start:linear.start + linear.cols], w.b)


def attach_sites(model: nn.Module, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[LoraBatch, list[_Site], dict[str, str]]:
    """Gives each dense projection the adapters may target its LoraLinear,
    with num_slots empty slots of max_rank; returns the LoraBatch the runner
    sets per step, the sites, and why each module that cannot take LoRA
    cannot (by PEFT module name)."""
    batch = LoraBatch(num_slots)
    sites: list[_Site] = []
    refused: dict[str, str] = {}
    for i, layer in enumerate(model.model.layers):
        for fused in sorted({t[0] for t in TARGETS.values()}):
            shorts = [s for s, (f, _) in TARGETS.items() if f == fused]
            modules = [f"model.layers.{i}.{fused.rpartition('.')[0]}.{s}" for s in shorts]
            linear = layer.get_submodule(fused) if _has(layer, fused) else None
            if not isinstance(linear, (ColumnLinear, RowLinear)):
                for m in modules:
                    refused[m] = (f"model.layers.{i}.{fused} is not a dense linear layer in "
                                  f"{model.cfg.architecture}; {SUPPORTED} of dense decoder layers")
                continue
            column = isinstance(linear, ColumnLinear)
            part_rows = [p.rows for p in linear.parts] if column else [linear.out_features]
            lora = LoraLinear.make_empty(batch, part_rows, linear.in_cols, max_rank, device, dtype)
            linear.lora = lora
            sites.append(_Site(linear, lora, modules, linear.in_features if column else linear.whole_in,
                               [p.whole for p in linear.parts] if column else [linear.out_features]))
    return batch, sites, refused


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


class LoraSet:
    """The adapters served: every configured one checked at start-up, the
    device slots the scheduler fills, and a host cache of read adapters."""

    def __init__(self, pairs: list[tuple[str, str]], model: nn.Module, max_rank: int, num_slots: int,
                 max_cpu: int, device: torch.device, dtype: torch.dtype, runtime_dir: str = ""):
        # [adapter id] -> its name (a runtime adapter's key), None once unregistered.
        self.names: list[str | None] = [n for n, _ in pairs]
        self.static_names = tuple(self.names)
        self.paths = dict(pairs)
        # EXECUTOR_RUNTIME_LORA_DIR, resolved ("" = no runtime adapters), and
        # the keys registered at runtime.
        self.runtime_dir = runtime_dir
        self.runtime: set[str] = set()
        self.max_rank, self.device, self.dtype = max_rank, device, dtype
        self.max_cpu = max_cpu
        self.batch, self.sites, self.refused = attach_sites(model, num_slots, max_rank, device, dtype)
        self._site_of = {m: (site, part) for site in self.sites for part, m in enumerate(site.modules)}
        self.slots: list[str | None] = [None] * num_slots
        # [adapter id] -> its slot, -1 when in none (ids: indices in names).
        self.slot_by_id = np.full(len(self.names), -1, dtype=np.int64)
        # Adapters read, on the host, least recently loaded first.
        self.host: OrderedDict[str, Adapter] = OrderedDict()
        self.num_disk_reads = 0
        for name in self.names:
            self._keep(self._read(name))

    def _read(self, name: str) -> Adapter:
        setting = "lora_path" if name in self.runtime else "EXECUTOR_LORA_ADAPTERS"
        adapter = read_adapter(name, self.paths[name], self.max_rank, torch.device("cpu"), self.dtype, setting)
        self._check_fits(adapter, setting)
        return adapter

    # ----- runtime adapters (RegisterLoraAdapter) ---------------------------

    def read_runtime(self, key: str, path: str) -> tuple[str, Adapter]:
        """Resolves and reads a runtime adapter and checks it exactly as a
        start-up one; touches no state, so it may run off the step thread.
        Raises LoraRefused."""
        if not self.runtime_dir:
            raise LoraRefused("FAILED_PRECONDITION", "runtime LoRA adapters are off on this executor: "
                                                     "EXECUTOR_RUNTIME_LORA_DIR is not set")
        resolved = resolve_runtime_path(self.runtime_dir, path)
        try:
            adapter = read_adapter(key, resolved, self.max_rank, torch.device("cpu"), self.dtype, "lora_path")
            self._check_fits(adapter, "lora_path")
        except StartupError as exc:
            raise LoraRefused("INVALID_ARGUMENT", str(exc)) from None
        except Exception as exc:  # unreadable JSON or safetensors, a missing key: not a PEFT adapter
            raise LoraRefused("INVALID_ARGUMENT", f"lora_path: adapter at {resolved} could not be read "
                                                  f"({type(exc).__name__}: {exc})") from None
        return resolved, adapter

    def register(self, key: str, path: str, adapter: Adapter | None = None) -> None:
        """Serves a runtime adapter under `key` (a new id); `adapter`, read
        by read_runtime, goes to the host cache (None: read at its first
        load, as tensor-parallel ranks other than 0 do)."""
        if key in self.paths:
            if self.paths[key] != path:
                raise LoraRefused("ALREADY_EXISTS", f"LoRA adapter key {key!r} is registered with "
                                                    f"{self.paths[key]}, not {path}")
            return  # the scheduler registering its adapters again
        self.paths[key] = path
        self.runtime.add(key)
        self.slot_by_id = np.append(self.slot_by_id, -1)
        self.names.append(key)
        if adapter is not None:
            self._keep(adapter)

    def unregister(self, key: str) -> bool:
        """Forgets a runtime adapter: its slot, host copy and key (its id
        is not reused). The scheduler calls it once no plan names it."""
        if key not in self.runtime:
            return False
        slot = self.slot_of(key)
        if slot is not None:
            self.evict(slot)
        self.names[self.names.index(key)] = None
        del self.paths[key]
        self.host.pop(key, None)
        self.runtime.discard(key)
        return True

    def forget_runtime(self) -> None:
        """A new step stream: its scheduler registers its own adapters."""
        for key in list(self.runtime):
            self.unregister(key)

    def _keep(self, adapter: Adapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)

    def _check_fits(self, a: Adapter, setting: str = "EXECUTOR_LORA_ADAPTERS") -> None:
        for module, w in a.weights.items():
            if module in self.refused:
                raise StartupError(f"{setting}: {self.refused[module]}")
            if module not in self._site_of:
                raise StartupError(f"{setting}: adapter {a.name!r} has weights for modules the base "
                                   f"model does not have: {sorted(set(a.weights) - set(self._site_of))[:3]}")
            site, part = self._site_of[module]
            if w.b.shape[0] != site.whole_out[part] or w.a.shape[1] != site.whole_in:
                raise StartupError(f"{setting}: adapter {a.name!r}: {module}: A {tuple(w.a.shape)} "
                                   f"and B {tuple(w.b.shape)} do not fit the base layer ({site.whole_in} in, "
                                   f"{site.whole_out[part]} out)")

    def use_impl(self, impl: str) -> None:
        """Computes the deltas with `impl`: torch, or triton (llmsched_kernels/lora.py:
        CUDA, or the CPU under TRITON_INTERPRET=1); anything else is refused."""
        if impl not in IMPLS:
            raise ValueError(f"LoRA compute {impl!r} is not implemented; supported: {', '.join(IMPLS)}")
        self.batch.impl = impl

    @property
    def impl(self) -> str:
        return self.batch.impl

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def slot_of(self, name: str) -> int | None:
        """The slot holding the adapter, or None when none does."""
        try:
            return self.slots.index(name)
        except ValueError:
            return None

    def id_of(self, name: str) -> int | None:
        """The adapter's id (a request row keeps it), or None when not served."""
        try:
            return self.names.index(name)
        except ValueError:
            return None

    def evict(self, slot: int) -> None:
        """Empties the slot: every part of every layer's delta goes (zeroed, rank 0)."""
        self._check_slot(slot)
        for site in self.sites:
            site.lora.write(slot, [None] * len(site.modules), 1.0)
        if self.slots[slot] is not None:
            self.slot_by_id[self.names.index(self.slots[slot])] = -1
        self.slots[slot] = None

    def load(self, slot: int, name: str) -> bool:
        """Puts the adapter in the slot, replacing all it held; returns
        whether it was read from disk (not in the host cache)."""
        self._check_slot(slot)
        if name not in self.paths:
            raise ValueError(f"LoRA load: adapter {name!r} is not served here")
        adapter = self.host.get(name)
        from_disk = adapter is None
        if from_disk:
            adapter = self._read(name)
            self.num_disk_reads += 1
        self._keep(adapter)
        for site in self.sites:
            weights = [adapter.weights.get(module) for module in site.modules]
            site.lora.write(slot, [None if w is None else site.shard(part, w) for part, w in enumerate(weights)],
                            adapter.scale)
        # An adapter sits in one slot: a stale copy elsewhere (the scheduler
        # took the slots as empty after a reset) is dropped from the lookup.
        for s, held in enumerate(self.slots):
            if held == name:
                self.slots[s] = None
        if self.slots[slot] is not None:
            self.slot_by_id[self.names.index(self.slots[slot])] = -1
        self.slots[slot] = name
        self.slot_by_id[self.names.index(name)] = slot
        return from_disk

    def evict_all(self) -> None:
        for slot in range(self.num_slots):
            self.evict(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is out of range (EXECUTOR_MAX_LORAS={self.num_slots})")


def load_adapters(setting: str, model: nn.Module, max_rank: int, max_loras: int, device: torch.device,
                  dtype: torch.dtype, max_cpu_loras: int = 0, runtime_dir: str = "") -> LoraSet | None:
    """EXECUTOR_LORA_ADAPTERS, each read and checked against `model`, with
    max_loras empty device slots attached to it; None when the setting and
    runtime_dir (EXECUTOR_RUNTIME_LORA_DIR) are empty (the model stays
    untouched). max_cpu_loras: adapters kept in host memory (0: every
    configured one, and max_loras runtime ones beyond them)."""
    pairs = parse_adapters(setting)
    if runtime_dir:
        resolved = os.path.realpath(runtime_dir)
        if not os.path.isdir(resolved):
            raise StartupError(f"EXECUTOR_RUNTIME_LORA_DIR={runtime_dir!r} is not a directory; it holds the "
                               "adapters /v1/load_lora_adapter may load (empty = runtime loading off)")
        runtime_dir = resolved
    if not pairs and not runtime_dir:
        return None
    if max_cpu_loras and max_cpu_loras < max_loras:
        raise StartupError(f"EXECUTOR_MAX_CPU_LORAS={max_cpu_loras} is below EXECUTOR_MAX_LORAS={max_loras}: an "
                           "adapter loaded into a device slot is read through the host cache; supported: "
                           "EXECUTOR_MAX_CPU_LORAS >= EXECUTOR_MAX_LORAS, or 0 (every configured adapter)")
    max_cpu = max_cpu_loras or len(pairs) + (max_loras if runtime_dir else 0)
    return LoraSet(pairs, model, max_rank, max_loras, max_cpu, device, dtype, runtime_dir)
