"""The executor's host KV tier: copies out and back in leave a request's
output as HF computes it; failed copies are reported, not raised; pools
that do not fit are refused by name."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.step.host_kv import HostKVPool, host_pool_num_blocks
from executor_svc.step.kv_cache import KVCachePool, bytes_per_block
from executor_svc.model.families import build_model, read_config
from executor_svc.step.runner import ModelRunner, NewRequestData, PlanError, StepPlan
from executor_svc.step.sampler import SamplingSettings
from llmsched.errors import StartupError
from tests.oracle import hf_greedy
from tests.unit.test_mla import DEEPSEEK_V3

GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
BLOCK = 4
PROMPT = [1, 403, 407, 261, 378, 300, 301, 302, 303, 304]  # 10 tokens: 3 blocks


@pytest.fixture(scope="module")
def model_and_cfg(stories_path):
    ckpt = load_checkpoint(str(stories_path))
    cfg = read_config(ckpt.hf_config)
    return build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), torch.float32), cfg


def make_runner(model_and_cfg, fail_every=0, device=torch.device("cpu")):
    model, cfg = model_and_cfg
    pool = KVCachePool(cfg, 32, BLOCK, device, torch.float32)
    host = HostKVPool(pool, 16, device, fail_every=fail_every)
    return ModelRunner(model, pool, make_backend("torch", device), device, host_kv=host)


def decode(runner, handle, num_tokens, step_id):
    """Greedy decode steps of one request already on the runner."""
    out = []
    for i in range(num_tokens):
        res = runner.execute(StepPlan(step_id + i, cached_handles=[handle], cached_num_scheduled_tokens=[1]))
        out += res.sampled_token_ids
    return out


def swap_round_trip(runner, stories_path) -> None:
    """A request preempted by swap after 4 tokens, its device blocks
    overwritten, resumed from the host tier into other blocks: HF's tokens."""
    first = runner.execute(StepPlan(0, [NewRequestData(7, PROMPT, [0, 1, 2, 3], 0, len(PROMPT), GREEDY, 0)]))
    tokens = first.sampled_token_ids + decode(runner, 7, 3, 1)  # 13 tokens computed, 14 known
    # Preempted by swap: forgotten, its 4 blocks copied out...
    out = runner.execute(StepPlan(4, finished_handles=[7], swap_out_device_blocks=[0, 1, 2, 3],
                                   swap_out_host_blocks=[9, 3, 12, 0]))
    assert out.swaps.failed_outs == [] and out.sampled_handles == []
    runner.pool.storage[:, :, :4] = float("nan")  # ...and the device blocks reused
    # ...then back into other device blocks, with only its last token to compute.
    known = PROMPT + tokens
    res = runner.execute(StepPlan(5, [NewRequestData(7, known, [20, 21, 22, 23, 24, 25], 13, 1, GREEDY, len(tokens))],
                                   swap_in_host_blocks=[9, 3, 12, 0], swap_in_device_blocks=[20, 21, 22, 23]))
    assert res.swaps.swap_ns > 0
    tokens += res.sampled_token_ids + decode(runner, 7, 8, 6)
    assert tokens == hf_greedy(str(stories_path), PROMPT, len(tokens), ignore_eos=True)


def test_swapped_out_and_back_into_other_blocks_the_output_is_hfs(model_and_cfg, stories_path):
    runner = make_runner(model_and_cfg)
    assert runner.host_kv.stream is None, "on the CPU the copies run inline"
    swap_round_trip(runner, stories_path)


@pytest.mark.gpu
def test_on_cuda_the_pool_is_pinned_and_copies_run_on_a_side_stream(stories_path):
    """The CUDA path: pinned host blocks, copies on their own stream, the
    forward ordered after them by an event, timed by the events."""
    dev = torch.device("cuda")
    ckpt = load_checkpoint(str(stories_path))
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, dev, torch.float32)
    runner = make_runner((model, cfg), device=dev)
    assert runner.host_kv.storage.is_pinned() and runner.host_kv.stream is not None
    assert runner.host_kv.stream != torch.cuda.current_stream(dev)
    swap_round_trip(runner, stories_path)
    # A failed copy is reported on CUDA too, and the forward still runs.
    failing = make_runner((model, cfg), fail_every=2, device=dev)
    failing.execute(StepPlan(0, [NewRequestData(1, PROMPT, [0, 1, 2], 0, len(PROMPT), GREEDY, 0)]))
    out = failing.execute(StepPlan(1, cached_handles=[1], cached_num_scheduled_tokens=[1],
                                    swap_out_device_blocks=[0, 1], swap_out_host_blocks=[2, 3]))
    assert out.swaps.failed_outs == [1] and out.sampled_handles == [1]
    torch.testing.assert_close(failing.host_kv.storage[2], failing.pool.storage[:, :, 0].cpu())


