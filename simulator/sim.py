"""Replays a trace through the real scheduler in virtual time.

The scheduler (scheduler_svc.core.scheduler), its block manager and prefix
cache, admission control and the engine's turn rules (EngineCore: plans in
flight, what to send when, applying results) are the production objects;
only the executor is replaced, by the profile's step-cost model:

- the executor runs plans in order; a plan starts when it is sent and the
  one before it is done, and takes the cost model's time for its shape;
- its result reaches the scheduler when the step is done; the scheduler is
  then busy for the profile's host time (applying the result, streaming
  its tokens, planning), and only after that sends its next plan, so with
  plans in flight the executor waits only when the host time exceeds a
  step;
- a token reaches its client when the scheduler is done with its step,
  plus the profile's stream latency;
- requests arrive at their trace times and are submitted as the engine
  would (admission control included), taking effect at the next turn.

Virtual time is a float advanced only by these rules: the host time spent
computing the simulation never enters it, and the same inputs give the
same events, bit for bit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bench.client import RequestResult, RunResult
from bench.traces import PromptMaker, Trace
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.core.backpressure import Overloaded
from scheduler_svc.core.engine_core import CoreListener, EngineCore, InFlightStep, TurnKind, core_limits, scheduler_config
from scheduler_svc.core.plan import SampledToken, StepResult
from scheduler_svc.core.request import Request, SamplingParams
from simulator.cost_model import StepShape
from simulator.profile import Profile

# The token every simulated step samples. Requests run with ignore_eos to
# max_tokens, as the bench client sends them, so the value never matters
# for timing; it only must not be a stop token.
SAMPLED_TOKEN = 3


class SimulationError(RuntimeError):
    pass


@dataclass(slots=True)
class ServerFigures:
    """What the real run's server section reports, from the simulation."""

    num_preemptions: int = 0
    num_free_kv_blocks: int = 0
    num_free_host_kv_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_tokens_held: int = 0
    kv_slots_allocated: int = 0
    executor_busy_s: float = 0.0
    executor_idle_s: float = 0.0
    num_steps: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    prefix_hit_tokens_device: int = 0
    prefix_hit_tokens_host: int = 0
    recomputed_tokens: int = 0
    swapped_blocks_out: int = 0
    swapped_blocks_in: int = 0
    swap_s: float = 0.0


@dataclass(slots=True)
class SimResult:
    run: RunResult
    server: ServerFigures
    settings: SchedulerSettings
    profile: Profile
    trace: Trace
    num_clamped: int = 0


