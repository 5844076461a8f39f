"""Multi-LoRA on the CPU torch path, in process, against HF transformers +
PEFT on a tiny random Llama (tests/lora.py). About 15 s."""

import json

import pytest
import torch

from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.model.lora import LoraRefused, load_adapters
from executor_svc.attention import make_backend
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner, NewRequestData, PlanError, StepPlan
from llmsched.errors import StartupError
from tests.lora import ADAPTERS, hf_peft_greedy, make_base_and_adapters
from tests.unit.test_runner_vs_hf import BLOCK, GREEDY

PROMPT = [1, 300, 301, 302, 303, 304, 305, 306, 307]
MAX_NEW = 10


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_base_and_adapters(tmp_path_factory.mktemp("lora"), list(ADAPTERS))


def _runner(base: str, setting: str, max_rank: int = 64, max_loras: int = 8, max_cpu_loras: int = 0,
            runtime_dir: str = "") -> ModelRunner:
    ckpt = load_checkpoint(base)
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    lora = load_adapters(setting, model, max_rank, max_loras, torch.device("cpu"), torch.float32, max_cpu_loras,
                         runtime_dir)
    pool = KVCachePool(cfg, 64, BLOCK, torch.device("cpu"), torch.float32)
    return ModelRunner(model, pool, make_backend("torch"), torch.device("cpu"), lora=lora)


