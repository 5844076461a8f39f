"""Start-up shared by every rank: the checkpoint's config, the device, the
tensor-parallel group, then this rank's shard of the weights, its KV pool
and its model runner."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.attention import make_backend
from executor_svc.model.batch_invariant import ROW_UNIT, make_batch_invariant
from executor_svc.model.checkpoint import (Checkpoint, checkpoint_shards, load_checkpoint, read_config_file,
                                          tensor_names)
from executor_svc.model.eagle3 import UNUSED as EAGLE3_UNUSED
from executor_svc.model.eagle3 import Eagle3Head, eagle3_model_class, read_eagle3
from executor_svc.config import ExecutorSettings
from executor_svc.step.constraints import ConstraintMatchers
from executor_svc.step.host_kv import HostKVPool, host_pool_num_blocks
from executor_svc.step.kv_cache import KVCachePool, pool_num_blocks, resolve_kv_cache_dtype
from executor_svc.model.cpu_gemv import has_cxx_compiler, use_cpu_gemv
from executor_svc.model.cpu_fp8_linear import use_cpu_fp8_kernel
from executor_svc.model.cpu_int_linear import use_cpu_int_kernels
from executor_svc.model.families import build_model, family_of, read_config
from executor_svc.model.model import build_model as build_model_as
from executor_svc.model.mtp import MTPHead, mtp_config, mtp_model_class, mtp_tensors
from executor_svc.model.model_config import ModelConfig
from executor_svc.inductor_cache import key_by_isa
from executor_svc.model.moe import experts_on_torch_loop, use_triton_moe
from executor_svc.model.model import CausalLM
from executor_svc.step.draft_model import DraftModel, vocabulary_mismatch
from executor_svc.step.ngram import NgramProposer
from executor_svc.step.head_drafts import HeadProposer
from executor_svc.step.invariance_check import self_test
from executor_svc.step.runner import FromRank0, ModelRunner
from executor_svc.model.sharding import Shard
from executor_svc.tensor_parallel import TPGroup, join, rank_device
from executor_svc.model.lora import load_adapters
from llmsched.errors import StartupError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def use_cuda_graphs(setting: str, device: torch.device, backend_name: str, tp_size: int,
                    experts_on_torch_loop: int = 0) -> bool:
    """EXECUTOR_CUDA_GRAPHS=auto: on for CUDA with the triton backend, on one
    device, unless some expert layers run the torch loop (quantized experts
    the fused-MoE kernel does not read), which syncs with the host every
    layer. MoE layers on the fused-MoE kernel and MLA's decode kernel take
    no host syncs (llmsched_kernels/fused_moe.py align_by_expert), so they
    are captured like dense layers. Under tensor parallelism decode steps
    run eagerly: capturing the NCCL all-reduces has not been tested on a
    multi-GPU machine yet."""
    return (setting == "auto" and device.type == "cuda" and backend_name == "triton" and tp_size == 1
            and not experts_on_torch_loop)


# A model below this hidden size is tiny on the CPU: per-op dispatch is
# most of a decode step, which the compiled decode removes (stories260K,
# hidden 64: docs/performance.md, P12 and CPU placement), and a token's
# products are too small for a second torch thread to share (torch runs
# such ops on one thread anyway), so more threads only wake for nothing.
TINY_HIDDEN = 512


def check_torch_compile(setting: str, device: torch.device, tp_size: int, cfg: ModelConfig | None = None,
                        kv_cache_dtype: str = "auto", batch_invariant: bool = False,
                        cpu_fp8_kernel: str = "auto") -> bool:
    if setting == "off":
        return False
    if setting == "auto":
        return compile_pays(device, tp_size, cfg, kv_cache_dtype, batch_invariant, cpu_fp8_kernel)
    if kv_cache_dtype != "auto":
        # The compiled graph reads the pool with its own gather (compiled_decode.py), which does not dequantize.
        raise StartupError("EXECUTOR_TORCH_COMPILE=on is not implemented with "
                           f"EXECUTOR_KV_CACHE_DTYPE={kv_cache_dtype}; leave EXECUTOR_KV_CACHE_DTYPE=auto to compile "
                           "decode steps")
    if cfg is not None and (cfg.moe is not None or cfg.mla is not None):
        raise StartupError(f"EXECUTOR_TORCH_COMPILE=on is implemented for dense families only; {cfg.architecture} "
                           "has mixture-of-experts or latent-attention layers")
    if device.type != "cpu":
        raise StartupError(f"EXECUTOR_TORCH_COMPILE=on compiles CPU decode steps; the device is {device} "
                           "(on CUDA, EXECUTOR_CUDA_GRAPHS=auto serves that purpose)")
    if tp_size > 1:
        raise StartupError("EXECUTOR_TORCH_COMPILE=on is not implemented with EXECUTOR_TENSOR_PARALLEL_SIZE > 1")
    return True


def compile_pays(device: torch.device, tp_size: int, cfg: ModelConfig | None, kv_cache_dtype: str,
                 batch_invariant: bool, cpu_fp8_kernel: str = "auto") -> bool:
    """EXECUTOR_TORCH_COMPILE=auto: compile decode steps where the compiled
    graph serves them, a dense model on one CPU rank, unquantized or with
    FP8 or integer weights (the CPU FP8 kernel is an operator of the graph,
    torch's int4/int8 kernels are aten operators), given a C++ compiler for
    inductor. On a tiny model per-op dispatch is most of a step
    (stories260K: 0.84 ms a token through the services compiled, 1.67
    eager, docs/performance.md P12); from hidden size 512 up the step
    compiles layerwise, a few seconds cold (compiled_decode.LAYERWISE_HIDDEN),
    and still saves each layer's few dozen eager ops (a Qwen3-0.6B shape's
    one-row step, P24; P20's quantized models gain 1.09x to 1.45x for
    one stream and 1.04x to 1.10x at 64). Schemes that quantize
    activations at run time are not measured compiled: `on`."""
    why_not = None
    if device.type != "cpu" or tp_size > 1:
        why_not = "not a single CPU rank"
    elif cfg is None or cfg.moe is not None or cfg.mla is not None:
        why_not = "not a dense family"
    elif cfg.quantization is not None and not all(
            s.activations is None and (s.kind == "int" or (s.kind == "fp8" and cpu_fp8_kernel != "off"))
            for _, s in cfg.quantization.schemes):
        why_not = ("a quantized checkpoint whose activations are quantized too, or FP8 off its CPU kernel "
                   "(EXECUTOR_TORCH_COMPILE=on compiles it)")
    elif kv_cache_dtype != "auto" or batch_invariant:
        why_not = "EXECUTOR_KV_CACHE_DTYPE or EXECUTOR_BATCH_INVARIANT rules it out"
    elif not has_cxx_compiler():
        why_not = "no C++ compiler for inductor"
    log.info("EXECUTOR_TORCH_COMPILE=auto: %s", f"off ({why_not})" if why_not else "compiling CPU decode steps")
    return why_not is None


@dataclass(slots=True)
class LoadedModel:
    ckpt: Checkpoint
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    pool: KVCachePool  # pool.dtype: the KV cache's element type (EXECUTOR_KV_CACHE_DTYPE)
    host_kv: HostKVPool | None
    runner: ModelRunner
    cuda_graphs: bool
    torch_compile: bool
    tp: TPGroup | None
    weight_bytes: int  # this rank's, as loaded (weight_bytes())
    generates: bool = True  # False: no lm_head in the checkpoint, embeddings only
    # torch's intra-op threads, as set on the loading thread (OpenMP keeps
    # the count per thread: ask the thread that loaded, not another).
    torch_threads: int = 1


def default_cpu_threads(cfg: ModelConfig, num_local_ranks: int) -> int:
    """EXECUTOR_NUM_THREADS=0 on the CPU: one per core this process may run
    on (its affinity, which llmsched.launch narrows to all cores but the
    scheduler's from three cores up), divided among the ranks sharing them;
    one for a tiny model."""
    return 1 if cfg.hidden_size < TINY_HIDDEN else cores_per_rank(num_local_ranks)


def cores_per_rank(num_local_ranks: int) -> int:
    """This process's cores (its affinity), shared among the ranks on them."""
    return max(1, len(os.sched_getaffinity(0)) // num_local_ranks)


def _set_threads(settings: ExecutorSettings, device: torch.device, cfg: ModelConfig) -> None:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    elif device.type == "cpu":
        torch.set_num_threads(default_cpu_threads(cfg, local))
    elif local > 1:
        # GPU ranks sharing this node's cores would otherwise each take them all.
        torch.set_num_threads(cores_per_rank(local))


def load(settings: ExecutorSettings) -> LoadedModel:
    ckpt = load_checkpoint(settings.model)
    cfg = read_config(ckpt.hf_config, ckpt.generation_config)
    size = settings.tensor_parallel_size
    device = rank_device(settings.device, int(os.environ.get("LOCAL_RANK", "0")) if size > 1 else 0, size)
    invariant = check_batch_invariant(settings)
    torch_compile = check_torch_compile(settings.torch_compile, device, size, cfg, settings.kv_cache_dtype, invariant,
                                        settings.cpu_fp8_kernel)
    tp = join(settings, cfg, device)
    _set_threads(settings, device, cfg)
    shard = tp.shard if tp else Shard()
    dtype = resolve_dtype(settings.dtype, device)
    if device.type == "cpu":
        key_by_isa()  # before anything compiles with inductor (inductor_cache.py)
    max_model_len = settings.max_model_len or cfg.max_position_embeddings
    model = build_model(cfg, ckpt.lazy_tensors(), max_model_len, device, dtype, shard, tp,
                        headless_ok=ckpt.pooling.pooling is not None)
    if device.type == "cpu" and cfg.quantization is not None:
        use_cpu_int_kernels(model, dtype, settings.cpu_int_kernels, invariant)
        use_cpu_fp8_kernel(model, settings.cpu_fp8_kernel, invariant)
    if device.type == "cpu":
        use_cpu_gemv(model, settings.cpu_gemv, invariant, prepack=settings.cpu_bf16_prepack)
    if invariant:
        log.info("batch-invariant mode: %d GEMM layers made invariant (rows padded to a multiple of %d; on CUDA, "
                 "unquantized ones on the Triton GEMM)", make_batch_invariant(model), ROW_UNIT)
    generates = model.lm_head is not None
    lora = load_adapters(settings.lora_adapters, model, settings.max_lora_rank, settings.max_loras, device, dtype,
                         settings.max_cpu_loras, settings.runtime_lora_dir)
    if lora is not None:
        log.info("LoRA adapters served: %s (%d device slots, %d kept in host memory; runtime loading from %s)",
                 ", ".join(lora.static_names) or "none at start-up", lora.num_slots, lora.max_cpu,
                 lora.runtime_dir or "off")
    if not generates:
        # Nothing is ever sampled, so no decode step is captured or compiled.
        log.info("the checkpoint ships no lm_head.weight (tie_word_embeddings is false): it serves embeddings only")
        torch_compile = False
    loaded_bytes = weight_bytes(model)
    log.info("weights: %.1f MiB on this rank (%s)", loaded_bytes / 2**20,
             f"{cfg.quantization.describe()}, kept quantized" if cfg.quantization is not None else dtype)
    kv_dtype = resolve_kv_cache_dtype(settings.kv_cache_dtype, dtype)
    if kv_dtype != dtype:
        scaled = sum(getattr(layer.self_attn, "k_scale", 1.0) != 1.0 or getattr(layer.self_attn, "v_scale", 1.0) != 1.0
                     for layer in model.model.layers)
        log.info("KV cache in %s (EXECUTOR_KV_CACHE_DTYPE=%s): %d of %d layers with checkpoint k/v scales, the "
                 "others 1.0", kv_dtype, settings.kv_cache_dtype, scaled, len(model.model.layers))
    check_speculative(settings, generates, cfg, ckpt.hf_config)
    # Rank 0 alone proposes drafts, and so alone holds a draft model.
    draft = (load_draft_model(settings, ckpt, device, dtype, max_model_len)
             if settings.speculative_method == "draft" and not (tp and tp.rank != 0) else None)
    mtp = (load_mtp(ckpt, cfg, device, dtype, max_model_len, shard, tp)
           if settings.speculative_method == "mtp" else None)
    eagle3 = (load_eagle3(settings, model, cfg, device, dtype, max_model_len)
              if settings.speculative_method == "eagle3" else None)
    # The proposer's KV, if it keeps any, shares the pool's block count and budget.
    proposer_cfg = (draft.cfg if draft is not None
                    else dataclasses.replace(cfg, num_layers=1) if mtp is not None
                    else eagle3.module.cfg if eagle3 is not None else None)
    num_blocks = pool_num_blocks(cfg, settings.block_size, kv_dtype, device, settings.num_kv_blocks,
                                 settings.kv_cache_memory_mb, shard, proposer_cfg)
    if tp:
        # One pool for the scheduler: the size every rank can hold.
        num_blocks = tp.min_over_ranks(num_blocks)
    pool = KVCachePool(cfg, num_blocks, settings.block_size, device, kv_dtype, shard)
    log.info("KV pool: %s", pool.describe())
    # After the device pool: on the CPU it took from the same MemAvailable.
    num_host_blocks = host_pool_num_blocks(cfg, settings.block_size, kv_dtype, settings.host_kv_cache_memory_mb, shard,
                                           int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if tp else 1)
    if tp:
        num_host_blocks = tp.min_over_ranks(num_host_blocks)
    host_kv = HostKVPool(pool, num_host_blocks, device, settings.debug_fail_swap_every) if num_host_blocks else None
    backend = make_backend(settings.attention_backend, device, batch_invariant=invariant)
    if backend.name == "triton" and use_triton_moe(model):
        log.info("mixture-of-experts layers run the triton fused-MoE kernel (llmsched_kernels/fused_moe.py), "
                 "quantized experts decoded in its load loop")
    if lora is not None and backend.name == "triton":
        lora.use_impl("triton")
        log.info("LoRA deltas run the triton shrink and expand kernels (llmsched_kernels/lora.py)")
    # Batch-invariant mode: one eager path for every batch size.
    cuda_graphs = generates and not invariant and use_cuda_graphs(settings.cuda_graphs, device, backend.name, size,
                                                                  experts_on_torch_loop(model))
    # Rank 0 alone samples, so it alone keeps constraint matchers.
    constraints = None if tp and tp.rank != 0 else ConstraintMatchers(ckpt.tokenizer_json, cfg.vocab_size,
                                                                       list(cfg.eos_token_ids))
    if draft is not None:
        if backend.name == "triton":
            use_triton_moe(draft)  # its experts, if any, as the target's
        draft_pool = KVCachePool(draft.cfg, num_blocks, settings.block_size, device, kv_dtype)
        log.info("draft model's KV pool: %s", draft_pool.describe())
        proposer = DraftModel(draft, draft_pool, backend, device, cfg.vocab_size)
    elif eagle3 is not None:
        # Whole on every rank: each runs it on the same replicated states.
        eagle3_pool = KVCachePool(proposer_cfg, num_blocks, settings.block_size, device, kv_dtype)
        log.info("EAGLE-3 head's KV pool: %s", eagle3_pool.describe())
        proposer = HeadProposer(eagle3, eagle3_pool, backend, device, tp)
    elif mtp is not None:
        mtp_pool = KVCachePool(proposer_cfg, num_blocks, settings.block_size, device, kv_dtype, shard)
        log.info("multi-token-prediction layer's KV pool: %s", mtp_pool.describe())
        proposer = HeadProposer(MTPHead(mtp, model), mtp_pool, backend, device, tp)
    elif settings.speculative_method == "off":
        proposer = None
    elif tp and tp.rank != 0:
        proposer = FromRank0()
    else:
        proposer = NgramProposer(settings.speculative_ngram_min, settings.speculative_ngram_max)
    runner_args = dict(fail_on_token=settings.debug_fail_on_token, max_model_len=max_model_len, tp=tp,
                       constraints=constraints, host_kv=host_kv, pooling=ckpt.pooling.pooling, proposer=proposer,
                       batch_invariant=invariant, lora=lora, speculative_tokens=settings.speculative_tokens)
    try:
        runner = ModelRunner(model, pool, backend, device, cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                             **runner_args)
    except Exception:
        if not (cuda_graphs or torch_compile):
            raise
        # Capture or compilation can fail where the rest works (an op that
        # cannot be captured, no C++ compiler for inductor): serve eagerly,
        # slower but correct.
        log.exception("%s failed; running decode steps eagerly",
                      "CUDA graph capture" if cuda_graphs else "compiling the decode step")
        cuda_graphs = torch_compile = False
        runner = ModelRunner(model, pool, backend, device, **runner_args)
    if invariant and generates:
        check_invariance(runner, tp)
    return LoadedModel(ckpt, cfg, device, dtype, max_model_len, pool, host_kv, runner, cuda_graphs, torch_compile, tp,
                       loaded_bytes, generates, torch.get_num_threads())


def check_batch_invariant(settings: ExecutorSettings) -> bool:
    """Whether EXECUTOR_BATCH_INVARIANT is on; a combination it cannot keep
    invariant is refused by name."""
    if settings.batch_invariant == "off":
        return False
    if settings.torch_compile == "on":
        raise StartupError("EXECUTOR_BATCH_INVARIANT=on runs every step eagerly; it cannot be combined with "
                           "EXECUTOR_TORCH_COMPILE=on (the compiled decode step is a second, batch-size-dependent "
                           "path): set EXECUTOR_TORCH_COMPILE=off")
    if settings.speculative_method != "off":
        raise StartupError(f"EXECUTOR_BATCH_INVARIANT=on is not implemented with EXECUTOR_SPECULATIVE_METHOD="
                           f"{settings.speculative_method} (a verified draft is computed in a multi-token step, "
                           "plain decoding in a one-token step); supported: EXECUTOR_SPECULATIVE_METHOD=off")
    if settings.lora_adapters:
        raise StartupError("EXECUTOR_BATCH_INVARIANT=on is not implemented with EXECUTOR_LORA_ADAPTERS (the adapters' "
                           "own products are not padded); supported: no adapters")
    if settings.runtime_lora_dir:
        raise StartupError("EXECUTOR_BATCH_INVARIANT=on is not implemented with EXECUTOR_RUNTIME_LORA_DIR (runtime "
                           "adapters' products are not padded either); supported: no adapters")
    if settings.tensor_parallel_size > 2:
        raise StartupError(f"EXECUTOR_BATCH_INVARIANT=on supports EXECUTOR_TENSOR_PARALLEL_SIZE 1 or 2, not "
                           f"{settings.tensor_parallel_size}: with more ranks the all-reduce's order of summation "
                           "depends on the message size, hence on the batch (two terms sum the same either way)")
    return True


def check_invariance(runner: ModelRunner, tp: TPGroup | None) -> None:
    """Batch-invariant mode's start-up self-test (invariance_check.py) on
    every rank; rank 0 judges, and every rank refuses start-up with it."""
    t = time.perf_counter()
    why = self_test(runner)
    if tp is not None and tp.min_over_ranks(int(why is None)) == 0 and why is None:
        why = "rank 0's self-test found a difference"
    if why is not None:
        raise StartupError(f"EXECUTOR_BATCH_INVARIANT=on, but this host does not keep it with this model: {why}. "
                           "Set EXECUTOR_BATCH_INVARIANT=off to serve anyway (results then depend on the batch)")
    log.info("batch-invariant mode: the start-up self-test passed in %.1f s", time.perf_counter() - t)


def check_speculative(settings: ExecutorSettings, generates: bool, cfg: ModelConfig | None = None,
                      hf_config: dict | None = None) -> None:
    """Refuses, by name, a speculative method or combination not implemented."""
    method = settings.speculative_method
    if settings.speculative_draft_model and method not in ("draft", "eagle3"):
        raise StartupError(f"EXECUTOR_SPECULATIVE_DRAFT_MODEL is set, but EXECUTOR_SPECULATIVE_METHOD={method} does "
                           "not use it (it is for draft and eagle3)")
    if method == "off":
        return

    if method == "mtp" and cfg is not None:
        layers = (hf_config or {}).get("num_nextn_predict_layers") or 0
        if cfg.family != "deepseek_v3" or layers < 1:
            raise StartupError(f"EXECUTOR_SPECULATIVE_METHOD=mtp: the checkpoint ({cfg.architecture}, "
                               f"num_nextn_predict_layers={layers}) ships no multi-token-prediction layer we load "
                               "(implemented: DeepSeek-V3 and Kimi K2's num_nextn_predict_layers >= 1)")

    if not generates:
        raise StartupError(f"EXECUTOR_SPECULATIVE_METHOD={method}: the checkpoint has no lm_head and cannot generate")
    if method == "draft" and not settings.speculative_draft_model:
        raise StartupError("EXECUTOR_SPECULATIVE_METHOD=draft needs EXECUTOR_SPECULATIVE_DRAFT_MODEL (a checkpoint "
                           "directory or built-in model with the target's tokenizer)")
    if method == "eagle3" and not settings.speculative_draft_model:
        raise StartupError("EXECUTOR_SPECULATIVE_METHOD=eagle3 needs EXECUTOR_SPECULATIVE_DRAFT_MODEL (the EAGLE-3 "
                           "head's directory, in the speculators format)")
    if method == "ngram" and settings.speculative_ngram_min > settings.speculative_ngram_max:
        raise StartupError(f"EXECUTOR_SPECULATIVE_NGRAM_MIN={settings.speculative_ngram_min} exceeds "
                           f"EXECUTOR_SPECULATIVE_NGRAM_MAX={settings.speculative_ngram_max}")


def load_eagle3(settings: ExecutorSettings, target: CausalLM, cfg: ModelConfig, device: torch.device,
                dtype: torch.dtype, max_model_len: int) -> Eagle3Head:
    """The EAGLE-3 head at EXECUTOR_SPECULATIVE_DRAFT_MODEL (model/eagle3.py),
    whole on this device, and the target set to keep the layer inputs it
    reads."""
    name = settings.speculative_draft_model
    where = f"EXECUTOR_SPECULATIVE_DRAFT_MODEL={name!r}"
    path = Path(name)
    if not path.is_dir():
        raise StartupError(f"{where}: not a directory (an EAGLE-3 head in the speculators format)")
    spec = read_eagle3(read_config_file(path / "config.json"), cfg, name)
    shards = checkpoint_shards(path, "EXECUTOR_SPECULATIVE_DRAFT_MODEL")
    names = tensor_names(shards)
    own_embedding = "embed_tokens.weight" in names
    if not own_embedding and spec.layer.hidden_size != cfg.hidden_size:
        raise StartupError(f"{where}: ships no embed_tokens, and the target's embedding is {cfg.hidden_size} wide, "
                           f"the head {spec.layer.hidden_size}")
    ckpt = Checkpoint(path.name, {}, "", shards=shards)
    d2t: list[torch.Tensor] = []

    def used():
        for key, t in ckpt.lazy_tensors():
            if key == "d2t":
                d2t.append(t.read().to(torch.int64))
            elif key not in EAGLE3_UNUSED:
                yield key, t

    model_cls = eagle3_model_class(spec, cfg.hidden_size, "fc.bias" in names, own_embedding)
    try:
        module = build_model_as(spec.layer, used(), max_model_len, device, dtype, model_cls=model_cls)
    except ValueError as exc:
        raise StartupError(f"{where}: {exc}") from None
    if d2t:
        draft_to_target = torch.arange(spec.draft_vocab_size) + d2t[0]
    elif spec.draft_vocab_size == cfg.vocab_size:
        draft_to_target = torch.arange(spec.draft_vocab_size)
    else:
        raise StartupError(f"{where}: no d2t, which maps its {spec.draft_vocab_size} draft ids to the target's")
    if draft_to_target.shape != (spec.draft_vocab_size,) or not (
            (draft_to_target >= 0) & (draft_to_target < cfg.vocab_size)).all():
        raise StartupError(f"{where}: d2t maps draft ids outside the target's {cfg.vocab_size} tokens")
    target.aux_layer_ids = spec.aux_layer_ids
    log.info("EAGLE-3 head %s: %.1f MiB of weights, reading target layers %s, %d draft tokens", path.name,
             weight_bytes(module) / 2**20, list(spec.aux_layer_ids), spec.draft_vocab_size)
    return Eagle3Head(module, target, draft_to_target.to(device))


def load_mtp(ckpt: Checkpoint, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
             shard: Shard, tp: TPGroup | None):
    """The checkpoint's first multi-token-prediction layer (model/mtp.py),
    its index num_hidden_layers; further ones (num_nextn_predict_layers > 1)
    are not loaded: drafts after the first come from the first again, as
    vLLM and SGLang run DeepSeek-V3's."""
    fam = family_of(cfg)
    mtp_cfg = mtp_config(cfg)
    try:
        model = build_model_as(mtp_cfg, mtp_tensors(ckpt.lazy_tensors(), cfg.num_layers), max_model_len, device,
                               dtype, shard, tp, model_cls=mtp_model_class(fam.model_cls), rename=fam.rename)
    except ValueError as exc:
        raise StartupError(f"EXECUTOR_SPECULATIVE_METHOD=mtp: multi-token-prediction layer {cfg.num_layers}: {exc}"
                           ) from None
    log.info("multi-token-prediction layer %d: %.1f MiB of weights (the embedding and lm_head are the target's)",
             cfg.num_layers, weight_bytes(model) / 2**20)
    return model


def load_draft_model(settings: ExecutorSettings, target: Checkpoint, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> CausalLM:
    """EXECUTOR_SPECULATIVE_DRAFT_MODEL, whole on this device (rank 0's
    under tensor parallelism: it alone proposes), refused by name when its
    tokenizer is not the target's or its layout is not one we serve."""
    name = settings.speculative_draft_model
    setting = f"EXECUTOR_SPECULATIVE_DRAFT_MODEL={name!r}"
    ckpt = load_checkpoint(name, "EXECUTOR_SPECULATIVE_DRAFT_MODEL")
    if (why := vocabulary_mismatch(target.tokenizer_json, ckpt.tokenizer_json)) is not None:
        raise StartupError(f"{setting}: {why}")
    try:
        cfg = read_config(ckpt.hf_config, ckpt.generation_config)
        model = build_model(cfg, ckpt.lazy_tensors(), max_model_len, device, dtype, Shard(), None)
    except StartupError as exc:
        raise StartupError(f"{setting}: {exc}") from None
    except ValueError as exc:
        raise StartupError(f"{setting}: {exc}") from None
    if model.lm_head is None:
        raise StartupError(f"{setting}: the checkpoint has no lm_head and cannot draft")
    log.info("draft model %s: %s, %.1f MiB of weights", ckpt.name, cfg.architecture, weight_bytes(model) / 2**20)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """What the model's parameters hold, each tensor once (tied embeddings
    share one): FP8 weights count one byte each."""
    seen, total = set(), 0
    for p in model.parameters():
        # A weight reordered for oneDNN (cpu_prepack.py) has no plain storage.
        key = id(p) if p.is_mkldnn else p.data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total
