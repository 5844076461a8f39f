"""EXECUTOR_TORCH_COMPILE=on (executor_svc/step/compiled_decode.py): decode
steps run as one compiled graph, in process, against HF greedy output on
stories260K and on the families whose attention differs (windows, soft-caps,
q/k norms, biases, partial rotary). Prefill and chunk steps stay eager, so
each generation mixes both paths over one KV cache."""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.step import compiled_decode
from executor_svc.step.compiled_decode import STEPS
from executor_svc.step import runner as runner_module
from executor_svc.step.ngram import NgramProposer
from executor_svc.step.runner import NewRequestData, StepPlan
from executor_svc.loading import check_torch_compile
from llmsched.errors import StartupError
from tests.unit.test_families_vs_hf import assert_matches_hf, checkpoints, runner_for  # noqa: F401 (a fixture)
from tests.unit.test_runner_vs_hf import GREEDY, generate, make_runner
from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow  # each runner compiles for ~10 s


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Every runner adds an entry to dynamo's cache for the one compiled
    # function; past its limit dynamo would stop compiling.
    yield
    torch._dynamo.reset()


def compiled_runner(path: str):
    runner = runner_for(path, torch_compile=True)
    assert runner.compiled is not None
    assert runner.compiled.direct[0], "decode steps call the compiled graph through dynamo (DirectCall did not bind)"
    return runner


# Attention that differs: biases and mixed windows (qwen2), soft-caps and
# windows (gemma2), q/k norms (qwen3: 2 layers, where gemma3's 6 cost as
# much to compile as the other three together), partial rotary (phi3).
@pytest.mark.parametrize("case", ["qwen2", "gemma2", "qwen3", "phi3"])
def test_compiled_decode_matches_hf_greedy_per_family(case, checkpoints):
    path = checkpoints(case)
    runner = compiled_runner(path)
    before = STEPS._value.get()
    assert_matches_hf(runner, path)
    assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"
    assert STEPS._value.get() - before > 0, "no decode step ran compiled"


# Layerwise (one graph per kind of layer, for models from hidden size 512;
# forced here on tiny ones): mixed windows make two kinds of layer (qwen2:
# max_window_layers; gemma2: alternating), whose graphs must each serve only
# their own layers.
@pytest.mark.parametrize("case, kinds", [("qwen2", 2), ("gemma2", 2), ("qwen3", 1)])
def test_layerwise_compiled_decode_matches_hf_greedy_per_family(case, kinds, checkpoints, monkeypatch):
    monkeypatch.setattr(compiled_decode, "LAYERWISE_HIDDEN", 0)
    path = checkpoints(case)
    runner = compiled_runner(path)
    assert runner.compiled.layerwise
    layers = runner.compiled._layer_calls
    assert len(layers) == len(runner.model.model.layers)
    assert len({id(direct) for direct, *_ in layers}) == kinds, "layers grouped into the wrong number of graphs"
    before = STEPS._value.get()
    assert_matches_hf(runner, path)
    assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"
    assert STEPS._value.get() - before > 0, "no decode step ran compiled"


def test_layerwise_compiled_decode_matches_hf_greedy_on_stories_one_and_five_rows(stories_path, monkeypatch):
    monkeypatch.setattr(compiled_decode, "LAYERWISE_HIDDEN", 0)
    runner = make_runner(str(stories_path), torch_compile=True, proposer=NgramProposer(1, 4))
    assert runner.compiled.layerwise and runner.compiled.direct[0], "layer graphs are not called directly"
    assert runner.compiled.runs_one_row[0], "a one-row decode step runs as two rows"
    assert runner.compiled.below_wrappers[0], "layer graphs are called through AOT autograd's wrappers"
    assert not runner.compiled.verifies, "layerwise: verify steps run eagerly"
    prompts = [[1, 403, 407, 261, 378], [1, 403], [1, 263, 403, 418, 395, 261, 378, 310, 412, 280], [1, 500], [1, 42]]
    before = STEPS._value.get()
    assert generate(runner, prompts[:1], 60, 16) == [hf_greedy(str(stories_path), prompts[0], 60)]
    got = generate(runner, prompts, 40, 3, drafts=4)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(str(stories_path), p, 40), f"prompt {p}"
    assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"
    assert STEPS._value.get() - before >= 59


