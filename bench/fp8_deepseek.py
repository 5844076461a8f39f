"""An FP8-block DeepSeek-V3 end to end: a random DeepseekV3ForCausalLM at a
scaled-down DeepSeek-V3 shape, served from its FP8 128 x 128 block copy and
from those FP8 weights dequantized back to bf16, through both services.

    python -m bench.fp8_deepseek                    # the default shape, Triton attention (a GPU)
    python -m bench.fp8_deepseek --tiny --attention-backend torch --prompts 4 --tokens 8 --rounds 1

Three checkpoints, saved by transformers and written here:

- **bf16:** the random model (weights re-drawn at a trained model's scale,
  so that greedy tokens are not decided by rounding noise), in bf16;
- **fp8:** every decoder linear in FP8 blocks of 128 x 128
  (bench.quantized.write_fp8): DeepSeek's latent projections, the dense
  MLP, every routed expert and the shared expert; the routers (`mlp.gate`),
  norms, embeddings and head stay bf16. kv_a_proj_with_mqa's
  kv_lora_rank + qk_rope_head_dim rows end in an edge block, as in
  DeepSeek-V3;
- **dequantized:** the fp8 checkpoint's weights times their block scales
  (quantization.dequantize_fp8_blocks, the executor's own definition), in
  bf16: the same weight values, held plainly.

The services are launched on fp8, then on dequantized (EXECUTOR_DTYPE
bfloat16, EXECUTOR_ATTENTION_BACKEND from --attention-backend). Each serves
one warm-up round (every prompt, 2 tokens), then `--rounds` rounds of
`--prompts` concurrent greedy requests of `--tokens` tokens, as token ids.
Reported per checkpoint: output tok/s (all tokens, from the first request
sent to the last token) and ms per token (each request's first to last
token, median over requests), medians over rounds; GetServerInfo's
weight_bytes and quantization; FP8 / dequantized ratios; and on how many
prompts the first round's greedy tokens are identical. Both compute on the
same weight values: on the CPU both dequantize them the same way, so all
should match; on a GPU the FP8 GEMM accumulates in another order than
bf16's, so a near-tie can flip a token (reported, not asserted).

What the ratio compares on CUDA with the triton backend: the FP8 run's
attention projections, dense MLP and shared expert run the FP8 GEMM
(llmsched_kernels/fp8_linear.py), and its routed experts the fused-MoE kernel
reading FP8 blocks (llmsched_kernels/fused_moe.py); the dequantized run's the same
kernels on bf16 weights. Neither run captures CUDA graphs (`auto` leaves
MoE and MLA models eager).

Exits 1 when either launch fails or any request errors or comes back short.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.quantized import BLOCK, write_fp8
from llmsched.assets import STORIES260K
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

CHECKPOINTS = ("fp8", "dequantized")  # the order they are served in


@dataclass(frozen=True, slots=True)
class Shape:
    """DeepSeek-V3 (hidden 7168, 61 layers, 256 experts) scaled down, named
    as DeepseekV3Config names them. Every weight dimension is a multiple of
    128 except kv_a_proj_with_mqa's kv_lora_rank + qk_rope_head_dim rows,
    which end in an edge block as DeepSeek-V3's 576 do."""

    hidden_size: int = 1024
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 2560
    num_attention_heads: int = 8
    q_lora_rank: int = 384
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 256
    vocab_size: int = 8192

    def num_params(self) -> int:
        """Weights of the linears, routers, embeddings and head (norms aside)."""
        h, heads = self.hidden_size, self.num_attention_heads
        attention = (h * self.q_lora_rank + self.q_lora_rank * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
                     + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                     + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                     + heads * self.v_head_dim * h)
        dense = 3 * h * self.intermediate_size
        sparse = 3 * h * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
        sparse += self.n_routed_experts * h  # the router
        mlps = self.first_k_dense_replace * dense + (self.num_hidden_layers - self.first_k_dense_replace) * sparse
        return self.num_hidden_layers * attention + mlps + 2 * self.vocab_size * h


# For a CPU test: the same structure (a dense layer then a sparse one, edge
# blocks in kv_a_proj_with_mqa's 160 rows and q_b_proj's 192) in 1.7M parameters.
TINY = Shape(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=2, q_lora_rank=128,
             kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=4,
             num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=128, vocab_size=1024)


def make_bf16(directory: Path, shape: Shape, seed: int = 0) -> Path:
    """The random model in bf16, with stories260K's tokenizer (requests send
    token ids, but the scheduler needs a tokenizer)."""
    import torch
    import transformers

    cfg = transformers.DeepseekV3Config(
        **dataclasses.asdict(shape), num_key_value_heads=shape.num_attention_heads, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 1024, "rope_theta": 10000.0})
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    _redraw(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory)
    shutil.copy(STORIES260K / "tokenizer.json", directory / "tokenizer.json")
    return directory


