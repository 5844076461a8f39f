"""CUDA graphs for decode and verify steps: the setting, the graphs'
padded layouts (on the CPU, uncaptured, the Triton backend under its
interpreter: verify steps, a draft model's steps, MoE and MLA decode), and
(on a GPU) graph replays against eager steps."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from executor_svc.config import ExecutorSettings
from executor_svc.step.cuda_graphs import VerifyGraphs, graph_buckets, verify_layout
from executor_svc.loading import use_cuda_graphs


def test_cuda_graphs_setting_refuses_values_it_does_not_support(monkeypatch):
    monkeypatch.setenv("EXECUTOR_CUDA_GRAPHS", "on")
    with pytest.raises(ValidationError, match="cuda_graphs"):
        ExecutorSettings()
    monkeypatch.setenv("EXECUTOR_CUDA_GRAPHS", "off")
    assert ExecutorSettings().cuda_graphs == "off"


@pytest.mark.parametrize(
    "setting,device,backend,want",
    [("auto", "cuda", "triton", True), ("auto", "cuda", "torch", False), ("auto", "cpu", "torch", False),
     ("auto", "cpu", "triton", False), ("off", "cuda", "triton", False)],
)
def test_auto_turns_graphs_on_only_for_cuda_with_triton(setting, device, backend, want):
    assert use_cuda_graphs(setting, torch.device(device), backend, 1) is want


def test_auto_leaves_graphs_off_under_tensor_parallelism():
    assert use_cuda_graphs("auto", torch.device("cuda"), "triton", 2) is False


def test_auto_leaves_graphs_off_when_experts_run_the_torch_loop():
    """Its per-expert loop syncs with the host every layer."""
    assert use_cuda_graphs("auto", torch.device("cuda"), "triton", 1, experts_on_torch_loop=3) is False
    assert use_cuda_graphs("auto", torch.device("cuda"), "triton", 1, experts_on_torch_loop=0) is True


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert graph_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def _runners(proposer=None, speculative_tokens: int = 0, block_size: int = 16, model_name: str = "bench-small"):
    """An eager runner and one with CUDA graphs on model_name, each with
    its own pool; proposer(model, cfg, block_size): each one's speculative
    proposer."""
    from executor_svc.attention import make_backend
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.moe import use_triton_moe
    from executor_svc.step.kv_cache import KVCachePool
    from executor_svc.model.families import build_model, read_config
    from executor_svc.step.runner import ModelRunner

    dev = torch.device("cuda")
    ckpt = load_checkpoint(model_name)
    cfg = read_config(ckpt.hf_config)
    # fp32 so eager and replayed steps can be held to a tight tolerance.
    model = build_model(cfg, ckpt.state_dict, 512, dev, torch.float32)
    use_triton_moe(model)  # as loading does with the triton backend
    out = []
    for graphs in (False, True):
        pool = KVCachePool(cfg, 256, block_size, dev, torch.float32)
        out.append(ModelRunner(model, pool, make_backend("triton", dev), dev, cuda_graphs=graphs,
                               proposer=proposer(model, cfg, block_size) if proposer else None,
                               speculative_tokens=speculative_tokens))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_replayed_verify_steps_draw_the_eager_verify_steps_greedy_tokens(batch):
    """n-gram drafts (up to 3 a row) verified by replayed graphs against the
    same steps run eagerly, greedy, on prompts that repeat themselves."""
    from executor_svc.step.ngram import NgramProposer
    from tests.unit.test_runner_vs_hf import BLOCK, generate

    eager, graphed = _runners(lambda *_: NgramProposer(1, 3), 3, BLOCK)
    assert graphed.verify_graphs is not None and eager.verify_graphs is None
    replays, run = [], graphed.verify_graphs.run
    graphed.verify_graphs.run = lambda *args: replays.append(len(args[-1])) or run(*args)
    g = torch.Generator().manual_seed(batch)
    prompts = [(torch.randint(3, 8000, (4,), generator=g).tolist() * 3)[:5 + h % 7] for h in range(batch)]
    assert generate(graphed, prompts, 24, 16, drafts=3) == generate(eager, prompts, 24, 16, drafts=3), (
        f"replayed verify steps drew other tokens than eager ones at batch {batch}")
    assert replays, "no verify step replayed a graph"


@pytest.mark.gpu
def test_a_draft_model_replaying_graphs_drafts_what_the_target_would():
    """bench-small as its own draft, its steps and the target's verify
    steps replayed: every greedy draft accepted, the eager runner's tokens."""
    from executor_svc.attention import make_backend
    from executor_svc.step.draft_model import DraftModel
    from executor_svc.step.kv_cache import KVCachePool
    from tests.unit.test_runner_vs_hf import BLOCK, generate

    def draft(model, cfg, block_size):
        dev = torch.device("cuda")
        return DraftModel(model, KVCachePool(cfg, 256, block_size, dev, torch.float32), make_backend("triton", dev),
                          dev, cfg.vocab_size)

    eager, graphed = _runners(draft, 3, BLOCK)
    assert graphed.proposer.graphs is not None and graphed.proposer.catch_up is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (5 + h,), generator=g).tolist() for h in range(5)]
    results = []
    execute = graphed.execute
    graphed.execute = lambda plan: results.append(execute(plan)) or results[-1]
    assert generate(graphed, prompts, 24, 16, drafts=3) == generate(eager, prompts, 24, 16, drafts=3)
    verified = sum(v for r in results for _, v, _ in r.verified_drafts)
    accepted = sum(a for r in results for _, _, a in r.verified_drafts)
    assert verified > 0 and accepted == verified, f"{accepted} of {verified} drafts accepted"


