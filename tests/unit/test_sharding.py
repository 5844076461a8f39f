"""The tensor-parallel split rules (executor_svc/model/sharding.py), without
processes: which sizes a model allows, which rows and columns each rank
holds, KV-head replication, vocabulary padding, and slices read from disk."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from executor_svc.model.checkpoint import LazyTensor, load_checkpoint
from executor_svc.model.families import read_config
from executor_svc.model.model_config import ModelConfig
from executor_svc.model.sharding import Shard, check_size, valid_sizes
from llmsched.errors import StartupError


def config(**overrides) -> ModelConfig:
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
              intermediate_size=172, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu")
    return read_config(hf | overrides)


def test_stories260k_shapes_allow_sizes_1_2_4():
    assert valid_sizes(config()) == [1, 2, 4]


def test_size_3_on_stories260k_is_refused_with_the_sizes_that_work(stories_path):
    ckpt = load_checkpoint(str(stories_path))
    with pytest.raises(StartupError, match=r"EXECUTOR_TENSOR_PARALLEL_SIZE=3 .*8 attention heads.*sizes that work: 1, 2, 4"):
        check_size(read_config(ckpt.hf_config), 3)


@pytest.mark.parametrize("size", [3, 6])
def test_40_heads_on_3_or_6_devices_is_refused_by_name(size):
    cfg = config(num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_size=5120,
                 intermediate_size=13824)
    with pytest.raises(StartupError, match=f"SIZE={size} .*40 attention heads.*sizes that work: 1, 2, 4, 8$"):
        check_size(cfg, size)


def test_fewer_kv_heads_than_ranks_needs_a_multiple_of_them():
    cfg = config(num_attention_heads=12, num_key_value_heads=3, intermediate_size=192)
    assert valid_sizes(cfg) == [1, 3, 6, 12]  # 2 and 4 split 3 KV heads unevenly


def test_kv_heads_are_replicated_on_the_ranks_whose_queries_use_them():
    cfg = config()  # 8 query heads, 4 KV heads: 2 queries per KV head
    for size in (1, 2, 4):
        for rank in range(size):
            shard = Shard(rank, size)
            queries = range(rank * shard.num_heads(cfg), (rank + 1) * shard.num_heads(cfg))
            kv = range(shard.first_kv_head(cfg), shard.first_kv_head(cfg) + shard.num_kv_heads(cfg))
            assert {q // 2 for q in queries} == set(kv), f"size {size} rank {rank}"
    eight = config(num_attention_heads=8, num_key_value_heads=2)
    assert [Shard(r, 8).first_kv_head(eight) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def _whole_state(cfg) -> dict[str, torch.Tensor]:
    from executor_svc.model.model import CausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in CausalLM(cfg, 16).named_parameters()}
    # The meta model fuses q/k/v and gate/up: the checkpoint keeps them apart.
    state = {}
    for name, shape in shapes.items():
        if name.endswith("qkv_proj.weight"):
            p = name.removesuffix("qkv_proj.weight")
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            state |= {p + "q_proj.weight": torch.randn(q, cfg.hidden_size), p + "k_proj.weight": torch.randn(kv, 64),
                      p + "v_proj.weight": torch.randn(kv, 64)}
        elif name.endswith("gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            state |= {p + k: torch.randn(cfg.intermediate_size, cfg.hidden_size) for k in ("gate_proj.weight",
                                                                                         "up_proj.weight")}
        else:
            state[name] = torch.randn(shape)
    return state


def test_each_layer_loads_its_rows_columns_or_all_of_its_tensors():
    """Rank 1 of 2: q/k/v and gate/up by rows, o and down by columns, the
    vocabulary by rows, norms whole."""
    from executor_svc.model.families import build_model

    cfg, shard = config(), Shard(1, 2)
    state = _whole_state(cfg)
    model = build_model(cfg, state, 16, torch.device("cpu"), torch.float32, shard)
    layer, p = model.model.layers[0], "model.layers.0."
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([
        state[p + "self_attn.q_proj.weight"][32:64], state[p + "self_attn.k_proj.weight"][16:32],
        state[p + "self_attn.v_proj.weight"][16:32]]))
    assert torch.equal(layer.self_attn.o_proj.weight, state[p + "self_attn.o_proj.weight"][:, 32:64])
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([state[p + "mlp.gate_proj.weight"][86:172],
                                                                 state[p + "mlp.up_proj.weight"][86:172]]))
    assert torch.equal(layer.mlp.down_proj.weight, state[p + "mlp.down_proj.weight"][:, 86:172])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"][256:512])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"][256:512])
    for replicated in (p + "input_layernorm.weight", "model.norm.weight"):
        assert torch.equal(model.get_parameter(replicated), state[replicated])


def test_vocabulary_is_padded_to_a_multiple_of_the_size_with_zero_rows():
    from executor_svc.model.layers import VocabEmbedding

    cfg = config(vocab_size=510)
    assert Shard(0, 4).padded_vocab(cfg) == 512
    assert [Shard(r, 4).vocab_range(cfg) for r in range(4)] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    embed = torch.randn(510, 64)
    with torch.device("meta"):
        layer = VocabEmbedding(510, 64, *Shard(3, 4).vocab_range(cfg))
    layer.load_weight("weight", LazyTensor.of(embed), torch.device("cpu"), torch.float32)
    part = layer.weight
    assert part.shape == (128, 64)
    assert torch.equal(part[:126], embed[384:]) and not part[126:].any()


def test_a_rank_reads_only_its_slice_from_the_safetensors_file(tmp_path):
    """get_slice, not get_tensor: a rank's read of a column split returns
    exactly those columns of the file's tensor, and a narrowed tensor (as
    Phi-3's fused split makes) reads only its rows."""
    from executor_svc.model.checkpoint import Checkpoint
    from executor_svc.model.layers import RowLinear

    down, fused = torch.randn(64, 172), torch.randn(48, 64)
    save_file({"model.layers.0.mlp.down_proj.weight": down, "fused": fused}, tmp_path / "m.safetensors")
    ckpt = Checkpoint("m", {}, "", shards=(tmp_path / "m.safetensors",))
    read = {}
    with torch.device("meta"):
        layer = RowLinear.split(172, 64, rank=1, size=2)
    for name, lazy in ckpt.lazy_tensors():  # each read before the next is taken, as build_model does
        if name == "fused":
            part = lazy.rows(16, 16)
            assert part.shape == (16, 64)
            read[name] = (part.read(), part.read(1, 4, 8))
        else:
            layer.load_weight("weight", lazy, torch.device("cpu"), torch.float32)
            read[name] = layer.weight
    assert torch.equal(read["model.layers.0.mlp.down_proj.weight"], down[:, 86:])
    assert torch.equal(read["fused"][0], fused[16:32]) and torch.equal(read["fused"][1], fused[16:32, 4:8])


