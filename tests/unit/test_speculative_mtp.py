"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer
(EXECUTOR_SPECULATIVE_METHOD=mtp), in process (issue 36), on a tiny random
DeepSeek-V3 checkpoint that ships one MTP layer (num_nextn_predict_layers:
1), which transformers ignores: greedy output equals HF's with drafts
verified at every step, and every first draft the layer proposes is the
argmax of a reference MTP built from transformers' own DeepSeek-V3 layer,
norm and head on the same weights (HF's hidden states in, the next token's
embedding beside them)."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench.mtp_deepseek import add_mtp_layer
from executor_svc.config import ExecutorSettings
from executor_svc.loading import load
from executor_svc.step.head_drafts import HeadProposer
from executor_svc.step.runner import NewRequestData, StepPlan
from llmsched.errors import StartupError
from tests import families, tp_ranks
from tests.families import CASES, make_checkpoint
from tests.unit.test_runner_vs_hf import GREEDY, generate

CASE = CASES["deepseek-v3"]
LAYERS = CASE.config["num_hidden_layers"]
MIN_MARGIN = 1e-3  # as the family oracles: HF's top-2 logits further apart than our fp32 differences
K = 3


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> str:
    """The deepseek-v3 case saved with one more layer, which config.json
    then calls the MTP layer, with the MTP module's own tensors added (and
    the copies of the embedding and head a real checkpoint carries:
    bench.mtp_deepseek.add_mtp_layer)."""
    directory = tmp_path_factory.mktemp("deepseek-mtp")
    deeper = dataclasses.replace(CASE, config=CASE.config | {"num_hidden_layers": LAYERS + 1})
    return str(add_mtp_layer(make_checkpoint(deeper, directory)))


@functools.lru_cache(maxsize=1)
def reference_mtp(directory: str):
    """transformers' DeepSeek-V3 with one layer, the MTP layer's (loaded by
    transformers itself from the checkpoint, as a fourth decoder layer), its
    final norm the MTP layer's shared_head norm; and the layer's enorm,
    hnorm and eh_proj."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    (file,) = Path(directory).glob("*.safetensors")
    weights = load_file(file)
    prefix = f"model.layers.{LAYERS}."
    config = transformers.AutoConfig.from_pretrained(directory)
    config.num_hidden_layers = LAYERS + 1
    deeper = transformers.DeepseekV3ForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    config = copy.deepcopy(deeper.config)
    config.num_hidden_layers, config.first_k_dense_replace = 1, 0
    ref = transformers.DeepseekV3ForCausalLM(config).eval()
    ref.model.layers[0] = deeper.model.layers[LAYERS]
    ref.model.layers[0].self_attn.layer_idx = 0
    ref.lm_head.weight.data = weights["lm_head.weight"]
    ref.model.norm.weight.data = weights[prefix + "shared_head.norm.weight"]
    norms = []
    for key in ("enorm", "hnorm"):
        norm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        norm.weight.data = weights[prefix + key + ".weight"]
        norms.append(norm)
    return ref, *norms, weights[prefix + "eh_proj.weight"]


def reference_mtp_logits(directory: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i predicts token i + 2, from HF's final
    (normed) hidden state at i and the embedding of token i + 1."""
    target = families.hf_model(directory)
    ref, enorm, hnorm, eh_proj = reference_mtp(directory)
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        h = target.model(ids_t).last_hidden_state[0]  # [L, hidden]
        e = target.model.embed_tokens(ids_t[0, 1:])
        x = torch.cat([enorm(e), hnorm(h[:-1])], dim=-1) @ eh_proj.T
        return ref(inputs_embeds=x[None], position_ids=torch.arange(len(ids) - 1)[None]).logits[0]


def mtp_runner(directory: str, **overrides):
    settings = ExecutorSettings(**dict(model=directory, speculative_method="mtp", speculative_tokens=K, device="cpu",
                                       dtype="float32", attention_backend="torch", block_size=4, num_kv_blocks=256)
                                | overrides)
    return load(settings).runner