def _drive(runner, batch, steps, sampling):
    """Prefill `batch` requests then decode `steps` tokens; returns each
    step's (handles, tokens)."""
    from executor_svc.step.runner import NewRequestData, StepPlan

    g = torch.Generator().manual_seed(batch)
    new = []
    for h in range(batch):
        prompt = torch.randint(3, 8000, (5 + h % 7,), generator=g).tolist()
        new.append(NewRequestData(h, prompt, list(range(h * 4, h * 4 + 4)), 0, len(prompt), sampling, 0))
    out = [runner.execute(StepPlan(0, new_requests=new))]
    for s in range(1, steps + 1):
        out.append(runner.execute(StepPlan(s, cached_handles=list(range(batch)),
                                            cached_num_scheduled_tokens=[1] * batch)))
    return [(o.sampled_handles, o.sampled_token_ids) for o in out]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_graph_decode_draws_the_eager_greedy_tokens(batch):
    """Greedy only: the replay's attention splits its context differently
    (its block table is full width), so logits differ in the last bits, and
    a seeded draw could flip at a CDF boundary; greedy top-2 gaps on
    bench-small are above 1e-4 (checked on CPU over 832 draws)."""
    from executor_svc.step.sampler import SamplingSettings

    eager, graphed = _runners()
    assert graphed.graphs is not None and eager.graphs is None
    greedy = SamplingSettings(0.0, 1.0, 0, None, 0)
    assert _drive(graphed, batch, 12, greedy) == _drive(eager, batch, 12, greedy), (
        f"graph replay drew other tokens than eager steps at batch {batch}"
    )


@pytest.mark.gpu
def test_an_moe_models_graph_decode_draws_the_eager_greedy_tokens():
    """bench-moe (a Qwen3-MoE): its experts on the fused-MoE kernel are
    captured too."""
    from executor_svc.step.sampler import SamplingSettings

    eager, graphed = _runners(model_name="bench-moe")
    assert graphed.graphs is not None
    greedy = SamplingSettings(0.0, 1.0, 0, None, 0)
    assert _drive(graphed, 5, 12, greedy) == _drive(eager, 5, 12, greedy), (
        "an MoE model's graph replay drew other tokens than eager steps")


