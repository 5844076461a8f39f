"""Calibration: measure a real executor's step times over a grid of
synthetic plans, fit the step-cost model, and write a profile.

    python -m simulator calibrate --model assets/models/stories260K --out profile.json

The executor is started here (or reached at --address) and driven over its
own Step stream, exactly as the scheduler drives it: two plans in flight,
so each step's time is the executor's alone (from when it could start the
step to its result), as the engine measures it. The plans are synthetic:

- prefill: 1-4 rows, each a chunk of c tokens after k already computed
  (the cache holds whatever; a step's time does not depend on the values);
- decode: B rows at context x, one token each, for several steps;
- mixes: B decode rows plus one prefill chunk.

The grid is visited `rounds` times, each time in a new (seeded) order and
with `steps` measured steps per point, so that a burst of load from
elsewhere on the machine spreads over many points instead of spoiling
one; a point's step time is the median of its steps. Every fifth point is
held out: the model is fitted on the others and scored on those (mean
absolute percentage error). With --host, a second phase
starts the scheduler too and measures the scheduler's own time per step
(profile.HostCost) from steady decodes through both services.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmsched.v1 import executor_pb2 as pb
from scheduler_svc.core.model_facts import ModelFacts
from simulator.cost_model import BASE_FEATURES, FEATURES, StepShape, fit, mape
from simulator.profile import Geometry, HostCost, Profile

HOLDOUT_EVERY = 5
WARMUP_STEPS = 30
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class GridPoint:
    kind: str  # prefill, decode or mix
    rows: int  # prefill rows, or decode rows
    length: int  # chunk (prefill) or context (decode)
    context: int = 0  # prefill: tokens computed before the chunk; mix: decode context
    chunk: int = 0  # mix: the prefill chunk

    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.rows}x{self.length}@{self.context}"
        if self.kind == "decode":
            return f"decode {self.rows}@{self.length}"
        return f"mix decode {self.rows}@{self.context} + chunk {self.chunk}"


def default_grid(max_model_len: int, max_batched_tokens: int = 2048) -> list[GridPoint]:
    """Prefill chunks x context, decode batch x context, and mixes, sized to
    the model's context."""
    grid = []
    for rows in (1, 2, 4):
        for chunk in (8, 32, 64, 128, 256, 512):
            for ctx in (0, 128, 256, 1024, 4096):
                if ctx + chunk < max_model_len and rows * chunk <= max_batched_tokens:
                    grid.append(GridPoint("prefill", rows, chunk, ctx))
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for ctx in (32, 128, 256, 448, 1024, 4096):
            if ctx + 64 < max_model_len:
                grid.append(GridPoint("decode", rows, ctx))
    for rows in (4, 16, 64, 128):
        for ctx in (128, 384):
            for chunk in (32, 128, 512):
                if ctx + 64 < max_model_len and chunk < max_model_len:
                    grid.append(GridPoint("mix", rows, 0, ctx, chunk))
    return grid


@dataclass(slots=True)
class Measurement:
    point: GridPoint
    shape: StepShape
    seconds: float