def _redraw(model, seed: int) -> None:
    """Weights at a trained model's scale (as tests/families.py draws them):
    transformers' init (std 0.02) gives near-flat logits whose argmax is
    rounding noise, which would make the agreement figure meaningless."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # linears [out, in] and experts [experts, out, in]: unit-variance outputs
                scale = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def write_dequantized(fp8: Path, out: Path) -> Path:
    """The fp8 checkpoint with each FP8 weight times its block scales, in
    bf16, by the executor's own dequantize_fp8_blocks, and no
    quantization_config: a plain checkpoint of the same weight values."""
    import torch
    from safetensors.torch import load_file, save_file

    from executor_svc.model.quantization import dequantize_fp8_blocks

    out.mkdir(parents=True)
    for f in fp8.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    bn, bk = BLOCK
    index = {}
    for f in sorted(fp8.glob("*.safetensors")):
        stored = load_file(f)
        plain = {}
        for name, t in stored.items():
            if name.endswith("_scale_inv"):
                continue
            scales = stored.get(name + "_scale_inv")
            if scales is None:
                plain[name] = t
            else:
                grid_rows = torch.arange(t.shape[0]) // bn  # [rows]: each row's block row
                plain[name] = dequantize_fp8_blocks(t, scales, grid_rows, bk, torch.bfloat16)
        save_file(plain, out / f.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(plain, f.name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """n prompts of 16-64 token ids in [3, vocab), lengths spread over the range."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (16 + (i * 13) % 49,), generator=g).tolist() for i in range(n)]


def greedy_round(stub, prompts: list[list[int]], tokens: int) -> dict:
    """All prompts at once, greedy, `tokens` tokens each: output tok/s, the
    median ms per token, each request's tokens, and the errors (a request
    that fails, or ends short of `tokens`)."""

    def generate(prompt: list[int]) -> tuple[list[int], list[float], str | None]:
        req = spb.GenerateRequest(prompt_token_ids=prompt, sampling=spb.SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True))
        ids, times = [], []
        try:
            for resp in stub.Generate(req, timeout=600):
                if resp.token_ids:
                    times.append(time.perf_counter())
                    ids.extend(resp.token_ids)
        except grpc.RpcError as e:
            return ids, times, f"{e.code().name}: {e.details()}"
        return ids, times, None if len(ids) == tokens else f"{len(ids)} of {tokens} tokens"

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(generate, prompts))
    errors = [f"prompt {i}: {err}" for i, (_, _, err) in enumerate(results) if err]
    done = [(ids, times) for ids, times, err in results if not err]
    figures = {}
    if done and tokens > 1:
        wall = max(times[-1] for _, times in done) - started
        figures = {"output_tok_per_s": sum(len(ids) for ids, _ in done) / wall,
                   "ms_per_token": statistics.median((t[-1] - t[0]) * 1000 / (len(t) - 1) for _, t in done)}
    return {**figures, "tokens": [ids for ids, _, _ in results], "errors": errors}


