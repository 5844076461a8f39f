"""LoRA adapters for tests, and HF + PEFT as their greedy oracle, on the
tiny random Llama of tests/families.py. Adapters are made with
init_lora_weights=False, since PEFT's default init leaves B at zero: such an
adapter changes nothing, and a test on it could not fail."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.families import CASES, make_checkpoint

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, lora_alpha, use_rslora): five adapters of ranks 8, 16 and 64.
ADAPTERS = {"a8": (8, 16, False), "b16": (16, 8, False), "c64": (64, 64, True), "d8": (8, 4, True),
            "e16": (16, 32, False)}


def _hf_base(path: str):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_adapter(base_path: str, directory: Path, rank: int, alpha: int, rslora: bool, seed: int) -> str:
    """A PEFT adapter on all seven projections, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=PROJECTIONS,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(_hf_base(base_path), config)
    with torch.no_grad():  # PEFT's random B is small; at this scale the adapter decides the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0 / p.shape[1] ** 0.5 / p.std())
    model.save_pretrained(directory)
    return str(directory)


def make_base_and_adapters(directory: Path, names: list[str]) -> tuple[str, dict[str, str]]:
    """The tiny Llama checkpoint and the named ADAPTERS on it."""
    base = str(make_checkpoint(CASES["llama3"], directory / "base"))
    return base, {name: make_adapter(base, directory / name, *ADAPTERS[name], seed=i)
                  for i, name in enumerate(ADAPTERS) if name in names}


def hf_peft_greedy(base_path: str, adapter_path: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False), through PEFT when an adapter is given."""
    from peft import PeftModel

    model = _hf_base(base_path)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