def test_a_layer_graph_that_would_read_another_layers_weights_is_refused(stories_path, monkeypatch):
    """Each layer's direct call is checked against the layer run eagerly: a
    graph retargeted without a layer's own weights must not serve."""
    from executor_svc.direct_call import DirectCall

    monkeypatch.setattr(compiled_decode, "LAYERWISE_HIDDEN", 0)
    monkeypatch.setattr(DirectCall, "retargeted", lambda self, swap: None)  # every layer on layer 0's weights
    with pytest.raises(RuntimeError, match="decoder layer 1's compiled graph disagrees with the layer run eagerly"):
        make_runner(str(stories_path), torch_compile=True)


def test_compiled_decode_matches_hf_greedy_on_stories_one_and_five_rows(stories_path):
    runner = make_runner(str(stories_path), torch_compile=True)
    assert runner.compiled.direct[0], "decode steps call the compiled graph through dynamo (DirectCall did not bind)"
    assert runner.compiled.runs_one_row[0], "a one-row decode step runs as two rows"
    assert runner.compiled.below_wrappers[0], "decode steps go through AOT autograd's wrappers"
    prompts = [[1, 403, 407, 261, 378], [1, 403], [1, 263, 403, 418, 395, 261, 378, 310, 412, 280], [1, 500], [1, 42]]
    before = STEPS._value.get()
    assert generate(runner, prompts[:1], 60, 16) == [hf_greedy(str(stories_path), prompts[0], 60)]
    got = generate(runner, prompts, 40, 3)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(str(stories_path), p, 40), f"prompt {p}"
    assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"
    # Every decode step after the first prefill ran compiled.
    assert STEPS._value.get() - before >= 59 + 30


def test_compiled_verify_steps_match_hf_greedy_with_drafts_alone_and_among_decoding_rows(stories_path, monkeypatch):
    """An executor that speculates verifies drafts in a second compiled
    graph: rows of 1 + drafts tokens padded to one length, beside rows that
    decode one token (five rows) and alone (one row, which the graph runs
    as two)."""
    runner = make_runner(str(stories_path), torch_compile=True, proposer=NgramProposer(1, 4))
    assert runner.compiled is not None and runner.compiled.verifies
    assert runner.compiled.direct == (True, True), "a graph is called through dynamo (DirectCall did not bind)"
    assert runner.compiled.runs_one_row == (True, True), "a one-row step runs as two rows"
    assert runner.compiled.below_wrappers == (True, True), "a graph is called through AOT autograd's wrappers"
    ran = {"verify": 0}
    run_verify = runner.compiled.run_verify

    def counting(*args, **kwargs):
        ran["verify"] += 1
        return run_verify(*args, **kwargs)

    monkeypatch.setattr(runner.compiled, "run_verify", counting)
    # Repeats, so the n-gram proposer drafts from the first decode step on,
    # and prompts without one, which draft only once their output repeats.
    prompts = [[1, 403, 407, 261, 378, 403, 407, 261], [1, 403], [1, 263, 403, 418, 263, 403, 418, 263],
               [1, 500], [1, 42, 42, 42]]
    assert generate(runner, prompts[:1], 60, 16, drafts=4) == [hf_greedy(str(stories_path), prompts[0], 60)]
    alone = ran["verify"]
    assert alone > 0, "no verify step ran compiled"
    got = generate(runner, prompts, 40, 3, drafts=4)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(str(stories_path), p, 40), f"prompt {p}"
    assert ran["verify"] > alone, "no verify step of several rows ran compiled"
    assert runner.compiled is not None and runner.compiled.verifies, "a compiled step failed and fell back to eager"


