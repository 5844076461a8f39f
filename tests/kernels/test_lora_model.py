"""The model's LoRA path (executor_svc/model/lora.py) through the Triton
shrink and expand kernels, under the interpreter without CUDA: every layer's
delta against the torch path on the same slot buffers, and greedy generation
with five adapters and the base model in one batch against HF + PEFT. The
adapters are tests/lora.py's (ranks 8, 16, 64; all seven projections).
About 40 s, most of it the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("llmsched_kernels.lora")
pytest.importorskip("peft")

from executor_svc.model.checkpoint import load_checkpoint  # noqa: E402
from executor_svc.model.families import build_model, read_config  # noqa: E402
from executor_svc.model.lora import load_adapters  # noqa: E402
from tests.lora import ADAPTERS, hf_peft_greedy, make_base_and_adapters  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_base_and_adapters(tmp_path_factory.mktemp("lora_kernels"), list(ADAPTERS))


def _lora_set(base: str, adapters: dict[str, str], dtype: torch.dtype):
    ckpt = load_checkpoint(base)
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, cfg.max_position_embeddings, torch.device("cpu"), dtype)
    lora = load_adapters(",".join(f"{n}={p}" for n, p in adapters.items()), model, 64, 8, torch.device("cpu"), dtype)
    for slot, name in enumerate(adapters):
        lora.load(slot + 2, name)  # slots 0 and 1 stay empty
    return lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_layer_s_delta_through_the_kernels_matches_the_torch_path(made, dtype):
    base, adapters = made
    lora = _lora_set(base, adapters, dtype)
    rng = np.random.default_rng(0)
    token_slots = rng.choice([-1, 2, 3, 4, 5, 6], size=23)  # base tokens interleaved with five adapters
    g = torch.Generator().manual_seed(0)
    for site in lora.sites:
        x = torch.randn(23, site.lora.a.shape[3], generator=g).to(dtype)
        y = torch.randn(23, sum(site.lora.part_rows), generator=g).to(dtype)
        got = {}
        for impl in ("torch", "triton"):
            lora.use_impl(impl)
            lora.batch.set(token_slots, torch.device("cpu"))
            assert (lora.batch.order is not None) == (impl == "triton") and bool(lora.batch.groups) == (impl == "torch")
            got[impl] = site.lora.add(x, y.clone())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(got["triton"].float(), got["torch"].float(), atol=tol, rtol=tol), site.modules
        assert not torch.allclose(got["torch"], y), "the adapters change this layer"
        base_rows = torch.from_numpy(token_slots < 0)
        assert torch.equal(got["triton"][base_rows], y[base_rows])


def test_unknown_lora_compute_is_refused_by_name(made):
    base, adapters = made
    lora = _lora_set(base, {"a8": adapters["a8"]}, torch.float32)
    with pytest.raises(ValueError, match="'cuda' is not implemented; supported: torch, triton"):
        lora.use_impl("cuda")


def test_mixed_adapters_through_the_kernels_match_hf_peft(made):
    """As tests/unit/test_lora.py's oracle test, with the deltas from the kernels."""
    from tests.unit.test_lora import MAX_NEW, PROMPT, _generate, _runner

    base, adapters = made
    # As many slots as adapters: the interpreter runs every program of the grid, even those that exit at once.
    runner = _runner(base, ",".join(f"{n}={p}" for n, p in adapters.items()), max_loras=len(adapters))
    runner.lora.use_impl("triton")
    names = ["", *adapters]
    got = _generate(runner, names)
    for name, tokens in zip(names, got):
        assert tokens == hf_peft_greedy(base, adapters.get(name), PROMPT, MAX_NEW), name
