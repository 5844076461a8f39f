"""Speculative decoding with a draft model (EXECUTOR_SPECULATIVE_METHOD=
draft), in process (issue 36): the target itself as its draft accepts
every greedy draft (the ceiling: K + 1 tokens per step); a draft model
that disagrees (stories260K with noise added) still leaves greedy output
equal to HF's and a seeded sampled request's tokens equal to plain
decoding's; the draft model's own KV follows requests that are re-sent,
and a draft model with another tokenizer is refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.attention import make_backend
from executor_svc.config import ExecutorSettings
from executor_svc.loading import load
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.step.draft_model import DraftModel, vocabulary_mismatch
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from llmsched.errors import StartupError
from tests import tp_ranks
from tests.oracle import hf_greedy
from tests.unit.test_runner_vs_hf import BLOCK, GREEDY, generate, make_runner

PROMPTS = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309], [1, 50]]
MAX_NEW, K = 25, 4
SEEDED = SamplingSettings(temperature=1.0, top_p=0.9, top_k=0, seed=1234, logprobs=2)


def with_draft(runner, model: str):
    """The runner proposing with `model` as its draft, its KV pool the
    size of the runner's."""
    ckpt = load_checkpoint(model)
    cfg = read_config(ckpt.hf_config)
    draft = build_model(cfg, ckpt.state_dict, runner.max_model_len, torch.device("cpu"), torch.float32)
    pool = KVCachePool(cfg, runner.pool.num_blocks, BLOCK, torch.device("cpu"), torch.float32)
    runner.proposer = DraftModel(draft, pool, make_backend("torch"), torch.device("cpu"), runner.vocab_size)
    return runner


@pytest.fixture(scope="module")
def noisy(stories_path, tmp_path_factory):
    """stories260K with noise on every weight: the same tokenizer, a model
    that agrees with the target on some tokens and not others."""
    out = tmp_path_factory.mktemp("noisy")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(stories_path / name, out / name)
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v
               for k, v in load_file(stories_path / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors")
    return str(out)


def accepted(runner, prompts, settings=None):
    """(tokens per prompt, drafts verified, drafts accepted, steps)."""
    counts = {"verified": 0, "accepted": 0}
    execute = runner.execute

    def counting(plan):
        result = execute(plan)
        yielded = {}
        for h in result.sampled_handles:
            yielded[h] = yielded.get(h, 0) + 1
        for h, verified, accepted in result.verified_drafts:
            assert not verified or accepted == yielded[h] - 1, "the accepted count is the tokens past the first"
            counts["verified"] += verified
            counts["accepted"] += accepted
        return result

    runner.execute = counting
    stats = {}
    tokens = generate(runner, prompts, MAX_NEW, 64, settings, drafts=K, stats=stats)
    return tokens, counts["verified"], counts["accepted"], stats["steps"]


def test_the_target_as_its_own_draft_accepts_every_greedy_draft(stories_path):
    """The ceiling: every verified draft is accepted and each step after
    the prompt's yields K + 1 tokens; the tokens are HF's."""
    runner = with_draft(make_runner(str(stories_path)), str(stories_path))
    tokens, verified, accepted_drafts, steps = accepted(runner, PROMPTS)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_greedy(str(stories_path), prompt, MAX_NEW, ignore_eos=True), prompt
    assert verified > 0 and accepted_drafts == verified, f"{accepted_drafts} of {verified} drafts accepted"
    assert steps == 1 + -(-(MAX_NEW - 1) // (K + 1)), f"{steps} steps for {MAX_NEW} tokens at {K + 1} a step"


def test_a_draft_model_that_disagrees_leaves_greedy_output_equal_to_hf(stories_path, noisy):
    runner = with_draft(make_runner(str(stories_path)), noisy)
    tokens, verified, accepted_drafts, _ = accepted(runner, PROMPTS)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_greedy(str(stories_path), prompt, MAX_NEW, ignore_eos=True), prompt
    assert 0 < accepted_drafts < verified, f"{accepted_drafts} of {verified}: the noisy draft should agree sometimes"


def test_the_draft_kv_kept_across_rejections_drafts_as_a_fresh_one_would(stories_path, noisy):
    """Each proposal from the draft KV kept since earlier steps equals the
    proposal after recomputing that KV from the first token: positions
    past a row's last accepted draft are recomputed, not reused."""
    runner = with_draft(make_runner(str(stories_path)), noisy)
    proposer, propose = runner.proposer, runner.proposer.propose
    checked = []

    def checking(r, rows, counts):
        kept = [d.tolist() for d in propose(r, rows, counts)]
        assert (r.num_draft_computed[rows] <= r.num_tokens[rows] + counts).all()
        r.num_draft_computed[rows] = 0
        fresh = [d.tolist() for d in propose(r, rows, counts)]
        assert kept == fresh, "drafts from the kept draft KV differ from a recomputation's"
        checked.append(len(rows))
        return [np.array(d) for d in fresh]

    proposer.propose = checking
    # One request, speculating every third step: the steps between decode
    # one token each, and the draft model must not trust KV it computed for
    # drafts the step before them rejected.
    prompt, verified, accepted_drafts = PROMPTS[1], 0, 0
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(32)), 0, len(prompt), GREEDY, 0)]))
    tokens = prompt + out.sampled_token_ids
    for step in range(1, 40):
        k = K if step % 3 == 1 else 0
        out = runner.execute(StepPlan(step, cached_handles=[0], cached_num_scheduled_tokens=[1 + k],
                                      draft_handles=[0] if k else [], draft_counts=[k] if k else []))
        tokens += out.sampled_token_ids
        verified += k and out.verified_drafts[0][1]
        accepted_drafts += len(out.sampled_token_ids) - 1
    assert tokens[len(prompt):] == hf_greedy(str(stories_path), prompt, len(tokens) - len(prompt), ignore_eos=True)
    assert accepted_drafts < verified and len(checked) > 3, "the check needs rejected drafts"