class Simulation(CoreListener):
    def __init__(self, profile: Profile, settings: SchedulerSettings, trace: Trace):
        g = profile.geometry
        self.profile = profile
        self.settings = settings
        self.trace = trace
        self.core = EngineCore(core_limits(settings), self)
        # The scheduler weighs a swap against a recompute with the step times
        # the core measures, here the cost model's: as in the engine.
        # One step per plan: the cost model prices a plan by its shape, one
        # forward, and the fake executor samples one token per row, so
        # multi-step decode (SCHEDULER_MULTI_STEP_DECODE) is not simulated.
        self.core.attach(scheduler_config(settings.model_copy(update={"multi_step_decode": 1}), g.num_kv_blocks,
                                          g.block_size, g.max_model_len, g.num_host_kv_blocks))
        self.maker = PromptMaker(g.vocab_size, trace.options.seed, max(r.prompt_len for r in trace.records))
        self.now = 0.0
        self.results = [RequestResult(r.index, f"trace-{r.index}", r.arrival_s, r.output_len, r.prompt_len)
                        for r in trace.records]
        self._by_request_id: dict[str, RequestResult] = {}
        # Tokens of the result being applied, streamed once the scheduler
        # is done with it.
        self._pending_tokens: list[SampledToken] = []
        self.server = ServerFigures()

    # ----- the loop ---------------------------------------------------------

    def run(self) -> SimResult:
        core, cost, host = self.core, self.profile.step_cost, self.profile.host
        sched = core.scheduler
        records = self.trace.records
        next_arrival = 0
        # (done time, step) of each plan in flight, parallel to core.in_flight.
        done_at: deque[float] = deque()
        executor_free_at = 0.0
        while True:
            # Requests that arrived by now, each judged at its own time.
            while next_arrival < len(records) and records[next_arrival].arrival_s <= self.now:
                self._submit(records[next_arrival])
                next_arrival += 1
            core.apply_pending()
            turn = core.next_turn()
            kind = turn.kind
            if kind is TurnKind.SEND:
                step = turn.step
                after_idle = core.take_after_idle()
                core.on_sent(step, self.now)
                start = max(self.now, executor_free_at)
                if not after_idle and start > executor_free_at:
                    self.server.executor_idle_s += start - executor_free_at
                out = step.out
                # A plan of forgets alone costs nothing; one of copies alone
                # costs its copies.
                shape = StepShape.of_plan(out)
                seconds = cost.step_seconds(shape) if out.entries else self._swap_seconds(shape)
                self.server.executor_busy_s += seconds
                executor_free_at = start + seconds
                done_at.append(executor_free_at)
            elif kind is TurnKind.RECEIVE:
                t = done_at.popleft()
                if t > self.now:
                    # Arrivals while the scheduler waits are submitted then.
                    while next_arrival < len(records) and records[next_arrival].arrival_s <= t:
                        self.now = records[next_arrival].arrival_s
                        self._submit(records[next_arrival])
                        next_arrival += 1
                    self.now = t
                step = core.on_result(self._outcome(core.in_flight[0]), self.now)
                n = sum(1 for e in step.out.entries.values() if e.samples)
                busy = host.busy_s(n)
                self._flush_tokens(self.now + busy + host.stream_latency_s)
                self.now += busy
            elif kind is TurnKind.AGAIN:
                continue
            else:  # WAIT, or STUCK: both wait for new input
                if next_arrival >= len(records):
                    if kind is TurnKind.STUCK or sched.has_work:
                        raise SimulationError("the scheduler has work but scheduled nothing and nothing is "
                                              "in flight, with no arrival left to change that")
                    break
                self.now = max(self.now, records[next_arrival].arrival_s)
        self.server.num_preemptions = sched.num_preemptions
        self.server.num_preemptions_swap = sched.num_preemptions_by_mode["swap"]
        self.server.num_preemptions_recompute = sched.num_preemptions_by_mode["recompute"]
        self.server.prefix_hit_tokens_device = sched.kv.num_hit_blocks * sched.config.block_size
        self.server.prefix_hit_tokens_host = sched.kv.num_host_hit_blocks * sched.config.block_size
        self.server.recomputed_tokens = sum(sched.num_recomputed_tokens.values())
        self.server.num_free_kv_blocks = sched.num_free_blocks
        self.server.num_free_host_kv_blocks = sched.num_free_host_blocks
        return SimResult(RunResult.of(self.results, 0.0), self.server, self.settings, self.profile, self.trace,
                         self.trace.num_clamped)

    def _submit(self, rec) -> None:
        res = self.results[rec.index]
        res.send_s = rec.arrival_s
        req = Request(
            request_id=res.request_id,
            prompt_token_ids=self.maker.prompt(rec),
            sampling=SamplingParams(max_tokens=rec.output_len, temperature=0.0, ignore_eos=True),
            eos_token_ids=frozenset(),
            arrival_time=rec.arrival_s,
        )
        try:
            self.core.submit(req)
        except Overloaded as exc:
            res.status, res.error, res.end_s = "rejected", f"RESOURCE_EXHAUSTED: {exc}", rec.arrival_s
            return
        except ValueError as exc:
            res.status, res.error, res.end_s = "failed", f"INVALID_ARGUMENT: {exc}", rec.arrival_s
            return
        res.prompt_tokens = req.num_prompt_tokens
        self._by_request_id[res.request_id] = res

    def _swap_seconds(self, shape: StepShape) -> float:
        return self.profile.step_cost.as_dict()["swapped_blocks"] * shape.swapped_blocks

    def _outcome(self, step: InFlightStep) -> StepResult:
        """What the executor answers: a token for every row that samples,
        every copy done, in the cost model's time for the copies."""
        out = step.out
        swap_s = 0.0
        if out.swaps is not None:
            self.server.swapped_blocks_out += len(out.swaps.out_host)
            self.server.swapped_blocks_in += len(out.swaps.in_host)
            swap_s = self._swap_seconds(StepShape.of_plan(out))
            self.server.swap_s += swap_s
        return StepResult(sampled=[(h, SAMPLED_TOKEN, None) for h in out.sampling_handles()],
                           swap_ns=round(swap_s * 1e9))

    # ----- CoreListener -------------------------------------------------------

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        self._pending_tokens = tokens

    def step_applied(self, step: InFlightStep, outcome: StepResult, elapsed: float) -> None:
        load = self.core.scheduler.load()
        self.server.num_steps += 1
        self.server.kv_tokens_held += load.tokens_held
        self.server.kv_slots_allocated += load.slots_allocated

    def _flush_tokens(self, at: float) -> None:
        tokens, self._pending_tokens = self._pending_tokens, []
        for t in tokens:
            req = t.request
            res = self._by_request_id.get(req.request_id)
            if res is None:
                continue
            res.chunk_times.append(at)
            res.chunk_tokens.append(1)
            if req.status.is_finished:
                res.end_s = at
                res.status, res.finish_reason = "ok", "length"
                res.completion_tokens = len(req.output_token_ids)
                res.cached_prompt_tokens = req.num_cached_prompt_tokens
                del self._by_request_id[req.request_id]


def simulate(profile: Profile, settings: SchedulerSettings, trace: Trace) -> SimResult:
    return Simulation(profile, settings, trace).run()