def _generate(runner: ModelRunner, adapters: list[str], chunk: int = 4,
              loads: list[tuple[int, str]] | None = None, evicts: list[int] = (),
              finished: list[int] = (), later: dict | None = None) -> list[list[int]]:
    """All requests (the same prompt, one per adapter; "" = base) in one
    batch: chunked prefill, then decode. The first plan forgets handles
    `finished`, evicts `evicts` and loads `loads` ((slot, adapter); by
    default each adapter into a slot of its own, in order). later: step ->
    (evicts, loads) of a later plan."""
    if loads is None:
        loads = list(enumerate(a for a in adapters if a))
    nb = -(-(len(PROMPT) + MAX_NEW) // BLOCK)
    computed = [0] * len(adapters)
    total = [len(PROMPT)] * len(adapters)
    outputs: list[list[int]] = [[] for _ in adapters]
    step = 0
    while any(len(o) < MAX_NEW for o in outputs):
        plan = StepPlan(step_id=step)
        if step == 0:
            plan.finished_handles = list(finished)
            plan.lora_evict_slots = list(evicts)
            plan.lora_load_slots, plan.lora_load_adapters = [s for s, _ in loads], [a for _, a in loads]
        elif later and step in later:
            plan.lora_evict_slots = list(later[step][0])
            plan.lora_load_slots, plan.lora_load_adapters = [s for s, _ in later[step][1]], [a for _, a in later[step][1]]
        for h, name in enumerate(adapters):
            n = min(chunk, total[h] - computed[h])
            if step == 0:
                plan.new_requests.append(NewRequestData(h, PROMPT, list(range(h * nb, (h + 1) * nb)), 0, n, GREEDY, 0,
                                                        adapter=name))
            elif len(outputs[h]) < MAX_NEW:
                plan.cached_handles.append(h)
                plan.cached_num_scheduled_tokens.append(n)
            else:
                continue
            computed[h] += n
        out = runner.execute(plan)
        for h, t in zip(out.sampled_handles, out.sampled_token_ids):
            outputs[h].append(t)
            total[h] += 1
        step += 1
    return outputs


def test_mixed_adapters_in_one_batch_match_hf_peft(made):
    """Five adapters (ranks 8, 16, 64; alpha and rsLoRA scaling; all seven
    projections) and the base model, in one batch, each token-identical
    to HF + PEFT greedy alone."""
    base, adapters = made
    runner = _runner(base, ",".join(f"{n}={p}" for n, p in adapters.items()))
    names = ["", *adapters]
    got = _generate(runner, names)
    want = {n: hf_peft_greedy(base, adapters.get(n), PROMPT, MAX_NEW) for n in names}
    for name, tokens in zip(names, got):
        assert tokens == want[name], name
    assert len({tuple(t) for t in want.values()}) == len(names), "each adapter changes the continuation"


def test_refusals_by_name(made, tmp_path):
    base, adapters = made
    with pytest.raises(StartupError, match="rank 64 exceeds EXECUTOR_MAX_LORA_RANK=16"):
        _runner(base, f"c64={adapters['c64']}", max_rank=16)
    with pytest.raises(StartupError, match="EXECUTOR_MAX_CPU_LORAS=1 is below EXECUTOR_MAX_LORAS=2"):
        _runner(base, f"a8={adapters['a8']},b16={adapters['b16']}", max_loras=2, max_cpu_loras=1)
    import shutil

    for key, value, why in [("modules_to_save", ["lm_head"], "modules_to_save"), ("use_dora", True, "DoRA"),
                            ("bias", "all", "bias='all'"), ("alpha_pattern", {"q_proj": 4}, "alpha_pattern"),
                            ("init_lora_weights", "pissa_niter_4", "rewrites the base weights")]:
        bad = tmp_path / key
        shutil.copytree(adapters["a8"], bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps(cfg | {key: value}))
        with pytest.raises(StartupError, match=why):
            _runner(base, f"bad={bad}")
    from safetensors.torch import load_file, save_file

    for key, why in [("base_model.model.model.embed_tokens.lora_embedding_A", "not a LoRA A/B weight"),
                     ("base_model.model.lm_head.lora_A.weight", "LoRA on lm_head is not implemented")]:
        bad = tmp_path / key.rpartition(".")[0].replace(".", "_")
        shutil.copytree(adapters["a8"], bad)
        tensors = load_file(str(bad / "adapter_model.safetensors")) | {key: torch.zeros(8, 64)}
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(StartupError, match=why):
            _runner(base, f"bad={bad}")
    bad = tmp_path / "lora_bias"
    shutil.copytree(adapters["a8"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(cfg | {"lora_bias": True}))
    with pytest.raises(StartupError, match="sets lora_bias=True, which is not implemented"):
        _runner(base, f"bad={bad}")


def test_unknown_adapter_in_a_plan_is_rejected(made):
    base, adapters = made
    runner = _runner(base, f"a8={adapters['a8']}")
    with pytest.raises(PlanError, match="'nope'"):
        runner.execute(StepPlan(0, [NewRequestData(0, PROMPT, [0, 1, 2], 0, 3, GREEDY, 0, adapter="nope")]))
    # Served, but in no slot: the plan must load it first.
    with pytest.raises(PlanError, match="'a8' is in no LoRA slot"):
        runner.execute(StepPlan(0, [NewRequestData(0, PROMPT, [0, 1, 2], 0, 3, GREEDY, 0, adapter="a8")]))
    with pytest.raises(PlanError, match="'nope' is not served"):
        runner.execute(StepPlan(0, lora_load_slots=[0], lora_load_adapters=["nope"]))
    with pytest.raises(PlanError, match="LoRA slot 8 is out of range"):
        runner.execute(StepPlan(0, lora_load_slots=[8], lora_load_adapters=["a8"]))


def _only_q_proj(source: str, directory) -> str:
    """A copy of a PEFT adapter that targets q_proj alone."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    cfg = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": ["q_proj"]}))
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".q_proj." in k}, str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_a_slot_reused_by_another_adapter_serves_only_the_new_one(made, tmp_path):
    """One device slot, one adapter in host memory: c64 (all seven
    projections) runs in slot 0, is evicted, and an adapter on q_proj
    alone is loaded there (read from disk): its output is HF + PEFT's for
    it, so nothing of c64 stayed. Then c64 comes back from disk into the
    same slot and matches again. The first switch loads over the slot
    without an eviction, the second evicts first: either way the slot
    holds the new adapter alone."""
    base, adapters = made
    q_only = _only_q_proj(adapters["a8"], tmp_path / "q_only")
    runner = _runner(base, f"c64={adapters['c64']},q={q_only}", max_loras=1, max_cpu_loras=1)
    lora = runner.lora
    assert list(lora.host) == ["q"], "the host cache keeps the most recently read adapter"
    (c64,) = _generate(runner, ["c64"], loads=[(0, "c64")])
    assert c64 == hf_peft_greedy(base, adapters["c64"], PROMPT, MAX_NEW)
    (q,) = _generate(runner, ["q"], loads=[(0, "q")], finished=[0])
    assert q == hf_peft_greedy(base, q_only, PROMPT, MAX_NEW)
    assert q != hf_peft_greedy(base, adapters["a8"], PROMPT, MAX_NEW), "q_proj alone changes the continuation"
    (again,) = _generate(runner, ["c64"], loads=[(0, "c64")], evicts=[0], finished=[0])
    assert again == c64
    assert lora.num_disk_reads == 3 and list(lora.host) == ["c64"]  # c64, q, c64: each missed the cache


def test_a_reload_leaves_no_row_of_the_previous_adapter_in_the_slot_buffers(made, tmp_path):
    """The slot buffers after c64 (rank 64, all seven projections) is
    loaded over by an adapter of rank 8 on q_proj alone: q's rows past 8,
    k's and v's, and every other layer's rows of the slot are zero, with
    rank 0 where nothing is targeted; the other slot is untouched; an
    eviction zeroes the slot."""
    base, adapters = made
    q_only = _only_q_proj(adapters["a8"], tmp_path / "q_only")
    runner = _runner(base, f"c64={adapters['c64']},q={q_only},b16={adapters['b16']}", max_loras=2)
    lora = runner.lora
    lora.load(1, "b16")
    kept = [(site.lora.a[1].clone(), site.lora.b[1].clone()) for site in lora.sites]
    lora.load(0, "c64")
    assert all(bool(site.lora.a[0].abs().sum()) and int(site.lora.ranks[0]) == 64 for site in lora.sites)
    lora.load(0, "q")
    for site, (a1, b1) in zip(lora.sites, kept):
        a, b = site.lora.a[0], site.lora.b[0]  # [parts, max_rank, in], [max_rank, out]
        if site.modules[0].endswith("q_proj"):
            q = lora.host["q"].weights[site.modules[0]]
            assert torch.equal(a[0, :8], q.a) and torch.equal(b[:8, :site.lora.part_rows[0]], q.b.T)
            assert not a[0, 8:].any() and not a[1:].any()
            assert not b[8:].any() and not b[:, site.lora.part_rows[0]:].any()
            assert int(site.lora.ranks[0]) == 8 and site.lora.targets[0] == [True, False, False]
        else:
            assert not a.any() and not b.any() and int(site.lora.ranks[0]) == 0, site.modules
        assert torch.equal(site.lora.a[1], a1) and torch.equal(site.lora.b[1], b1), "slot 1 changed"
    lora.evict(0)
    assert all(not site.lora.a[0].any() and not site.lora.b[0].any() and int(site.lora.ranks[0]) == 0
               for site in lora.sites)


def test_mixed_adapters_under_tensor_parallelism_match_hf_peft(made):
    """TP=2 over gloo: B split by rows for q/k/v/gate/up, A by columns for
    o/down (a share of the delta, summed by the base layer's all-reduce).
    About 15 s (two rank processes)."""
    from tests import tp_ranks

    base, adapters = made
    names = ["", "a8", "c64", "d8"]
    tokens, _, _ = tp_ranks.run_group(base, 2, [PROMPT] * len(names), MAX_NEW, 4,
                                      lora_adapters=",".join(f"{n}={p}" for n, p in adapters.items()), adapters=names)
    for name, got in zip(names, tokens):
        assert got == hf_peft_greedy(base, adapters.get(name), PROMPT, MAX_NEW), name


def test_a_request_s_adapter_may_move_to_another_slot_between_its_steps(made):
    """A request row keeps its adapter's id, not its slot: when the
    scheduler evicts the adapter (its requests parked) and loads it again
    into another slot, the request goes on with the same weights."""
    base, adapters = made
    runner = _runner(base, f"a8={adapters['a8']},b16={adapters['b16']}", max_loras=2)
    (a8,) = _generate(runner, ["a8"], loads=[(0, "a8")], later={4: ([0], [(0, "b16"), (1, "a8")])})
    assert a8 == hf_peft_greedy(base, adapters["a8"], PROMPT, MAX_NEW)
    assert runner.lora.slots == ["b16", "a8"]


def test_a_runtime_adapter_is_checked_as_a_start_up_one_and_matches_hf_peft(made, tmp_path):
    """EXECUTOR_RUNTIME_LORA_DIR with no start-up adapter: slots exist; a
    registered adapter generates as HF + PEFT; refusals carry the gRPC
    code and the reason; an unregistered key leaves its slot, and a plan
    naming it is refused."""
    import os
    import shutil

    base, adapters = made
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    shutil.copytree(adapters["b16"], runtime / "b16")
    shutil.copytree(adapters["c64"], runtime / "c64")
    os.symlink(adapters["a8"], runtime / "escape")
    runner = _runner(base, "", max_rank=16, runtime_dir=str(runtime))
    lora = runner.lora
    assert lora is not None and lora.static_names == () and lora.num_slots == 8
    for path, code, why in [("c64", "INVALID_ARGUMENT", "rank 64 exceeds EXECUTOR_MAX_LORA_RANK=16"),
                            (adapters["a8"], "PERMISSION_DENIED", "outside EXECUTOR_RUNTIME_LORA_DIR"),
                            ("escape", "PERMISSION_DENIED", "outside EXECUTOR_RUNTIME_LORA_DIR"),
                            ("../runtime/../..", "PERMISSION_DENIED", "outside"),
                            ("missing", "NOT_FOUND", "is not a directory")]:
        with pytest.raises(LoraRefused, match=why) as exc:
            lora.read_runtime("k", path)
        assert exc.value.code == code, path
    resolved, adapter = lora.read_runtime("b16@s.1", "b16")
    assert resolved == str((runtime / "b16").resolve())
    lora.register("b16@s.1", resolved, adapter)
    lora.register("b16@s.1", resolved, adapter)  # the scheduler registering again: a no-op
    with pytest.raises(LoraRefused) as exc:
        lora.register("b16@s.1", str(runtime / "c64"))
    assert exc.value.code == "ALREADY_EXISTS"
    assert _generate(runner, ["", "b16@s.1"]) == [hf_peft_greedy(base, None, PROMPT, MAX_NEW),
                                                  hf_peft_greedy(base, adapters["b16"], PROMPT, MAX_NEW)]
    assert lora.slot_of("b16@s.1") == 0
    assert lora.unregister("b16@s.1") and lora.slot_of("b16@s.1") is None and not lora.unregister("b16@s.1")
    assert all(site.lora.slot_ranks[0] == 0 and not site.lora.a[0].any() and not site.lora.b[0].any()
               for site in lora.sites), "an unregistered adapter's slot kept weights"
    runner.reset()
    with pytest.raises(PlanError, match="is not served"):
        runner.execute(StepPlan(0, lora_load_slots=[0], lora_load_adapters=["b16@s.1"]))
    lora.register("b16@s.2", resolved)  # read at its first load, as a rank other than 0 does
    lora.forget_runtime()
    assert lora.runtime == set() and lora.id_of("b16@s.2") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_padded_batch_gives_every_layer_the_per_adapter_loops_delta(made, dtype):
    # The CPU's batched path (PaddedGroups) against its per-adapter loop on
    # the same slot buffers: five adapters of ranks 8-64 and base tokens,
    # groups of unequal length (the shorter ones padded).
    base, adapters = made
    ckpt = load_checkpoint(base)
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), dtype)
    lora = load_adapters(",".join(f"{n}={p}" for n, p in adapters.items()), model, 64, 8, torch.device("cpu"), dtype)
    for slot, name in enumerate(adapters):
        lora.load(slot + 1, name)
    token_slots = torch.tensor([1, -1, 2, 3, 1, 4, 5, -1, 2, 1, 3, 4, 5, 5, 1, 2]).numpy()
    g = torch.Generator().manual_seed(0)
    for site in lora.sites:
        x = torch.randn(len(token_slots), site.lora.a.shape[3], generator=g).to(dtype)
        y = torch.randn(len(token_slots), sum(site.lora.part_rows), generator=g).to(dtype)
        lora.batch.set(token_slots, torch.device("cpu"))
        assert lora.batch.padded is not None, "a decode-like batch takes the padded path"
        padded = site.lora.add(x, y.clone())
        lora.batch.padded = None
        loop = site.lora.add(x, y.clone())
        tol = 1e-4 if dtype == torch.float32 else 3e-2  # the sums run in another order; a wrong row is off by O(1)
        worst = ((padded.float() - loop.float()).abs() / (loop.float().abs() + 1)).max().item()
        assert worst <= tol, f"{site.modules}: padded and loop differ by {worst:.2e}"
        assert torch.equal(padded[token_slots < 0], y[token_slots < 0]), "base tokens changed"
    # One long prompt beside single decode tokens would pad the others 8x: the loop serves it.
    lora.batch.set(torch.tensor([1] * 64 + [2, 3]).numpy(), torch.device("cpu"))
    assert lora.batch.padded is None and len(lora.batch.groups) == 3
