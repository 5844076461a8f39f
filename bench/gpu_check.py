"""make gpu-check: everything that needs a GPU, in one run of under 9 minutes.

    python -m bench.gpu_check [--out-dir bench_results/gpu] [--num-requests 64]

1. the CUDA-marked tests (pytest -m gpu), junit XML in the output folder;
2. P8, the paged-attention kernel benchmark (python -m bench.kernels);
3. end to end: python -m bench --launch on bench-small with the Triton
   backend, CUDA graphs on (auto) and off, one JSON report each;
4. P13, tensor parallelism over NCCL: python -m bench.tensor_parallel,
   TP=2 against TP=1 on bench-small, only where torch sees at least two
   CUDA devices; elsewhere summary.json records it as skipped, and why;
5. the fused-MoE and MLA-decode kernels against their torch paths and a
   dense GEMM of the same FLOPs, and W4A16 and NVFP4 experts against bf16
   ones in the fused-MoE kernel (python -m bench.moe_kernels --quick);
6. the simulator's calibration on this GPU (python -m simulator calibrate,
   bench-small, Triton): a measured profile, profile_bench-small.json,
   which replaces a roofline estimate for what this GPU runs; summary.json
   carries its held-out step-time error;
7. the quantized-weight GEMMs, FP8 block-scaled, int4 (group 128) and
   NVFP4, against torch's bf16 GEMM of the same shape at batch 1 and 64
   (python -m bench.quant_gemm): TFLOP/s, GB/s and the ratio to bf16;
8. an end-to-end FP8-block run of a DeepSeek-shaped model
   (python -m bench.fp8_deepseek, Triton): a random 76M-parameter
   DeepSeek-V3 (MLA, 16 experts top-4) served from its FP8 128 x 128 block
   copy and from the same weights dequantized to bf16, --num-requests
   greedy requests each: output tok/s, ms/token, the FP8 / bf16 ratios,
   weight bytes and on how many requests the greedy tokens agree;
9. speculative decoding end to end (python -m bench --workload copy
   --speculative 4, bench-small, Triton): the copy workload's single
   stream with n-gram drafts and without, one round each: the ratio, the
   mean acceptance length and whether the greedy outputs are equal;
10. the same with DeepSeek-V3's multi-token-prediction layer
   (python -m bench.mtp_deepseek, Triton): a random DeepSeek-V3 at part 8's
   shape saved with one MTP layer, K=2. Its MTP weights are random, so
   this checks the path on the GPU (greedy outputs equal, the MTP latent
   pool under the Triton MLA kernels) and what an MTP step costs, not a
   trained layer's acceptance.
11. what batch-invariant mode costs (python -m bench.batch_invariant,
   bench-small, Triton, one round of 64 streams, EXECUTOR_BATCH_INVARIANT
   on and off): the on/off throughput ratio, and whether the mode's stack
   gave every request the same tokens. Where this GPU's GEMMs or kernels
   do not keep the mode, its stack refuses to start (the start-up
   self-test) and the part fails with that line in its log.
12. the multi-LoRA shrink and expand kernels (python -m bench.lora_kernels
   --quick) through the model's LoRA layer at Llama-3-8B's q/k/v, ranks 8,
   16 and 64 in 8 slots: agreement with the torch path, and the
   milliseconds of a batch of base tokens only against the bare GEMM (what
   a request with no adapter pays) and of a mixed-adapter batch.

Each part has its own time limit, so one that hangs cannot eat the others'
time; summary.json records what each part did. Exits 2 at once, saying so,
when torch sees no CUDA device, and 1 when any part fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Seconds per part; the sum stays under 9 minutes. pytest_gpu includes the
# two-GPU tensor-parallel tests (two service launches) where they run. The
# quantized GEMMs' 30 s came out of P8 (about a minute on an H100) and P13.
# The FP8 DeepSeek run's 60 s (build and quantize ~76M parameters on the
# host, two launches, 2 rounds each; estimated, not measured) took 10 s
# each from pytest_gpu, P8, both bench-small end-to-end runs (one launch
# and 64 requests each), P13 (skipped on one GPU) and the --quick kernels.
# The speculative run's 45 s (two launches, 8 copy prompts built on each,
# one round of 8 x 100 tokens on each; estimated, not measured) took 15 s
# from pytest_gpu, 10 s from each bench-small end-to-end run, and 5 s each
# from the calibration and the FP8 DeepSeek run. The MTP run's 35 s (build
# ~76M parameters on the host, two launches, shorter copy prompts) and the
# batch-invariant run's 40 s (two launches, one round of 64 streams on
# each), both estimated, not measured, took 15 s from pytest_gpu, 15 s
# from P8, 10 s from each bench-small end-to-end run, 5 s each from the
# kernels, the calibration and the n-gram run, and 10 s from the FP8
# DeepSeek run. The LoRA kernels' 20 s (compiling two kernels in a few
# variants, 2 batch sizes; estimated, not measured) took 10 s from P8 and 5 s
# from each bench-small end-to-end run. The quantized experts' 10 s in the
# kernels part (4 more fused-MoE variants to compile; estimated, not
# measured) came from P13, which one GPU skips.
LIMITS = {"pytest_gpu": 100, "kernels_p8": 50, "e2e_graphs_auto": 35, "e2e_graphs_off": 35,
          "tensor_parallel_p13": 40, "moe_mla_kernels": 45, "calibrate_sim": 25, "quant_gemm": 30,
          "fp8_deepseek_e2e": 45, "speculative_e2e": 40, "speculative_mtp_e2e": 35, "batch_invariant_e2e": 40,
          "lora_kernels": 20}
CALIBRATED_PROFILE = "profile_bench-small.json"
# What summary.json keeps of each bench.moe_kernels row.
KERNEL_KEYS = ("format", "tokens", "batch", "context", "ms", "triton_vs_dense", "vs_bf16", "ok")
# P13 needs this many devices (one per rank).
P13_DEVICES = 2


def skipped_parts(device_count: int) -> dict[str, str]:
    """Parts this machine cannot run, with why."""
    if device_count < P13_DEVICES:
        return {"tensor_parallel_p13": f"needs at least {P13_DEVICES} CUDA devices for TP=2 over NCCL; "
                                       f"torch sees {device_count}"}
    return {}


def cuda_device() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def parts(out: Path, num_requests: int) -> dict[str, list[str]]:
    e2e = [sys.executable, "-m", "bench", "--launch", "--model", "bench-small", "--num-requests", str(num_requests),
           "--executor-env", "EXECUTOR_ATTENTION_BACKEND=triton", "--no-plots", "--no-progress"]
    return {
        "pytest_gpu": [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests",
                       f"--junitxml={out / 'pytest_gpu.xml'}"],
        "kernels_p8": [sys.executable, "-m", "bench.kernels", "--out", str(out / "kernels_p8.json")],
        "e2e_graphs_auto": e2e + ["--executor-env", "EXECUTOR_CUDA_GRAPHS=auto", "--out", str(out / "e2e_graphs_auto.json")],
        "e2e_graphs_off": e2e + ["--executor-env", "EXECUTOR_CUDA_GRAPHS=off", "--out", str(out / "e2e_graphs_off.json")],
        # Graphs off for both sizes: a group runs decode steps eagerly.
        "tensor_parallel_p13": [sys.executable, "-m", "bench.tensor_parallel", "--size", str(P13_DEVICES),
                                "--num-requests", str(num_requests), "--rounds", "1", "--executor-env",
                                "EXECUTOR_CUDA_GRAPHS=off", "--out", str(out / "tensor_parallel_p13.json")],
        "moe_mla_kernels": [sys.executable, "-m", "bench.moe_kernels", "--quick", "--out",
                            str(out / "moe_mla_kernels.json")],
        # Two passes over the grid: GPU steps take milliseconds, loading
        # bench-small most of the time.
        "calibrate_sim": [sys.executable, "-m", "simulator", "calibrate", "--model", "bench-small", "--rounds", "2",
                          "--executor-env", "EXECUTOR_ATTENTION_BACKEND=triton", "--out",
                          str(out / CALIBRATED_PROFILE)],
        "quant_gemm": [sys.executable, "-m", "bench.quant_gemm", "--out", str(out / "quant_gemm.json")],
        "fp8_deepseek_e2e": [sys.executable, "-m", "bench.fp8_deepseek", "--attention-backend", "triton",
                             "--prompts", str(num_requests), "--rounds", "2", "--out",
                             str(out / "fp8_deepseek_e2e.json")],
        "speculative_e2e": [sys.executable, "-m", "bench", "--launch", "--model", "bench-small", "--workload", "copy",
                            "--speculative", "4", "--rounds", "1", "--executor-env",
                            "EXECUTOR_ATTENTION_BACKEND=triton", "--no-plots", "--no-progress", "--out",
                            str(out / "speculative_e2e.json")],
        "speculative_mtp_e2e": [sys.executable, "-m", "bench.mtp_deepseek", "--", "--rounds", "1",
                                "--copy-source-tokens", "60", "--copy-output-tokens", "40", "--executor-env",
                                "EXECUTOR_ATTENTION_BACKEND=triton", "--no-plots", "--no-progress", "--out",
                                str(out / "speculative_mtp_e2e.json")],
        "batch_invariant_e2e": [sys.executable, "-m", "bench.batch_invariant", "--model", "bench-small", "--rounds",
                                "1", "--streams", str(num_requests), "--max-len", "2048", "--executor-env",
                                "EXECUTOR_ATTENTION_BACKEND=triton", "--out", str(out / "batch_invariant_e2e.json")],
        "lora_kernels": [sys.executable, "-m", "bench.lora_kernels", "--quick", "--out",
                         str(out / "lora_kernels.json")],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench_results" / "gpu")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in each end-to-end run")
    args = ap.parse_args(argv)

    device = cuda_device()
    if device is None:
        print("gpu-check: torch sees no CUDA device (torch.cuda.is_available() is False); "
              "run it on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device_count = torch.cuda.device_count()
    summary: dict = {"device": device, "device_count": device_count, "parts": {}}
    failed = []
    skipped = skipped_parts(device_count)
    for name, cmd in parts(args.out_dir, args.num_requests).items():
        if name in skipped:
            summary["parts"][name] = {"command": cmd, "skipped": skipped[name]}
            print(f"gpu-check: {name}: skipped: {skipped[name]}", flush=True)
            continue
        print(f"gpu-check: {name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        log = args.out_dir / f"{name}.log"
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=LIMITS[name]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        took = time.monotonic() - t0
        summary["parts"][name] = {"command": cmd, "returncode": rc, "seconds": round(took, 1), "log": str(log)}
        print(f"gpu-check: {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {took:.0f} s, log {log}", flush=True)
        if rc != 0:
            failed.append(name)
    for name in ("e2e_graphs_auto", "e2e_graphs_off"):
        report = args.out_dir / f"{name}.json"
        if report.exists():
            s = json.loads(report.read_text())["summary"]
            summary["parts"][name]["output_throughput"] = s["output_throughput"]
            summary["parts"][name]["tpot_ms_p50"] = s["tpot_ms"]["p50"]
            print(f"gpu-check: {name}: {s['output_throughput']:.0f} output tok/s, TPOT p50 {s['tpot_ms']['p50']:.2f} ms")
    if summary["parts"]["tensor_parallel_p13"].get("returncode") == 0:
        r = json.loads((args.out_dir / "tensor_parallel_p13.json").read_text())
        summary["parts"]["tensor_parallel_p13"].update(
            median_output_throughput=r["median_output_throughput"], ratio=r["ratio"],
            greedy_agreement=r["greedy_agreement"])
        print(f"gpu-check: tensor_parallel_p13: TP{P13_DEVICES}/TP1 output throughput {r['ratio']:.2f}x")
    kernels = args.out_dir / "moe_mla_kernels.json"
    if summary["parts"]["moe_mla_kernels"].get("returncode") in (0, 1) and kernels.exists():
        r = json.loads(kernels.read_text())
        summary["parts"]["moe_mla_kernels"].update({
            kind: [{k: row[k] for k in KERNEL_KEYS if k in row} for row in r.get(kind, [])]
            for kind in ("fused_moe", "quantized_moe", "mla_decode")})
    gemms = args.out_dir / "quant_gemm.json"
    if summary["parts"]["quant_gemm"].get("returncode") in (0, 1) and gemms.exists():
        r = json.loads(gemms.read_text())
        summary["parts"]["quant_gemm"]["gemms"] = [
            {"m": row["m"], "n": row["n"], "k": row["k"],
             **{name: {key: cell[key] for key in ("ms", "tflops", "gb_per_s", "vs_bf16", "ok") if key in cell}
                for name, cell in row["kernels"].items()}} for row in r["gemms"]]
        for row in r["gemms"]:
            print(f"gpu-check: quant_gemm M={row['m']} [{row['n']}, {row['k']}]: " + ", ".join(
                f"{name} {cell['tflops']:.1f} TFLOP/s {cell['gb_per_s']:.0f} GB/s ({cell['vs_bf16']:.2f}x bf16 time)"
                for name, cell in row["kernels"].items()))
    fp8_deepseek = args.out_dir / "fp8_deepseek_e2e.json"
    if fp8_deepseek.exists():
        r = json.loads(fp8_deepseek.read_text())
        part = summary["parts"]["fp8_deepseek_e2e"]
        for name, result in r["checkpoints"].items():
            part[name] = {k: result[k] for k in ("output_tok_per_s", "ms_per_token", "weight_bytes", "quantization")
                          if k in result}
            if result["errors"]:
                part[name]["errors"] = result["errors"][:3]
        if "ratios" in r:
            a = r["agreement"]
            part.update(fp8_over_bf16=r["ratios"], greedy_identical=a["identical"], greedy_compared=a["compared"])
            print(f"gpu-check: fp8_deepseek_e2e: FP8/bf16 output tok/s {r['ratios']['output_tok_per_s']:.2f}x, "
                  f"weight bytes {r['ratios']['weight_bytes']:.2f}x, greedy tokens identical on "
                  f"{a['identical']} of {a['compared']}")
    for name in ("speculative_e2e", "speculative_mtp_e2e"):
        if not (args.out_dir / f"{name}.json").exists():
            continue
        sp = json.loads((args.out_dir / f"{name}.json").read_text())["speculative"]
        method = sp.get("method", "ngram")
        summary["parts"][name].update(
            ratio_output_throughput=sp["ratio_output_throughput"],
            ms_per_token={stack: sp["median"][stack]["ms_per_output_token"] for stack in ("off", method)},
            mean_acceptance_length=sp["acceptance"]["mean_acceptance_length"], greedy_equal=sp["greedy"]["equal"])
        print(f"gpu-check: {name}: {method}/off output tok/s {sp['ratio_output_throughput']:.2f}x, mean "
              f"acceptance length {sp['acceptance']['mean_acceptance_length']:.2f}, greedy equal {sp['greedy']['equal']}")
    invariant = args.out_dir / "batch_invariant_e2e.json"
    if invariant.exists():
        r = json.loads(invariant.read_text())
        summary["parts"]["batch_invariant_e2e"].update(
            on_over_off=r["median_ratio"], tokens_per_s=r["tokens_per_s"], stable_requests=r["stable_requests"])
        print(f"gpu-check: batch_invariant_e2e: on/off output tok/s {r['median_ratio']:.2f}x, requests with the "
              f"same tokens every round: on {r['stable_requests']['on']}")
    lora = args.out_dir / "lora_kernels.json"
    if summary["parts"]["lora_kernels"].get("returncode") in (0, 1) and lora.exists():
        rows = json.loads(lora.read_text())["lora"]
        summary["parts"]["lora_kernels"]["lora"] = [
            {k: row[k] for k in ("tokens", "ms", "base_only_over_no_lora", "mixed_triton_over_base", "ok")}
            for row in rows]
        for row in rows:
            print(f"gpu-check: lora_kernels {row['tokens']} tokens: base tokens only "
                  f"{row['base_only_over_no_lora']:.2f}x the bare GEMM, mixed adapters "
                  f"{row['mixed_triton_over_base']:.2f}x base; agree={row['ok']}")
    profile = args.out_dir / CALIBRATED_PROFILE
    if summary["parts"]["calibrate_sim"].get("returncode") == 0 and profile.exists():
        fit = json.loads(profile.read_text())["fit"]
        summary["parts"]["calibrate_sim"].update(profile=str(profile), model=fit.get("model"),
                                                 holdout_mape_points_pct=fit["holdout_mape_points_pct"])
        print(f"gpu-check: calibrate_sim: held-out step-time MAPE {fit['holdout_mape_points_pct']:.1f}%, "
              f"profile {profile}")
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"gpu-check: wrote {args.out_dir / 'summary.json'}; {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
