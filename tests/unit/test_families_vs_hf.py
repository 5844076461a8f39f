"""Each family's decoder, in process on the torch backend, against HF
transformers on the same tiny checkpoint (saved by transformers itself):
greedy tokens through batched, chunked prefill and decode past the sliding
window, and next-token log-probs.

Sensitivity: `test_hf_oracle_catches_a_missing_feature` rebuilds the model
with one feature switched off (RoPE scaling, the window, a soft-cap, the
norm variant, the embedding scale, q/k norms, biases, partial rotary; MoE
routing's renormalisation, norm_topk_prob, correction bias, group limit,
scaling, shared expert and its gate; attention sinks, router bias, the
SwiGLU clamp, YaRN's attention factor and mscale, rope_interleave) and
asserts the same comparison then fails, so a pass above is not luck. The
integration oracle (tests/integration/test_families.py) uses the same
checkpoints and prompt lengths, so it fails the same way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import family_of, read_config
from executor_svc.model.families.gemma2 import Gemma2ForCausalLM
from executor_svc.model.families.gpt_oss import GptOssForCausalLM
from executor_svc.model.model import Attention, CausalLM
from executor_svc.model.model import build_model as build_decoder
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.model.model_config import FULL, SLIDING, ModelConfig, RopeSpec
from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from tests.families import CASES, hf_greedy, hf_model, make_checkpoint, prompts
from tests.unit.test_runner_vs_hf import BLOCK, generate

MIN_MARGIN = 1e-3  # fp32 differences from HF are ~1e-5 in these logits
MAX_NEW = 24
PROMPTS = prompts(4, min_len=5, max_len=30)  # with MAX_NEW, every request passes windows of 8-12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = str(make_checkpoint(CASES[name], tmp_path_factory.mktemp(name)))
        return made[name]

    return get


def runner_for(path: str, cfg: ModelConfig | None = None, drop: tuple[str, ...] = (),
               torch_compile: bool = False, model_cls: type[CausalLM] | None = None) -> ModelRunner:
    """model_cls: another decoder class than the family's (its layers
    without one of the family's own)."""
    ckpt = load_checkpoint(path)
    cfg = cfg or read_config(ckpt.hf_config, ckpt.generation_config)
    tensors = ((n, t) for n, t in ckpt.tensors() if not any(d in n for d in drop))
    family = family_of(cfg)
    model = build_decoder(cfg, tensors, 256, torch.device("cpu"), torch.float32,
                          model_cls=model_cls or family.model_cls, rename=family.rename)
    pool = KVCachePool(cfg, 128, BLOCK, torch.device("cpu"), torch.float32)
    return ModelRunner(model, pool, make_backend("torch"), torch.device("cpu"), torch_compile=torch_compile)


def next_token_logprobs(runner: ModelRunner, prompt: list[int], k: int = 5) -> tuple[list[int], list[float]]:
    settings = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=k)
    blocks = list(range(-(-len(prompt) // BLOCK)))
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, blocks, 0, len(prompt), settings, 0)]))
    _, ids, lps = out.logprobs[0]
    return ids, lps


def hf_logprobs(path: str, prompt: list[int], k: int = 5) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()
    top = torch.log_softmax(logits, -1).topk(k)
    return top.indices.tolist(), top.values.tolist()


def assert_matches_hf(runner: ModelRunner, path: str) -> None:
    got = generate(runner, PROMPTS, MAX_NEW, chunk=5)
    for p, g in zip(PROMPTS, got):
        want = hf_greedy(path, p, MAX_NEW)
        assert want.min_margin > MIN_MARGIN, f"HF's top-2 logits come within {want.min_margin:.2g}: a near tie"
        assert g == want.tokens, f"prompt of {len(p)} tokens: first difference at {_first_diff(g, want.tokens)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("case", CASES)
def test_batched_chunked_greedy_generation_matches_hf(case, checkpoints):
    path = checkpoints(case)
    assert_matches_hf(runner_for(path), path)


@pytest.mark.parametrize("case", CASES)
def test_next_token_logprobs_match_hf(case, checkpoints):
    """Log-probs see what greedy tokens cannot: the final logit soft-cap
    (monotonic, so it never changes an argmax)."""
    path = checkpoints(case)
    ids, lps = next_token_logprobs(runner_for(path), PROMPTS[-1])
    want_ids, want_lps = hf_logprobs(path, PROMPTS[-1])
    assert ids == want_ids
    assert torch.allclose(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4), (lps, want_lps)


def _default_rope(cfg: ModelConfig) -> dict[str, RopeSpec]:
    return {t: RopeSpec("default", spec.theta, spec.rotary_dim) for t, spec in cfg.rope.items()}


def _no_window(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, sliding_window=None)  # sliding layers keep their RoPE, lose the window


def _moe(**changes):
    return lambda c: dataclasses.replace(c, moe=dataclasses.replace(c.moe, **changes))


def _mla(**changes):
    return lambda c: dataclasses.replace(c, mla=dataclasses.replace(c.mla, **changes))


def _no_attention_factor(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, rope={t: dataclasses.replace(s, attention_factor=1.0) for t, s in cfg.rope.items()})


