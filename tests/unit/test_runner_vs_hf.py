"""The executor's model runner, in process, against HF transformers."""

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner, NewRequestData, PlanError, StepPlan
from executor_svc.step.sampler import SamplingSettings
from tests.oracle import hf_greedy, hf_greedy_penalised

GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
BLOCK = 4


def make_runner(model: str, num_blocks=128, torch_compile=False, proposer=None):
    ckpt = load_checkpoint(model)
    cfg = read_config(ckpt.hf_config)
    m = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    pool = KVCachePool(cfg, num_blocks, BLOCK, torch.device("cpu"), torch.float32)
    return ModelRunner(m, pool, make_backend("torch"), torch.device("cpu"), torch_compile=torch_compile,
                       proposer=proposer)


def generate(runner, prompts, max_new, chunk, settings=None, drafts=0, stats=None, adapters=None):
    """Drives the runner the way the scheduler would: chunked prefill, then
    decode, all requests in one batch, blocks handed out sequentially. With
    drafts, each decode step lets a request verify up to that many
    speculative drafts (the runner must speculate); stats, a dict, gets the
    number of steps. adapters: each prompt's LoRA adapter ("" = none)."""
    next_block, outputs, state = 0, {}, {}
    for h, p in enumerate(prompts):
        nb = -(-(len(p) + max_new + drafts) // BLOCK)
        state[h] = dict(blocks=list(range(next_block, next_block + nb)), computed=0, total=len(p))
        next_block += nb
        outputs[h] = []
    step = 0
    while any(len(o) < max_new for o in outputs.values()):
        inp = StepPlan(step_id=step)
        if step == 0 and adapters:  # each adapter into a slot of its own, as the scheduler's plan would
            inp.lora_load_adapters = sorted(set(adapters) - {""})
            inp.lora_load_slots = list(range(len(inp.lora_load_adapters)))
        for h, p in enumerate(prompts):
            st = state[h]
            if len(outputs[h]) >= max_new:
                continue
            n = min(chunk, st["total"] - st["computed"])
            if step == 0:
                sampling = settings[h] if settings else GREEDY
                inp.new_requests.append(NewRequestData(h, p, st["blocks"], 0, n, sampling, 0,
                                                       adapter=adapters[h] if adapters else ""))
            else:
                k = min(drafts, max_new - len(outputs[h]) - 1) if st["total"] - st["computed"] == 1 else 0
                n += k
                inp.cached_handles.append(h)
                inp.cached_num_scheduled_tokens.append(n)
                if k:
                    inp.draft_handles.append(h)
                    inp.draft_counts.append(k)
            st["computed"] += n
        out = runner.execute(inp)
        for h, t in zip(out.sampled_handles, out.sampled_token_ids):
            outputs[h].append(t)
            state[h]["total"] += 1
        for st in state.values():  # positions past the last accepted draft count as not computed
            st["computed"] = min(st["computed"], st["total"] - 1)
        step += 1
    if stats is not None:
        stats["steps"] = step
    return [outputs[h] for h in range(len(prompts))]


@pytest.mark.parametrize("model", ["stories", "tiny-random", "bench-moe"])
def test_batched_chunked_generation_matches_hf_greedy(model, stories_path):
    """bench-moe (P15's Qwen3-MoE) against transformers' Qwen3MoeForCausalLM on the same weights."""
    name = str(stories_path) if model == "stories" else model
    runner = make_runner(name)
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309], [1, 50]]
    got = generate(runner, prompts, max_new=12, chunk=3)
    for p, g in zip(prompts, got):
        want = hf_greedy(name, p, 12, ignore_eos=True)
        assert g == want


def test_plan_naming_an_unknown_handle_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    with pytest.raises(PlanError, match="handle 9"):
        runner.execute(StepPlan(step_id=0, cached_handles=[9], cached_num_scheduled_tokens=[1]))


def test_plan_scheduling_past_known_tokens_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    with pytest.raises(PlanError, match="scheduled"):
        runner.execute(StepPlan(0, [NewRequestData(0, [1, 2], [0], 0, 3, GREEDY, 0)]))


def test_greedy_with_repetition_penalty_matches_hf_generate(stories_path):
    """HF's RepetitionPenaltyLogitsProcessor over prompt and output, from
    token counts the runner keeps on the device, with a request without
    penalties in the same batch."""
    name = str(stories_path)
    runner = make_runner(name)
    penalised = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0, repetition_penalty=1.3)
    prompts = [[1, 403, 407, 261, 378], [1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305]]
    got = generate(runner, prompts, max_new=30, chunk=3, settings=[penalised, GREEDY, penalised])
    assert got[0] == hf_greedy_penalised(name, prompts[0], 30, 1.3, ignore_eos=True)
    assert got[1] == hf_greedy(name, prompts[1], 30, ignore_eos=True)
    assert got[0] != got[1], "the penalty changes this continuation"
    assert got[2] == hf_greedy_penalised(name, prompts[2], 30, 1.3, ignore_eos=True)