@pytest.mark.gpu
def test_graph_logits_match_eager_logits_with_padding(monkeypatch):
    """5 requests replay the bucket-8 graph with 3 padding rows."""
    import executor_svc.step.runner as runner_mod
    from executor_svc.step.runner import NewRequestData, StepPlan
    from executor_svc.step.sampler import SamplingSettings

    eager, graphed = _runners()
    greedy = SamplingSettings(0.0, 1.0, 0, None, 0)
    seen: list[torch.Tensor] = []
    real_sample = runner_mod.sample
    def spy(logits, batch):
        seen.append(logits.clone())
        return real_sample(logits, batch)

    monkeypatch.setattr(runner_mod, "sample", spy)
    logits = {}
    for name, r in (("eager", eager), ("graph", graphed)):  # same prompts and blocks, each in its own cache
        r.execute(StepPlan(0, new_requests=[NewRequestData(h, [1, 5 + h, 9, 33], [h], 0, 4, greedy, 0)
                                             for h in range(5)]))
        seen.clear()
        r.execute(StepPlan(1, cached_handles=list(range(5)), cached_num_scheduled_tokens=[1] * 5))
        logits[name] = seen[0]
    assert logits["graph"].shape == logits["eager"].shape == (5, 8192)
    torch.testing.assert_close(logits["graph"], logits["eager"], atol=1e-4, rtol=1e-4)


def _cpu_model(path: str, max_len: int | None = None):
    """(config, model) of a checkpoint on the CPU in float32."""
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.families import build_model, read_config

    ckpt = load_checkpoint(path)
    cfg = read_config(ckpt.hf_config)
    return cfg, build_model(cfg, ckpt.state_dict, max_len or cfg.max_position_embeddings, torch.device("cpu"),
                            torch.float32)


def _step_meta(q: list[int], start: list[int], block: int, width: int):
    """Positions and attention metadata of a step whose row i (blocks
    width * i onwards) computes q[i] tokens from position start[i]."""
    from executor_svc.attention import AttentionMetadata

    positions = [s + j for n, s in zip(q, start) for j in range(n)]
    rows = [i for i, n in enumerate(q) for _ in range(n)]
    slots = [(width * i + p // block) * block + p % block for i, p in zip(rows, positions)]
    ends = [s + n for n, s in zip(q, start)]
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(np.cumsum([0] + q), dtype=torch.int32),
                             torch.tensor(ends, dtype=torch.int32),
                             torch.arange(width * len(q), dtype=torch.int32).view(len(q), width), list(q), ends)
    return torch.tensor(positions), meta


@settings(max_examples=300, deadline=None)
@given(data=st.data(), q_len=st.integers(1, 9), rows=st.integers(1, 40))
def test_verify_layout_keeps_the_steps_rows_and_puts_every_padding_token_in_a_request_of_its_own(data, q_len, rows):
    n = data.draw(st.integers(1, rows))
    q = np.array(data.draw(st.lists(st.integers(1, q_len), min_size=n, max_size=n)))
    seq_lens = q + np.array(data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n)))
    cu, lens = verify_layout(q, seq_lens, rows, q_len)
    query = np.diff(cu)
    assert cu[0] == 0 and cu[-1] == rows * q_len + 1, "the graph's token count is fixed by its bucket"
    assert query[:n].tolist() == q.tolist() and lens[:n].tolist() == seq_lens.tolist(), "the step's rows as they are"
    assert (query[n:] >= 1).all(), "a padding request with no token"
    assert lens[n:].tolist() == query[n:].tolist(), "a padding request must attend to its own tokens only"
    assert query[n:-1].tolist() == [1] * (rows - n)


