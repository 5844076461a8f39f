"""Turns a run into figures: the summary dict that goes into the JSON
report, the printed table, and the JSON file itself; and the same for a
--speculative pair of stacks."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import asdict
from pathlib import Path

from bench.baselines import BaselineResult, compare_outputs, describe
from bench.client import RequestResult, RunResult
from bench.stats import Distribution, inter_token_latencies, throughput_timeline, tpot, ttft

MS = 1000.0
LATENCY_FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")


def output_tokens(r: RequestResult) -> int:
    # An OpenAI stream carries no token ids: its usage counts them.
    return len(r.output_ids) or r.completion_tokens


def request_record(r: RequestResult) -> dict:
    """Everything measured about one request; times in seconds from the
    run's start, rounded to the microsecond to keep the file readable."""
    n = output_tokens(r)
    return {
        "index": r.index, "request_id": r.request_id, "status": r.status, "error": r.error,
        "finish_reason": r.finish_reason, "prompt_len": r.prompt_len, "max_tokens": r.max_tokens,
        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "output_tokens": n,
        "cached_prompt_tokens": r.cached_prompt_tokens, "session": r.session, "turn": r.turn,
        "arrival_s": _round(r.arrival_s), "send_s": _round(r.send_s), "end_s": _round(r.end_s),
        "ttft_s": _round(ttft(r.send_s, r.chunk_times)), "tpot_s": _round(tpot(r.send_s, r.chunk_times, n)),
        "e2e_s": _round(r.end_s - r.send_s),
        "chunk_times_s": [_round(t) for t in r.chunk_times], "chunk_tokens": list(r.chunk_tokens),
        # Greedy token ids (gRPC only), so that two runs' outputs can be compared.
        "output_ids": list(r.output_ids),
    }


def summarize(run: RunResult) -> dict:
    ok = [r for r in run.results if r.ok]
    latencies: dict[str, list[float]] = {k: [] for k in LATENCY_FIGURES}
    token_events: list[tuple[float, int]] = []
    for r in ok:
        n = output_tokens(r)
        if (v := ttft(r.send_s, r.chunk_times)) is not None:
            latencies["ttft_ms"].append(v)
        if (v := tpot(r.send_s, r.chunk_times, n)) is not None:
            latencies["tpot_ms"].append(v)
        latencies["itl_ms"].extend(inter_token_latencies(r.chunk_times, r.chunk_tokens))
        latencies["e2e_ms"].append(r.end_s - r.send_s)
        latencies["queue_ms"].append(r.send_s - r.arrival_s)
        token_events.extend(zip(r.chunk_times, r.chunk_tokens))
    duration = run.duration_s
    out_tokens = sum(output_tokens(r) for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_prompt_tokens for r in ok)
    bucket_s, timeline = throughput_timeline(token_events, duration)
    per_sec = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(run.results),
        "completed": len(ok),
        "rejected": sum(r.status == "rejected" for r in run.results),
        "failed": sum(r.status == "failed" for r in run.results),
        "duration_s": duration,
        "request_throughput": per_sec(len(ok)),
        "output_throughput": per_sec(out_tokens),
        "total_token_throughput": per_sec(out_tokens + prompt_tokens),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "cached_prompt_tokens": cached,
        "cached_prompt_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
        **{k: asdict(Distribution.of(v).scaled(MS)) for k, v in latencies.items()},
        "timeline": {"bucket_s": bucket_s, "output_tokens_per_s": timeline},
        **({"turns": summarize_turns(ok)} if any(r.session is not None for r in run.results) else {}),
    }


def summarize_turns(ok: list[RequestResult]) -> dict:
    """Multi-turn: per turn, and over turns >= 2 (those with a history to
    reuse), the prompt tokens the server computed (prompt - cached; a
    preempted request's recompute is not in it: see the server figures)
    and the mean TTFT."""

    def figures(rs: list[RequestResult]) -> dict:
        ttfts = [v for r in rs if (v := ttft(r.send_s, r.chunk_times)) is not None]
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_prompt_tokens for r in rs)
        return {"requests": len(rs), "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                "computed_prompt_tokens": prompt - cached,
                "ttft_mean_ms": sum(ttfts) / len(ttfts) * MS if ttfts else math.nan}

    turns = sorted({r.turn for r in ok})
    return {"per_turn": {t: figures([r for r in ok if r.turn == t]) for t in turns},
            "turns_2_on": figures([r for r in ok if r.turn >= 1])}


