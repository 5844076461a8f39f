"""P20: an FP8 checkpoint with block scales against the same model in bf16,
measured in the same run (docs/performance.md, P20).

    python -m bench.quantized                       # ~150M-parameter Llama, 3 rounds
    python -m bench.quantized --hidden 256 --layers 2 --vocab 2048 --rounds 1 --tokens 8 --streams 4

The model is a random LlamaForCausalLM saved by transformers in bf16
(bench/load_memory.py), and a copy with every decoder linear in FP8 blocks
of 128 x 128 (quantization.quantize_fp8_blocks). Both are served in bf16
(EXECUTOR_DTYPE=bfloat16): the FP8 one keeps its FP8 weights.

- **Memory:** each checkpoint is loaded in a fresh interpreter as the
  executor loads it. The figures are the loaded weight bytes, and the
  resident memory after loading (VmRSS).
- **Decode:** both services are launched for each checkpoint in turn, in
  interleaved rounds.
  - One greedy stream: ms per output token, from the first token to the
    last.
  - `--streams` concurrent streams: output tokens per second, from the
    first request sent to the last token.
- Medians over rounds; the ratios are FP8 / bf16.
"""

from __future__ import annotations

import argparse
import json
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
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def linear_bytes(checkpoint: Path) -> int:
    """Bytes of the decoder linears' tensors in the checkpoint (FP8 weights
    and their scales, or bf16 weights): what those layers hold in memory."""
    from safetensors import safe_open

    total = 0
    for f in checkpoint.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if any(f".{p}.weight" in name for p in LINEARS):
                    t = st.get_tensor(name)
                    total += t.numel() * t.element_size()
    return total


def decode_figures(model: str, tokens: int, streams: int, threads: int, vocab: int) -> dict:
    """Launches both services on `model` in bf16; one stream's ms per token
    and `streams` streams' output tok/s."""
    from llmsched.launch import launch

    services = launch(executor_env={"EXECUTOR_MODEL": model, "EXECUTOR_DTYPE": "bfloat16",
                                    "EXECUTOR_NUM_THREADS": str(threads), "EXECUTOR_NUM_KV_BLOCKS": "2048"}).start()
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
    p.add_argument("--out", type=Path, default=Path("bench_results") / "quantized.json")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        bf16 = make_checkpoint(Path(tmp) / "bf16", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                               dtype="bfloat16", shard="200MB")
        # The services need a real tokenizer (the scheduler's, the constraint
        # matchers'); requests send token ids, so any will do.
        shutil.copy(STORIES260K / "tokenizer.json", bf16 / "tokenizer.json")
        fp8 = write_fp8(bf16, Path(tmp) / "fp8")
        paths = {"bf16": bf16, "fp8": fp8}
        memory = {name: measure(path, "bfloat16") for name, path in paths.items()}
        for name, path in paths.items():
            memory[name]["linears_mb"] = linear_bytes(path) / 2**20
        runs: dict[str, list[dict]] = {"bf16": [], "fp8": []}
        for r in range(args.rounds):
            for name in (("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16")):  # interleaved, order alternating
                runs[name].append(decode_figures(str(paths[name]), args.tokens, args.streams, args.num_threads,
                                                 args.vocab))

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    report = {"config": {k: str(v) for k, v in vars(args).items()}, "block": list(BLOCK), "memory": memory,
              "runs": runs, "ratios": {}}
    weights = {n: m["shard_mb"] for n, m in memory.items()}
    rss = {n: m["rss_after_mb"] for n, m in memory.items()}
    linears = {n: m["linears_mb"] for n, m in memory.items()}
    report["ratios"] = {
        "weight_bytes": weights["fp8"] / weights["bf16"],
        "linear_bytes": linears["fp8"] / linears["bf16"],
        "rss_saved_over_bf16_weight_bytes": (rss["bf16"] - rss["fp8"]) / weights["bf16"],
        "one_stream_ms_per_token": median("fp8", "one_stream_ms_per_token") / median("bf16", "one_stream_ms_per_token"),
        "many_streams_tok_per_s": median("fp8", "many_streams_tok_per_s") / median("bf16", "many_streams_tok_per_s"),
    }
    params = weights["bf16"] * 2**20 / 2
    print(f"P20: Llama of {params / 1e6:.0f}M parameters, FP8 blocks {list(BLOCK)} against bf16, both served in bf16; "
          f"{args.rounds} rounds, medians")
    print(f"{'':34} {'bf16':>10} {'fp8':>10} {'fp8/bf16':>9}")
    print(f"{'weights (MiB)':34} {weights['bf16']:10.1f} {weights['fp8']:10.1f} {report['ratios']['weight_bytes']:8.2f}x")
    print(f"{'  of which decoder linears (MiB)':34} {linears['bf16']:10.1f} {linears['fp8']:10.1f} "
          f"{report['ratios']['linear_bytes']:8.2f}x")
    print(f"{'RSS after load (MiB)':34} {rss['bf16']:10.1f} {rss['fp8']:10.1f} "
          f"{rss['fp8'] / rss['bf16']:8.2f}x")
    for key, label in (("one_stream_ms_per_token", "1 stream, ms/token"),
                       ("many_streams_tok_per_s", f"{args.streams} streams, output tok/s")):
        print(f"{label:34} {median('bf16', key):10.2f} {median('fp8', key):10.2f} {report['ratios'][key]:8.2f}x")
    print(f"RSS saved / bf16 weight bytes: {report['ratios']['rss_saved_over_bf16_weight_bytes']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