def test_greedy_output_with_mtp_drafts_equals_hf_and_first_drafts_equal_the_reference(mtp_checkpoint):
    runner = mtp_runner(mtp_checkpoint)
    assert isinstance(runner.proposer, HeadProposer)
    proposer, propose = runner.proposer, runner.proposer.propose
    first_drafts: list[tuple[list[int], int]] = []  # (the row's tokens, its first draft)

    def recording(r, rows, counts):
        out = propose(r, rows, counts)
        for row, drafts in zip(rows.tolist(), out):
            if len(drafts):
                first_drafts.append((r.token_ids[row, :r.num_tokens[row]].tolist(), int(drafts[0])))
        return out

    proposer.propose = recording
    prompts = families.prompts(3, min_len=6, max_len=20)
    max_new = 16
    tokens = generate(runner, prompts, max_new, chunk=5, drafts=K)
    for prompt, got in zip(prompts, tokens):
        want = families.hf_greedy(mtp_checkpoint, prompt, max_new)
        assert want.min_margin > MIN_MARGIN, f"HF's top-2 logits come within {want.min_margin:.2g}: a near tie"
        assert got == want.tokens, f"prompt {prompt}: greedy output with MTP drafts differs from HF"
    compared = 0
    for ids, draft in first_drafts:
        top2 = reference_mtp_logits(mtp_checkpoint, ids)[-1].topk(2)
        if float(top2.values[0] - top2.values[1]) > MIN_MARGIN:
            assert draft == int(top2.indices[0]), f"after {ids}: MTP drafted {draft}, the reference {top2.indices[0]}"
            compared += 1
    assert compared >= 10, f"only {compared} first drafts compared (of {len(first_drafts)})"


def test_mtp_is_refused_by_name_where_the_checkpoint_has_no_mtp_layer(tmp_path):
    plain = make_checkpoint(CASES["llama3"], tmp_path / "llama")
    with pytest.raises(StartupError, match="EXECUTOR_SPECULATIVE_METHOD=mtp: the checkpoint .* ships no "
                                           "multi-token-prediction layer"):
        mtp_runner(str(plain))


def test_mtp_drafts_only_for_rows_whose_last_step_reached_their_last_token(mtp_checkpoint):
    """A row in mid-prefill has no first draft: it proposes nothing."""
    runner = mtp_runner(mtp_checkpoint)
    prompt = families.prompts(1, min_len=12, max_len=12)[0]
    runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(8)), 0, 6, GREEDY, 0)]))
    assert runner.proposer.propose(runner.rows, np.array([0]), np.array([K]))[0].tolist() == []


def test_mtp_at_tp2_equals_hf(mtp_checkpoint):
    """The MTP layer is sharded like the target's layers: both ranks run
    it, rank 0 draws every draft and shares it, both verify the same."""
    prompts = families.prompts(2, min_len=6, max_len=14)
    tokens, _, _ = tp_ranks.run_group(mtp_checkpoint, 2, prompts, 12, 5, drafts=K, method="mtp")
    for prompt, got in zip(prompts, tokens):
        want = families.hf_greedy(mtp_checkpoint, prompt, 12)
        assert want.min_margin > MIN_MARGIN, f"HF's top-2 logits come within {want.min_margin:.2g}: a near tie"
        assert got[:12] == want.tokens, f"prompt {prompt}: greedy output with MTP drafts at TP=2 differs from HF"


def test_mtp_steps_laid_out_for_cuda_graphs_draft_as_eager_steps_do(mtp_checkpoint):
    """MLA's verify steps in a graph once read stale host lengths and gave
    other tokens from the first (test_cuda_graphs.assert_graph_layouts_draft_as_eager_steps)."""
    from tests.unit.test_cuda_graphs import assert_graph_layouts_draft_as_eager_steps

    assert_graph_layouts_draft_as_eager_steps(lambda: mtp_runner(mtp_checkpoint, attention_backend="triton"),
                                              families.prompts(2, min_len=6, max_len=12), 10, K,
                                              lambda prompt, n: families.hf_greedy(mtp_checkpoint, prompt, n).tokens)
