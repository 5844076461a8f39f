"""Hugging Face transformers baselines on the very same weights, prompts and
output lengths as the measured run (docs/performance.md, P3).

- hf-static: `generate` in static batches of 16, left padded; a batch runs
  until its longest request is done, which is exactly the waste continuous
  batching removes.
- hf-cb: transformers' own continuous batching (the paged-cache manager
  behind `generate_batch`), fed each request with its own max_new_tokens.

torch and transformers are imported inside the functions, so the client
half of the benchmark still runs on a scheduler-only install.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.workloads import BenchRequest

STATIC_BATCH_SIZE = 16
PAD_ID = 0  # <unk>: never attended to, left padding is masked out
# hf-cb gets the same per-step limits as our scheduler's defaults
# (scheduler_svc/config.py), unless --scheduler-env overrides ours.
DEFAULT_MAX_BATCHED_TOKENS = 2048
DEFAULT_MAX_SEQS = 256
CB_PAGE_SIZE = 256  # transformers' default page size: their engine as shipped


@dataclass(slots=True)
class BaselineResult:
    name: str
    wall_s: float
    num_requests: int
    output_tokens: int
    outputs: list[list[int]]
    extra: dict = field(default_factory=dict)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class HFModel:
    """The baseline model plus the facts every baseline needs."""

    model: object  # transformers.PreTrainedModel
    tokenizer_json: str
    device: str
    num_threads: int


def hf_builtin(model: str):
    """A built-in model as HF transformers' own class, on the executor's
    weights: Llama ones loaded directly; others (bench-moe's Qwen3-MoE,
    whose per-expert tensors transformers 5 fuses at load) saved to a
    temporary directory and read back with from_pretrained."""
    import tempfile

    import torch
    import transformers
    from safetensors.torch import save_file

    from executor_svc.model.builtin import load_builtin

    ckpt = load_builtin(model)
    if ckpt.hf_config["architectures"] == ["LlamaForCausalLM"]:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ckpt.hf_config))
        missing, unexpected = hf.load_state_dict(ckpt.state_dict, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"weights do not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}")
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
        return hf
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(ckpt.hf_config))
        save_file(ckpt.state_dict, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        arch = getattr(transformers, ckpt.hf_config["architectures"][0])
        return arch.from_pretrained(tmp, dtype=torch.float32)


def load_hf_model(model: str, num_threads: int) -> HFModel:
    """Built-ins: HF's class on the executor's own weights (hf_builtin).
    Directories: from_pretrained. Device and dtype follow the executor's
    'auto' rule (cuda+bf16, else cpu+fp32), and the thread count is the
    executor's, so both sides get the same CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from executor_svc.model.builtin import BUILTIN_MODELS, load_builtin

    torch.set_num_threads(num_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model in BUILTIN_MODELS:
        hf = hf_builtin(model)
        tokenizer_json = load_builtin(model).tokenizer_json
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        tokenizer_json = (Path(model) / "tokenizer.json").read_text()
    hf = hf.to(device=device, dtype=dtype).eval()
    # ignore_eos on our side means "keep going", not "never pick EOS": so no
    # min_new_tokens (it would mask EOS out of the argmax and change tokens);
    # with no EOS id at all, generation simply runs to max_new_tokens.
    hf.generation_config.eos_token_id = None
    return HFModel(hf, tokenizer_json, device, num_threads)


def prompt_token_ids(requests: Sequence[BenchRequest], tokenizer_json: str) -> list[list[int]]:
    """Token ids as the server sees them: text prompts go through the same
    tokenizer.json, special tokens (BOS) included, as scheduler_svc does."""
    if all(r.prompt_token_ids is not None for r in requests):
        return [list(r.prompt_token_ids) for r in requests]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return [list(r.prompt_token_ids) if r.prompt_token_ids is not None else tok.encode(r.prompt_text).ids
            for r in requests]


def hf_static(hf: HFModel, prompts: Sequence[list[int]], max_tokens: Sequence[int],
              batch_size: int = STATIC_BATCH_SIZE, **_: object) -> BaselineResult:
    import torch

    model = hf.model
    outputs: list[list[int]] = []
    batch_times: list[float] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, lens = prompts[b:b + batch_size], max_tokens[b:b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch], device=hf.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=hf.device)
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                                 eos_token_id=None, pad_token_id=PAD_ID)
            batch_times.append(time.perf_counter() - t)
            # Every row ran max(lens) steps; each request keeps only its own.
            outputs.extend(row[width:width + n].tolist() for row, n in zip(out, lens))
    wall = time.perf_counter() - start
    return BaselineResult("hf-static", wall, len(prompts), sum(len(o) for o in outputs), outputs,
                          {"batch_size": batch_size, "batch_wall_s": batch_times,
                           "padded_output_tokens": sum(max(max_tokens[b:b + batch_size]) * len(max_tokens[b:b + batch_size])
                                                       for b in range(0, len(max_tokens), batch_size))})


