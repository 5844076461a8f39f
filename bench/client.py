"""The load generator: one grpc.aio Generate stream per request, sent at
its arrival time, every response timestamped on arrival.

Times are seconds from the run's start (time.perf_counter), so a request's
figures are differences of numbers in the same clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from bench import workloads as wl
from bench.progress import Progress
from bench.workloads import BenchRequest
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]
FINISH_NAMES = {spb.FINISH_REASON_STOP: "stop", spb.FINISH_REASON_LENGTH: "length", spb.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. chunk_times/chunk_tokens list
    only responses that carried tokens; status is ok, rejected (the server
    said RESOURCE_EXHAUSTED: load shedding, not a bug) or failed (any other
    error, or a stream that ended aborted or without a finish reason)."""

    index: int
    request_id: str
    arrival_s: float
    max_tokens: int
    prompt_len: int | None
    send_s: float = math.nan
    end_s: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    status: str = "pending"
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Multi-turn: the session and turn (bench.workloads.multi_turn).
    session: int | None = None
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(slots=True)
class RunResult:
    results: list[RequestResult]
    duration_s: float  # start to the last request's end
    started_unix: float  # wall clock at t=0, to line the run up with server logs

    @classmethod
    def of(cls, results: list[RequestResult], started_unix: float) -> RunResult:
        """The run's duration is the last request's end."""
        ends = [r.end_s for r in results if not math.isnan(r.end_s)]
        return cls(results, max(ends, default=0.0), started_unix)


def to_proto(req: BenchRequest, request_id: str, history: list[int] | None = None) -> spb.GenerateRequest:
    # Greedy and ignore_eos: every engine then produces exactly max_tokens
    # tokens, the same ones, so throughput compares equal work.
    # A constrained request's EOS waits until its grammar allows nothing
    # else (see GenerateRequest.structured), so it too runs to max_tokens.
    sampling = spb.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    msg = spb.GenerateRequest(request_id=request_id, sampling=sampling, structured=req.structured)
    if history:
        msg.prompt_token_ids.extend(history)
    if req.prompt_token_ids is not None:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    else:
        msg.prompt = req.prompt_text
    return msg


async def _one(stub: spb_grpc.SchedulerStub, req: BenchRequest, res: RequestResult, t0: float,
               timeout_s: float | None, progress: Progress | None, history: list[int] | None = None) -> None:
    res.send_s = time.perf_counter() - t0
    try:
        call = stub.Generate(to_proto(req, res.request_id, history), timeout=timeout_s)
        async for resp in call:
            now = time.perf_counter() - t0
            if resp.token_ids:
                res.chunk_times.append(now)
                res.chunk_tokens.append(len(resp.token_ids))
                res.output_ids.extend(resp.token_ids)
                if progress is not None:
                    progress.add_tokens(len(resp.token_ids))
            if resp.finish_reason:
                res.finish_reason = FINISH_NAMES.get(resp.finish_reason, str(resp.finish_reason))
            if resp.HasField("usage"):
                res.prompt_tokens = resp.usage.prompt_tokens
                res.completion_tokens = resp.usage.completion_tokens
                res.cached_prompt_tokens = resp.usage.cached_prompt_tokens
        if res.finish_reason in ("stop", "length"):
            res.status = "ok"
        else:
            res.status, res.error = "failed", f"stream ended with finish_reason={res.finish_reason or 'none'}"
    except grpc.aio.AioRpcError as exc:
        rejected = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        res.status = "rejected" if rejected else "failed"
        res.error = f"{exc.code().name}: {exc.details()}"
    res.end_s = time.perf_counter() - t0
    if progress is not None:
        progress.request_done(res.ok)


async def _ticker(progress: Progress, period_s: float = 0.5) -> None:
    while True:
        await asyncio.sleep(period_s)  # a display refresh rate, not a wait for an event
        progress.refresh()


async def gather_with_progress(progress: Progress, show_progress: bool, sends: Iterable[Awaitable[None]]) -> None:
    """Awaits every send, refreshing the progress display meanwhile, and
    closes the display however the sends end."""
    ticker = asyncio.create_task(_ticker(progress)) if show_progress else None
    try:
        await asyncio.gather(*sends)
    finally:
        if ticker is not None:
            ticker.cancel()
        progress.close()


