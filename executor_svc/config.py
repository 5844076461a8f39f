"""Executor settings, read from EXECUTOR_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ExecutorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXECUTOR_", extra="ignore")

    # Address to bind. Loopback by default: the step channel carries no
    # authentication, so binding it elsewhere must be a deliberate choice.
    host: str = "127.0.0.1"
    # Port of the llmsched.v1.Executor service; 0 picks a free port.
    port: int = Field(default=50052, ge=0, le=65535)
    # Port of the Prometheus /metrics endpoint; 0 turns it off.
    metrics_port: int = Field(default=8001, ge=0, le=65535)
    # A built-in model name (tiny-random, bench-small) or a Hugging Face
    # checkpoint directory with config.json, *.safetensors, tokenizer.json.
    model: str = "tiny-random"
    # auto = cuda when available, else cpu.
    device: str = "auto"
    # auto = float32 on CPU, bfloat16 on CUDA.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Tokens per KV-cache block.
    block_size: int = Field(default=16, ge=1, le=1024)
    # Number of KV blocks in the pool; 0 = size it from kv_cache_memory_mb.
    num_kv_blocks: int = Field(default=0, ge=0)
    # Memory budget for the KV pool when num_kv_blocks is 0, in MiB.
    kv_cache_memory_mb: int = Field(default=512, ge=1)
    # Longest prompt + generation; 0 = the model's max_position_embeddings.
    max_model_len: int = Field(default=0, ge=0)
    # Attention implementation: torch (plain PyTorch, any device), triton
    # (the Triton kernels in kernels/; CUDA, or CPU only under
    # TRITON_INTERPRET=1, for tests) or auto = triton on CUDA, else torch.
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # CUDA graphs for decode steps: auto = on when the device is CUDA and
    # the attention backend is triton (the torch backend splits batches on
    # the host, which a graph cannot replay), else off.
    cuda_graphs: Literal["auto", "off"] = "auto"
    # on: decode steps of small batches on CPU run as one torch.compile'd
    # graph (executor_svc/compiled_decode.py), compiled at start-up (about
    # 22 s cold on the development machine, 5 s with inductor's cache
    # warm). CPU and one rank only.
    torch_compile: Literal["off", "on"] = "off"
    # Tensor parallelism: one executor spread over this many ranks (one
    # device each) with torch.distributed, NCCL on CUDA and gloo on CPU.
    # Without torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    # MASTER_ADDR, MASTER_PORT) rank 0 starts the other ranks itself on this
    # node; with them, every process joins that group and WORLD_SIZE must
    # equal this. Rank 0 alone serves gRPC. See executor_svc/tensor_parallel.py.
    tensor_parallel_size: int = Field(default=1, ge=1, le=512)
    # A rank that does not answer a collective within this many seconds (it
    # died or hangs) stops the whole group, which exits non-zero: the
    # scheduler then recomputes its requests on the restarted executor.
    tensor_parallel_timeout_s: float = Field(default=120.0, gt=0)
    # Intra-op CPU threads for torch; 0 = torch's default.
    num_threads: int = Field(default=0, ge=0)
    # Largest number of top logprobs a request may ask for.
    max_logprobs: int = Field(default=20, ge=0, le=1024)
    # Largest gRPC message accepted or sent, in bytes.
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Keepalive ping interval to the connected scheduler, in seconds: a
    # scheduler that stops answering for as long again loses its step
    # stream, so a standby scheduler can take over.
    scheduler_keepalive_s: float = Field(default=10.0, gt=0)
    # Fault injection for tests: a step whose batch holds this token id
    # fails with an exception, as a broken forward pass would. -1 = off.
    debug_fail_on_token: int = -1
    # TLS for the step channel: PEM certificate and key. With
    # tls_client_ca, the scheduler must present a certificate signed by it.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    log_level: str = "INFO"
