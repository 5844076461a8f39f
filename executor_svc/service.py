"""The llmsched.v1.Executor gRPC service around the model runner."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from executor_svc.chat_template import load_chat_template
from executor_svc.config import ExecutorSettings
from executor_svc.convert import result_to_proto, step_from_proto
from executor_svc.loading import LoadedModel
from executor_svc.model.model_config import SLIDING
from executor_svc.telemetry import StepTelemetry, SwapStats
from executor_svc.tensor_parallel import HEARTBEAT, RESET, STEP
from llmsched.tracing import Tracing
from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A CPU decode step runs on the event loop only while the last decode step
# took less than this. Against a longer step the thread's hand-off (a few
# hundred microseconds) is small, and the loop must stay free to answer
# health checks: a decode step of a large model on CPU can take seconds.
INLINE_DECODE_MAX_S = 0.02


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(self, settings: ExecutorSettings, tracing: Tracing, loaded: LoadedModel):
        self.settings = settings
        self.device, self.dtype, self.cfg = loaded.device, loaded.dtype, loaded.cfg
        self.model_name = loaded.ckpt.name
        self.tokenizer_json = loaded.ckpt.tokenizer_json
        self.chat_template = load_chat_template(settings.model)
        self.max_model_len = loaded.max_model_len
        self.pool, self.runner, self.cuda_graphs = loaded.pool, loaded.runner, loaded.cuda_graphs
        self.host_kv = loaded.host_kv
        # Rank 0 of a tensor-parallel group forwards plans and resets to the
        # other ranks (tensor_parallel.py); None on one device.
        self.tp = loaded.tp
        self.tp_size = self.tp.size if self.tp else 1
        log.info("CUDA graphs for decode steps: %s (EXECUTOR_CUDA_GRAPHS=%s)", "on" if self.cuda_graphs else "off",
                 settings.cuda_graphs)
        if settings.torch_compile == "on":
            log.info("compiled CPU decode steps: %s (EXECUTOR_TORCH_COMPILE=on)", "on" if loaded.torch_compile else
                     "off, compiling failed")
        self.instance_id = uuid.uuid4().hex
        self.telemetry = StepTelemetry(tracing)
        # One thread runs steps, in plan order, so the event loop stays free
        # to receive and decode the next plan, and to answer health checks,
        # while the model computes.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # Except decode steps on CPU, which run on the event loop itself. A
        # CPU forward keeps the CPU busy, so the thread would overlap only
        # the next plan's decoding (microseconds), while the hand-off costs
        # hundreds: the two threads pass the GIL back and forth, often
        # across cores. Prefill and chunks, which on CPU can take seconds,
        # and decode steps once they take INLINE_DECODE_MAX_S or more, keep
        # the thread so that health checks are answered meanwhile. On CUDA the
        # host waits on the device with the GIL released, and under tensor
        # parallelism heartbeats share the thread: both keep it for every
        # step. (Measured: docs/architecture.md, "The executor's step".)
        self._inline_decode = self.device.type == "cpu" and self.tp is None
        # Seconds the last decode step took, wherever it ran (see
        # INLINE_DECODE_MAX_S). Written by whichever runs steps; a float, so
        # the event loop may read it meanwhile.
        self._last_decode_s = 0.0
        # One scheduler drives the executor at a time: a second step stream
        # is refused while the first is open. A scheduler that dies or stops
        # answering keepalive pings loses its stream, and the next one in
        # starts from empty request state.
        self._stream_open = False
        # Epoch of the last plan that failed (StepPlan.epoch); plans of that
        # epoch still arriving are discarded. Touched only by whichever runs
        # the steps, one at a time.
        self._failed_epoch: int | None = None
        # Set on SIGTERM: the step in flight finishes and its result is
        # sent, then the stream ends so the scheduler reconnects elsewhere.
        self.stopping = False
        log.info(
            "executor %s: model=%s architecture=%s rope=%s sliding_window=%s device=%s dtype=%s kv_blocks=%d "
            "host_kv_blocks=%d block_size=%d max_model_len=%d tensor_parallel_size=%d",
            self.instance_id, self.model_name, self.cfg.architecture, self.cfg.rope_description(),
            self.cfg.sliding_window if SLIDING in self.cfg.layer_types else None, self.device, self.dtype,
            self.pool.num_blocks, self.num_host_kv_blocks, settings.block_size, self.max_model_len, self.tp_size,
        )
        log.info("config.json keys ignored: %s", "; ".join(f"{k} ({why})" for k, why in self.cfg.ignored.items()))

    @property
    def num_host_kv_blocks(self) -> int:
        return self.host_kv.num_blocks if self.host_kv is not None else 0

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
            tensor_parallel_size=self.tp_size,
            kv_bytes_per_token=self.pool.bytes_per_token,
            supports_constraints=True,
            num_host_kv_blocks=self.num_host_kv_blocks,
        )

    def _reset(self) -> None:
        self._reset_ranks()
        self._failed_epoch = None

    def _reset_ranks(self) -> None:
        self.runner.reset()
        if self.tp:
            self.tp.send(RESET)

    async def heartbeats(self) -> None:
        """Rank 0 of a tensor-parallel group: keeps the idle group checked
        (and the other ranks' waits under the timeout). Queued on the step
        thread, so it never runs between a plan and its collectives."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tp.timeout_s / 4)
            await loop.run_in_executor(self._compute, self.tp.send, HEARTBEAT)

    @staticmethod
    def _decode_only(step) -> bool:
        """One token for each request the executor already holds."""
        return (not isinstance(step, Exception) and not step.new_requests
                and all(n == 1 for n in step.cached_num_scheduled_tokens))

    def _runs_inline(self, step) -> bool:
        """Whether this step runs on the event loop (see __init__): a CPU
        decode step, while decode steps are short."""
        return self._inline_decode and self._last_decode_s < INLINE_DECODE_MAX_S and self._decode_only(step)

    def _run_step(self, plan: pb.StepPlan, step) -> pb.StepResult:
        """Runs on the step thread, or inline (see _runs_inline). `step` is
        the decoded plan, or the exception decoding it raised."""
        if plan.epoch == self._failed_epoch:
            # Sent before the scheduler learnt of the failure: it names
            # requests forgotten since. The scheduler ignores this result.
            return pb.StepResult(step_id=plan.step_id, discarded=True)
        started_wall, started = time.time_ns(), time.perf_counter()
        try:
            if self.tp:
                # The other ranks decode and run the same plan (tp_worker.py).
                self.tp.send(STEP, plan.SerializeToString())
            if isinstance(step, Exception):
                raise step
            result = result_to_proto(self.runner.execute(step))
        except Exception as exc:  # the executor must survive a bad step
            log.exception("step %d failed", plan.step_id)
            # Request state may be half-applied: forget it all, on every
            # rank, so the scheduler recomputes from a clean slate.
            self._reset_ranks()
            self._failed_epoch = plan.epoch
            result = pb.StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}")
        ended = time.perf_counter()
        if self._decode_only(step):
            self._last_decode_s = ended - started
        num_tokens = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(plan.cached_num_scheduled_tokens)
        swaps = None
        if self.host_kv is not None and (plan.swap_out_host_blocks or plan.swap_in_host_blocks):
            swaps = SwapStats(len(plan.swap_out_host_blocks) - len(result.failed_swap_outs),
                              len(plan.swap_in_host_blocks) - len(result.failed_swap_ins),
                              self.host_kv.block_bytes * self.tp_size,
                              len(result.failed_swap_outs) + len(result.failed_swap_ins), result.swap_ns)
        self.telemetry.record(plan.traceparent, plan.step_id, plan.after_idle, started_wall, started, ended,
                              result.prepare_ns, result.forward_ns, result.sample_ns, num_tokens, result.error or None,
                              swaps)
        return result

    async def Step(self, request_iterator, context):
        if self._stream_open:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "another scheduler holds this executor's step stream (one scheduler per executor)",
            )
        self._stream_open = True
        loop = asyncio.get_running_loop()
        # One task receives and decodes plans. It always has the next read
        # outstanding, so a plan arrives while earlier steps run, and it
        # hands steps for the step thread over on arrival. This generator
        # runs inline steps itself, so a result goes out as soon as its
        # step ends, and yields every result in plan order.
        steps: asyncio.Queue = asyncio.Queue()
        # Queued plans this generator starts itself. While any is queued,
        # later plans queue behind it instead of reaching the thread first.
        held = 0

        async def receive_plans() -> None:
            nonlocal held
            async for plan in request_iterator:
                try:
                    step = step_from_proto(plan)
                except Exception as exc:  # reported as that step's failure
                    step = exc
                if held or self._runs_inline(step):
                    held += 1
                    steps.put_nowait((plan, step, None))
                else:
                    steps.put_nowait((plan, step, loop.run_in_executor(self._compute, self._run_step, plan, step)))
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
                plan, step, result = item
                if result is None:
                    held -= 1
                    if self._runs_inline(step):  # every earlier step has ended
                        result = self._run_step(plan, step)
                    else:
                        result = await loop.run_in_executor(self._compute, self._run_step, plan, step)
                else:
                    result = await result
                yield result
                if self.stopping:
                    log.info("stopping: step stream closed after step %d", plan.step_id)
                    return
            await receiver  # re-raises a broken request stream
        finally:
            if receiver is not None:
                receiver.cancel()
            self._stream_open = False

    def close(self) -> None:
        self._compute.shutdown(wait=True)
        if self.tp:
            self.tp.shutdown()