def test_a_seeded_sampled_request_yields_the_same_tokens_with_a_draft_model(stories_path, noisy):
    """The target draws each verified position as plain decoding would; a
    seeded draft draws with the same uniforms, so it is accepted often."""
    plain = generate(make_runner(str(stories_path)), PROMPTS, MAX_NEW, 64, [SEEDED] * len(PROMPTS))
    for draft in (str(stories_path), noisy):
        runner = with_draft(make_runner(str(stories_path)), draft)
        tokens, verified, accepted_drafts, _ = accepted(runner, PROMPTS, [SEEDED] * len(PROMPTS))
        assert tokens == plain, f"draft {draft}: sampled tokens differ from plain decoding's"
        if draft == str(stories_path):
            assert accepted_drafts >= 0.9 * verified, f"{accepted_drafts} of {verified} seeded drafts accepted"


def test_a_resent_request_drafts_from_its_new_blocks(stories_path):
    """A request finished and re-sent (as after a preemption) with other
    blocks: its draft KV starts again from 0, so the ceiling still holds
    (stale draft KV would only lower acceptance, which this detects)."""
    runner = with_draft(make_runner(str(stories_path)), str(stories_path))
    prompt = PROMPTS[0]
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(8)), 0, len(prompt), GREEDY, 0)]))
    tokens = prompt + out.sampled_token_ids
    for step in range(1, 3):
        out = runner.execute(StepPlan(step, cached_handles=[0], cached_num_scheduled_tokens=[1 + K],
                                      draft_handles=[0], draft_counts=[K]))
        assert len(out.sampled_token_ids) == K + 1
        tokens += out.sampled_token_ids
    # Re-sent, reversed blocks: nothing it computed before is where it was.
    blocks = list(range(40, 32, -1))
    out = runner.execute(StepPlan(3, [NewRequestData(0, tokens, blocks, 0, len(tokens), GREEDY, MAX_NEW)],
                                  finished_handles=[0]))
    tokens += out.sampled_token_ids
    out = runner.execute(StepPlan(4, cached_handles=[0], cached_num_scheduled_tokens=[1 + K], draft_handles=[0],
                                  draft_counts=[K]))
    assert len(out.sampled_token_ids) == K + 1, "drafts after a re-send were rejected"
    tokens += out.sampled_token_ids
    n = len(tokens) - len(prompt)
    assert tokens[len(prompt):] == hf_greedy(str(stories_path), prompt, n, ignore_eos=True)