def baseline_record(b: BaselineResult, ours: dict, agreement: dict | None) -> dict:
    def ratio(x: float, y: float) -> float:
        return x / y if y > 0 else math.nan

    return {
        "name": b.name, "wall_s": b.wall_s, "num_requests": b.num_requests, "output_tokens": b.output_tokens,
        "output_throughput": b.output_throughput, "request_throughput": b.request_throughput,
        # ours / baseline: above 1 means we are faster on the same work.
        "ratio_output_throughput": ratio(ours["output_throughput"], b.output_throughput),
        "ratio_request_throughput": ratio(ours["request_throughput"], b.request_throughput),
        "agreement": agreement, "extra": b.extra,
    }


# A --speculative run's figures per round and per stack, in table order.
PAIR_FIGURES = ("output_throughput", "ms_per_output_token", "ttft_ms_p50", "itl_ms_p50", "tpot_ms_p50")


def pair_figures(summary: dict) -> dict:
    """One run's headline figures for --speculative. ms per output token is
    the run's wall time over its output tokens, prefills included: what a
    single stream waits per token."""
    tput = summary["output_throughput"]
    return {"output_throughput": tput, "ms_per_output_token": MS / tput if tput > 0 else math.nan,
            "ttft_ms_p50": summary["ttft_ms"]["p50"], "itl_ms_p50": summary["itl_ms"]["p50"],
            "tpot_ms_p50": summary["tpot_ms"]["p50"]}


def speculative_record(runs: list[tuple[int, str, RunResult]], acceptance: dict, sources_equal: bool | None,
                       method: str = "ngram") -> dict:
    """--speculative: each run (round, stack "off" or the method's name)
    with its figures, summary and requests; each stack's medians over the
    rounds; speculating / off output throughput; the speculating
    scheduler's acceptance figures; and the greedy outputs of each round
    compared between the stacks (sources_equal: whether both generated the
    same copy prompts, None for other workloads)."""
    records = []
    for r, name, run in runs:
        summary = summarize(run)
        records.append({"round": r, "stack": name, **pair_figures(summary), "summary": summary,
                        "requests": [request_record(x) for x in run.results]})
    median = {name: {f: statistics.median(rec[f] for rec in records if rec["stack"] == name) for f in PAIR_FIGURES}
              for name in ("off", method)}
    off, on = median["off"]["output_throughput"], median[method]["output_throughput"]
    return {"runs": records, "median": median, "ratio_output_throughput": on / off if off > 0 else math.nan,
            "acceptance": acceptance, "greedy": _pair_agreement(runs, sources_equal, method)}


def _pair_agreement(runs: list[tuple[int, str, RunResult]], sources_equal: bool | None, method: str) -> dict:
    """Each round's speculating outputs against the same round's off
    outputs, on the requests both completed."""
    by_run = {(r, name): {x.index: x.output_ids for x in run.results if x.ok} for r, name, run in runs}
    compared, mismatches = 0, []
    for r in sorted({r for r, _, _ in runs}):
        off, on = by_run[(r, "off")], by_run[(r, method)]
        both = sorted(off.keys() & on.keys())
        compared += len(both)
        differ = compare_outputs(both, [off[i] for i in both], [on[i] for i in both])
        mismatches += [f"round {r}: {describe(m)}" for m in differ]
    return {"compared": compared, "identical": compared - len(mismatches), "mismatches": mismatches[:20],
            "copy_sources_equal": sources_equal, "equal": not mismatches and sources_equal is not False}


