"""Multi-LoRA on the CPU torch path, in process, against HF transformers +
PEFT on a tiny random Llama (tests/lora.py). About 15 s."""

import json

import pytest
import torch

from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.model.lora import load_adapters
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


def _runner(base: str, setting: str, max_rank: int = 64, max_loras: int = 8) -> ModelRunner:
    ckpt = load_checkpoint(base)
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    lora = load_adapters(setting, model, max_rank, max_loras, torch.device("cpu"), torch.float32)
    pool = KVCachePool(cfg, 64, BLOCK, torch.device("cpu"), torch.float32)
    return ModelRunner(model, pool, make_backend("torch"), torch.device("cpu"), lora=lora)


def _generate(runner: ModelRunner, adapters: list[str], chunk: int = 4) -> list[list[int]]:
    """All requests (the same prompt, one per adapter; "" = base) in one
    batch: chunked prefill, then decode."""
    nb = -(-(len(PROMPT) + MAX_NEW) // BLOCK)
    computed = [0] * len(adapters)
    total = [len(PROMPT)] * len(adapters)
    outputs: list[list[int]] = [[] for _ in adapters]
    step = 0
    while any(len(o) < MAX_NEW for o in outputs):
        plan = StepPlan(step_id=step)
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
    with pytest.raises(StartupError, match="EXECUTOR_MAX_LORAS=1"):
        _runner(base, f"a8={adapters['a8']},b16={adapters['b16']}", max_loras=1)
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
