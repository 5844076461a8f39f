"""Quantized checkpoints through both real services: an FP8 checkpoint with
block scales and a GPTQ act-order int4 one (tests/quantized.py) serve HF
transformers' greedy tokens on the same weights, alone and 4 at once, with
their weights kept quantized in the executor (tests/unit/test_fp8_checkpoints.py and test_quantized_formats.py check
the layers and refusals in process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmsched.v1 import scheduler_pb2 as spb
from tests.families import CASES, make_checkpoint, prompts
from tests.integration.test_families import EXECUTOR_ENV, SCHEDULER_ENV, check_against_hf
from tests.integration.conftest import start_services
from tests.quantized import write_fp8, write_gptq


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    plain = make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))
    path = str(write_fp8(plain, tmp_path_factory.mktemp("fp8") / "llama", (32, 32)))
    services, client = start_services(path, executor_env=EXECUTOR_ENV, scheduler_env=SCHEDULER_ENV)
    yield path, client
    client.channel.close()
    services.stop()


def test_fp8_block_checkpoint_serves_hfs_greedy_tokens_alone_and_concurrently(fp8_llama):
    path, client = fp8_llama
    check_against_hf(path, client, prompts(1, min_len=12, max_len=12, seed=4))
    check_against_hf(path, client, prompts(4, min_len=5, max_len=30, seed=5))


def test_server_info_reports_the_weights_at_their_quantized_size(fp8_llama):
    path, client = fp8_llama
    info = client.stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=10)
    assert info.quantization == "fp8 blocks [32, 32]"
    # What the checkpoint holds: FP8 weights at one byte and their float32
    # scales; the rest (embeddings, head, norms) loaded in float32.
    tensors = load_file(Path(path) / "model.safetensors")
    want = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4) for t in tensors.values())
    assert info.weight_bytes == want


@pytest.fixture(scope="module")
def gptq_llama(tmp_path_factory):
    plain = make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))
    root = tmp_path_factory.mktemp("gptq")
    path, dense = write_gptq(plain, root / "llama", root / "dense", bits=4, group=32, sym=False, desc_act=True)
    services, client = start_services(str(path), executor_env=EXECUTOR_ENV, scheduler_env=SCHEDULER_ENV)
    yield str(path), str(dense), client
    client.channel.close()
    services.stop()


def test_gptq_act_order_int4_serves_hfs_greedy_tokens_on_its_dequantized_weights(gptq_llama):
    path, dense, client = gptq_llama
    check_against_hf(dense, client, prompts(4, min_len=5, max_len=30, seed=5))
    info = client.stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=10)
    assert info.quantization == "gptq: int4 group 32 asymmetric act-order"
    # As held: the packed weights at their stored size (half a byte per
    # weight), scales as stored (fp16), a zero point byte per group, one
    # g_idx per matmul (q/k/v share theirs, as gate/up do); the rest
    # (embeddings, head, norms) in float32.
    tensors = load_file(Path(path) / "model.safetensors")
    want = 0
    for name, t in tensors.items():
        if name.endswith((".qweight", ".scales")):
            want += t.numel() * t.element_size()
        elif name.endswith(".qzeros"):
            want += t.numel() * 8  # 8 zero points per int32
        elif name.endswith(".g_idx"):
            want += t.numel() * 4 if name.endswith(("q_proj.g_idx", "o_proj.g_idx", "gate_proj.g_idx",
                                                    "down_proj.g_idx")) else 0
        else:
            want += t.numel() * 4
    assert info.weight_bytes == want