def hf_cb(hf: HFModel, prompts: Sequence[list[int]], max_tokens: Sequence[int],
          max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, max_seqs: int = DEFAULT_MAX_SEQS,
          **_: object) -> BaselineResult:
    """Continuous batching through the manager that generate_batch wraps:
    generate_batch itself takes one max_new_tokens for all requests, while
    the workload gives each its own. On CPU the KV pool cannot be sized from
    device memory, so it gets room for every request at once (as our
    default pool has), and the same per-step limits as our scheduler."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = sum(-(-(len(p) + n) // CB_PAGE_SIZE) for p, n in zip(prompts, max_tokens))
    cb_config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=pages + 8,
                                         max_batch_tokens=max_batched_tokens, max_requests_per_batch=max_seqs)
    # eos_token_id=-1 is transformers' "no EOS" for continuous batching.
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID,
                                  max_new_tokens=max(max_tokens))
    model = hf.model
    results: dict[str, object] = {}
    # Its CPU memory probe logs an error without psutil; harmless, since the
    # pool is sized explicitly above, and it would clutter the progress bar.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    # No inference_mode here: the model runs on the manager's own thread,
    # which sets up its own no-grad context.
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, warmup=False, block=True, timeout=30,
    ) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"cb-{i}", max_new_tokens=n, eos_token_id=-1, record_timestamps=True)
               for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching stopped with {len(ids) - len(results)} "
                                   "requests unfinished")
        wall = time.perf_counter() - start
    outs = [list(results[i].generated_tokens) for i in ids]
    errors = [results[i].error for i in ids if results[i].error is not None]
    if errors:
        raise RuntimeError(f"hf-cb: {len(errors)} requests failed, first: {errors[0]}")
    # Their per-token timestamps share perf_counter with created_time.
    ttft = [results[i].timestamps[0] - results[i].created_time for i in ids if results[i].timestamps]
    return BaselineResult("hf-cb", wall, len(prompts), sum(len(o) for o in outs), outs,
                          {"page_size": CB_PAGE_SIZE, "num_blocks": pages + 8, "max_batch_tokens": max_batched_tokens,
                           "max_requests_per_batch": max_seqs, "ttft_s": ttft})


BASELINES: dict[str, Callable[..., BaselineResult]] = {"hf-static": hf_static, "hf-cb": hf_cb}


def cb_limits_from_env(scheduler_env: Mapping[str, str]) -> dict[str, int]:
    """The per-step limits our scheduler runs with, so hf-cb gets the same."""
    return {"max_batched_tokens": int(scheduler_env.get("SCHEDULER_MAX_NUM_BATCHED_TOKENS", DEFAULT_MAX_BATCHED_TOKENS)),
            "max_seqs": int(scheduler_env.get("SCHEDULER_MAX_NUM_SEQS", DEFAULT_MAX_SEQS))}


# ----- greedy agreement -------------------------------------------------------


@dataclass(slots=True)
class Mismatch:
    index: int
    first_diff: int  # position of the first differing token
    ours_len: int
    theirs_len: int


def compare_outputs(indices: Sequence[int], ours: Sequence[Sequence[int]],
                    theirs: Sequence[Sequence[int]]) -> list[Mismatch]:
    """Requests whose greedy token lists differ, with where they part."""
    out = []
    for i, a, b in zip(indices, ours, theirs):
        a, b = list(a), list(b)
        if a == b:
            continue
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(Mismatch(i, first, len(a), len(b)))
    return out


def describe(m: Mismatch) -> str:
    return json.dumps({"request": m.index, "first_diff_token": m.first_diff, "ours_len": m.ours_len,
                       "theirs_len": m.theirs_len})
