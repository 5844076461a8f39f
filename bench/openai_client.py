"""The load generator against an OpenAI-compatible endpoint (our gateway,
or a router in front of replicas): one streamed /v1/completions request per
bench request, timed like the gRPC client so the figures compare.

The stream carries text, not token ids: token counts come from the final
usage chunk (stream_options.include_usage), and each content chunk counts
as one token, the last one taking whatever the usage says is left.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import aiohttp

from bench.client import RequestResult, RunResult, gather_with_progress
from bench.progress import Progress
from bench.workloads import BenchRequest


def request_body(req: BenchRequest, model: str, prompt_text: str | None) -> dict:
    # Greedy and ignore_eos, as the gRPC client sends: equal work per request.
    prompt = prompt_text if prompt_text is not None else (
        req.prompt_text if req.prompt_token_ids is None else list(req.prompt_token_ids))
    return {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _one(session: aiohttp.ClientSession, url: str, body: dict, res: RequestResult, t0: float,
               timeout_s: float | None, progress: Progress | None) -> None:
    res.send_s = time.perf_counter() - t0
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url + "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                text = await resp.text()
                res.status = "rejected" if resp.status == 429 else "failed"
                res.error = f"HTTP {resp.status}: {text[:200]}"
            else:
                await _read_stream(resp, res, t0, progress)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.status, res.error = "failed", f"{type(exc).__name__}: {exc}"
    res.end_s = time.perf_counter() - t0
    if progress is not None:
        progress.request_done(res.ok)


async def _read_stream(resp, res: RequestResult, t0: float, progress: Progress | None) -> None:
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            res.status, res.error = "failed", chunk["error"].get("message", "stream error")
            return
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                res.chunk_times.append(time.perf_counter() - t0)
                res.chunk_tokens.append(1)
                if progress is not None:
                    progress.add_tokens(1)
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        if usage := chunk.get("usage"):
            res.prompt_tokens = usage["prompt_tokens"]
            res.completion_tokens = usage["completion_tokens"]
            res.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if res.chunk_tokens:
        # Held-back bytes or merged responses: the last chunk takes the rest.
        res.chunk_tokens[-1] += max(0, res.completion_tokens - sum(res.chunk_tokens))
    if res.finish_reason in ("stop", "length"):
        res.status = "ok"
    else:
        res.status, res.error = "failed", f"stream ended with finish_reason={res.finish_reason or 'none'}"


async def run_openai_requests(url: str, model: str, requests: Sequence[BenchRequest], *,
                              prompt_texts: Sequence[str] | None = None, tag: str = "bench",
                              max_concurrency: int | None = None, timeout_s: float | None = None,
                              show_progress: bool = True, desc: str = "bench") -> RunResult:
    """Like bench.client.run_requests, against url's /v1/completions.
    prompt_texts replaces the workload's prompts (routers refuse token-id
    prompts)."""
    progress = Progress(len(requests), desc=desc, enabled=show_progress)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [RequestResult(r.index, f"{tag}-{r.index}", r.arrival_s, r.max_tokens, r.prompt_len) for r in requests]
    # No connection cap: concurrency is the workload's to decide.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        started_unix = time.time()

        async def send(i: int, req: BenchRequest, res: RequestResult) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself
            body = request_body(req, model, prompt_texts[i] if prompt_texts is not None else None)
            if gate is None:
                await _one(session, url, body, res, t0, timeout_s, progress)
                return
            async with gate:
                await _one(session, url, body, res, t0, timeout_s, progress)

        await gather_with_progress(progress, show_progress,
                                   (send(i, q, r) for i, (q, r) in enumerate(zip(requests, results))))
    return RunResult.of(results, started_unix)


async def served_model(url: str) -> tuple[str, int]:
    """(model id, max_model_len) from /v1/models."""
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        entry = (await resp.json())["data"][0]
        return entry["id"], int(entry.get("max_model_len") or 0)
