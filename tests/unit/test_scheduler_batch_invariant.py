"""The scheduler with a batch-invariant executor (SchedulerConfig.batch_invariant,
from the handshake): a prompt's chunks end at the same positions whatever
the load and whether its prefix was cached; without the mode the budget
moves them (the control that shows these tests can fail)."""

from __future__ import annotations

from llmsched.v1 import executor_pb2 as epb
from scheduler_svc.convert import model_facts
from scheduler_svc.core.scheduler_config import SchedulerConfig
from tests.factories import make_request, make_requests, make_scheduler, run_step

CHUNK = 32  # max_prefill_chunk of these schedulers: 8 blocks of 4


def chunk_ends(invariant: bool, others: int, prompt: list[int] | None = None, warm_prefix: list[int] | None = None):
    """Where the canary's prompt chunks end, with `others` long prompts
    admitted before it competing for the 64-token budget."""
    sched = make_scheduler(batch_invariant=invariant, max_num_batched_tokens=64, max_prefill_chunk=CHUNK,
                           num_kv_blocks=256, max_num_seqs=16, max_model_len=512)
    if warm_prefix is not None:
        donor = make_request(prompt=warm_prefix + [5, 6, 7], max_tokens=1)
        sched.add_request(donor)
        while not donor.status.is_finished:
            run_step(sched)
    for r in make_requests(others, prompt_len=45, max_tokens=3):
        sched.add_request(r)
    canary = make_request(prompt=prompt or list(range(100, 250)), max_tokens=2)
    sched.add_request(canary)
    ends = []
    while not canary.status.is_finished:
        out, _ = run_step(sched)
        entry = out.entries.get(canary.handle) if canary.handle is not None else None
        if entry is not None and entry.start < canary.num_prompt_tokens:
            ends.append(entry.start + entry.num_tokens)
    return ends


def test_the_invariant_chunk_is_max_prefill_chunk_in_whole_blocks_within_the_budget():
    cfg = dict(num_kv_blocks=8, block_size=16, max_model_len=512)
    assert SchedulerConfig(**cfg, max_prefill_chunk=100).invariant_chunk == 96
    assert SchedulerConfig(**cfg, max_prefill_chunk=512, max_num_batched_tokens=200).invariant_chunk == 192
    assert SchedulerConfig(**cfg, max_prefill_chunk=5).invariant_chunk == 16
    assert SchedulerConfig(**cfg, max_num_batched_tokens=10).invariant_chunk == 10, "a chunk must fit the budget"


def test_prompt_chunks_end_at_the_same_positions_under_any_load():
    alone = chunk_ends(True, others=0)
    assert alone == [32, 64, 96, 128, 150]
    for others in (1, 3, 7):
        assert chunk_ends(True, others) == alone, f"with {others} competing prompts the chunks moved"


def test_without_the_mode_the_load_moves_the_chunks():
    """The control: the budget left by other prompts cuts chunks short."""
    assert chunk_ends(False, others=0) == [32, 64, 96, 128, 150]
    assert any(chunk_ends(False, others) != [32, 64, 96, 128, 150] for others in (1, 3, 7))


def test_a_cached_prefix_leaves_the_later_chunks_where_they_were():
    """40 cached tokens (10 blocks): the first chunk computes 40..64 and
    every later chunk ends where it does uncached."""
    prompt = list(range(100, 250))
    cached = chunk_ends(True, others=2, prompt=prompt, warm_prefix=prompt[:40])
    assert cached == [64, 96, 128, 150]


def test_the_handshake_carries_the_mode_to_the_scheduler():
    facts = model_facts(epb.HandshakeResponse(model="m", block_size=16, num_kv_blocks=8, batch_invariant=True))
    assert facts.batch_invariant
    assert not model_facts(epb.HandshakeResponse(model="m", block_size=16, num_kv_blocks=8)).batch_invariant
    assert facts.geometry != model_facts(epb.HandshakeResponse(model="m", block_size=16, num_kv_blocks=8)).geometry, (
        "an executor that comes back with the mode changed must not keep the old scheduler")


def test_an_unseeded_request_gets_a_seed_of_its_own_for_its_whole_life():
    sched = make_scheduler(batch_invariant=True)
    a, b = make_request(temperature=1.0), make_request(temperature=1.0, seed=7)
    sched.add_request(a)
    sched.add_request(b)
    assert a.sampling.seed is not None and 0 <= a.sampling.seed < 1 << 64
    assert b.sampling.seed == 7, "a client's seed is kept"
    seed = a.sampling.seed
    run_step(sched)
    sched._preempt(a)
    assert a.sampling.seed == seed, "a preemption keeps the stream"
    plain = make_scheduler()
    c = make_request(temperature=1.0)
    plain.add_request(c)
    assert c.sampling.seed is None, "without the mode unseeded requests stay unseeded"
