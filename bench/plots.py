"""PNG plots of a report, when matplotlib is importable. matplotlib is not
a project dependency, so without it the benchmark says so and goes on."""

from __future__ import annotations

from pathlib import Path

CDF_FIGURES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl", "ITL"), ("e2e_s", "E2E latency"))


def write_plots(report: dict, stem: Path) -> tuple[list[Path], str | None]:
    """Writes <stem>_latency_cdf.png and <stem>_throughput.png. Returns the
    paths written and, when nothing could be drawn, why."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: skipping plots (pip install matplotlib to get them)"

    ok = [r for r in report["requests"] if r["status"] == "ok"]
    series = {
        "ttft_s": [r["ttft_s"] for r in ok if r["ttft_s"] is not None],
        "tpot_s": [r["tpot_s"] for r in ok if r["tpot_s"] is not None],
        "e2e_s": [r["e2e_s"] for r in ok if r["e2e_s"] is not None],
        "itl": _itl(ok),
    }
    written = []

    fig, axes = plt.subplots(1, len(CDF_FIGURES), figsize=(4 * len(CDF_FIGURES), 3.4))
    for ax, (key, label) in zip(axes, CDF_FIGURES):
        values = sorted(v * 1000 for v in series[key])
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_title(label)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of tokens)")
    fig.suptitle(_title(report))
    fig.tight_layout()
    path = stem.with_name(stem.name + "_latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    timeline = report["summary"]["timeline"]
    bucket, rates = timeline["bucket_s"], timeline["output_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    tok_line, = ax.plot([bucket * (i + 0.5) for i in range(len(rates))], rates, label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    # Requests in flight on a second axis: a throughput dip next to a
    # concurrency drop is the tail of the run, not a slowdown.
    ax2 = ax.twinx()
    times, inflight = _in_flight(report["requests"])
    flight_line, = ax2.step(times, inflight, where="post", color="tab:orange", alpha=0.6, label="in flight")
    ax2.set_ylabel("requests in flight")
    ax.legend(handles=[tok_line, flight_line], loc="lower center", fontsize="small")
    fig.suptitle(_title(report))
    fig.tight_layout()
    path = stem.with_name(stem.name + "_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written, None


def _itl(requests: list[dict]) -> list[float]:
    from bench.stats import inter_token_latencies

    out: list[float] = []
    for r in requests:
        out.extend(inter_token_latencies(r["chunk_times_s"], r["chunk_tokens"]))
    return out


def _in_flight(requests: list[dict]) -> tuple[list[float], list[int]]:
    events = sorted([(r["send_s"], 1) for r in requests if r["send_s"] is not None]
                    + [(r["end_s"], -1) for r in requests if r["end_s"] is not None])
    times, counts, n = [0.0], [0], 0
    for t, d in events:
        n += d
        times.append(t)
        counts.append(n)
    return times, counts


def _title(report: dict) -> str:
    return f"{report['workload']['name']} ({report['mode']}), {report['config']['model']}"
