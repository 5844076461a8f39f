"""Every served family through both real services: greedy output equals HF
transformers' generate(do_sample=False) on the same checkpoint, token for
token, alone and with 8 concurrent requests, with prompts and generations
longer than the sliding windows (8-12 tokens); on the Triton backend (the
interpreter without CUDA), with 4 concurrent requests and shorter
generations that still run past every window. Checkpoints are tiny random
models built and saved by transformers itself (tests/families.py).

Sensitivity: each feature these tests rely on (RoPE scaling, windows,
soft-caps, the norm variant, the embedding scale, q/k norms, biases,
partial rotary; for the MoE and MLA families attention sinks, router and
correction biases, group-limited routing, renormalisation, the shared
expert and its gate, YaRN's attention factor and mscale, rope_interleave,
the SwiGLU clamp) is switched off one at a time in
tests/unit/test_families_vs_hf.py::test_hf_oracle_catches_a_missing_feature,
which shows the same oracle and prompt lengths then fail.

Refusals: a checkpoint the executor cannot serve exactly ends the executor
at start with a non-zero exit and an error naming what was refused (MoE
routing and attention keys among them). The handshake reports each
family's KV bytes per token (DeepSeek-V3's one latent per layer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from executor_svc.model.families import read_config
from executor_svc.step.kv_cache import bytes_per_token
from llmsched.v1 import executor_pb2, executor_pb2_grpc
from tests.conftest import HAS_CUDA, REPO_ROOT
from tests.families import CASES, hf_greedy, make_checkpoint, prompts
from tests.integration.conftest import start_services

SERVED = ["llama3", "llama3-t4", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3-mm", "phi3",
          "mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss", "deepseek-v3"]
MIN_MARGIN = 1e-3  # fp32 differences from HF are ~1e-5 in these logits
MAX_NEW = 32
ALONE = prompts(2, min_len=5, max_len=30, seed=3)
CONCURRENT = prompts(8, min_len=5, max_len=40, seed=2)
# Small blocks and prefill chunks: contexts span many blocks, windows end
# mid-block, and prompts are computed in chunks that share steps with other
# requests' decodes. float32, so tokens can be held to HF's exactly.
EXECUTOR_ENV = {"EXECUTOR_BLOCK_SIZE": "4", "EXECUTOR_NUM_KV_BLOCKS": "512", "EXECUTOR_DTYPE": "float32"}
SCHEDULER_ENV = {"SCHEDULER_MAX_PREFILL_CHUNK": "6"}
GREEDY = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def _serve(name: str, tmp_path_factory, backend_env: dict[str, str]):
    path = str(make_checkpoint(CASES[name], tmp_path_factory.mktemp(name)))
    services, client = start_services(path, executor_env=EXECUTOR_ENV | backend_env, scheduler_env=SCHEDULER_ENV)
    return path, services, client


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    path, services, client = _serve(request.param, tmp_path_factory, {"EXECUTOR_ATTENTION_BACKEND": "torch"})
    yield request.param, path, client, services
    client.channel.close()
    services.stop()


def check_against_hf(path: str, client, cases: list[list[int]], timeout_s: float = 60, max_new: int = MAX_NEW) -> None:
    sampling = GREEDY | {"max_tokens": max_new}
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(
            lambda p: client.generate(prompt_token_ids=p, sampling=sampling, timeout=timeout_s)[0], cases))
    for prompt, got in zip(cases, results):
        want = hf_greedy(path, prompt, max_new)
        assert want.min_margin > MIN_MARGIN, f"HF's top-2 logits come within {want.min_margin:.2g}: a near tie"
        assert got == want.tokens, f"prompt of {len(prompt)} tokens: served {got} but HF {want.tokens}"
    client.assert_no_leaked_blocks()


def test_alone_greedy_matches_hf(served):
    _, path, client, _ = served
    for prompt in ALONE:
        check_against_hf(path, client, [prompt])


def test_8_concurrent_greedy_requests_each_match_hf(served):
    _, path, client, _ = served
    check_against_hf(path, client, CONCURRENT)


def test_server_info_names_the_architecture_and_the_rope_in_use(served):
    name, path, client, _ = served
    info = client.info()
    cfg = read_config(json.loads((Path(path) / "config.json").read_text()))
    assert info.architecture == CASES[name].model_cls
    assert info.rope_type == cfg.rope_description()
    if name.startswith("llama3"):
        assert info.rope_type == "llama3(factor=8)"


def test_handshake_reports_the_kv_bytes_per_token(served):
    """K and V per KV head and layer, or MLA's one latent per layer."""
    name, path, _, services = served
    cfg = read_config(json.loads((Path(path) / "config.json").read_text()))
    with grpc.insecure_channel(services.executor_address) as channel:
        handshake = executor_pb2_grpc.ExecutorStub(channel).Handshake(executor_pb2.HandshakeRequest(), timeout=5)
    assert handshake.kv_bytes_per_token == bytes_per_token(cfg, torch.float32)
    if name == "deepseek-v3":  # 3 layers x (kv_lora_rank 16 + qk_rope_head_dim 8) x 4 bytes
        assert handshake.kv_bytes_per_token == 3 * (16 + 8) * 4


# --- the Triton backend (under the interpreter without CUDA) ----------------