def test_a_copy_that_fails_is_reported_and_the_rest_of_the_step_stands(model_and_cfg):
    runner = make_runner(model_and_cfg, fail_every=2)  # the 2nd and 4th copies
    runner.execute(StepPlan(0, [NewRequestData(1, PROMPT, [0, 1, 2], 0, len(PROMPT), GREEDY, 0)]))
    out = runner.execute(StepPlan(1, cached_handles=[1], cached_num_scheduled_tokens=[1],
                                   swap_out_device_blocks=[5, 6], swap_out_host_blocks=[2, 3],
                                   swap_in_host_blocks=[3, 4], swap_in_device_blocks=[7, 8]))
    assert out.swaps.failed_outs == [1] and out.swaps.failed_ins == [1]
    assert out.sampled_handles == [1], "the forward ran"


def test_swaps_without_a_host_tier_or_past_its_end_are_refused(model_and_cfg):
    model, cfg = model_and_cfg
    cpu = torch.device("cpu")
    bare = ModelRunner(model, KVCachePool(cfg, 8, BLOCK, cpu, torch.float32), make_backend("torch"), cpu)
    with pytest.raises(PlanError, match="no host KV tier"):
        bare.execute(StepPlan(0, swap_out_device_blocks=[0], swap_out_host_blocks=[0]))
    with pytest.raises(PlanError, match="host block 16 of 16"):
        make_runner(model_and_cfg).execute(StepPlan(0, swap_in_host_blocks=[16], swap_in_device_blocks=[0]))


def test_a_host_tier_larger_than_memavailable_is_refused_by_name(model_and_cfg, monkeypatch):
    _, cfg = model_and_cfg
    import executor_svc.step.host_kv as host_kv

    monkeypatch.setattr(host_kv, "free_memory_bytes", lambda device: 100 * 1024 * 1024)
    assert host_pool_num_blocks(cfg, BLOCK, torch.float32, 0) == 0
    per_block = bytes_per_block(cfg, BLOCK, torch.float32)
    assert host_pool_num_blocks(cfg, BLOCK, torch.float32, 64) == 64 * 1024 * 1024 // per_block
    with pytest.raises(StartupError, match=r"EXECUTOR_HOST_KV_CACHE_MEMORY_MB=200: the host KV tier needs 200 MiB "
                                           r"but only 100 MiB is available \(MemAvailable\)"):
        host_pool_num_blocks(cfg, BLOCK, torch.float32, 200)
    with pytest.raises(StartupError, match=r"needs 128 MiB \(2 ranks on this node\)"):
        host_pool_num_blocks(cfg, BLOCK, torch.float32, 64, ranks_on_node=2)


def test_host_blocks_mirror_each_layers_cache_an_mla_latent_or_a_kv_pair(model_and_cfg):
    """A host block holds what a device block holds: for MLA one latent per
    token and layer (not K and V), and it comes back bit for bit."""
    cpu = torch.device("cpu")
    mla_cfg = read_config(DEEPSEEK_V3 | {"num_hidden_layers": 2, "kv_lora_rank": 8, "qk_rope_head_dim": 4})
    llama_cfg = model_and_cfg[1]
    for cfg, per_layer in [(mla_cfg, (1, 1, 12)), (llama_cfg, (2, llama_cfg.num_kv_heads, llama_cfg.head_dim))]:
        pool = KVCachePool(cfg, 6, BLOCK, cpu, torch.float32)
        host = HostKVPool(pool, 3, cpu)
        assert host.storage.shape == (3, cfg.num_layers, per_layer[0], BLOCK, *per_layer[1:])
        assert host.block_bytes == bytes_per_block(cfg, BLOCK, torch.float32)
        pool.storage.copy_(torch.randn_like(pool.storage))
        before = pool.storage[:, :, [1, 4]].clone()
        assert host.swap(pool.storage, [1, 4], [2, 0], [], []).failed_outs == []
        pool.storage[:, :, [1, 4]] = float("nan")
        host.swap(pool.storage, [], [], [2, 0], [5, 3])
        assert torch.equal(pool.storage[:, :, [5, 3]], before)
