"""Embeddings and prompt logprobs in the executor's runner, in process,
against HF transformers on the same weights: each pooling mode, alone and
in a batch beside generating rows, whole and in chunks; and which
sentence-transformers configs are read or refused (issue 35, part 6)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from executor_svc.model.pooling import Pooling, read_pooling
from executor_svc.step.runner import NewRequestData, PlanError, StepPlan
from tests.embeddings import hf_pooled, hf_prompt_logprobs, write_pooling
from tests.oracle import hf_greedy, hf_model
from tests.unit.test_runner_vs_hf import BLOCK, GREEDY, make_runner

PROMPTS = [[1, 403, 407, 261, 378, 280, 300, 301, 302, 303, 304], [1, 291, 376, 400, 428]]


def run_prompts(runner, embed: list[bool], chunk: int, prompt_logprobs: int | None = None, generate: bool = True):
    """Every prompt prefilled in chunks in the same steps, plus (with
    generate) one generating row throughout; returns (embeddings by handle,
    prompt logprob entries by handle, the generating row's tokens)."""
    gen_prompt, settings = [1, 300, 301], replace(GREEDY, prompt_logprobs=prompt_logprobs)
    computed = [0] * len(PROMPTS)
    embeddings, logprobs, generated = {}, {}, []
    blocks = [list(range(i * 16, i * 16 + 16)) for i in range(len(PROMPTS) + 1)]
    step = 0
    while any(c < len(p) for c, p in zip(computed, PROMPTS)) or (generate and len(generated) < 4):
        plan = StepPlan(step_id=step)
        for h, p in enumerate(PROMPTS):
            n = min(chunk, len(p) - computed[h])
            if n <= 0:
                continue
            if step == 0:
                plan.new_requests.append(NewRequestData(h, p, blocks[h], 0, n, settings, 0, embed=embed[h]))
            else:
                plan.cached_handles.append(h)
                plan.cached_num_scheduled_tokens.append(n)
            computed[h] += n
        g = len(PROMPTS)
        if not generate:
            pass
        elif step == 0:
            plan.new_requests.append(NewRequestData(g, gen_prompt, blocks[g], 0, len(gen_prompt), GREEDY, 0))
        elif len(generated) < 4:
            plan.cached_handles.append(g)
            plan.cached_num_scheduled_tokens.append(1)
        out = runner.execute(plan)
        for handle, values in out.embeddings:
            assert handle not in embeddings, "one embedding per request"
            embeddings[handle] = values
        for p in out.prompt_logprobs:
            logprobs.setdefault(p.handle, []).append(p)
        generated += [t for h, t in zip(out.sampled_handles, out.sampled_token_ids) if h == g]
        assert not set(out.sampled_handles) & {h for h, e in enumerate(embed) if e}, "an embedding row sampled"
        step += 1
    return embeddings, logprobs, generated


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("chunk", [64, 3], ids=["whole", "chunks-of-3"])
def test_each_pooling_mode_equals_hf_pooled_hidden_states_beside_a_generating_row(stories_path, mode, chunk):
    pooling = Pooling(mode, normalize=mode != "cls")
    runner = make_runner(str(stories_path))
    runner.pooling = pooling
    embeddings, _, generated = run_prompts(runner, embed=[True, True], chunk=chunk)
    for h, ids in enumerate(PROMPTS):
        want = hf_pooled(str(stories_path), ids, pooling)
        got = torch.tensor(embeddings[h])
        assert (got - want).abs().max() < 1e-5, f"{mode} pooling of prompt {h} ({len(ids)} tokens)"
    assert generated == hf_greedy(str(stories_path), [1, 300, 301], 4, ignore_eos=True)
    assert not runner.rows.pooled, "pooling state kept after the embedding was returned"


@pytest.mark.parametrize("top", [0, 3])
@pytest.mark.parametrize("chunk", [64, 4], ids=["whole", "chunks-of-4"])
def test_prompt_logprobs_equal_hf_log_softmax_at_each_position(stories_path, top, chunk):
    runner = make_runner(str(stories_path))
    _, logprobs, _ = run_prompts(runner, embed=[False, False], chunk=chunk, prompt_logprobs=top)
    for h, ids in enumerate(PROMPTS):
        parts = logprobs[h]
        assert [p.first for p in parts] == list(range(1, len(ids), chunk))[:len(parts)], "chunks out of order"
        got = torch.tensor([lp for p in parts for lp in p.logprobs])
        want = hf_prompt_logprobs(str(stories_path), ids)
        assert got.shape == want.shape, "one logprob per prompt token after the first"
        assert (got - want).abs().max() < 1e-4
        if top:
            top_ids = [p.top_token_ids[i:i + top] for p in parts for i in range(0, len(p.top_token_ids), top)]
            with torch.no_grad():
                logits = hf_model(str(stories_path))(torch.tensor([ids])).logits[0, :-1]
            assert top_ids == logits.topk(top, dim=-1).indices.tolist()


def test_an_embedding_row_without_a_pooling_config_fails_the_plan(stories_path):
    runner = make_runner(str(stories_path))
    with pytest.raises(PlanError, match="no pooling config"):
        runner.execute(StepPlan(0, [NewRequestData(0, [1, 2], [0], 0, 2, GREEDY, 0, embed=True)]))


def test_mean_pooling_refuses_a_row_that_starts_past_position_0(stories_path):
    runner = make_runner(str(stories_path))
    runner.pooling = Pooling("mean", True)
    with pytest.raises(PlanError, match="every prompt position"):
        runner.execute(StepPlan(0, [NewRequestData(0, [1, 2, 3, 4, 5], [0, 1], BLOCK, 1, GREEDY, 0, embed=True)]))


@pytest.mark.parametrize("key, mode", [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                       ("pooling_mode_cls_token", "cls")])
def test_a_sentence_transformers_pooling_config_is_read(tmp_path, key, mode):
    assert read_pooling(write_pooling(tmp_path, key)).pooling == Pooling(mode, True)
    assert read_pooling(write_pooling(tmp_path, key, normalize=False)).pooling == Pooling(mode, False)


@pytest.mark.parametrize("setup, why", [
    (lambda p: None, "no modules.json"),
    (lambda p: write_pooling(p, "pooling_mode_max_tokens"), "pooling_mode_max_tokens is not implemented"),
    (lambda p: write_pooling(p, modules=["Transformer", "Pooling", "Dense", "Normalize"]), "Dense"),
    (lambda p: write_pooling(p, pooling_mode_cls_token=True), "one of"),
    (lambda p: write_pooling(p, include_prompt=False), "include_prompt=false"),
    (lambda p: write_pooling(p, modules=["Transformer", "Normalize", "Pooling"]), "Normalize before Pooling"),
], ids=["none", "max-pooling", "dense-layer", "two-modes", "without-prompt", "normalize-first"])
def test_a_pooling_config_this_server_cannot_reproduce_leaves_no_embeddings_with_the_reason(tmp_path, setup, why):
    setup(tmp_path)
    config = read_pooling(tmp_path)
    assert config.pooling is None and why in config.why_not


def test_a_checkpoint_without_its_head_loads_for_embeddings_only(stories_path, tmp_path):
    """Flat keys, untied, no lm_head.weight (Qwen3-Embedding-8B's layout):
    with a pooling config it loads without a head and pools HF's vectors;
    without one it is refused as a checkpoint missing its head."""
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.families import build_model, read_config
    from tests.embeddings import headless_checkpoint

    path = headless_checkpoint(stories_path, tmp_path / "headless")
    ckpt = load_checkpoint(str(path))
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.lazy_tensors(), 64, torch.device("cpu"), torch.float32,
                        headless_ok=ckpt.pooling.pooling is not None)
    assert model.lm_head is None
    runner = make_runner(str(stories_path))
    runner.model, runner.pooling = model, ckpt.pooling.pooling
    embeddings, _, _ = run_prompts(runner, embed=[True, True], chunk=4, generate=False)
    for h, ids in enumerate(PROMPTS):
        want = hf_pooled(str(stories_path), ids, ckpt.pooling.pooling)
        assert (torch.tensor(embeddings[h]) - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="lm_head.weight"):
        build_model(cfg, ckpt.lazy_tensors(), 64, torch.device("cpu"), torch.float32)
