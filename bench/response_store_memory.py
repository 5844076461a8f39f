"""The Responses store's memory bound (issue 35): storing 10,000 responses
under a cap of 1,000 keeps the gateway's RSS flat (within 10%).

    python -m bench.response_store_memory --responses 10000 --cap 1000

One set of services with the gateway at GATEWAY_RESPONSES_STORE_MAX_ENTRIES
= --cap, on a small built-in model. --responses `store: true` Responses
calls (each its own short input, greedy, --max-output-tokens) go out from
--threads threads, each on its own kept-alive connection, in batches of
--batch (default --cap); after each batch, with nothing in flight, the
gateway's RSS (VmRSS) is read. The figure is the growth after the first
batch, which fills the store: (largest RSS after the first batch - RSS
after the first batch) / RSS after the first batch. Then every id is
looked up with GET /v1/responses/{id}: exactly --cap must still be stored,
the first sent must be gone (404) and every id of the last batch there
(exit 1 if not). Writes bench_results/response_store_memory.json.

A control with no eviction, to see what the store holds without its cap:
`--cap 10000 --batch 1000` (every id is then still stored).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import environment
from bench.http_json import JsonConnection
from llmsched.launch import launch


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


class Client:
    """One kept-alive connection per thread."""

    def __init__(self, url: str):
        self.url = url
        self._local = threading.local()

    def conn(self) -> JsonConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = JsonConnection(self.url)
        return conn

    def store_one(self, model: str, index: int, max_output_tokens: int) -> str:
        body = {"model": model, "input": f"Request {index}: tell me a story about a dog.",
                "max_output_tokens": max_output_tokens, "temperature": 0, "store": True}
        status, answer = self.conn().post("/v1/responses", body)
        if status != 200:
            raise RuntimeError(f"POST /v1/responses: HTTP {status}: {answer}")
        return answer["id"]

    def is_stored(self, response_id: str) -> bool:
        status, answer = self.conn().get(f"/v1/responses/{response_id}")
        if status not in (200, 404):
            raise RuntimeError(f"GET /v1/responses/{response_id}: HTTP {status}: {answer}")
        return status == 200


def growth_after_full(samples: list[dict]) -> float:
    """(largest RSS once the store was full - RSS when it first was) / the latter."""
    full = samples[0]["rss_kib"]
    return (max(s["rss_kib"] for s in samples) - full) / full


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.response_store_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random", help="a built-in model or a checkpoint directory")
    p.add_argument("--responses", type=int, default=10_000, help="stored responses to create")
    p.add_argument("--cap", type=int, default=1000, help="GATEWAY_RESPONSES_STORE_MAX_ENTRIES")
    p.add_argument("--batch", type=int, default=None, help="responses between two RSS readings (default: --cap)")
    p.add_argument("--threads", type=int, default=16, help="calls in flight")
    p.add_argument("--max-output-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("bench_results") / "response_store_memory.json")
    args = p.parse_args(argv)
    args.batch = args.batch or args.cap
    if args.responses < 2 * args.batch:
        p.error("--responses must be at least twice --batch: the figure is the growth after the first batch")

    services = launch(executor_env={"EXECUTOR_MODEL": args.model},
                      gateway_env={"GATEWAY_RESPONSES_STORE_MAX_ENTRIES": str(args.cap)}, with_gateway=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).name
    ids: list[str] = []
    samples: list[dict] = []
    with open(args.out.with_suffix(".services.log"), "w") as log:
        services.stdout = log
        try:
            services.start()
            pid = services.gateway.pid
            client = Client(services.gateway_url)
            rss_before = rss_kib(pid)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                for start in range(0, args.responses, args.batch):
                    batch = range(start, min(start + args.batch, args.responses))
                    ids += pool.map(lambda i: client.store_one(model, i, args.max_output_tokens), batch)
                    samples.append({"stored": len(ids), "rss_kib": rss_kib(pid),
                                    "elapsed_s": round(time.perf_counter() - t0, 2)})
                    print(f"{len(ids):6d} stored: gateway RSS {samples[-1]['rss_kib'] / 1024:7.1f} MiB",
                          file=sys.stderr, flush=True)
                still_stored = list(pool.map(client.is_stored, ids))
        finally:
            services.stop()

    num_stored = sum(still_stored)
    # A batch is sent once the one before it has been answered, so the last
    # batch is the newest in the store.
    last_batch = still_stored[(len(ids) - 1) // args.batch * args.batch:]
    checks = {"num_still_stored": num_stored,
              "num_still_stored_is_cap": num_stored == min(args.cap, args.responses),
              "first_sent_is_gone": not still_stored[0] if args.responses > args.cap else None,
              "last_batch_is_stored": all(last_batch) if args.batch <= args.cap else None}
    growth = growth_after_full(samples)
    report = {
        "model": args.model, "responses": args.responses, "cap": args.cap, "batch": args.batch,
        "threads": args.threads,
        "max_output_tokens": args.max_output_tokens, "rss_before_kib": rss_before,
        "rss_when_full_kib": samples[0]["rss_kib"], "rss_max_after_full_kib": max(s["rss_kib"] for s in samples),
        "rss_last_kib": samples[-1]["rss_kib"], "growth_after_full": growth, "samples": samples,
        "checks": checks, "environment": environment(1),
    }
    args.out.write_text(json.dumps(report, indent=2))
    mib = {k: report[k] / 1024 for k in ("rss_before_kib", "rss_when_full_kib", "rss_max_after_full_kib",
                                          "rss_last_kib")}
    print(f"Responses store, {args.responses:,} stored under a cap of {args.cap:,}, {model}, {args.threads} threads, "
          f"{samples[-1]['elapsed_s']:.0f} s")
    print(f"gateway RSS: {mib['rss_before_kib']:.1f} MiB before, {mib['rss_when_full_kib']:.1f} MiB after the "
          f"first {args.batch:,}, at most {mib['rss_max_after_full_kib']:.1f} MiB after that, "
          f"{mib['rss_last_kib']:.1f} MiB at the end: growth after the first batch {growth:+.1%}")
    print(f"still stored: {num_stored:,} of {len(ids):,} ids; the first sent "
          f"{'stored' if still_stored[0] else 'gone'}, the last batch "
          f"{'all stored' if all(last_batch) else 'NOT ALL STORED'}")
    print(f"report: {args.out}")
    failed = [name for name, ok in checks.items() if ok is False]
    if failed:
        print(f"error: the store did not keep its cap: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