class PlanWriter:
    """Synthetic plans: handles and blocks handed out and taken back the
    way the scheduler would, so the executor sees valid plans."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int):
        self.block_size = block_size
        self.vocab = vocab_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.next_handle = 0
        self.step_id = 0
        self.to_forget: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def blocks_for(self, handle: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(handle, [])
        new = []
        while len(table) * self.block_size < num_tokens:
            b = self.free_blocks.pop()
            table.append(b)
            new.append(b)
        return new

    def forget(self, handle: int) -> None:
        self.to_forget.append(handle)
        self.free_blocks.extend(reversed(self.tables.pop(handle)))
        self.lengths.pop(handle)

    def plan(self, new: list[tuple[int, int]] = (), cached: list[int] = ()) -> tuple[pb.StepPlan, StepShape]:
        """new: (tokens computed, tokens to compute) of fresh requests;
        cached: handles that decode one token."""
        plan = pb.StepPlan(step_id=self.step_id, finished_handles=self.to_forget)
        self.step_id += 1
        self.to_forget = []
        rows = []
        for computed, n in new:
            h = self.next_handle
            self.next_handle += 1
            total = computed + n
            self.blocks_for(h, total)
            self.lengths[h] = total
            ids = [3 + (h * 7919 + i * 31) % (self.vocab - 3) for i in range(total)]
            plan.new_requests.append(pb.NewRequest(
                handle=h, token_ids=ids, block_ids=self.tables[h], num_computed_tokens=computed,
                num_scheduled_tokens=n, sampling=pb.StepSampling(temperature=0.0, top_p=1.0)))
            rows.append((n, computed))
        for h in cached:
            start = self.lengths[h]
            self.lengths[h] = start + 1  # the token sampled last step
            plan.cached_handles.append(h)
            plan.cached_num_scheduled_tokens.append(1)
            for b in self.blocks_for(h, start + 1):
                plan.new_block_handles.append(h)
                plan.new_block_ids.append(b)
            rows.append((1, start))
        return plan, StepShape(tuple(rows))


def scenario(w: PlanWriter, p: GridPoint, repeats: int) -> Iterator[tuple[pb.StepPlan, StepShape | None]]:
    """The plans of one grid point: (plan, shape) where shape is None for
    plans that are not measured (setting rows up)."""
    if p.kind == "prefill":
        for _ in range(repeats):
            handles = list(range(w.next_handle, w.next_handle + p.rows))
            yield w.plan(new=[(p.context, p.length)] * p.rows)
            for h in handles:
                w.forget(h)
        return
    ctx = p.length if p.kind == "decode" else p.context
    decoders = list(range(w.next_handle, w.next_handle + p.rows))
    # The rows' prompts, their last token computed by a decode-like step.
    plan, _ = w.plan(new=[(ctx - 1, 1)] * p.rows)
    yield plan, None
    for _ in range(repeats):
        if p.kind == "decode":
            yield w.plan(cached=decoders)
        else:
            h = w.next_handle
            yield w.plan(new=[(0, p.chunk)], cached=decoders)
            w.forget(h)
    for h in decoders:
        w.forget(h)


async def measure(address: str, grid: list[GridPoint], rounds: int, steps: int, connect_timeout_s: float = 120.0,
                  progress=None, seed: int = 0) -> tuple[ModelFacts, list[Measurement]]:
    """Runs the grid over the executor's Step stream with two plans in
    flight; returns each measured step's time."""
    from scheduler_svc.executor_client import ExecutorClient

    client = ExecutorClient(address, 64 * 1024 * 1024)
    info = await client.connect(connect_timeout_s)
    w = PlanWriter(info.num_kv_blocks, info.block_size, info.vocab_size)
    fits = [p for p in grid if _blocks_needed(p, info.block_size, steps) <= info.num_kv_blocks
            and _max_len(p, steps) <= info.max_model_len]
    rng = random.Random(seed)

    def plans() -> Iterator[tuple[pb.StepPlan, GridPoint | None, StepShape | None]]:
        warm = GridPoint("decode", 8, min(64, info.max_model_len // 2))
        for plan, _ in scenario(w, warm, WARMUP_STEPS):
            yield plan, None, None
        for r in range(rounds):
            if progress:
                progress(r, rounds, len(fits))
            order = list(fits)
            rng.shuffle(order)
            for p in order:
                for plan, shape in scenario(w, p, steps):
                    yield plan, p, shape
        yield pb.StepPlan(step_id=w.step_id, finished_handles=w.to_forget), None, None

    out: list[Measurement] = []
    sent: list[tuple[float, GridPoint | None, StepShape | None]] = []
    last_result = 0.0
    it = plans()
    try:
        for _ in range(2):
            plan, p, shape = next(it)
            await client.send_plan(plan)
            sent.append((time.perf_counter(), p, shape))
        while sent:
            result = await client.receive_result()
            now = time.perf_counter()
            sent_at, p, shape = sent.pop(0)
            if result.error:
                raise RuntimeError(f"the executor failed a calibration step: {result.error}")
            if shape is not None:
                out.append(Measurement(p, shape, now - max(sent_at, last_result)))
            last_result = now
            nxt = next(it, None)
            if nxt is not None:
                await client.send_plan(nxt[0])
                sent.append((time.perf_counter(), nxt[1], nxt[2]))
    finally:
        await client.close()
    return info, out


def _max_len(p: GridPoint, repeats: int) -> int:
    if p.kind == "prefill":
        return p.context + p.length
    return max(p.chunk, (p.length if p.kind == "decode" else p.context) + repeats + 1)


def _blocks_needed(p: GridPoint, block_size: int, repeats: int) -> int:
    per = -(-_max_len(p, repeats) // block_size)
    if p.kind == "prefill":
        return 2 * p.rows * per  # this plan's rows and the last one's, not yet forgotten
    return p.rows * per + 2 * -(-p.chunk // block_size)


@dataclass(slots=True)
class Fit:
    profile_cost: object
    train_points: int
    holdout_points: int
    holdout_mape_points: float  # on each held-out point's median step time
    holdout_mape_steps: float  # on every held-out step
    train_mape_points: float
    by_point: list[dict] = field(default_factory=list)
    # Which model was kept, and each candidate's held-out MAPE (points).
    model: str = "base"
    candidates: dict = field(default_factory=dict)


# The candidate models: the features, and those plus a cost per
# prefill row (cost_model.py). The extended one is kept only when it is
# better on the held-out points.
MODELS = {"base": BASE_FEATURES, "extended": FEATURES}


def fit_measurements(ms: list[Measurement]) -> Fit:
    by_point: dict[GridPoint, list[Measurement]] = {}
    for m in ms:
        by_point.setdefault(m.point, []).append(m)
    points = list(by_point)
    medians = []
    for p in points:
        steps = by_point[p]
        # Decode repeats grow their context by a token a step: the median
        # step's shape goes with the median time.
        order = sorted(range(len(steps)), key=lambda i: steps[i].seconds)
        mid = steps[order[len(order) // 2]]
        medians.append((p, mid.shape.features(), statistics.median(s.seconds for s in steps)))
    train = [m for i, m in enumerate(medians) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    held = [m for i, m in enumerate(medians) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    candidates = {name: fit([f for _, f, _ in train], [s for _, _, s in train], names)
                  for name, names in MODELS.items()}
    scores = {name: mape(model, [f for _, f, _ in held], [s for _, _, s in held]) if held else float("nan")
              for name, model in candidates.items()}
    chosen = "extended" if held and scores["extended"] < scores["base"] else "base"
    model = candidates[chosen]
    held_steps = [m for p, _, _ in held for m in by_point[p]]
    rows = [{"point": p.name(), "measured_ms": s * 1e3, "predicted_ms": model.predict(f) * 1e3,
             "held_out": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1, "repeats": len(by_point[p])}
            for i, (p, f, s) in enumerate(medians)]
    return Fit(
        model, len(train), len(held), scores[chosen],
        mape(model, [m.shape.features() for m in held_steps], [m.seconds for m in held_steps]) if held else float("nan"),
        mape(model, [f for _, f, _ in train], [s for _, _, s in train]),
        rows, chosen,
        {name: {"holdout_mape_points_pct": scores[name], "coefficients": candidates[name].as_dict()}
         for name in MODELS},
    )


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def calibrate(model: str, executor_env: dict[str, str], out: Path, *, address: str | None = None,
              rounds: int = 10, steps: int = 3, grid: list[GridPoint] | None = None, name: str | None = None,
              host: bool = False, log=print) -> Profile:
    services = None
    env = {"EXECUTOR_MODEL": model, "EXECUTOR_NUM_THREADS": "1", **executor_env}
    if address is None:
        from llmsched.launch import launch

        services = launch(executor_env=env)
        log_path = out.with_suffix(".executor.log")
        services.stdout = log_path.open("w")
        log(f"calibrate: starting the executor ({model}); log in {log_path}")
        services.start_executor()
        address = services.executor_address
    try:
        max_len_guess = 1 << 20
        info, ms = asyncio.run(measure(address, grid or default_grid(max_len_guess), rounds, steps,
                                       progress=lambda r, n, points: log(f"calibrate: round {r + 1}/{n} over "
                                                                         f"{points} grid points")))
    finally:
        if services is not None and not host:
            services.stop()
    result = fit_measurements(ms)
    provenance = {
        "source": "calibrate", "model": model, "device": info.device or "cpu",
        "dtype": env.get("EXECUTOR_DTYPE", "auto"), "tensor_parallel_size": info.tensor_parallel_size or 1,
        "commit": git_commit(), "executor_env": {k: v for k, v in env.items() if k != "EXECUTOR_MODEL"},
        "num_threads": int(env.get("EXECUTOR_NUM_THREADS", "1")), "created_unix": int(time.time()),
        "host": os.uname().nodename, "instance_id": info.instance_id,
    }
    host_cost = HostCost()
    host_fit: dict = {}
    if host:
        try:
            host_cost, host_fit = calibrate_host(services, result.profile_cost, log=log)
        finally:
            services.stop()
    profile = Profile(
        name or f"{Path(model).name}-{provenance['device']}", True, provenance,
        Geometry(info.block_size, info.num_kv_blocks, info.max_model_len, info.vocab_size, info.num_host_kv_blocks),
        result.profile_cost, host_cost,
        {"rounds": rounds, "steps_per_round": steps, "num_steps": len(ms), "train_points": result.train_points,
         "holdout_points": result.holdout_points, "holdout_every": HOLDOUT_EVERY,
         "holdout_mape_points_pct": result.holdout_mape_points, "holdout_mape_steps_pct": result.holdout_mape_steps,
         "train_mape_points_pct": result.train_mape_points, "features": list(FEATURES), "model": result.model,
         "candidates": result.candidates, "points": result.by_point,
         "host": host_fit},
    )
    profile.write(out)
    return profile


# ----- the scheduler's own time per step ------------------------------------------

HOST_BATCHES = (1, 4, 16, 48, 96)
HOST_OUTPUT_TOKENS = 96
HOST_PROMPT_TOKENS = 16


def calibrate_host(services, cost, log=print) -> tuple[HostCost, dict]:
    """Steady decodes of B requests through both services: the client's
    inter-token time against the executor's predicted step time. Where the
    scheduler is the slower of the two, the cadence is its time per step;
    a line through those points (NNLS) is its per-step and per-token cost.
    The first token's delay over the step that computed it is the stream
    latency."""
    from bench.client import run_requests
    from bench.stats import inter_token_latencies
    from bench.workloads import BenchRequest, random_token_ids
    from simulator.cost_model import fit as nnls_fit

    import random

    services.start_scheduler()
    rng = random.Random(0)
    points = []
    latencies = []
    for batch in HOST_BATCHES:
        reqs = [BenchRequest(i, HOST_OUTPUT_TOKENS, prompt_token_ids=random_token_ids(rng, HOST_PROMPT_TOKENS, 500))
                for i in range(batch)]
        run = asyncio.run(run_requests(services.scheduler_address, reqs, tag=f"host-{batch}", show_progress=False))
        itl = []
        for r in run.results:
            gaps = inter_token_latencies(r.chunk_times, r.chunk_tokens)
            itl.extend(gaps[len(gaps) // 4: 3 * len(gaps) // 4])  # steady: all B decoding
        cadence = statistics.median(itl)
        executor = cost.step_seconds(StepShape(tuple((1, HOST_PROMPT_TOKENS + HOST_OUTPUT_TOKENS // 2)
                                                     for _ in range(batch))))
        points.append({"batch": batch, "cadence_ms": cadence * 1e3, "executor_ms": executor * 1e3})
        log(f"calibrate --host: {batch} streams: {cadence * 1e3:.2f} ms between tokens, "
            f"executor step {executor * 1e3:.2f} ms")
        first = [r.chunk_times[0] - r.send_s for r in run.results if r.chunk_times]
        prefill = cost.step_seconds(StepShape(tuple((HOST_PROMPT_TOKENS, 0) for _ in range(batch))))
        latencies.append(statistics.median(first) - prefill)
    # The scheduler's time shows only where it exceeds the executor's.
    slow = [p for p in points if p["cadence_ms"] > 1.05 * p["executor_ms"]]
    if slow:
        model = nnls_fit([(1.0, float(p["batch"]), 0, 0, 0, 0) for p in slow], [p["cadence_ms"] / 1e3 for p in slow])
        per_step, per_token = model.coefficients[0], model.coefficients[1]
    else:
        per_step = per_token = 0.0
    # Only a lone request's first token has no other request's prefill
    # ahead of it: the least excess is the stream latency.
    latency = max(0.0, min(latencies))
    return (HostCost(per_step, per_token, latency),
            {"points": points, "scheduler_bound_points": len(slow), "first_token_excess_ms": [x * 1e3 for x in latencies]})


def _print_fit(profile: Profile, out=sys.stdout) -> None:
    f = profile.fit
    print(f"held-out step-time MAPE: {f['holdout_mape_points_pct']:.2f}% over {f['holdout_points']} grid points "
          f"(their medians); {f['holdout_mape_steps_pct']:.2f}% over every held-out step; "
          f"{f['train_mape_points_pct']:.2f}% on the {f['train_points']} fitted points", file=out)
    if f.get("candidates"):
        print("held-out MAPE by model: " + ", ".join(f"{name} {c['holdout_mape_points_pct']:.2f}%"
                                                    for name, c in f["candidates"].items())
              + f"; kept: {f['model']}", file=out)
    print("coefficients: " + ", ".join(f"{k} {v:.4g}" for k, v in profile.step_cost.as_dict().items()), file=out)
