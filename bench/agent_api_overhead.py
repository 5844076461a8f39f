"""What the gateway adds to a non-streamed Responses or Messages call over
the chat completion it translates into (issue 35: p50 under 2 ms).

    python -m bench.agent_api_overhead --rounds 200

One set of services with the gateway, on a small built-in model. The same
conversation (one short user message, greedy, --max-tokens) goes out as
`POST /v1/chat/completions`, `POST /v1/responses` (store as the API's
default, true) and `POST /v1/messages`, one call at a time over one kept-alive
connection, in rounds of one call each; the order rotates every round, so
each API goes first, second and third equally often. Every call must
return the same text and output token count as the round's chat
completion, or the comparison would not be of equal work (exit 1). Prints
each API's p50 and p90 wall time, its p50 against chat's, and the p50 and
p90 of the paired differences (API - chat of the same round), the figure
the target is about. On a busy machine those differences are noisy, so the
gateway's CPU time per call (all its threads, from /proc/PID/task/*/schedstat,
read before and after each call) is reported the same way: it counts the
work the gateway does, whatever else runs. Writes
bench_results/agent_api_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import environment
from bench.http_json import JsonConnection
from bench.stats import percentile
from llmsched.launch import launch

APIS = ("chat", "responses", "messages")
DEFAULT_PROMPT = "Tell me a story about a dog."


def requests_for(model: str, prompt: str, max_tokens: int, store: bool) -> dict[str, tuple[str, dict]]:
    """Each API's (path, body) for the same conversation. Responses and
    Messages have no ignore_eos, so none of the three sends it: an output
    that stops early stops early in all three, and the check sees it."""
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                          "max_tokens": max_tokens, "temperature": 0}),
        "responses": ("/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                        "temperature": 0, "store": store}),
        "messages": ("/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                      "max_tokens": max_tokens, "temperature": 0}),
    }


def answer_of(api: str, body: dict) -> tuple[str, int]:
    """(generated text, output tokens) of a non-streamed answer."""
    if api == "chat":
        return body["choices"][0]["message"]["content"] or "", body["usage"]["completion_tokens"]
    if api == "responses":
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
        return text, body["usage"]["output_tokens"]
    text = "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return text, body["usage"]["output_tokens"]


def cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads so far, in seconds (the
    scheduler's own count, in ns; /proc/PID/stat's is in 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def timed_call(conn: JsonConnection, path: str, body: dict, pid: int) -> tuple[float, float, int, dict]:
    """(seconds from sending the request to the last byte of the answer,
    the gateway's CPU seconds meanwhile, status, answer). Encoding and
    decoding the JSON stay outside the time."""
    raw = json.dumps(body).encode()
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    status, answer = conn.request("POST", path, raw)
    elapsed = time.perf_counter() - t0
    return elapsed, cpu_seconds(pid) - cpu0, status, json.loads(answer)


def summary_ms(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "mean_ms": sum(ms) / len(ms)}


def run_rounds(conn: JsonConnection, calls: dict[str, tuple[str, dict]], num_rounds: int,
               pid: int) -> tuple[list[dict], list[str]]:
    """Each round's wall and gateway CPU seconds per API, and what
    disagreed with chat's answer."""
    rounds, mismatches = [], []
    for r in range(num_rounds):
        order = APIS[r % len(APIS):] + APIS[:r % len(APIS)]
        times, cpu, answers = {}, {}, {}
        for api in order:
            path, body = calls[api]
            times[api], cpu[api], status, answer = timed_call(conn, path, body, pid)
            if status != 200:
                raise RuntimeError(f"{api}: HTTP {status}: {answer}")
            answers[api] = answer_of(api, answer)
        for api in APIS[1:]:
            if answers[api] != answers["chat"]:
                mismatches.append(f"round {r}: {api} answered {answers[api]!r}, chat {answers['chat']!r}")
        rounds.append({"order": list(order), "seconds": times, "cpu_seconds": cpu, "answer": answers["chat"]})
    return rounds, mismatches


def compared(rounds: list[dict], key: str) -> tuple[dict, dict]:
    """Each API's summary of rounds' `key`, and of its paired difference
    with chat in the same round."""
    per_api = {api: summary_ms([r[key][api] for r in rounds]) for api in APIS}
    paired = {api: summary_ms([r[key][api] - r[key]["chat"] for r in rounds]) for api in APIS[1:]}
    return per_api, paired


def report_of(rounds: list[dict], args: argparse.Namespace) -> dict:
    per_api, paired = compared(rounds, "seconds")
    cpu_per_api, cpu_paired = compared(rounds, "cpu_seconds")
    text, num_tokens = rounds[0]["answer"]
    return {
        "model": args.model, "rounds": len(rounds), "warmup_rounds": args.warmup, "max_tokens": args.max_tokens,
        "prompt": args.prompt, "responses_store": args.store, "output_tokens": num_tokens, "output_text": text,
        "per_api": per_api,
        "ratio_p50_to_chat": {api: per_api[api]["p50_ms"] / per_api["chat"]["p50_ms"] for api in APIS},
        "added_over_chat_ms": paired,
        "gateway_cpu_per_api": cpu_per_api,
        "gateway_cpu_added_over_chat_ms": cpu_paired,
        "environment": environment(args.num_threads),
        "round_seconds": [r["seconds"] for r in rounds],
        "round_gateway_cpu_seconds": [r["cpu_seconds"] for r in rounds],
    }


def print_report(report: dict) -> None:
    print(f"Agent APIs over chat, {report['model']}, {report['rounds']} rounds after {report['warmup_rounds']} "
          f"warm-up, {report['output_tokens']} output tokens each, non-streamed, one call at a time")
    print(f"{'':10} {'wall p50':>9} {'p90':>8} {'p50/chat':>9} {'added p50':>10} {'p90':>8}   "
          f"{'gateway CPU p50':>15} {'added p50':>10} {'p90':>8}   (ms)")
    for api in APIS:
        s, cpu = report["per_api"][api], report["gateway_cpu_per_api"][api]
        added = report["added_over_chat_ms"].get(api)
        cpu_added = report["gateway_cpu_added_over_chat_ms"].get(api)
        wall_diff = f"{added['p50_ms']:10.3f} {added['p90_ms']:8.3f}" if added else f"{'':10} {'':8}"
        cpu_diff = f"{cpu_added['p50_ms']:10.3f} {cpu_added['p90_ms']:8.3f}" if cpu_added else ""
        print(f"{api:10} {s['p50_ms']:9.3f} {s['p90_ms']:8.3f} {report['ratio_p50_to_chat'][api]:8.3f}x "
              f"{wall_diff}   {cpu['p50_ms']:15.3f} {cpu_diff}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent_api_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random", help="a built-in model or a checkpoint directory")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="rounds run first and not counted")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=True,
                   help="the Responses calls' store (the API's default: true)")
    p.add_argument("--num-threads", type=int, default=1, help="the executor's torch threads")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "agent_api_overhead.json")
    args = p.parse_args(argv)

    # Prefix caching off: every call computes the same prompt, whatever ran before it.
    services = launch(executor_env={"EXECUTOR_MODEL": args.model, "EXECUTOR_NUM_THREADS": str(args.num_threads)},
                      scheduler_env={"SCHEDULER_ENABLE_PREFIX_CACHING": "false"}, with_gateway=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".services.log"), "w") as log:
        services.stdout = log
        try:
            services.start()
            conn = JsonConnection(services.gateway_url)
            calls = requests_for(Path(args.model).name, args.prompt, args.max_tokens, args.store)
            run_rounds(conn, calls, args.warmup, services.gateway.pid)
            rounds, mismatches = run_rounds(conn, calls, args.rounds, services.gateway.pid)
            conn.close()
        finally:
            services.stop()
    report = report_of(rounds, args)
    report["mismatches"] = mismatches
    args.out.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"report: {args.out}")
    if mismatches:
        print(f"error: {len(mismatches)} rounds answered differently across the APIs, e.g. {mismatches[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