def serve(model: Path, prompts: list[list[int]], tokens: int, rounds: int, env: dict[str, str]) -> dict:
    """Launches both services on `model`; its ServerInfo, a warm-up round,
    then `rounds` measured rounds."""
    from llmsched.launch import launch

    services = launch(executor_env={**env, "EXECUTOR_MODEL": str(model)}).start()
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = spb_grpc.SchedulerStub(channel)
            info = stub.GetServerInfo(spb.GetServerInfoRequest(), timeout=30)
            warm = greedy_round(stub, prompts, 2)
            runs = [greedy_round(stub, prompts, tokens) for _ in range(rounds)]
    finally:
        services.stop()
    return {"weight_bytes": info.weight_bytes, "quantization": info.quantization,
            "errors": warm["errors"] + [e for run in runs for e in run["errors"]], "runs": runs}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Prompts whose greedy tokens are identical, and where the others part."""
    first_difference = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
                        for s, t in zip(a, b) if s != t]
    return {"identical": sum(s == t for s, t in zip(a, b)), "compared": len(a),
            "first_difference": first_difference}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Shape]:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_deepseek", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="start from the CPU test's shape (TINY), not the default")
    for f in dataclasses.fields(Shape):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, dest=f.name, metavar="N",
                       help=f"DeepseekV3Config.{f.name} (default {f.default}; --tiny: {getattr(TINY, f.name)})")
    p.add_argument("--attention-backend", choices=("triton", "torch", "auto"), default="triton",
                   help="EXECUTOR_ATTENTION_BACKEND for both runs (triton needs CUDA)")
    p.add_argument("--prompts", type=int, default=64, help="concurrent greedy requests a round")
    p.add_argument("--tokens", type=int, default=64, help="output tokens a request (at least 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2, help="EXECUTOR_NUM_THREADS")
    p.add_argument("--executor-env", action="append", default=[], metavar="K=V", help="more executor settings")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "fp8_deepseek.json")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.prompts < 1 or args.rounds < 1:
        p.error("--tokens must be at least 2, --prompts and --rounds at least 1")
    if any("=" not in pair for pair in args.executor_env):
        p.error(f"--executor-env takes K=V: {args.executor_env}")
    sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(Shape) if getattr(args, f.name) is not None}
    return args, dataclasses.replace(TINY if args.tiny else Shape(), **sizes)


def main(argv: list[str] | None = None) -> int:
    args, shape = parse_args(argv)
    env = {"EXECUTOR_DTYPE": "bfloat16", "EXECUTOR_ATTENTION_BACKEND": args.attention_backend,
           "EXECUTOR_NUM_THREADS": str(args.num_threads), **dict(pair.split("=", 1) for pair in args.executor_env)}
    report: dict = {"config": {k: str(v) for k, v in vars(args).items()}, "shape": dataclasses.asdict(shape),
                    "num_params": shape.num_params(), "block": list(BLOCK), "seconds": {}, "checkpoints": {}}
    prompts = make_prompts(args.prompts, shape.vocab_size)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        bf16 = make_bf16(Path(tmp) / "bf16", shape)
        fp8 = write_fp8(bf16, Path(tmp) / "fp8")
        paths = {"fp8": fp8, "dequantized": write_dequantized(fp8, Path(tmp) / "dequantized")}
        report["seconds"]["checkpoints"] = round(time.monotonic() - t0, 1)
        for name in CHECKPOINTS:
            t0 = time.monotonic()
            try:
                result = serve(paths[name], prompts, args.tokens, args.rounds, env)
            except (RuntimeError, TimeoutError, grpc.RpcError) as e:  # a launch that fails to serve
                result = {"errors": [f"launch: {e}"], "runs": []}
            report["seconds"][name] = round(time.monotonic() - t0, 1)
            report["checkpoints"][name] = result
            if result["errors"]:
                failed.append(name)
                print(f"fp8_deepseek: {name}: {len(result['errors'])} errors, first: {result['errors'][0]}",
                      file=sys.stderr)
    if not failed:
        summarize(report)
        print_table(report, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 1 if failed else 0


def summarize(report: dict) -> None:
    """Medians over rounds, FP8 / dequantized ratios and the agreement, into the report."""
    runs = {name: report["checkpoints"][name]["runs"] for name in CHECKPOINTS}
    for name in CHECKPOINTS:
        for key in ("output_tok_per_s", "ms_per_token"):
            report["checkpoints"][name][key] = statistics.median(run[key] for run in runs[name])
    fp8, plain = report["checkpoints"]["fp8"], report["checkpoints"]["dequantized"]
    report["ratios"] = {key: fp8[key] / plain[key] for key in ("output_tok_per_s", "ms_per_token", "weight_bytes")}
    report["agreement"] = agreement(runs["fp8"][0]["tokens"], runs["dequantized"][0]["tokens"])


def print_table(report: dict, args: argparse.Namespace) -> None:
    fp8, plain, agree = report["checkpoints"]["fp8"], report["checkpoints"]["dequantized"], report["agreement"]
    print(f"FP8 blocks {report['block']} DeepSeek-V3 of {report['num_params'] / 1e6:.1f}M parameters against its "
          f"dequantized bf16 weights, {args.attention_backend} attention; {args.prompts} greedy requests x "
          f"{args.tokens} tokens, {args.rounds} rounds, medians")
    print(f"{'':24} {'fp8':>14} {'dequantized':>14} {'fp8/deq':>8}")
    for key, label, digits in (("output_tok_per_s", "output tok/s", 1), ("ms_per_token", "ms/token", 2),
                               ("weight_bytes", "weight MiB", 1)):
        scale = 2**-20 if key == "weight_bytes" else 1
        print(f"{label:24} {fp8[key] * scale:14.{digits}f} {plain[key] * scale:14.{digits}f} "
              f"{report['ratios'][key]:7.2f}x")
    print(f"quantization: {fp8['quantization']!r} against {plain['quantization'] or 'plain'!r}")
    print(f"greedy tokens identical on {agree['identical']} of {agree['compared']} prompts"
          + (f"; the others part at tokens {agree['first_difference']}" if agree["first_difference"] else ""))
    print(f"seconds: {report['seconds']}")


if __name__ == "__main__":
    sys.exit(main())
