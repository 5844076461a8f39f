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
from executor_svc.chat_template import load_chat_template
from executor_svc.checkpoint import load_checkpoint
from executor_svc.config import ExecutorSettings
from executor_svc.convert import result_to_proto, step_from_proto
from executor_svc.kv_cache import KVCachePool, pool_num_blocks
from executor_svc.model import build_model
from executor_svc.model_config import SLIDING, ModelConfig
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
        self.cfg = ModelConfig.from_hf(ckpt.hf_config, ckpt.generation_config)
        self.model_name = ckpt.name
        self.tokenizer_json = ckpt.tokenizer_json
        self.chat_template = load_chat_template(settings.model)
        self.max_model_len = settings.max_model_len or self.cfg.max_position_embeddings
        model = build_model(self.cfg, ckpt.tensors(), self.max_model_len, self.device, self.dtype)
        num_blocks = pool_num_blocks(self.cfg, settings.block_size, self.dtype, self.device,
                                     settings.num_kv_blocks, settings.kv_cache_memory_mb)
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
        # One thread runs every step, in plan order, so the event loop stays
        # free to receive and decode the next plan, and to answer health
        # checks, while the model computes.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # One scheduler drives the executor at a time: a second step stream
        # is refused while the first is open. A scheduler that dies or stops
        # answering keepalive pings loses its stream, and the next one in
        # starts from empty request state.
        self._stream_open = False
        # Epoch of the last plan that failed (StepPlan.epoch); plans of that
        # epoch still arriving are discarded. Touched by the step thread only.
        self._failed_epoch: int | None = None
        # Set on SIGTERM: the step in flight finishes and its result is
        # sent, then the stream ends so the scheduler reconnects elsewhere.
        self.stopping = False
        log.info(
            "executor %s: model=%s architecture=%s rope=%s sliding_window=%s device=%s dtype=%s kv_blocks=%d "
            "block_size=%d max_model_len=%d",
            self.instance_id, self.model_name, self.cfg.architecture, self.cfg.rope_description(),
            self.cfg.sliding_window if SLIDING in self.cfg.layer_types else None, self.device, self.dtype,
            num_blocks, settings.block_size, self.max_model_len,
        )
        log.info("config.json keys ignored: %s", "; ".join(f"{k} ({why})" for k, why in self.cfg.ignored.items()))

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
            # top-k over the vocabulary cannot return more than it holds, so
            # a larger setting would let requests through that fail the step.
            max_logprobs=min(self.settings.max_logprobs, self.cfg.vocab_size),
            device=str(self.device),
            chat_template=self.chat_template.template,
            bos_token=self.chat_template.bos_token,
            eos_token=self.chat_template.eos_token,
            architecture=self.cfg.architecture,
            rope_type=self.cfg.rope_description(),
        )

    def _reset(self) -> None:
        self.runner.reset()
        self._failed_epoch = None

    def _run_step(self, plan: pb.StepPlan, step) -> pb.StepResult:
        """Runs on the step thread. `step` is the decoded plan, or the
        exception decoding it raised."""
        if plan.epoch == self._failed_epoch:
            # Sent before the scheduler learnt of the failure: it names
            # requests forgotten since. The scheduler ignores this result.
            return pb.StepResult(step_id=plan.step_id, discarded=True)
        started_wall, started = time.time_ns(), time.perf_counter()
        try:
            if isinstance(step, Exception):
                raise step
            result = result_to_proto(self.runner.execute(step))
        except Exception as exc:  # the executor must survive a bad step
            log.exception("step %d failed", plan.step_id)
            # Request state may be half-applied: forget it all, so the
            # scheduler recomputes from a clean slate.
            self.runner.reset()
            self._failed_epoch = plan.epoch
            result = pb.StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}")
        num_tokens = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(plan.cached_num_scheduled_tokens)
        self.telemetry.record(plan.traceparent, plan.step_id, started_wall, started, time.perf_counter(),
                              result.prepare_ns, result.forward_ns, result.sample_ns, num_tokens, result.error or None)
        return result

    async def Step(self, request_iterator, context):
        if self._stream_open:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "another scheduler holds this executor's step stream (one scheduler per executor)",
            )
        self._stream_open = True
        loop = asyncio.get_running_loop()
        # Plans are received and decoded here, on the event loop, while the
        # step thread computes earlier ones; results go back in plan order.
        steps: asyncio.Queue = asyncio.Queue()

        async def receive_plans() -> None:
            async for plan in request_iterator:
                try:
                    step = step_from_proto(plan)
                except Exception as exc:  # reported as that step's failure
                    step = exc
                steps.put_nowait((plan.step_id, loop.run_in_executor(self._compute, self._run_step, plan, step)))
            steps.put_nowait(None)

        receiver = None
        try:
            # Queued behind whatever the step thread still runs for a
            # previous stream, so no old step sees the fresh state.
            await loop.run_in_executor(self._compute, self._reset)
            self.telemetry.stream_started()
            await context.send_initial_metadata(())  # accepted: see ExecutorClient.connect
            receiver = asyncio.create_task(receive_plans())
            while (item := await steps.get()) is not None:
                step_id, result = item
                yield await result
                if self.stopping:
                    log.info("stopping: step stream closed after step %d", step_id)
                    return
            await receiver  # re-raises a broken request stream
        finally:
            if receiver is not None:
                receiver.cancel()
            self._stream_open = False

    def close(self) -> None:
        self._compute.shutdown(wait=True)