class GptOssWithoutSinks(GptOssForCausalLM):
    attention_cls = Attention


# (case, feature) -> the ModelConfig without it (or, for a layer of the
# family's own, the decoder class without that layer), and checkpoint
# tensors to drop to match.
WITHOUT = {
    ("llama3", "llama3 RoPE scaling"): (lambda c: dataclasses.replace(c, rope=_default_rope(c)), ()),
    ("llama3-t4", "llama3 RoPE scaling"): (lambda c: dataclasses.replace(c, rope=_default_rope(c)), ()),
    ("llama-linear", "linear RoPE scaling"): (lambda c: dataclasses.replace(c, rope=_default_rope(c)), ()),
    ("qwen2", "sliding window"): (_no_window, ()),
    ("qwen2", "q/k/v bias"): (lambda c: dataclasses.replace(c, qkv_bias=False), ("_proj.bias",)),
    ("qwen3", "q/k norm"): (CausalLM, ("q_norm", "k_norm")),
    ("mistral", "sliding window"): (_no_window, ()),
    ("gemma2", "sliding window"): (_no_window, ()),
    ("gemma2", "attention soft-cap"): (lambda c: dataclasses.replace(c, attn_softcap=None), ()),
    ("gemma2", "final logit soft-cap"): (lambda c: dataclasses.replace(c, final_softcap=None), ()),
    ("gemma2", "(1+w) norm"): (lambda c: dataclasses.replace(c, norm_unit_offset=False), ()),
    ("gemma2", "sandwich norms"): (CausalLM, ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    ("gemma2", "embedding scale"): (lambda c: dataclasses.replace(c, embed_scale=False), ()),
    ("gemma2", "query_pre_attn_scalar"): (lambda c: dataclasses.replace(c, query_pre_attn_scalar=None), ()),
    ("gemma3", "sliding window"): (_no_window, ()),
    ("gemma3", "q/k norm"): (Gemma2ForCausalLM, ("q_norm", "k_norm")),
    ("gemma3", "RoPE per layer type"): (lambda c: dataclasses.replace(c, rope={FULL: c.rope[FULL],
                                                                              SLIDING: c.rope[FULL]}), ()),
    ("gemma3", "embedding scale"): (lambda c: dataclasses.replace(c, embed_scale=False), ()),
    ("phi3", "partial rotary factor"): (lambda c: dataclasses.replace(c, rope={
        t: dataclasses.replace(s, rotary_dim=c.head_dim) for t, s in c.rope.items()}), ()),
    ("phi3", "sliding window"): (_no_window, ()),
    ("mixtral", "sliding window"): (_no_window, ()),
    ("mixtral", "top-k renormalisation"): (_moe(norm_topk_prob=False), ()),
    ("qwen2-moe", "shared expert's gate"): (_moe(shared_gate=False), ("shared_expert_gate",)),
    ("qwen2-moe", "sliding window"): (_no_window, ()),
    ("qwen3-moe", "norm_topk_prob"): (_moe(norm_topk_prob=False), ()),
    ("qwen3-moe", "YaRN attention factor"): (_no_attention_factor, ()),
    ("gpt-oss", "attention sinks"): (GptOssWithoutSinks, (".sinks",)),
    ("gpt-oss", "router bias"): (_moe(router_bias=False), ("router.bias",)),
    ("gpt-oss", "SwiGLU clamp"): (_moe(swiglu_limit=float("inf")), ()),
    ("gpt-oss", "YaRN attention factor"): (_no_attention_factor, ()),
    ("gpt-oss", "sliding window"): (_no_window, ()),
    ("deepseek-v3", "correction bias"): (_moe(correction_bias=False), ("e_score_correction_bias",)),
    ("deepseek-v3", "group-limited routing"): (_moe(n_group=1, topk_group=1), ()),
    ("deepseek-v3", "norm_topk_prob"): (_moe(norm_topk_prob=False), ()),
    ("deepseek-v3", "routed_scaling_factor"): (_moe(routed_scaling_factor=1.0), ()),
    ("deepseek-v3", "shared expert"): (_moe(shared_intermediate_size=0), ("shared_experts",)),
    ("deepseek-v3", "rope_interleave"): (_mla(rope_interleave=False), ()),
    ("deepseek-v3", "YaRN mscale in the softmax scale"): (_mla(softmax_scale=(16 + 8) ** -0.5), ()),
}


@pytest.mark.parametrize("case, feature", WITHOUT)
def test_hf_oracle_catches_a_missing_feature(case, feature, checkpoints):
    path = checkpoints(case)
    ckpt = load_checkpoint(path)
    without, drop = WITHOUT[(case, feature)]
    if isinstance(without, type):
        runner = runner_for(path, drop=drop, model_cls=without)
    else:
        runner = runner_for(path, without(read_config(ckpt.hf_config)), drop)
    if feature == "final logit soft-cap":
        with pytest.raises(AssertionError):
            ids, lps = next_token_logprobs(runner, PROMPTS[-1])
            assert torch.allclose(torch.tensor(lps), torch.tensor(hf_logprobs(path, PROMPTS[-1])[1]), atol=1e-4)
        return
    with pytest.raises(AssertionError, match="first difference"):
        assert_matches_hf(runner, path)