def test_a_verify_step_laid_out_for_its_graph_gives_the_eager_logits_and_writes_its_own_tokens_kv_only(
        stories_path):
    """Steps of 3 rows in the 4-row layout, on the CPU (the Triton backend
    under its interpreter, no capture), the second with 1, 3 and 2 tokens a
    row. The padding tokens of a smaller step after a larger one must not
    write at the larger step's slots, still in the static buffer."""
    from executor_svc.attention import make_backend
    from executor_svc.step.kv_cache import KVCachePool

    cpu, block = torch.device("cpu"), 4
    cfg, model = _cpu_model(str(stories_path))
    pool = KVCachePool(cfg, 16, block, cpu, torch.float32)
    backend = make_backend("triton", cpu)
    graphs = VerifyGraphs(model, pool.layer_caches(), backend, cpu, 4, block, 4, capture=False)

    def step(q: list[int], first_id: int) -> None:
        """Row i (blocks 4i .. 4i + 3) computes q[i] tokens from its
        position 0: the graph layout's logits against the eager forward's
        (which writes the same K/V again)."""
        positions, meta = _step_meta(q, [0] * len(q), block, 4)
        ids = torch.arange(first_id, first_id + len(positions))
        got = graphs.run(ids, positions, meta, np.array(q))[0].clone()
        want = model.compute_logits(model(ids, positions, pool.layer_caches(), meta, backend))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {q}: {m}")

    step([4, 4, 4], 3)
    before = pool.storage.clone()
    step([1, 3, 2], 100)
    changed = (pool.storage != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    written = sorted(int(s) for s in torch.nonzero(changed.flatten()).flatten())
    assert written == [0, 16, 17, 18, 32, 33], f"the 6-token step wrote slots {written}, not only its own"


def test_a_draft_models_steps_laid_out_for_graphs_draft_what_the_target_would(stories_path):
    """The target itself as its draft, every step laid out for graphs and
    run without capture (the Triton backend under its interpreter): the
    draft model's decode steps in DecodeGraphs' padded rows, its catch-up
    steps and the target's verify steps in VerifyGraphs' layout. Every
    greedy draft is accepted (a layout that mixed rows or positions up
    would draft other tokens) and the tokens are HF's."""
    from executor_svc.attention import make_backend
    from executor_svc.step.draft_model import DraftModel
    from executor_svc.step.kv_cache import KVCachePool
    from executor_svc.step.runner import ModelRunner
    from tests.oracle import hf_greedy
    from tests.unit.test_runner_vs_hf import BLOCK, generate

    cpu, k = torch.device("cpu"), 3
    cfg, model = _cpu_model(str(stories_path))
    backend = make_backend("triton", cpu)
    draft = DraftModel(model, KVCachePool(cfg, 64, BLOCK, cpu, torch.float32), backend, cpu, cfg.vocab_size)
    runner = ModelRunner(model, KVCachePool(cfg, 64, BLOCK, cpu, torch.float32), backend, cpu, proposer=draft)
    runner.verify_graphs = VerifyGraphs(model, runner.kv_caches, backend, cpu, runner.rows.max_blocks, BLOCK, k + 1,
                                        capture=False)
    draft.use_graphs(runner.rows.max_blocks, k + 1, capture=False)
    used = {"decode": 0, "catch-up": 0, "verify": 0}
    for name, graphs in (("decode", draft.graphs), ("catch-up", draft.catch_up), ("verify", runner.verify_graphs)):
        graphs.run = (lambda run, name: lambda *args: used.__setitem__(name, used[name] + 1) or run(*args))(
            graphs.run, name)
    verified = accepted = 0
    execute = runner.execute

    def counting(plan):
        nonlocal verified, accepted
        result = execute(plan)
        verified += sum(v for _, v, _ in result.verified_drafts)
        accepted += sum(a for _, _, a in result.verified_drafts)
        return result

    runner.execute = counting
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305]]
    got = generate(runner, prompts, max_new=9, chunk=16, drafts=k)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(str(stories_path), prompt, 9, ignore_eos=True), f"prompt {prompt}"
    assert verified > 0 and accepted == verified, f"{accepted} of {verified} drafts accepted"
    assert all(used.values()), f"a kind of step never ran laid out for its graph: {used}"