async def run_requests(address: str, requests: Sequence[BenchRequest], *, tag: str = "bench",
                       max_concurrency: int | None = None, timeout_s: float | None = None,
                       show_progress: bool = True, desc: str = "bench") -> RunResult:
    """Sends every request at its arrival_s (all at once for offline) and
    waits for all of them. With max_concurrency, a request that has arrived
    waits for a free slot; its TTFT counts from when it is actually sent,
    and the wait shows as send_s - arrival_s."""
    progress = Progress(len(requests), desc=desc, enabled=show_progress)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [RequestResult(r.index, f"{tag}-{r.index}", r.arrival_s, r.max_tokens, r.prompt_len) for r in requests]
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        t0 = time.perf_counter()
        started_unix = time.time()

        async def send(req: BenchRequest, res: RequestResult) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself
            if gate is None:
                await _one(stub, req, res, t0, timeout_s, progress)
                return
            async with gate:
                await _one(stub, req, res, t0, timeout_s, progress)

        await gather_with_progress(progress, show_progress, (send(q, r) for q, r in zip(requests, results)))
    return RunResult.of(results, started_unix)


async def run_sessions(address: str, requests: Sequence[BenchRequest], *, tag: str = "bench",
                       timeout_s: float | None = None, show_progress: bool = True, desc: str = "bench") -> RunResult:
    """Multi-turn: every session starts at once, and each turn is sent its
    think_s after the session's previous turn has been answered, with the
    whole history (every earlier prompt and answer) before its new question.
    A turn that fails ends its session; its later turns count as failed."""
    progress = Progress(len(requests), desc=desc, enabled=show_progress)
    results = [RequestResult(r.index, f"{tag}-{r.index}", 0.0, r.max_tokens, None, session=r.session, turn=r.turn)
               for r in requests]
    sessions: dict[int, list[tuple[BenchRequest, RequestResult]]] = {}
    for req, res in zip(requests, results):
        sessions.setdefault(req.session, []).append((req, res))
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        t0 = time.perf_counter()
        started_unix = time.time()

        async def session(turns: list[tuple[BenchRequest, RequestResult]]) -> None:
            history: list[int] = []
            for req, res in sorted(turns, key=lambda t: t[0].turn):
                if req.think_s:
                    await asyncio.sleep(req.think_s)  # the workload's pause, not a wait for an event
                res.arrival_s = time.perf_counter() - t0
                res.prompt_len = len(history) + len(req.prompt_token_ids)
                await _one(stub, req, res, t0, timeout_s, progress, history)
                if not res.ok:
                    for _, later in turns:
                        if later.status == "pending":
                            later.status, later.error = "failed", f"turn {res.turn} of the session failed"
                    return
                history = history + req.prompt_token_ids + res.output_ids

        await gather_with_progress(progress, show_progress, (session(turns) for turns in sessions.values()))
    return RunResult.of(results, started_unix)


def copy_prompts_from(address: str, openings: list[str], source_tokens: int, max_prompt_len: int | None = None
                      ) -> list[list[int]]:
    """The copy workload's prompts (workloads.copy_prompts), with the
    scheduler at address tokenizing the openings (its Tokenize RPC) and
    generating each continuation (greedy, ignore_eos), one request at a
    time. Blocking: it runs before anything is timed."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.SchedulerStub(channel)

        def tokenize(text: str, add_special_tokens: bool) -> list[int]:
            req = spb.TokenizeRequest(prompt=text, add_special_tokens=add_special_tokens)
            return list(stub.Tokenize(req, timeout=30).token_ids)

        def generate(prompt: list[int], max_tokens: int) -> list[int]:
            req = to_proto(BenchRequest(0, max_tokens, prompt_token_ids=prompt), request_id="")
            return [t for resp in stub.Generate(req, timeout=600) for t in resp.token_ids]

        return wl.copy_prompts(openings, source_tokens, tokenize, generate, max_prompt_len)


async def server_info(address: str, timeout_s: float = 10.0) -> spb.ServerInfo:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return await spb_grpc.SchedulerStub(channel).GetServerInfo(spb.GetServerInfoRequest(), timeout=timeout_s)


async def drained_server_info(address: str, timeout_s: float = 10.0) -> tuple[spb.ServerInfo, bool]:
    """ServerInfo once nothing runs or waits (aborts and frees land at a
    step boundary, so a moment may pass after the last stream ends).
    Returns (info, drained)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        while True:
            info = await stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=timeout_s)
            if info.num_running == 0 and info.num_waiting == 0:
                return info, True
            if time.monotonic() > deadline:
                return info, False
            await asyncio.sleep(0.1)  # the API has no "drained" event to wait on