def format_table(report: dict) -> str:
    s, wl, cfg = report["summary"], report["workload"], report["config"]
    lines = []

    def title(text: str) -> None:
        lines.append(f"{' ' + text + ' ':=^64}")

    def row(label: str, value: object) -> None:
        lines.append(f"{label:<44}{value:>20}")

    title("llmsched serving benchmark")
    row("Workload", f"{wl['name']} ({report['mode']})")
    lines.extend(_prompts_note(wl))
    row("Model", Path(cfg["model"]).name)  # a checkpoint path would overflow the column
    row("Requests: completed / total", f"{s['completed']} / {s['num_requests']}")
    row("Rejected (RESOURCE_EXHAUSTED)", s["rejected"])
    row("Failed", s["failed"])
    row("Duration (s)", f"{s['duration_s']:.2f}")
    row("Request throughput (req/s)", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}")
    row("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}")
    row("Prompt / output tokens", f"{s['total_prompt_tokens']} / {s['total_output_tokens']}")
    row("Cached prompt tokens", f"{s['cached_prompt_tokens']} ({s['cached_prompt_fraction']:.1%})")
    title("latency (ms)")
    lines.append(f"{'':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>12}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
                       ("queue_ms", "client q")):
        d = s[key]
        lines.append(f"{label:<12}" + "".join(f"{_num(d[k]):>10}" for k in ("mean", "p50", "p90", "p99"))
                     + f"{_num(d['max']):>12}")
    if turns := s.get("turns"):
        title("multi-turn (turn 1 = the first)")
        lines.append(f"{'turn':<12}{'requests':>10}{'prompt':>10}{'cached':>10}{'computed':>10}{'TTFT ms':>12}")
        for label, t in [*((str(k + 1), v) for k, v in turns["per_turn"].items()), (">= 2", turns["turns_2_on"])]:
            lines.append(f"{label:<12}{t['requests']:>10}{t['prompt_tokens']:>10}{t['cached_prompt_tokens']:>10}"
                         f"{t['computed_prompt_tokens']:>10}{_num(t['ttft_mean_ms']):>12}")
    server = report.get("server") or {}
    if server.get("after"):
        title("server")
        row("Preemptions during run", server.get("preemptions", "?"))
        if server.get("after", {}).get("num_host_kv_blocks"):
            row("Preemptions by swap / recompute", f"{server.get('preemptions_swap', 0):.0f} / "
                f"{server.get('preemptions_recompute', 0):.0f}")
            row("Prefix hits, device / host tier (tokens)", f"{server.get('prefix_hit_tokens_device', 0):.0f} / "
                f"{server.get('prefix_hit_tokens_host', 0):.0f}")
            row("Blocks swapped out / in", f"{server.get('swapped_blocks_out', 0):.0f} / "
                f"{server.get('swapped_blocks_in', 0):.0f}")
        row("Tokens recomputed after a KV loss", f"{server.get('recomputed_tokens', 0):.0f}")
        row("KV blocks held after drain (must be 0)", server.get("kv_blocks_held_after", "?"))
        for key, label in (("p6_kv_utilisation", "P6 KV utilisation (tokens held / slots)"),
                           ("p7_executor_idle_fraction", "P7 executor idle fraction between steps")):
            value = server.get(key)
            row(label, "n/a (needs --launch)" if value is None else f"{value:.3f}")
    if report.get("baselines"):
        title("baselines (same run; ratio = ours / baseline)")
        lines.append(f"{'':<12}{'wall s':>10}{'out tok/s':>12}{'ratio':>10}{'greedy agreement':>20}")
        lines.append(f"{'ours':<12}{s['duration_s']:>10.2f}{s['output_throughput']:>12.1f}{'1.00':>10}{'':>20}")
        for b in report["baselines"]:
            agree = b.get("agreement") or {}
            agree_text = f"{agree.get('identical', '?')}/{agree.get('compared', '?')}"
            lines.append(f"{b['name']:<12}{b['wall_s']:>10.2f}{b['output_throughput']:>12.1f}"
                         f"{_num(b['ratio_output_throughput'], 2) + 'x':>10}{agree_text:>20}")
        if report["mode"] != "offline":
            lines.append("note: baselines run offline; the ratio compares them with an online run")
    check = report.get("correctness") or {}
    for name, c in (check.get("per_baseline") or {}).items():
        if c["mismatches"]:
            lines.append(f"!!! GREEDY MISMATCH vs {name} on {len(c['mismatches'])} of {c['checked']} checked requests")
    lines.append("=" * 64)
    return "\n".join(lines)


