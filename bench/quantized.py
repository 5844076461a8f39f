"""P20: quantized checkpoints (FP8 with block scales, int4 W4A16, int8 W8A16)
against the same model in bf16, measured in the same run (docs/performance.md, P20).

    python -m bench.quantized                       # ~150M-parameter Llama, 3 rounds
    python -m bench.quantized --hidden 256 --layers 2 --vocab 2048 --rounds 1 --tokens 8 --streams 4
    python -m bench.quantized --dequantizing        # + every format dequantizing per matmul (kernels off)
    python -m bench.quantized --eager               # + every format with its decode steps eager (not compiled)

The model is a random LlamaForCausalLM saved by transformers in bf16
(bench/load_memory.py), a copy with every decoder linear in FP8 blocks of
128 x 128 (quantization.quantize_fp8_blocks), and one in compressed-tensors'
W4A16 (symmetric int4, groups of 128, bf16 scales; write_w4a16), and one in
its int-quantized W8A16 (symmetric int8, one bf16 scale per row;
peer_models.write_int8). All are served in bf16 (EXECUTOR_DTYPE=bfloat16),
each keeping its quantized weights; on the CPU the int formats run torch's
int4/int8 kernels (executor_svc/model/cpu_int_linear.py) and FP8 our own
(cpu_fp8_linear.py), and `--dequantizing` adds each again dequantizing per
matmul, as before those (EXECUTOR_CPU_INT_KERNELS / _FP8_KERNEL=off).
Decode steps are compiled (EXECUTOR_TORCH_COMPILE=auto) for every one;
`--eager` adds each quantized format with them eager.

- **Memory:** each checkpoint is loaded in a fresh interpreter as the
  executor loads it. The figures are the loaded weight bytes, and the
  resident memory after loading (VmRSS).
- **Decode:** both services are launched for each checkpoint in turn, in
  interleaved rounds.
  - One greedy stream: ms per output token, from the first token to the
    last.
  - `--streams` concurrent streams: output tokens per second, from the
    first request sent to the last token.
- Medians over rounds; the ratios are each format / bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.load_memory import make_checkpoint, measure
from llmsched.assets import STORIES260K
from llmsched.v1 import scheduler_pb2 as spb
from llmsched.v1 import scheduler_pb2_grpc as spb_grpc

BLOCK = (128, 128)
# Decoder linears, experts' and shared experts' included, and DeepSeek-V3's
# latent projections (bench/fp8_deepseek.py); routers (`mlp.gate`), norms,
# embeddings and the head stay as they are.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj")


def write_fp8(plain: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """`plain` with every decoder linear in FP8 blocks, the rest as it was."""
    from safetensors.torch import load_file, save_file

    from executor_svc.model.quantization import quantize_fp8_blocks

    out.mkdir(parents=True)
    for f in plain.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    index = {}
    for f in sorted(plain.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(f).items():
            if any(f".{p}.weight" in name for p in LINEARS):
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(t, block)
            else:
                tensors[name] = t
        save_file(tensors, out / f.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, f.name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_w4a16(plain: Path, out: Path) -> Path:
    """`plain` with every decoder linear in compressed-tensors' pack-quantized
    W4A16: per group of 128 columns (fewer where the model's widths are not
    multiples of 128), scale = amax / 7.5 (its symmetric
    int4 range), values rounded into [-8, 7], stored plus 8, eight to an
    int32 word, value j of a row at bit 4 * (j % 8) of word j // 8."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in plain.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    group = math.gcd(128, cfg["hidden_size"], cfg["intermediate_size"])
    index = {}
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    for f in sorted(plain.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(f).items():
            if not any(f".{p}.weight" in name for p in LINEARS):
                tensors[name] = t
                continue
            module = name[: -len(".weight")]
            groups = t.float().unflatten(1, (-1, group))
            scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
            q = (groups / scale.float()[..., None]).round().clamp(-8, 7).flatten(1).to(torch.int64) + 8
            words = (q.unflatten(1, (-1, 8)) << shifts).sum(-1) & 0xFFFFFFFF
            words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
            tensors |= {f"{module}.weight_packed": words, f"{module}.weight_scale": scale,
                        f"{module}.weight_shape": torch.tensor(list(t.shape))}
        save_file(tensors, out / f.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, f.name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def linear_bytes(checkpoint: Path) -> int:
    """Bytes of the decoder linears' tensors in the checkpoint (FP8 weights
    and their scales, or bf16 weights): what those layers hold in memory."""
    from safetensors import safe_open

    total = 0
    for f in checkpoint.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if any(f".{p}.weight" in name for p in LINEARS):  # weight, weight_scale(_inv), weight_packed
                    t = st.get_tensor(name)
                    total += t.numel() * t.element_size()
    return total


def decode_figures(model: str, tokens: int, streams: int, threads: int, vocab: int, env: dict[str, str]) -> dict:
    """Launches both services on `model` in bf16; one stream's ms per token
    and `streams` streams' output tok/s."""
    from llmsched.launch import launch

    services = launch(executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_DTYPE": "bfloat16",
                                    "EXECUTOR_NUM_THREADS": str(threads), "EXECUTOR_NUM_KV_BLOCKS": "2048",
                                    **env}).start()
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = spb_grpc.SchedulerStub(channel)

            def generate(i: int) -> tuple[list[float], int]:
                prompt = [(7 * i + j) % (vocab - 1) + 1 for j in range(16)]
                req = spb.GenerateRequest(prompt_token_ids=prompt, sampling=spb.SamplingParams(
                    max_tokens=tokens, temperature=0, ignore_eos=True))
                times, n = [], 0
                for resp in stub.Generate(req, timeout=1800):
                    if resp.token_ids:
                        times.append(time.perf_counter())
                        n += len(resp.token_ids)
                return times, n

            generate(0)  # warm-up
            times, n = generate(1)
            one_ms = (times[-1] - times[0]) * 1000 / (n - 1)
            started = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                results = list(pool.map(generate, range(2, 2 + streams)))
            wall = max(t[-1] for t, _ in results) - started
            return {"one_stream_ms_per_token": one_ms,
                    "many_streams_tok_per_s": sum(n for _, n in results) / wall}
    finally:
        services.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per stream")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--dequantizing", action="store_true",
                   help="also serve each format with its CPU kernel off, dequantizing per matmul (fp8-deq, "
                   "w4a16-deq, w8a16-deq)")
    p.add_argument("--eager", action="store_true",
                   help="also serve each format with its decode steps eager (fp8-eager, w4a16-eager, w8a16-eager: "
                   "EXECUTOR_TORCH_COMPILE=off; the default compiles them, as for bf16)")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "quantized.json")
    args = p.parse_args(argv)
    from bench.peer_models import write_int8

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = make_checkpoint(Path(tmp) / "bf16", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                               dtype="bfloat16", shard="200MB")
        # The services need a real tokenizer (the scheduler's, the constraint
        # matchers'); requests send token ids, so any will do.
        shutil.copy(STORIES260K / "tokenizer.json", bf16 / "tokenizer.json")
        paths = {"bf16": bf16, "fp8": write_fp8(bf16, Path(tmp) / "fp8"),
                 "w4a16": write_w4a16(bf16, Path(tmp) / "w4a16"), "w8a16": write_int8(bf16, Path(tmp) / "w8a16")}
        memory = {name: measure(path, "bfloat16") for name, path in paths.items()}
        for name, path in paths.items():
            memory[name]["linears_mb"] = linear_bytes(path) / 2**20
        envs = dict.fromkeys(paths, {})
        for name in ("fp8", "w4a16", "w8a16") if args.eager else ():
            paths[f"{name}-eager"], envs[f"{name}-eager"] = paths[name], {"EXECUTOR_TORCH_COMPILE": "off"}
            memory[f"{name}-eager"] = memory[name]
        if args.dequantizing:
            for name, setting in (("fp8", "EXECUTOR_CPU_FP8_KERNEL"), ("w4a16", "EXECUTOR_CPU_INT_KERNELS"),
                                  ("w8a16", "EXECUTOR_CPU_INT_KERNELS")):
                paths[f"{name}-deq"], envs[f"{name}-deq"] = paths[name], {setting: "off"}
                memory[f"{name}-deq"] = memory[name]
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))  # interleaved, order alternating
            for name in order:
                runs[name].append(decode_figures(str(paths[name]), args.tokens, args.streams, args.num_threads,
                                                 args.vocab, envs[name]))

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    report = {"config": {k: str(v) for k, v in vars(args).items()}, "block": list(BLOCK), "memory": memory,
              "runs": runs, "ratios": {}}
    weights = {n: m["shard_mb"] for n, m in memory.items()}
    rss = {n: m["rss_after_mb"] for n, m in memory.items()}
    linears = {n: m["linears_mb"] for n, m in memory.items()}
    formats = [n for n in paths if n != "bf16"]
    for n in formats:
        report["ratios"][n] = {
            "weight_bytes": weights[n] / weights["bf16"],
            "linear_bytes": linears[n] / linears["bf16"],
            "rss_saved_over_bf16_weight_bytes": (rss["bf16"] - rss[n]) / weights["bf16"],
            "one_stream_ms_per_token": median(n, "one_stream_ms_per_token") / median("bf16", "one_stream_ms_per_token"),
            "many_streams_tok_per_s": median(n, "many_streams_tok_per_s") / median("bf16", "many_streams_tok_per_s"),
        }
    params = weights["bf16"] * 2**20 / 2
    print(f"P20: Llama of {params / 1e6:.0f}M parameters, FP8 blocks {list(BLOCK)}, W4A16 (int4 groups) and W8A16 "
          f"(int8 rows) against bf16, all served in bf16 (-deq: the CPU kernels off); {args.rounds} "
          "rounds, medians; ratios to bf16 in brackets")
    print(f"{'':34} {'bf16':>10} " + " ".join(f"{n:>18}" for n in formats))

    def row(label: str, values: dict, digits: int = 1) -> None:
        cells = " ".join(f"{values[n]:10.{digits}f} ({values[n] / values['bf16']:4.2f}x)" for n in formats)
        print(f"{label:34} {values['bf16']:10.{digits}f} {cells}")

    row("weights (MiB)", weights)
    row("  of which decoder linears (MiB)", linears)
    row("RSS after load (MiB)", rss)
    for key, label in (("one_stream_ms_per_token", "1 stream, ms/token"),
                       ("many_streams_tok_per_s", f"{args.streams} streams, output tok/s")):
        row(label, {n: median(n, key) for n in paths}, 2)
    for n in formats:
        print(f"{n}: RSS saved / bf16 weight bytes: {report['ratios'][n]['rss_saved_over_bf16_weight_bytes']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