def test_a_row_split_bias_is_held_by_rank_0_only():
    """gpt-oss's o_proj has a bias: the ranks' partial sums add up to it once."""
    from executor_svc.model.layers import RowLinear

    w, b, x = torch.randn(8, 16), torch.randn(8), torch.randn(3, 16)
    total = torch.zeros(3, 8)
    for rank in range(2):
        with torch.device("meta"):
            layer = RowLinear.split(16, 8, rank, 2, bias=True)
        for name, t in (("weight", w), ("bias", b)):
            layer.load_weight(name, LazyTensor.of(t), torch.device("cpu"), torch.float32)
        total += layer(x[:, rank * 8 : (rank + 1) * 8])
    assert torch.allclose(total, x @ w.T + b, atol=1e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_q_k_v_and_gate_up_shards_into_the_rows_of_one_fused_weight(rank):
    from executor_svc.model.families import build_model

    cfg, shard = config(), Shard(rank, 2)
    state = _whole_state(cfg)
    model = build_model(cfg, state, 16, torch.device("cpu"), torch.float32, shard)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    q, kv, inter = slice(rank * 32, rank * 32 + 32), slice(rank * 16, rank * 16 + 16), slice(rank * 86, rank * 86 + 86)
    assert torch.equal(attn.qkv_proj.weight, torch.cat([state[p + "self_attn.q_proj.weight"][q],
                                                        state[p + "self_attn.k_proj.weight"][kv],
                                                        state[p + "self_attn.v_proj.weight"][kv]])), "qkv rows"
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([state[p + "mlp.gate_proj.weight"][inter],
                                                           state[p + "mlp.up_proj.weight"][inter]]))
    # The separate projections never existed as parameters: nothing else holds them.
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n, _ in model.named_parameters())


def test_expert_and_mla_sizes_are_refused_with_the_sizes_that_work():
    """Experts split along their intermediate units and so must divide them;
    MLA has no KV heads to divide (the latent is replicated)."""
    moe = read_config({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                       "num_key_value_heads": 4, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 20})
    assert valid_sizes(moe) == [1, 2, 4]
    with pytest.raises(StartupError, match=r"SIZE=8 does not divide Qwen3MoeForCausalLM's expert intermediate size 20"
                                           r"; sizes that work: 1, 2, 4$"):
        check_size(moe, 8)
    from tests.unit.test_mla import DEEPSEEK_V3

    mla = read_config(DEEPSEEK_V3 | {"num_key_value_heads": 1})  # ignored by MLA: no KV heads to split
    assert valid_sizes(mla)[-1] == 128 and 16 in valid_sizes(mla)
