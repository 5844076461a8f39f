"""The llmsched.v1.Executor gRPC service around the model runner."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from executor_svc.attention import make_backend
from executor_svc.checkpoint import load_checkpoint
from executor_svc.config import ExecutorSettings
from executor_svc.convert import result_to_proto, step_from_proto
from executor_svc.kv_cache import KVCachePool, num_blocks_for_budget
from executor_svc.model import build_model
from executor_svc.model_config import ModelConfig
from executor_svc.runner import ModelRunner
from executor_svc.telemetry import StepTelemetry
from llmsched.tracing import Tracing
from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def use_cuda_graphs(setting: str, device: torch.device, backend_name: str) -> bool:
    """EXECUTOR_CUDA_GRAPHS=auto: on for CUDA with the triton backend."""
    return setting == "auto" and device.type == "cuda" and backend_name == "triton"


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(self, settings: ExecutorSettings, tracing: Tracing):
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        ckpt = load_checkpoint(settings.model)
        self.cfg = ModelConfig.from_hf(ckpt.hf_config)
        self.model_name = ckpt.name
        self.tokenizer_json = ckpt.tokenizer_json
        self.max_model_len = settings.max_model_len or self.cfg.max_position_embeddings
        model = build_model(self.cfg, ckpt.state_dict, self.max_model_len, self.device, self.dtype)
        num_blocks = settings.num_kv_blocks or num_blocks_for_budget(
            self.cfg, settings.block_size, self.dtype, settings.kv_cache_memory_mb
        )
        self.pool = KVCachePool(self.cfg, num_blocks, settings.block_size, self.device, self.dtype)
        backend = make_backend(settings.attention_backend, self.device)
        self.cuda_graphs = use_cuda_graphs(settings.cuda_graphs, self.device, backend.name)
        try:
            self.runner = ModelRunner(model, self.pool, backend, self.device,
                                      fail_on_token=settings.debug_fail_on_token, cuda_graphs=self.cuda_graphs)
        except Exception:
            if not self.cuda_graphs:
                raise
            # auto may pick graphs where capture then fails (an op that
            # cannot be captured): serve eagerly, slower but correct.
            log.exception("CUDA graph capture failed; running decode steps eagerly")
            self.cuda_graphs = False
            self.runner = ModelRunner(model, self.pool, backend, self.device,
                                      fail_on_token=settings.debug_fail_on_token)
        log.info("CUDA graphs for decode steps: %s (EXECUTOR_CUDA_GRAPHS=%s)", "on" if self.cuda_graphs else "off",
                 settings.cuda_graphs)
        self.instance_id = uuid.uuid4().hex
        self.telemetry = StepTelemetry(tracing)
        # One thread runs every step, so the event loop stays free for
        # health checks and handshakes while the model computes.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # Only one scheduler drives the executor at a time; a new stream
        # replaces the old one and starts from empty request state.
        self._stream_lock = asyncio.Lock()
        # Set on SIGTERM: the step in flight finishes and its result is
        # sent, then the stream ends so the scheduler reconnects elsewhere.
        self.stopping = False
        log.info(
            "executor %s: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
            self.instance_id, self.model_name, self.device, self.dtype, num_blocks, settings.block_size,
            self.max_model_len,
        )

    async def Handshake(self, request, context):
        eos = list(self.cfg.eos_token_ids)
        return pb.HandshakeResponse(
            model=self.model_name,
            tokenizer_json=self.tokenizer_json,
            block_size=self.pool.block_size,
            num_kv_blocks=self.pool.num_blocks,
            max_model_len=self.max_model_len,
            instance_id=self.instance_id,
            vocab_size=self.cfg.vocab_size,
            eos_token_ids=eos,
            max_logprobs=self.settings.max_logprobs,
            device=str(self.device),
        )

    def _run_step(self, plan: pb.StepPlan) -> pb.StepResult:
        started_wall, started = time.time_ns(), time.perf_counter()
        try:
            result = result_to_proto(self.runner.execute(step_from_proto(plan)))
        except Exception as exc:  # the executor must survive a bad step
            log.exception("step %d failed", plan.step_id)
            # Request state may be half-applied: forget it all, so the
            # scheduler recomputes from a clean slate.
            self.runner.reset()
            result = pb.StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}")
        num_tokens = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(plan.cached_num_scheduled_tokens)
        self.telemetry.record(plan.traceparent, plan.step_id, started_wall, started, time.perf_counter(),
                              result.prepare_ns, result.forward_ns, result.sample_ns, num_tokens, result.error or None)
        return result

    async def Step(self, request_iterator, context):
        async with self._stream_lock:
            self.runner.reset()
            self.telemetry.stream_started()
            loop = asyncio.get_running_loop()
            async for plan in request_iterator:
                yield await loop.run_in_executor(self._compute, self._run_step, plan)
                if self.stopping:
                    log.info("stopping: step stream closed after step %d", plan.step_id)
                    return

    def close(self) -> None:
        self._compute.shutdown(wait=True)