def assert_graph_layouts_draft_as_eager_steps(make_runner, prompts, max_new: int, k: int, hf_greedy) -> None:
    """For a proposer that reads the target's hidden states (MTP, EAGLE-3):
    on CUDA, decode and verify steps replay graphs that also compute what
    it reads of them (cuda_graphs.py: features), so it no longer sends
    every step eager. Laid out for those graphs and run without capture on
    the CPU (Triton under its interpreter), the proposer proposes exactly
    the drafts it proposes after eager steps, both kinds of graph run, and
    the tokens are HF's. A layout that handed it another row's or a padding
    token's state would draft otherwise."""
    from executor_svc.step.cuda_graphs import DecodeGraphs
    from tests.unit.test_runner_vs_hf import generate

    drafts, used = {}, {"decode": 0, "verify": 0}
    for name in ("eager", "graphs"):
        runner = make_runner()
        if name == "graphs":
            args = (runner.model, runner.kv_caches, runner.backend, runner.device, runner.rows.max_blocks)
            runner.graphs = DecodeGraphs(*args, max_batch=4, capture=False, features=runner.features)
            runner.verify_graphs = VerifyGraphs(*args, runner.pool.block_size, k + 1, capture=False,
                                                features=runner.features)
            for kind, graphs in (("decode", runner.graphs), ("verify", runner.verify_graphs)):
                graphs.run = (lambda run, kind: lambda *a: used.__setitem__(kind, used[kind] + 1) or run(*a))(
                    graphs.run, kind)
        propose, proposed = runner.proposer.propose, []
        runner.proposer.propose = lambda r, rows, counts, propose=propose, proposed=proposed: (
            lambda out: proposed.append([d.tolist() for d in out]) or out)(propose(r, rows, counts))
        tokens = generate(runner, prompts, max_new, chunk=5, drafts=k)
        for prompt, got in zip(prompts, tokens):
            assert got == hf_greedy(prompt, max_new), f"{name}: prompt {prompt}"
        drafts[name] = proposed
    assert sum(len(d) for step in drafts["eager"] for d in step) >= 10, "too few drafts to compare"
    assert drafts["graphs"] == drafts["eager"], "steps laid out for graphs drafted otherwise"
    assert all(used.values()), f"a kind of step never ran laid out for its graph: {used}"


@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss"])
def test_moe_and_mla_decode_steps_padded_for_graphs_give_the_eager_logits(family, tmp_path):
    """auto captures MoE layers on the fused-MoE kernel and MLA's decode
    kernel too (DeepSeek-V3: MLA, grouped sigmoid routing, a shared
    expert; gpt-oss: biased experts, attention sinks). DecodeGraphs'
    padded rows (slot -1, one position) run without capture on the CPU,
    the Triton backend under its interpreter: 3 requests in the 4-row
    bucket give the eager forward's logits, step after step."""
    from executor_svc.attention import make_backend
    from executor_svc.model.moe import experts_on_torch_loop, use_triton_moe
    from executor_svc.step.cuda_graphs import DecodeGraphs
    from executor_svc.step.kv_cache import KVCachePool
    from tests.families import CASES, make_checkpoint

    cpu, block, width = torch.device("cpu"), 4, 4
    cfg, model = _cpu_model(str(make_checkpoint(CASES[family], tmp_path / family)), 64)
    use_triton_moe(model)
    assert use_cuda_graphs("auto", torch.device("cuda"), "triton", 1, experts_on_torch_loop(model)), (
        f"auto would leave {family}'s decode steps eager on CUDA")
    pool = KVCachePool(cfg, 3 * width, block, cpu, torch.float32)
    backend = make_backend("triton", cpu)
    graphs = DecodeGraphs(model, pool.layer_caches(), backend, cpu, width, max_batch=4, capture=False)
    ids = torch.randint(3, 500, (3, 9), generator=torch.Generator().manual_seed(0))
    positions, meta = _step_meta([5, 5, 5], [0, 0, 0], block, width)  # the prompts
    model(ids[:, :5].reshape(-1), positions, pool.layer_caches(), meta, backend)
    for at in range(5, 8):
        positions, meta = _step_meta([1, 1, 1], [at] * 3, block, width)
        got = graphs.run(ids[:, at], positions, meta)[0].clone()
        want = model.compute_logits(model(ids[:, at], positions, pool.layer_caches(), meta, backend))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{family} position {at}: {m}")