def test_a_draft_model_with_another_tokenizer_is_refused_by_name(stories_path, tmp_path):
    tokenizer = json.loads((stories_path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    assert "2 of 512 target tokens" in vocabulary_mismatch((stories_path / "tokenizer.json").read_text(),
                                                           json.dumps(tokenizer))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(stories_path / name, tmp_path / name)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = ExecutorSettings(model=str(stories_path), speculative_method="draft",
                                speculative_draft_model=str(tmp_path), device="cpu", num_kv_blocks=64)
    with pytest.raises(StartupError, match="EXECUTOR_SPECULATIVE_DRAFT_MODEL=.*its tokenizer differs"):
        load(settings)


def test_a_started_executor_sizes_the_draft_pool_with_the_target_pool(stories_path):
    """Through load(), as the service starts: the draft model's pool has
    the target pool's blocks, and the budget pays for both."""
    settings = ExecutorSettings(model=str(stories_path), speculative_method="draft",
                                speculative_draft_model=str(stories_path), device="cpu", dtype="float32",
                                kv_cache_memory_mb=1, block_size=BLOCK)
    loaded = load(settings)
    draft = loaded.runner.proposer
    assert isinstance(draft, DraftModel) and draft.pool.num_blocks == loaded.pool.num_blocks
    per_block = loaded.pool.bytes_per_token * BLOCK
    assert loaded.pool.num_blocks == 2**20 // (2 * per_block), "the 1 MiB budget should hold both pools"
    tokens = generate(loaded.runner, PROMPTS[:1], 12, 64, drafts=K)
    assert tokens[0] == hf_greedy(str(stories_path), PROMPTS[0], 12, ignore_eos=True)


def test_a_draft_model_at_tp2_equals_hf(stories_path):
    """Rank 0 alone holds the draft model; it proposes and shares the
    drafts, and both ranks verify them alike."""
    tokens, _, steps = tp_ranks.run_group(str(stories_path), 2, PROMPTS, MAX_NEW, 64, drafts=K, method="draft",
                                          draft_model=str(stories_path))
    for prompt, got in zip(PROMPTS, tokens):
        assert got[:MAX_NEW] == hf_greedy(str(stories_path), prompt, MAX_NEW, ignore_eos=True), prompt
    assert steps == 1 + -(-(MAX_NEW - 1) // (K + 1)), f"{steps} steps: the ceiling should hold at TP=2"


def test_drafts_stop_before_an_id_the_target_has_no_logit_for(stories_path):
    """A draft vocabulary padded past the target's: a draft with an id the
    target lacks ends the row's drafts there."""
    runner = with_draft(make_runner(str(stories_path)), str(stories_path))
    runner.execute(StepPlan(0, [NewRequestData(0, PROMPTS[1], list(range(8)), 0, len(PROMPTS[1]), GREEDY, 0)]))
    rows, counts = np.array([0]), np.array([K])
    whole = runner.proposer.propose(runner.rows, rows, counts)[0]
    assert len(whole) == K
    runner.proposer.target_vocab_size = int(whole.max())
    cut = runner.proposer.propose(runner.rows, rows, counts)[0]
    assert cut.tolist() == whole[:int(np.argmax(whole >= whole.max()))].tolist()