def test_a_step_allowed_drafts_where_the_proposer_finds_none_runs_the_compiled_decode_graph(stories_path,
                                                                                            monkeypatch):
    """No n-gram match: the row just decodes, in the decode graph by its
    short path (no eager attention metadata), and reports 0 drafts
    verified."""
    runner = make_runner(str(stories_path), torch_compile=True, proposer=NgramProposer(2, 4))
    calls = {"run": 0, "run_verify": 0}
    for name in calls:
        def counting(*args, _f=getattr(runner.compiled, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(runner.compiled, name, counting)
    prompt = [1, 403, 407, 261, 378]  # no token repeats: nothing to propose
    first = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(4)), 0, len(prompt), GREEDY, 0)]))
    assert first.sampled_token_ids[0] not in prompt[1:], "the first token repeats the prompt: pick another"

    def general_path(*args, **kwargs):
        raise AssertionError("the step built the general path's inputs (step_inputs)")

    monkeypatch.setattr(runner_module, "step_inputs", general_path)
    out = runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[5], draft_handles=[0],
                                  draft_counts=[4]))
    assert calls == {"run": 1, "run_verify": 0}
    assert out.verified_drafts == [(0, 0, 0)]
    want = hf_greedy(str(stories_path), prompt, 2)
    assert first.sampled_token_ids + out.sampled_token_ids == want


def test_a_failing_compiled_step_falls_back_to_eager_with_the_same_tokens(stories_path, monkeypatch):
    runner = make_runner(str(stories_path), torch_compile=True)

    def fail(*args, **kwargs):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    monkeypatch.setattr(runner.compiled, "run", fail)
    prompt = [1, 403, 407, 261, 378]
    assert generate(runner, [prompt], 20, 16) == [hf_greedy(str(stories_path), prompt, 20)]
    assert runner.compiled is None


def test_torch_compile_is_refused_by_name_off_cpu_and_under_tensor_parallelism():
    assert check_torch_compile("off", torch.device("cuda", 0), 4) is False
    assert check_torch_compile("on", torch.device("cpu"), 1) is True
    with pytest.raises(StartupError, match=r"EXECUTOR_TORCH_COMPILE=on compiles CPU decode steps; the device is cuda:0"):
        check_torch_compile("on", torch.device("cuda", 0), 1)
    with pytest.raises(StartupError, match=r"EXECUTOR_TORCH_COMPILE=on is not implemented with "
                                           r"EXECUTOR_TENSOR_PARALLEL_SIZE > 1"):
        check_torch_compile("on", torch.device("cpu"), 2)


def test_auto_compiles_a_dense_model_unquantized_or_with_quantized_weights_on_one_cpu_rank(stories_path, monkeypatch):
    import dataclasses
    import shutil

    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.families import read_config
    from executor_svc.model.model_config import ActivationQuant, LinearScheme, QuantSpec

    tiny = read_config(load_checkpoint(str(stories_path)).hf_config)
    cpu = torch.device("cpu")
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine: auto is off by design")
    assert check_torch_compile("auto", cpu, 1, tiny) is True, "stories260K on one CPU rank compiles"
    assert check_torch_compile("auto", cpu, 1, dataclasses.replace(tiny, hidden_size=1024)) is True, "layerwise"
    fp8 = dataclasses.replace(tiny, quantization=QuantSpec("fp8", ((("Linear",), LinearScheme("fp8", "fp8",
                                                                                             block=(8, 8))),)))
    assert check_torch_compile("auto", cpu, 1, fp8) is True, "FP8 weights: the CPU FP8 kernel is a graph operator"
    assert check_torch_compile("auto", cpu, 1, fp8, cpu_fp8_kernel="off") is False, "dequantizing: not measured"
    int4 = QuantSpec("compressed-tensors", ((("Linear",), LinearScheme("int", "ct-pack", bits=4, group_size=32)),))
    assert check_torch_compile("auto", cpu, 1, dataclasses.replace(tiny, quantization=int4)) is True
    w8a8 = LinearScheme("fp8", "ct-float", activations=ActivationQuant("float"))
    quantized = dataclasses.replace(tiny, quantization=QuantSpec("compressed-tensors", ((("Linear",), w8a8),)))
    assert check_torch_compile("auto", cpu, 1, quantized) is False, "activations quantized at run time: not measured"
    assert check_torch_compile("auto", cpu, 2, tiny) is False, "tensor parallelism: eager, not refused"
    assert check_torch_compile("auto", torch.device("cuda", 0), 1, tiny) is False, "CUDA graphs' job"
    assert check_torch_compile("auto", cpu, 1, tiny, "fp8_e4m3") is False
    assert check_torch_compile("auto", cpu, 1, tiny, batch_invariant=True) is False
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert check_torch_compile("auto", cpu, 1, tiny) is False, "no C++ compiler: eager"


