"""P6 and P7 from the services' own Prometheus counters, read before and
after the timed run: KV utilisation (tokens held / slots allocated, over
steps) and the executor's idle fraction between steps; and what the KV
tiers did (prefix hits per tier, preemptions per mode, blocks swapped,
tokens recomputed); and how many speculated tokens were accepted."""

from __future__ import annotations

import urllib.request


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Sums of every sample by metric name (labels folded together), and
    each labelled sample by its own name too (`name{label="value"}`)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
        if name_part != name:
            out[name_part] = float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def derived_figures(sched_before, sched_after, exec_before, exec_after) -> dict[str, float | None]:
    held = _delta(sched_before, sched_after, "llmsched_kv_tokens_held_total")
    slots = _delta(sched_before, sched_after, "llmsched_kv_slots_allocated_total")
    idle = _delta(exec_before, exec_after, "llmsched_executor_idle_between_steps_seconds_total")
    busy = _delta(exec_before, exec_after, "llmsched_executor_busy_seconds_total")
    def sched(name: str) -> float:
        return _delta(sched_before, sched_after, name)

    def execu(name: str) -> float:
        return _delta(exec_before, exec_after, name)

    return {
        "p6_kv_utilisation": held / slots if slots else None,
        "p7_executor_idle_fraction": idle / (idle + busy) if idle + busy else None,
        "executor_busy_s": busy,
        "executor_idle_s": idle,
        "prefix_hit_tokens_device": sched('llmsched_prefix_cache_hits_total{tier="device"}'),
        "prefix_hit_tokens_host": sched('llmsched_prefix_cache_hits_total{tier="host"}'),
        "preemptions_swap": sched('llmsched_num_preemptions_total{mode="swap"}'),
        "preemptions_recompute": sched('llmsched_num_preemptions_total{mode="recompute"}'),
        "recomputed_tokens": sched("llmsched_recomputed_tokens_total"),
        "swapped_blocks_out": execu('llmsched_executor_swapped_blocks_total{direction="out"}'),
        "swapped_blocks_in": execu('llmsched_executor_swapped_blocks_total{direction="in"}'),
        "swap_s": execu("llmsched_executor_swap_seconds_sum"),
    }


def speculative_acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """A speculating scheduler's figures between two scrapes: speculative
    steps (one per request per step that verified drafts), drafts proposed
    and accepted, and the mean acceptance length, tokens per speculative
    step: the accepted drafts plus the one token the verifying forward
    yields anyway. None when no step speculated."""
    steps = _delta(before, after, "llmsched_spec_decode_accepted_length_count")
    accepted = _delta(before, after, "llmsched_spec_decode_accepted_tokens_total")
    return {"steps": steps, "accepted": accepted,
            "drafted": _delta(before, after, "llmsched_spec_decode_draft_tokens_total"),
            "mean_acceptance_length": 1 + accepted / steps if steps else None}
