"""Runs one tensor-parallel rank in a fresh process for the unit tests:
every rank drives its own model runner with the same plans (as the other
ranks do with rank 0's), over a real gloo group, and rank 0 reports its
greedy tokens and the logits it sampled from."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time

import numpy as np

from executor_svc.config import ExecutorSettings
from llmsched.launch import free_port

BLOCK = 4


def settings_for(model: str, size: int, drafts: int = 0, method: str = "ngram", draft_model: str = "",
                 lora_adapters: str = "") -> ExecutorSettings:
    speculative = {"speculative_method": method, "speculative_tokens": drafts,
                   "speculative_draft_model": draft_model} if drafts else {}
    return ExecutorSettings(model=model, tensor_parallel_size=size, tensor_parallel_timeout_s=60, device="cpu",
                            dtype="float32", attention_backend="torch", block_size=BLOCK, num_kv_blocks=512,
                            num_threads=1, lora_adapters=lora_adapters, **speculative)


def generate_on_rank(model: str, size: int, rank: int, port: int, prompts, max_new: int, chunk: int, results,
                     drafts: int = 0, method: str = "ngram", draft_model: str = "", lora_adapters: str = "",
                     adapters: list[str] | None = None) -> None:
    from executor_svc.loading import load
    from tests.unit.test_runner_vs_hf import generate

    if size > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    loaded = load(settings_for(model, size, drafts, method, draft_model, lora_adapters))
    logits: list[np.ndarray] = []
    compute = loaded.runner.model.compute_logits

    def recording(hidden):
        out = compute(hidden)
        if out is not None:
            logits.append(out.numpy().copy())
        return out

    loaded.runner.model.compute_logits = recording
    stats: dict[str, int] = {}
    tokens = generate(loaded.runner, prompts, max_new, chunk, drafts=drafts, stats=stats, adapters=adapters)
    if rank == 0:
        results.put((tokens, logits, stats["steps"]))
        results.close()
        results.join_thread()  # flushed before leave()'s os._exit below
    if loaded.tp is not None:
        loaded.tp.leave()  # as the service's ranks stop: without destroy_process_group


def run_group(model: str, size: int, prompts, max_new: int, chunk: int, timeout_s: float = 240.0, drafts: int = 0,
              method: str = "ngram", draft_model: str = "", lora_adapters: str = "",
              adapters: list[str] | None = None):
    """(tokens per prompt, logits per step, steps) from rank 0 of a group of
    `size`; with drafts, every rank speculates up to that many, by
    EXECUTOR_SPECULATIVE_METHOD=method (draft: with draft_model); with
    lora_adapters (EXECUTOR_LORA_ADAPTERS), prompt i runs under adapters[i]."""
    return _run_ranks(size, timeout_s, lambda r, port, results: (
        generate_on_rank, (model, size, r, port, prompts, max_new, chunk, results, drafts, method, draft_model,
                           lora_adapters, adapters)))


def canary_on_rank(model: str, size: int, rank: int, port: int, results) -> None:
    """Batch-invariant mode on this rank of a group: the canary alone, then
    among 63 neighbours (tests/invariance.py); rank 0 reports both runs."""
    from executor_svc.loading import load
    from tests import invariance

    if size > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    settings = ExecutorSettings(model=model, tensor_parallel_size=size, tensor_parallel_timeout_s=60, device="cpu",
                                dtype="float32", attention_backend="torch", block_size=invariance.BLOCK,
                                num_kv_blocks=64 * invariance.BLOCKS_PER_REQUEST, num_threads=1, batch_invariant="on")
    loaded = load(settings)  # runs the start-up self-test on every rank
    canary = lambda: invariance.Req(invariance.CANARY, invariance.canary_prompt(), 256, invariance.CANARY_SAMPLING)
    alone = invariance.run(loaded.runner, [canary()], chunk=512)
    among = invariance.run(loaded.runner, [canary()] + invariance.neighbours(63, seed=5, max_arrival=60,
                                                                             max_prompt=150, max_tokens=40), chunk=64)
    if rank == 0:
        results.put((alone, among))
        results.close()
        results.join_thread()
    if loaded.tp is not None:
        loaded.tp.leave()


def run_canary_group(model: str, size: int, timeout_s: float = 240.0):
    """(the canary alone, the canary among neighbours), from rank 0 of a
    batch-invariant group of `size`."""
    return _run_ranks(size, timeout_s, lambda r, port, results: (canary_on_rank, (model, size, r, port, results)))


def _run_ranks(size: int, timeout_s: float, target_and_args):
    """Starts `size` ranks, each running target_and_args(rank, port, results);
    returns what rank 0 put on results."""
    ctx = multiprocessing.get_context("forkserver")
    # Each rank is forked from a server that has already imported torch and
    # the executor (about 2 s of CPU a rank, 30-odd ranks in the suite);
    # nothing in that server has started a thread, so forking is safe.
    ctx.set_forkserver_preload(["executor_svc.loading", "tests.unit.test_runner_vs_hf"])
    results = ctx.Queue()
    port = free_port()
    procs = []
    for r in range(size):
        target, args = target_and_args(r, port, results)
        procs.append(ctx.Process(target=target, args=args))
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # fail at once, naming the rank, when one dies first
            try:
                got = results.get(timeout=0.5)
                break
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                assert not dead, f"ranks exited before rank 0 reported: {dead}"
                assert time.monotonic() < deadline, f"no result from rank 0 within {timeout_s}s"
        for p in procs:
            p.join(timeout=60)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * size, f"rank exit codes {codes}"
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
