"""Executor settings, read from EXECUTOR_* environment variables.

Each field's description is what docs/configuration.md shows for it: that
page is rendered from these classes (python -m devtools.docgen), and a test
fails when it is stale. Importing this module must not import torch."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmsched.logs import LOG_LEVEL_HELP, LogFormat, LogLevel, log_format_help


class ExecutorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXECUTOR_", extra="ignore")

    # Loopback by default: the step channel carries no authentication, so
    # binding it elsewhere must be a deliberate choice.
    host: str = Field(
        default="127.0.0.1", description="Address the step channel binds to. The step channel has no "
        "authentication of its own: keep it on loopback or a private network, or turn on mutual TLS.")
    port: int = Field(default=50052, ge=0, le=65535,
                      description="Port of the `llmsched.v1.Executor` step channel; 0 picks a free port.")
    metrics_port: int = Field(default=8001, ge=0, le=65535,
                              description="Port of the Prometheus `/metrics` endpoint; 0 turns it off.")
    model: str = Field(
        default="tiny-random", description="A built-in model (`tiny-random`, `bench-small`) or a Hugging Face "
        "checkpoint directory with `config.json`, `*.safetensors` and `tokenizer.json`.")
    device: str = Field(
        default="auto", description="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`. Under "
        "tensor parallelism `auto`, `cuda` (each rank on `cuda:LOCAL_RANK`) or `cpu`.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Weights and compute dtype, and the KV cache's unless `EXECUTOR_KV_CACHE_DTYPE` "
        "says otherwise; `auto` = float32 on CPU, bfloat16 on CUDA.")
    # FP8 halves the pool's bytes per token; the scales (value = stored *
    # scale) are the checkpoint's per-layer k_scale / v_scale, else 1.0.
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV cache element type: `auto` = the compute dtype (`EXECUTOR_DTYPE`); "
        "`fp8_e4m3` or `fp8_e5m2` store one byte per value, so the same `EXECUTOR_KV_CACHE_MEMORY_MB` holds about "
        "twice the tokens of a bfloat16 cache. Values are divided by the layer's scale (the checkpoint's "
        "`self_attn.k_scale` / `v_scale`, else 1.0) and saturated to the format's finite range when written, "
        "multiplied back when read. Every attention backend and the host KV tier read and write it; "
        "`EXECUTOR_TORCH_COMPILE=on` is refused with it.")
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int = Field(
        default=0, ge=0, description="Blocks in the KV pool; 0 sizes the pool from `EXECUTOR_KV_CACHE_MEMORY_MB`.")
    # A pool the device cannot hold is refused at start-up: on CPU it would
    # otherwise be OOM-killed while being zeroed.
    kv_cache_memory_mb: int = Field(
        default=512, ge=1, description="KV pool budget in MiB when `EXECUTOR_NUM_KV_BLOCKS` is 0 (per rank, over "
        "its KV heads, under tensor parallelism). A pool larger than free memory (CUDA free memory, or "
        "`MemAvailable` on CPU) is refused at start-up.")
    # Pinned memory on CUDA cannot be swapped, and on the CPU an oversized
    # pool would be OOM-killed when written: refused at start-up instead.
    host_kv_cache_memory_mb: int = Field(
        default=0, ge=0, description="A KV tier in host memory, in MiB (per rank under tensor parallelism); 0 = "
        "off. The scheduler copies cached prefix blocks that the device pool evicts into it, finds them there "
        "again, and can preempt a request by swapping its blocks out instead of recomputing it "
        "(`SCHEDULER_PREEMPTION_MODE`). Pinned memory on CUDA. Refused at start-up when this node's ranks together "
        "would need more than `MemAvailable`.")
    max_model_len: int = Field(
        default=0, ge=0, description="Longest prompt + generation, in tokens; 0 = the model's "
        "`max_position_embeddings`.")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        default="auto", description="`torch` (plain PyTorch, any device), `triton` (the Triton kernels in "
        "`llmsched_kernels/`; CUDA, or CPU only under `TRITON_INTERPRET=1`, for tests) or `auto` = triton on CUDA, else "
        "torch.")
    # The torch backend splits batches on the host, which a graph cannot
    # replay; capturing NCCL all-reduces has not been tested on GPUs.
    cuda_graphs: Literal["auto", "off"] = Field(
        default="auto", description="Decode steps replayed from CUDA graphs (batch sizes 1, 2, 4, ..., 512), and "
        "with `EXECUTOR_SPECULATIVE_METHOD` on, verify steps too (1, 2, 4, ..., 32 rows of up to "
        "1 + `EXECUTOR_SPECULATIVE_TOKENS` tokens; larger ones run eagerly). "
        "`auto` = on with a CUDA device and the `triton` backend on one device (off under tensor parallelism, and "
        "for a model whose experts run the torch loop: quantized experts the fused-MoE kernel does not read), else "
        "off; `off`.")
    torch_compile: Literal["auto", "off", "on"] = Field(
        default="auto", description="`auto` = `on` for a dense model on one CPU rank, unquantized or with FP8 "
        "(on `EXECUTOR_CPU_FP8_KERNEL`) or integer weights, when a C++ compiler is found, else `off`. Inductor's "
        "cache "
        "is kept in `~/.cache/llmsched/inductor` (unless `TORCHINDUCTOR_CACHE_DIR` is set), in a subdirectory per CPU "
        "vector ISA (`cpu-<isa>`: inductor's own cache key leaves the ISA out, so hosts of different CPUs may share "
        "the directory), so a restart loads the "
        "compiled step instead of compiling it again. `on`: decode-only steps on CPU whose gathered K fits 4 MiB per layer (e.g. 64 "
        "requests x 512 tokens on stories260K) run compiled (`executor_svc/step/compiled_decode.py`), compiled at "
        "start-up: under hidden size 512 as one `torch.compile`d graph (stories260K: about 22 s cold on the "
        "development machine, 5 s with inductor's on-disk cache warm), and in an executor that speculates "
        "(`ngram`, `draft`) a verify step too (about 2 s warm); from hidden size 512 layerwise, one graph per kind "
        "of decoder layer called for each such layer (a Qwen3-0.6B shape: 7-9 s cold), with verify steps eager. "
        "Other steps run eagerly. Needs a C++ compiler: if compiling "
        "fails the executor logs why and serves eagerly. Refused on CUDA (use `EXECUTOR_CUDA_GRAPHS`) and under "
        "tensor parallelism.")
    cpu_int_kernels: Literal["auto", "off"] = Field(
        default="auto", description="On the CPU, integer-quantized linears (int8 with one scale per row; int4 in "
        "groups of 32-256 columns or per row: compressed-tensors, GPTQ without act-order, AWQ) run torch's "
        "weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) when the compute dtype is "
        "bfloat16, instead of dequantizing their weight for every matmul (`executor_svc/model/cpu_int_linear.py`). "
        "`auto` = on where a layer fits (the start-up log counts the layers and says why others do not; not in "
        "batch-invariant mode); `off` = always dequantize. With `EXECUTOR_DTYPE=auto` (float32) on the CPU they "
        "are not used: set `bfloat16`.")
    cpu_fp8_kernel: Literal["auto", "off"] = Field(
        default="auto", description="On the CPU, FP8 linears (block-scaled, per-channel or per-tensor) multiply "
        "steps of up to 64 rows through a C kernel that decodes the FP8 weight in L1 as it goes "
        "(`executor_svc/model/cpu_fp8_linear.py`; AVX2, FMA and F16C), instead of dequantizing the whole weight for "
        "every matmul; each weight is the dequantizing path's, bit for bit, and only the order of the sums differs. "
        "`auto` = on where the CPU has AVX2 and a layer's columns and scale blocks are multiples of 8 (not in "
        "batch-invariant mode); `off` = always dequantize. Steps of more rows dequantize either way.")
    cpu_gemv: Literal["auto", "off"] = Field(
        default="auto", description="On the CPU, a step with one row (a single stream's decode) multiplies it by each "
        "large unquantized weight (at least 2^20 values over 512 or more columns, bfloat16 or float32: the layers "
        "and head of models from about 0.5B parameters) with an inductor-compiled GEMV, which streams the weights "
        "faster than torch's GEMM (`executor_svc/model/cpu_gemv.py`), compiled once at start-up (about 2 s, then "
        "inductor's on-disk cache); bf16 weights are packed instead where `EXECUTOR_CPU_BF16_PREPACK` packs them. "
        "With that off, in bfloat16 on a CPU without native bf16 instructions (AVX2), where torch's "
        "bf16 GEMM costs a one-row product's time for every row, steps of up to 64 rows take C kernels "
        "(`executor_svc/model/cpu_bf16_gemm.py`: a GEMV for one row, a tiled GEMM for 2 to 64, built with the "
        "system's C compiler in about 1 s and cached in `~/.cache/llmsched/cpu_kernels`; where they cannot be "
        "built, the inductor GEMV and compiled passes of 8 rows) over those weights, "
        "and larger ones convert them to float32 a block at a time for MKL's GEMM. `auto` = on where a weight fits and a C++ compiler is found, not in "
        "batch-invariant mode; `off` = always the GEMM.")
    cpu_bf16_prepack: Literal["auto", "avx512bf16", "avx512", "avx2", "onednn", "off"] = Field(
        default="auto", description="Each bf16 linear's weight that `EXECUTOR_CPU_GEMV` would take is packed "
        "once at load, replacing the stored one, and every product of the layer runs on it "
        "(`executor_svc/model/cpu_prepack.py`). `avx512bf16`, `avx512` and `avx2`: the layout of C kernels built "
        "at start-up (`executor_svc/model/cpu_bf16_vnni.py`, about 1 s each, cached in "
        "`~/.cache/llmsched/cpu_kernels`), on AVX512-BF16, on AVX512F, or on AVX2 with FMA (`avx512` and `avx2` "
        "give the same outputs bit for bit); their outputs differ from "
        "F.linear's by float32 rounding, and a row's outputs do not depend on the rows beside it. `onednn`: "
        "oneDNN's blocked layout, on a CPU with native bf16, the same outputs as F.linear bit for bit (torch's "
        "bf16 GEMM otherwise reorders the weight on every call). On two Zen 4 cores `avx512bf16` was the "
        "fastest at one row and at 16, `avx2` beat `off`'s C kernels on AVX2 at both, and `avx512` beat `avx2` "
        "(docs/performance.md, P24). A "
        "head tied to the embedding is packed for the three C kernels only (the embedding then reads its "
        "rows from the packed copy); no weight of a latent-attention model is packed. `auto` = `avx512bf16` "
        "where the CPU has AVX512-BF16 but no AMX, `onednn` where it has other native bf16 (AMX), `avx512` where "
        "it has none but AVX512F, `avx2` where it has AVX2, each where its kernel builds, and `EXECUTOR_CPU_GEMV` "
        "is on; `off` = keep the "
        "stored layout. Replaces `EXECUTOR_CPU_ONEDNN_REORDER`, which is refused by name if set.")

    @field_validator("cpu_bf16_prepack")
    @classmethod
    def _renamed_setting_is_not_ignored(cls, value: str) -> str:
        # Unknown EXECUTOR_* variables are ignored: a value left under the old
        # name would silently not apply.
        if "EXECUTOR_CPU_ONEDNN_REORDER" in os.environ:
            raise ValueError("EXECUTOR_CPU_ONEDNN_REORDER is set, but was renamed EXECUTOR_CPU_BF16_PREPACK "
                             "(auto|avx512bf16|avx512|avx2|onednn|off; its old `off` is `off`, its old `auto` is "
                             "`onednn`): set that instead")
        return value

    tensor_parallel_size: int = Field(
        default=1, ge=1, le=512, description="Ranks (one device each) one executor's model is split over, with "
        "torch.distributed: NCCL on CUDA, gloo on CPU. Without torchrun's variables rank 0 starts the other ranks "
        "on this node; with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` every process "
        "joins that group, and `WORLD_SIZE` must equal this. Rank 0 alone serves gRPC. A size that does not "
        "divide the model's heads, KV heads (or a multiple of them) and intermediate size is refused with the "
        "sizes that work.")
    # Fail-stop: the scheduler then recomputes its requests on the restarted
    # executor, which beats a group that hangs on a dead rank.
    tensor_parallel_timeout_s: float = Field(
        default=120.0, gt=0, description="A rank that dies or does not answer a collective within this many "
        "seconds stops the whole group, which exits non-zero; rank 0 checks an idle group every quarter of it. "
        "Start-up waits (rendezvous, pool-size agreement) are bounded by it too.")
    num_threads: int = Field(
        default=0, ge=0, description="torch intra-op CPU threads; 0 = on the CPU, one per core the executor may "
        "run on (its CPU affinity: `llmsched.launch` leaves it every core but the scheduler's from three cores up, see "
        "`LLMSCHED_PIN_CPUS`), divided among the ranks sharing them under tensor parallelism, and 1 for models "
        "whose hidden size is under 512, whose products are too small for a second thread to pay; torch's "
        "default on CUDA. Idle OpenMP threads spin for a few milliseconds, then sleep (libgomp's default; "
        "`OMP_WAIT_POLICY` and `GOMP_SPINCOUNT` change it).")
    speculative_method: Literal["off", "ngram", "draft", "mtp", "eagle3"] = Field(
        default="off", description="Speculative decoding: `ngram` proposes each request's next tokens from the "
        "last place its own prompt and output repeat their last few tokens, and verifies them in one forward, "
        "exactly: every generating request speculates, greedy or sampled, with or without `logit_bias`, "
        "`min_tokens`, penalties, stop strings or a constraint (drafts cut to what the grammar accepts, each "
        "verified position masked by it), each verified position drawing as plain decoding would there. "
        "`draft` proposes with a smaller model (`EXECUTOR_SPECULATIVE_DRAFT_MODEL`) that shares the target's "
        "tokenizer, with its own KV pool of as many blocks; `mtp` with the checkpoint's own multi-token-prediction "
        "layer (DeepSeek-V3 and Kimi K2's `num_nextn_predict_layers`); `eagle3` with an EAGLE-3 head in the "
        "speculators format (`EXECUTOR_SPECULATIVE_DRAFT_MODEL`), which reads three of the target's layers. "
        "Verify steps replay graphs of their own with `EXECUTOR_CUDA_GRAPHS` on CUDA (for `mtp` and `eagle3` these, "
        "and the decode steps', also compute what the proposer reads of the target's hidden states), as do a dense "
        "draft model's own steps; on the CPU `ngram` and `draft` verify in a graph compiled with "
        "`EXECUTOR_TORCH_COMPILE`, and `mtp` and `eagle3` steps run eagerly. At low load, "
        "steps with drafts run several to a plan, as decode steps do (`SCHEDULER_MULTI_STEP_DECODE`).")
    speculative_tokens: int = Field(
        default=4, ge=1, le=16, description="Most drafts per request per step (the scheduler chooses fewer, or "
        "none, as the batch grows: `SCHEDULER_SPECULATIVE_MAX_BATCH`).")
    speculative_draft_model: str = Field(
        default="", description="`draft`: the draft model, a checkpoint directory or built-in name as for "
        "`EXECUTOR_MODEL`, whose tokenizer maps every token to the target's ids (refused otherwise). It runs whole on "
        "the device (rank 0's under tensor parallelism), and its KV takes a share of `EXECUTOR_KV_CACHE_MEMORY_MB` "
        "in proportion to its bytes per token. `eagle3`: the EAGLE-3 head's directory (speculators format: "
        "config.json with `speculators_model_type: eagle3` and its safetensors), whole on every rank, its KV "
        "likewise from the budget.")
    speculative_ngram_min: int = Field(
        default=2, ge=1, le=16, description="`ngram`: the shortest run of a request's last tokens matched against "
        "its earlier tokens.")
    speculative_ngram_max: int = Field(
        default=4, ge=1, le=16, description="`ngram`: the longest run of a request's last tokens matched; longer "
        "matches are tried first.")
    # Off by default: it pads every GEMM's rows and attends every query in
    # fixed pieces, which costs throughput (docs/performance.md, P22).
    batch_invariant: Literal["off", "on"] = Field(
        default="off", description="`on`: a request's logits and logprobs are bitwise the same whatever else "
        "shares its steps, however its prompt was chunked and whether its prefix was cached. Every GEMM's rows are "
        "padded to a multiple of 4 (the row count from which the CPU BLAS sums every row in one order; on CUDA, "
        "unquantized linear layers run a Triton GEMM whose tiles never depend on the rows), every "
        "query token, prefill or decode, attends its keys in fixed 512-position pieces merged in order, decode "
        "steps run eagerly, and unseeded sampling draws from a stream keyed by the request and the token's "
        "position. Checked at start-up on the model's own shapes: start-up is refused if the host does not keep "
        "it. The scheduler learns it in the handshake and then cuts prompt chunks at block boundaries, sized "
        "independently of load. Refused with `EXECUTOR_TORCH_COMPILE=on` and with `EXECUTOR_SPECULATIVE_METHOD` "
        "other than `off`. What it guarantees and costs: `docs/batch-invariance.md`.")
    lora_adapters: str = Field(
        default="", description="LoRA adapters served beside the base model, `name=path,...`, each a PEFT "
        "directory (`adapter_config.json` and `adapter_model.safetensors`) on q/k/v/o/gate/up/down projections of "
        "a dense decoder, scaled by `lora_alpha` / rank (or / sqrt(rank) with `use_rslora`). A request names one by "
        "`GenerateRequest.adapter` (gRPC) or as its `model` (OpenAI). Every adapter is read and checked at "
        "start-up; the scheduler loads them into the `EXECUTOR_MAX_LORAS` device slots as requests need them. "
        "Refused by name: "
        "`modules_to_save`, embedding or lm_head weights, DoRA, a `bias` other than `none`, per-module rank or "
        "alpha patterns, and any other adapter setting that would change the math. Under tensor parallelism each "
        "rank holds its share of each adapter (B's rows for q/k/v/gate/up, A's columns for o/down). Steps with "
        "adapter tokens run eagerly (no CUDA graph or compiled decode). The deltas run the Triton kernels of "
        "`llmsched_kernels/lora.py` with the `triton` attention backend (so on CUDA by default), else a torch loop over the "
        "adapters present.")
    runtime_lora_dir: str = Field(
        default="", description="The directory runtime LoRA adapters are loaded from (the scheduler's "
        "`LoadLoraAdapter`, the gateway's `/v1/load_lora_adapter`): a `lora_path`, absolute or relative to it, is "
        "refused unless it lies inside it once symlinks and `..` are followed. Each is read and checked as an "
        "`EXECUTOR_LORA_ADAPTERS` one. Empty = runtime loading off. With it set the executor has "
        "`EXECUTOR_MAX_LORAS` slots even with no start-up adapters.")
    max_lora_rank: int = Field(
        default=64, ge=1, le=1024, description="Largest adapter rank `EXECUTOR_LORA_ADAPTERS` may hold; a larger "
        "one is refused at start-up.")
    max_loras: int = Field(
        default=8, ge=1, le=1024, description="LoRA slots on the device: adapters held there at once. The "
        "scheduler decides which adapter sits in which slot; a request whose adapter has no slot waits until one "
        "frees (an adapter that running requests use is never evicted). More adapters than slots may be "
        "configured. Every slot's weights are allocated at start-up, at `EXECUTOR_MAX_LORA_RANK` for every "
        "adapted layer, before the KV pool (whose check against free memory counts them).")
    max_cpu_loras: int = Field(
        default=0, ge=0, le=65536, description="Adapters kept in host memory, least recently loaded dropped "
        "first; a load of one that is not there reads it from disk again. 0 = every configured adapter; "
        "below `EXECUTOR_MAX_LORAS` is refused at start-up. With `EXECUTOR_RUNTIME_LORA_DIR`, 0 keeps `EXECUTOR_MAX_LORAS` more.")
    max_logprobs: int = Field(
        default=20, ge=0, le=1024, description="Most top logprobs per token a request may ask for; capped at the "
        "vocabulary size.")
    max_message_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest gRPC message on the step channel, in bytes.")
    step_socket: Literal["auto", "off"] = Field(
        default="auto", description="`auto`: besides gRPC, offer the step stream on a Unix socket "
        "(`llmsched-step-<instance>.sock` in `EXECUTOR_STEP_SOCKET_DIR`), which a scheduler on this host uses "
        "instead of gRPC's stream: a plan's round trip costs about a quarter as much (`llmsched/step_socket.py`). "
        "Not offered with `EXECUTOR_TLS_CERT` set, so that TLS and client certificates keep guarding every "
        "step. A socket that cannot be made (an unwritable directory, a path over 107 bytes) is logged and "
        "the stream stays on gRPC. `off`: gRPC only.")
    step_socket_dir: str = Field(
        default="", description="Directory of `EXECUTOR_STEP_SOCKET`'s socket; empty = the system's temporary "
        "directory. A scheduler in another container reaches the socket only if this directory is shared with "
        "it; otherwise it uses gRPC.")
    scheduler_keepalive_s: float = Field(
        default=10.0, gt=0, description="Keepalive ping interval to the connected scheduler, in seconds. A "
        "scheduler that stops answering for as long again loses its step stream, so a standby scheduler can take "
        "over.")
    debug_fail_on_token: int = Field(
        default=-1, description="Fault injection for tests: a step whose batch holds this token id fails with an "
        "exception, as a broken forward pass would. -1 = off.")
    debug_fail_swap_every: int = Field(
        default=0, ge=0, description="Fault injection for tests: every n-th block copy between the device pool and "
        "the host KV tier fails, counted over the process's life (the step's result names it in `failed_swap_outs` / "
        "`failed_swap_ins`). 0 = off.")
    tls_cert: str = Field(
        default="", description="PEM certificate file: TLS on the step channel (with `EXECUTOR_TLS_KEY`).")
    tls_key: str = Field(default="", description="PEM private key file of `EXECUTOR_TLS_CERT`.")
    tls_client_ca: str = Field(
        default="", description="With TLS: the scheduler must present a certificate signed by this CA (mutual "
        "TLS).")
    log_level: LogLevel = Field(default="INFO", description=LOG_LEVEL_HELP)
    log_format: LogFormat = Field(
        default="text", validation_alias=AliasChoices("EXECUTOR_LOG_FORMAT", "LOG_FORMAT"),
        description=log_format_help("executor"))