TRITON_ENV = {"EXECUTOR_ATTENTION_BACKEND": "triton", **({} if HAS_CUDA else {"TRITON_INTERPRET": "1"})}
# The interpreter's cost grows with rows x steps, so this oracle is
# shorter than the torch backend's, and as strict where it matters: every
# request runs past the family's window, and four requests of 5-33 tokens
# share steps, the 33-token prompt in chunks of 6 beside the others'
# decodes (test_triton_oracle_still_crosses_windows_and_mixes_steps).
TRITON_MAX_NEW = 16
TRITON_CONCURRENT = CONCURRENT[::2]


# The slow interpreter run covers each way the Triton path differs by
# family: plain attention (llama3), another head_dim (qwen3's 32), windows
# on every layer (phi3) and alternating with global layers plus soft-caps
# (gemma2), sinks and MXFP4-style experts (gpt-oss), the fused-MoE kernel
# (qwen3-moe) and the MLA kernel (deepseek-v3). The rest differ only in
# torch code that both backends share, which the torch backend's oracle
# above runs per family: gemma3 (mixed windows as gemma2's; its per-type
# RoPE and norms are torch code) and gemma3-mm (the same text model), the
# llama3 checkpoint in transformers 4's keys (config reading), qwen2
# (biases; mixed windows again), mistral (windows on every layer as phi3's);
# Mixtral and Qwen2-MoE run the same fused-MoE kernel as Qwen3-MoE.
TRITON_SKIPPED = ("gemma3", "gemma3-mm", "llama3-t4", "qwen2", "mistral", "mixtral", "qwen2-moe")


@pytest.fixture(scope="module", params=[name for name in SERVED if name not in TRITON_SKIPPED])
def served_triton(request, tmp_path_factory):
    pytest.importorskip("triton")
    path, services, client = _serve(request.param, tmp_path_factory, TRITON_ENV)
    yield request.param, path, client
    client.channel.close()
    services.stop()


@pytest.mark.slow
def test_triton_backend_alone_and_concurrent_greedy_matches_hf(served_triton):
    """Slow under the interpreter: one request alone, then 4 at once."""
    _, path, client = served_triton
    check_against_hf(path, client, ALONE[:1], timeout_s=600, max_new=TRITON_MAX_NEW)
    check_against_hf(path, client, TRITON_CONCURRENT, timeout_s=600, max_new=TRITON_MAX_NEW)


@pytest.mark.parametrize("name", [name for name in SERVED if name not in TRITON_SKIPPED])
def test_triton_oracle_still_crosses_windows_and_mixes_steps(name):
    case = CASES[name]
    window = case.config.get("sliding_window")
    shortest = min(len(p) for p in ALONE[:1] + TRITON_CONCURRENT)
    if window is not None:
        assert shortest + TRITON_MAX_NEW > window, f"{name}: a request ends inside its {window}-token window"
    chunk = int(SCHEDULER_ENV["SCHEDULER_MAX_PREFILL_CHUNK"])
    lengths = sorted(len(p) for p in TRITON_CONCURRENT)
    # The longest prompt is still in prefill chunks while the shortest decodes.
    assert len(TRITON_CONCURRENT) >= 4 and -(-lengths[-1] // chunk) > -(-lengths[0] // chunk) + 2, lengths


# --- refusals ---------------------------------------------------------------

@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    """A family's checkpoint to break, made once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_checkpoint(CASES[name], tmp_path_factory.mktemp(f"{name}-base"))
        return made[name]

    return get


# case -> (the family checkpoint it breaks, its config.json change, what the error must name)
REFUSALS = {
    "unknown architecture": ("llama3-t4", {"architectures": ["FalconForCausalLM"]},
                             "architecture FalconForCausalLM is not supported"),
    "dynamic RoPE": ("llama3-t4", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
                     "RoPE type 'dynamic' is not supported"),
    "unread forward-changing key": ("llama3-t4", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "llama with biases": ("llama3-t4", {"attention_bias": True}, "attention_bias=True is not supported"),
    # MoE and MLA: routing and attention keys the executor does not implement.
    "unknown routing key": ("qwen3-moe", {"scoring_func": "sigmoid"}, "scoring_func"),
    "routing method": ("deepseek-v3", {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    "unknown attention key": ("deepseek-v3", {"index_topk": 2048}, "index_topk"),  # DeepSeek-V3.2's sparse attention
    "static fp8 activations": ("deepseek-v3", {"quantization_config": {"quant_method": "fp8",
                                                                         "activation_scheme": "static"}},
                               "activation_scheme='static' is not supported"),
    "3-bit awq": ("llama3-t4", {"quantization_config": {"quant_method": "awq", "bits": 3, "group_size": 128}},
                  "bits=3 is not supported; supported: [4]"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_executor_refuses_at_start_with_a_named_error_and_nonzero_exit(case, base_dirs, tmp_path):
    family, change, message = REFUSALS[case]
    bad = tmp_path / "ckpt"
    shutil.copytree(base_dirs(family), bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | change))
    env = {**os.environ, "EXECUTOR_MODEL": str(bad), "EXECUTOR_PORT": "0", "EXECUTOR_METRICS_PORT": "0",
           "EXECUTOR_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "executor_svc"], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"executor served a checkpoint it should refuse ({case}):\n{output[-2000:]}"
    assert "cannot serve" in output and message in output, output[-2000:]
    assert "executor listening" not in output
