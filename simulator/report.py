"""A simulation as a `python -m bench --out` report, key for key: the same
summary (bench.report.summarize), the same per-request records, a config
that is what `python -m bench` records for the equivalent real run, and a
server section from the simulated scheduler. Predicted and measured runs
then compare directly, and bench's plots draw either.

Where a value cannot be what a real run holds, it says what produced it:
`mode` is `simulated` (`simulated, uncalibrated roofline` with a roofline
profile), `config.endpoint` is `simulator` and `config.url` the profile,
and the server's `executor_instance_id` is the profile's label.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import traces as tr
from bench.common import environment, parse_env_pairs
from bench.report import request_record, summarize
from llmsched.v1 import scheduler_pb2 as spb
from simulator.profile import Profile
from simulator.sim import SimResult

SIMULATED = "simulated"
UNCALIBRATED = "simulated, uncalibrated roofline"


def mode_of(profile: Profile) -> str:
    return SIMULATED if profile.calibrated else UNCALIBRATED


def _server_info(result: SimResult, free_blocks: int, running: int, waiting: int, free_host: int | None = None
                 ) -> dict:
    g, p = result.profile.geometry, result.profile.provenance
    values = {
        "model": Path(str(p.get("model", ""))).name, "max_model_len": g.max_model_len, "block_size": g.block_size,
        "num_kv_blocks": g.num_kv_blocks, "num_free_kv_blocks": free_blocks, "num_running": running,
        "num_waiting": waiting, "executor_instance_id": result.profile.label,
        "num_host_kv_blocks": g.num_host_kv_blocks,
        "num_free_host_kv_blocks": g.num_host_kv_blocks if free_host is None else free_host,
        "tensor_parallel_size": int(p.get("tensor_parallel_size") or 1),
    }
    # Every field of the real ServerInfo, so the keys match a real report's.
    out = {}
    for f in spb.ServerInfo.DESCRIPTOR.fields:
        default = "" if f.type == f.TYPE_STRING else 0
        if not isinstance(getattr(spb.ServerInfo(), f.name), (bool, int, float, str, bytes)):
            default = []  # a repeated field (the LoRA adapters): bench reports it as a list
        out[f.name] = values.get(f.name, default)
    return out


def build_report(result: SimResult, bench_args: argparse.Namespace, profile_path: str,
                 scheduler_env: dict[str, str]) -> dict:
    """bench_args: what `python -m bench` would parse for the same run
    (simulator/__main__.py builds it), so config has bench's keys."""
    run, server, profile = result.run, result.server, result.profile
    summary = summarize(run)
    g = profile.geometry
    held_slots = server.kv_slots_allocated
    busy, idle = server.executor_busy_s, server.executor_idle_s
    offline = bool(getattr(bench_args, "trace_offline", False))
    config = {key: (str(v) if isinstance(v, Path) else v) for key, v in vars(bench_args).items()}
    # As python -m bench records them for the equivalent real run.
    executor_env = parse_env_pairs(bench_args.executor_env)
    executor_env.setdefault("EXECUTOR_NUM_THREADS", str(bench_args.num_threads))
    config.update(request_rate=None if offline else tr.mean_rate(result.trace), address=None, endpoint="simulator",
                  url=profile_path, executor_env=executor_env, scheduler_env=scheduler_env)
    return {
        "mode": mode_of(profile),
        "workload": {"name": "trace", **result.trace.params(), "vocab_size": g.vocab_size},
        "config": config,
        "environment": environment(int(profile.provenance.get("num_threads") or 1)),
        "started_unix": run.started_unix,
        "summary": summary,
        "server": {
            "before": _server_info(result, g.num_kv_blocks, 0, 0),
            "after": _server_info(result, server.num_free_kv_blocks, 0, 0, server.num_free_host_kv_blocks),
            "drained": True,
            "kv_blocks_held_after": g.num_kv_blocks - server.num_free_kv_blocks,
            "preemptions": server.num_preemptions,
            "p6_kv_utilisation": server.kv_tokens_held / held_slots if held_slots else None,
            "p7_executor_idle_fraction": idle / (idle + busy) if idle + busy else None,
            "executor_busy_s": busy,
            "executor_idle_s": idle,
            "prefix_hit_tokens_device": server.prefix_hit_tokens_device,
            "prefix_hit_tokens_host": server.prefix_hit_tokens_host,
            "preemptions_swap": server.num_preemptions_swap,
            "preemptions_recompute": server.num_preemptions_recompute,
            "recomputed_tokens": server.recomputed_tokens,
            "swapped_blocks_out": server.swapped_blocks_out,
            "swapped_blocks_in": server.swapped_blocks_in,
            "swap_s": server.swap_s,
        },
        "correctness": {"checked": 0, "per_baseline": {}},
        "baselines": [],
        "requests": [request_record(r) for r in run.results],
    }


def banner(profile: Profile) -> str:
    if profile.calibrated:
        return f"SIMULATED with profile {profile.label}"
    return (f"SIMULATED with an UNCALIBRATED roofline profile ({profile.label}): figures are estimates from "
            "published specs, not measurements")