def format_speculative(report: dict) -> str:
    """The --speculative table: each round of each stack, each stack's
    medians, their ratio, the mean acceptance length and the greedy
    comparison."""
    sp, wl, cfg = report["speculative"], report["workload"], report["config"]
    acc, greedy = sp["acceptance"], sp["greedy"]
    lines = []

    def row(label: str, value: object) -> None:
        lines.append(f"{label:<44}{value:>20}")

    def figures_row(label: str, f: dict) -> None:
        lines.append(f"{label:<14}" + "".join(f"{_num(f[k], 2 if k == 'ms_per_output_token' else 1):>10}"
                                              for k in PAIR_FIGURES))

    method = sp["method"]
    lines.append(f"{' llmsched serving benchmark, speculative (' + method + ', K=' + str(sp['tokens']) + ') ':=^64}")
    concurrency = f", max concurrency {cfg['max_concurrency']}" if cfg["max_concurrency"] else ""
    lines.append(f"{'Workload':<20}{wl['name'] + ' (' + report['mode'] + concurrency + ')':>44}")
    lines.extend(_prompts_note(wl))
    row("Model", Path(cfg["model"]).name)
    lines.append(f"{'':<14}{'out tok/s':>10}{'ms/token':>10}{'TTFT p50':>10}{'ITL p50':>10}{'TPOT p50':>10}")
    for run in sp["runs"]:
        figures_row(f"r{run['round']} {run['stack']}", run)
    for name in ("off", method):
        figures_row(f"median {name}", sp["median"][name])
    row(f"{method} / off, output tok/s", _num(sp["ratio_output_throughput"], 2) + "x")
    row("Mean acceptance length", _num(acc["mean_acceptance_length"], 2))
    row("Drafts accepted / proposed", f"{acc['accepted']:.0f} / {acc['drafted']:.0f}")
    row("Greedy outputs identical on both stacks", f"{greedy['identical']} / {greedy['compared']}")
    if greedy["copy_sources_equal"] is False:
        lines.append("!!! the stacks generated different copy prompts")
    lines.append("=" * 64)
    return "\n".join(lines)


def speculative_summary_line(report: dict) -> str:
    """One line to paste: the medians of both stacks, the ratio, the mean
    acceptance length and whether the greedy outputs are identical."""
    sp, wl = report["speculative"], report["workload"]
    off, on = sp["median"]["off"], sp["median"][sp["method"]]
    return (f"speculative {sp['method']} K={sp['tokens']} vs off, {wl['name']} x{len(sp['runs'][0]['requests'])}, "
            f"{sp['rounds']} round(s), medians: {_num(off['output_throughput'])} -> {_num(on['output_throughput'])} "
            f"output tok/s ({_num(sp['ratio_output_throughput'], 2)}x), {_num(off['ms_per_output_token'], 2)} -> "
            f"{_num(on['ms_per_output_token'], 2)} ms/token; mean acceptance length "
            f"{_num(sp['acceptance']['mean_acceptance_length'], 2)}; greedy outputs identical: {sp['greedy']['equal']}")


def without_nan(obj: object) -> object:
    """NaN (an empty distribution, a zero-time ratio) becomes null: NaN is
    not JSON, and jq or a browser would refuse the file."""
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {k: without_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [without_nan(v) for v in obj]
    return obj


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(without_nan(report), indent=1, allow_nan=False) + "\n")


def _prompts_note(workload: dict) -> list[str]:
    """How a workload's prompts were built, when its params say (copy),
    wrapped under the table's width."""
    return textwrap.wrap("Prompts: " + workload["prompts"], 64) if "prompts" in workload else []


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def _round(v: float | None) -> float | None:
    if v is None or math.isnan(v):
        return None
    return round(v, 6)
