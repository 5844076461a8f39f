"""The llmsched.v1.Executor gRPC service around the model runner."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from executor_svc.chat_template import load_chat_template
from executor_svc.config import ExecutorSettings
from executor_svc.convert import receive_plan, result_to_proto
from executor_svc.loading import LoadedModel
from executor_svc.model.lora import LoraRefused
from executor_svc.model.model_config import SLIDING
from executor_svc.step.step_loop import StepExecutor, StepLoop
from executor_svc.telemetry import StepTelemetry
from executor_svc.tensor_parallel import HEARTBEAT, LORA_REGISTER, LORA_UNREGISTER
from llmsched import cpus, step_socket
from llmsched.tracing import Tracing
from llmsched.v1 import executor_pb2 as pb
from llmsched.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ANOTHER_SCHEDULER = "another scheduler holds this executor's step stream (one scheduler per executor)"


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(self, settings: ExecutorSettings, tracing: Tracing, loaded: LoadedModel,
                 step_thread: ThreadPoolExecutor | None = None):
        self.settings = settings
        self.device, self.dtype, self.cfg = loaded.device, loaded.dtype, loaded.cfg
        self.model_name = loaded.ckpt.name
        self.tokenizer_json = loaded.ckpt.tokenizer_json
        self.chat_template = load_chat_template(settings.model)
        self.max_model_len = loaded.max_model_len
        self.pool, self.cuda_graphs = loaded.pool, loaded.cuda_graphs
        self.host_kv = loaded.host_kv
        self.weight_bytes = loaded.weight_bytes
        self.pooling = loaded.ckpt.pooling.pooling
        self.generates = loaded.generates
        lora = self.lora = loaded.runner.lora
        self.lora_adapters = [] if lora is None else list(lora.static_names)
        self.max_loras, self.max_cpu_loras = (0, 0) if lora is None else (lora.num_slots, lora.max_cpu)
        log.info("embeddings: %s", f"pooled {self.pooling.describe()} (sentence-transformers config)"
                 if self.pooling else f"not served: {loaded.ckpt.pooling.why_not}")
        self.tp = loaded.tp
        self.tp_size = self.tp.size if self.tp else 1
        log.info("CUDA graphs for decode steps: %s (EXECUTOR_CUDA_GRAPHS=%s)", "on" if self.cuda_graphs else "off",
                 settings.cuda_graphs)
        if settings.torch_compile != "off":
            log.info("compiled CPU decode steps: %s (EXECUTOR_TORCH_COMPILE=%s)",
                     "on" if loaded.torch_compile else "off", settings.torch_compile)
        executor = StepExecutor(loaded.runner, StepTelemetry(tracing), self.tp,
                                self.host_kv.block_bytes if self.host_kv is not None else 0)
        # Decode steps run inline on CPU with one torch thread alone: see StepLoop.
        self.steps = StepLoop(executor, thread=step_thread, inline_decode=(
            self.device.type == "cpu" and self.tp is None and loaded.torch_threads == 1))
        loaded.runner.run_interrupts = self.steps.interrupts.pending
        self.instance_id = uuid.uuid4().hex
        # One scheduler drives the executor at a time: a second step stream
        # is refused while the first is open. A scheduler that dies or stops
        # answering keepalive pings loses its stream, and the next one in
        # starts from empty request state.
        self._stream_open = False
        # Set on SIGTERM: the step in flight finishes and its result is
        # sent, then the stream ends so the scheduler reconnects elsewhere.
        self.stopping = False
        # Set by serve() once the socket listens (EXECUTOR_STEP_SOCKET).
        self.step_socket_path: Path | None = None
        self._socket_streams: set[asyncio.Task] = set()
        log.info(
            "executor %s: model=%s architecture=%s rope=%s sliding_window=%s device=%s dtype=%s kv_cache_dtype=%s "
            "kv_blocks=%d host_kv_blocks=%d block_size=%d max_model_len=%d tensor_parallel_size=%d torch_threads=%d "
            "cpus=%s",
            self.instance_id, self.model_name, self.cfg.architecture, self.cfg.rope_description(),
            self.cfg.sliding_window if SLIDING in self.cfg.layer_types else None, self.device, self.dtype,
            f"{settings.kv_cache_dtype} ({self.pool.dtype})", self.pool.num_blocks, self.num_host_kv_blocks,
            settings.block_size, self.max_model_len, self.tp_size, loaded.torch_threads,
            cpus.format_cpu_list(cpus.usable_cpus()),
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
            weight_bytes=self.weight_bytes,
            quantization=self.cfg.quantization.describe() if self.cfg.quantization else "",
            pooling=self.pooling.describe() if self.pooling else "",
            hidden_size=self.cfg.hidden_size,
            embedding_only=not self.generates,
            speculative_method="" if self.settings.speculative_method == "off" else self.settings.speculative_method,
            speculative_tokens=0 if self.settings.speculative_method == "off" else self.settings.speculative_tokens,
            batch_invariant=self.settings.batch_invariant == "on",
            lora_adapters=self.lora_adapters,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            step_socket=str(self.step_socket_path or ""),
            runtime_lora_dir=self.lora.runtime_dir if self.lora is not None else "",
        )

    async def RegisterLoraAdapter(self, request, context):
        # Read and checked off the step thread (a read takes a while), and
        # registered on it, between steps, where the other ranks get it
        # in order with the plans.
        try:
            if self.lora is None or not self.lora.runtime_dir:
                raise LoraRefused("FAILED_PRECONDITION", "runtime LoRA adapters are off on this executor: "
                                                         "EXECUTOR_RUNTIME_LORA_DIR is not set")
            resolved, adapter = await asyncio.to_thread(self.lora.read_runtime, request.key, request.path)
            await asyncio.wrap_future(self.steps.on_thread(self._register_on_ranks, request.key, resolved, adapter))
        except LoraRefused as exc:
            log.warning("runtime LoRA adapter %r refused: %s", request.key, exc)
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        log.info("runtime LoRA adapter %r registered: %s (rank %d)", request.key, resolved, adapter.rank)
        return pb.RegisterLoraAdapterResponse(resolved_path=resolved, rank=adapter.rank)

    def _register_on_ranks(self, key: str, path: str, adapter) -> None:
        self.lora.register(key, path, adapter)  # ALREADY_EXISTS is raised before any rank hears of it
        if self.tp:
            self.tp.send(LORA_REGISTER, pb.RegisterLoraAdapterRequest(key=key, path=path).SerializeToString())

    async def UnregisterLoraAdapter(self, request, context):
        if self.lora is None:
            return pb.UnregisterLoraAdapterResponse(found=False)
        found = await asyncio.wrap_future(self.steps.on_thread(self._unregister_on_ranks, request.key))
        if found:
            log.info("runtime LoRA adapter %r unregistered", request.key)
        return pb.UnregisterLoraAdapterResponse(found=found)

    def _unregister_on_ranks(self, key: str) -> bool:
        found = self.lora.unregister(key)
        if found and self.tp:
            self.tp.send(LORA_UNREGISTER, key.encode())
        return found

    async def heartbeats(self) -> None:
        """Rank 0 of a tensor-parallel group: keeps the idle group checked
        (and the other ranks' waits under the timeout). Queued on the step
        thread, so it never runs between a plan and its collectives."""
        while True:
            await asyncio.sleep(self.tp.timeout_s / 4)
            await asyncio.wrap_future(self.steps.on_thread(self.tp.send, HEARTBEAT))

    async def Step(self, request_iterator, context):
        if self._stream_open:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, ANOTHER_SCHEDULER)
        async for result in self._step_stream(request_iterator, lambda: context.send_initial_metadata(())):
            yield result

    async def serve_step_socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The Step stream on the Unix socket (llmsched/step_socket.py)."""
        task = asyncio.current_task()
        self._socket_streams.add(task)
        try:
            if self._stream_open:
                step_socket.write_frame(writer, step_socket.REFUSE, ANOTHER_SCHEDULER.encode())
                return
            max_bytes = self.settings.max_message_bytes
            keepalive_s = self.settings.scheduler_keepalive_s
            last_frame = time.monotonic()

            async def plans():
                nonlocal last_frame
                while (frame := await step_socket.read_frame(reader, max_bytes)) is not None:
                    last_frame = time.monotonic()
                    kind, payload = frame
                    if kind == step_socket.PLAN:
                        yield pb.StepPlan.FromString(payload)
                    elif kind != step_socket.KEEPALIVE:
                        raise step_socket.FrameError(f"a frame of kind {kind!r} where plans come")

            async def drop_if_silent():
                # The scheduler sends a frame at least every keepalive_s / 2.
                while True:
                    await asyncio.sleep(keepalive_s / 2)  # a timer: it only judges elapsed time
                    if time.monotonic() - last_frame > 2 * keepalive_s:
                        log.warning("step socket: the scheduler sent nothing for %.1fs: dropping its stream",
                                    time.monotonic() - last_frame)
                        writer.transport.abort()  # the pending read ends, and with it the stream
                        return

            async def accept():
                step_socket.write_frame(writer, step_socket.ACCEPT,
                                        step_socket.accept_payload(self.instance_id, keepalive_s))
                await writer.drain()

            watchdog = asyncio.create_task(drop_if_silent())
            try:
                async for result in self._step_stream(plans(), accept):
                    step_socket.write_frame(writer, step_socket.RESULT, result.SerializeToString())
                    await writer.drain()
            finally:
                watchdog.cancel()
        except (step_socket.FrameError, DecodeError) as exc:
            log.warning("step socket: closing a stream that broke the protocol: %s", exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the scheduler went away: as a broken gRPC stream, the next one starts afresh
        finally:
            writer.close()
            self._socket_streams.discard(task)

    async def drain_step_sockets(self, grace_s: float) -> None:
        """At shutdown, as gRPC's grace does for its streams: the step in
        flight finishes and its result is sent (the stream then ends, see
        `stopping`), or the scheduler closes the stream; after grace_s it
        is cut."""
        if self._socket_streams:
            _, pending = await asyncio.wait(set(self._socket_streams), timeout=grace_s)
            for task in pending:
                task.cancel()

    async def _step_stream(self, plans: AsyncIterator[pb.StepPlan], accept: Callable[[], Awaitable[None]]):
        """One scheduler's stream, whatever carries it: each plan in gets
        exactly one result out, in order."""
        self._stream_open = True
        # One task receives and decodes plans. It always has the next read
        # outstanding, so a plan arrives while earlier steps run, and the
        # queue starts it on arrival (step_loop.py).
        queue = self.steps.stream()
        keep_wire = self.tp is not None

        async def receive_plans() -> None:
            try:
                async for plan in plans:
                    queue.put(receive_plan(plan, keep_wire))
            finally:  # a broken stream too: the results end after the plans received
                queue.end()

        receiver = None
        try:
            # Queued behind whatever the step thread still runs for a
            # previous stream, so no old step sees the fresh state.
            await asyncio.wrap_future(self.steps.on_thread(self.steps.executor.reset))
            self.steps.executor.telemetry.stream_started()
            await accept()  # see ExecutorClient.connect
            receiver = asyncio.create_task(receive_plans())
            async for result in queue.results():
                yield result_to_proto(result)
                if self.stopping:
                    log.info("stopping: step stream closed after step %d", result.step_id)
                    return
            await receiver  # re-raises a broken request stream
        finally:
            if receiver is not None:
                receiver.cancel()
            self._stream_open = False

    def close(self) -> None:
        if self.tp:
            # On the step thread, as every collective: it started the other
            # ranks (serve() loads there), which die with it (PDEATHSIG).
            self.steps.on_thread(self.tp.shutdown).result()
        self.steps.close()