def test_the_compiled_decode_fast_path_samples_as_the_general_path_does(stories_path, monkeypatch):
    """Plain decode steps of the compiled graph build their inputs straight
    from the request rows (ModelRunner._compiled_decode_step); constrained,
    seeded, penalised and logprob-wanting rows must come out of it exactly
    as out of the general path, which runs the same graph."""
    from llguidance import LLMatcher

    from executor_svc.step.constraints import ConstraintMatchers
    from executor_svc.step.sampler import SamplingSettings
    from tests.unit.test_constraints import EOS, VOCAB, run, text_of

    runner = make_runner(str(stories_path), num_blocks=128, torch_compile=True)
    runner.constraints = ConstraintMatchers((stories_path / "tokenizer.json").read_text(), VOCAB, [EOS])
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["age"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    greedy = SamplingSettings(0.0, 1.0, 0, None, 0)
    penalised = SamplingSettings(0.8, 0.9, 0, 7, 2, presence_penalty=0.5, frequency_penalty=0.3,
                                 repetition_penalty=1.2, logit_bias=((400, 2.0),))
    requests = {0: ([1, 403, 407, 261, 378], grammar, greedy), 1: ([1, 300, 301, 302], None, penalised),
                2: ([1, 403, 407], None, greedy), 3: ([1, 50], None, SamplingSettings(0.0, 1.0, 0, None, 3))}
    fast = {"steps": 0}
    step = runner._compiled_decode_step

    def counting(*args, **kwargs):
        fast["steps"] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(runner, "_compiled_decode_step", counting)
    got, got_logprobs = run(runner, requests, max_new=30)
    assert fast["steps"] > 0, "no decode step took the fast path"
    monkeypatch.setattr(runner, "_decodes_compiled", lambda *args: False)
    compiled_before = STEPS._value.get()
    want, want_logprobs = run(runner, requests, max_new=30)
    assert STEPS._value.get() > compiled_before, "the general path ran no decode step compiled"
    assert got == want, "tokens differ between the fast path and the general path"
    assert got_logprobs == want_logprobs, "logprobs differ between the fast path and the general path"
    assert got[0][-1] == EOS and json.loads(text_of(runner, got[0])).keys() == {"age"}
    assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"


def test_one_row_check_tolerates_16_bit_rounding_but_not_another_rows_outputs():
    """The warm-up runs one row alone and compares it with the same row in a
    two-row run (compiled_decode._close). In bf16 the two take different
    products on a CPU without native bf16 (GEMV against the tiled kernel)
    and part by bf16's rounding: a Qwen3-0.6B shape's logits came 0.025
    apart at a largest of 2.97, which float32's bound refused, so single
    streams ran as two rows. Another row's outputs must still fail."""
    from executor_svc.step.compiled_decode import _close

    g = torch.Generator().manual_seed(0)
    want = torch.randn(1, 4096, generator=g) * 1.5
    rounded_apart = want + torch.randn(1, 4096, generator=g) * 0.01 * want.abs().max()
    another_row = torch.randn(1, 4096, generator=g) * 1.5
    assert _close(rounded_apart, want, torch.bfloat16)
    assert not _close(another_row, want, torch.bfloat16)
    assert not _close(rounded_apart, want, torch.float32), "float32's bound loosened"
    assert _close(want + 1e-6, want, torch.float32)
    kv = torch.randn(2, 2, 1, 4, 64, generator=g).bfloat16()
    assert _close(kv + (kv * 2 ** -8).to(torch.bfloat16), kv, torch.bfloat16)
    assert not _close(torch.randn(2, 2, 1, 4, 64, generator=g).bfloat16(), kv, torch.bfloat16)
