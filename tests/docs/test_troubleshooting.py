"""docs/troubleshooting.md covers every start-up error: each message the
start-up tests assert (a list kept here, naming the test), and every
message the product code raises as a StartupError or UnsupportedConfig
(found by reading the code, so a new one cannot be left out)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
PACKAGES = ("llmsched", "scheduler_svc", "executor_svc", "gateway_svc")
START_UP_ERRORS = {"StartupError", "UnsupportedConfig"}
# Raises whose message is not a literal: load_settings passes on pydantic's
# own messages, which the page shows by example.
DYNAMIC = {("llmsched/errors.py", "load_settings")}

# What the start-up tests assert, as the page must show it: (the test that
# asserts it, a fragment of the message with placeholders where the test
# has a concrete path, port or number).
ASSERTED = [
    ("integration/test_start_stop.py checkpoint-without-tokenizer.json",
     "tokenizer.json: missing (the scheduler tokenizes with the checkpoint's tokenizer.json)"),
    ("integration/test_start_stop.py corrupt-config.json", "config.json: not valid JSON"),
    ("integration/test_start_stop.py kv-memory-beyond-free-memory",
     "EXECUTOR_KV_CACHE_MEMORY_MB=<n>: the KV pool needs <x> MiB but only <y> MiB is free on <device>"),
    ("integration/test_start_stop.py kv-blocks-beyond-free-memory", "EXECUTOR_NUM_KV_BLOCKS=<n>"),
    ("integration/test_start_stop.py model-neither-directory-nor-built-in",
     "EXECUTOR_MODEL='<value>' is neither a directory nor a built-in model (bench-moe, bench-small, tiny-random)"),
    ("integration/test_start_stop.py port-not-a-number",
     "SCHEDULER_PORT='fifty': Input should be a valid integer"),
    ("integration/test_start_stop.py *-port-in-use", "<SETTING>=<port>: address already in use (<host>:<port>)"),
    ("integration/test_start_stop.py executor-metrics-port-in-use", "EXECUTOR_METRICS_PORT"),
    ("integration/test_start_stop.py scheduler-metrics-port-in-use", "SCHEDULER_METRICS_PORT"),
    ("integration/test_start_stop.py second-executor-on-a-port-in-use", "`EXECUTOR_PORT`"),
    ("integration/test_start_stop.py bad-tenant-weight", "SCHEDULER_TENANT_WEIGHTS: the weight of"),
    ("integration/test_start_stop.py bad-tenant-in-an-api-key-entry", "in a tenant:key entry must be"),
    ("integration/test_start_stop.py second-scheduler-on-a-port-in-use", "`SCHEDULER_PORT`"),
    ("integration/test_start_stop.py (all cases)", "cannot start:"),
    ("integration/test_families.py REFUSALS", "cannot serve"),
    ("integration/test_families.py unknown architecture", "architecture <name> is not supported; supported: <list>"),
    ("integration/test_families.py dynamic RoPE", "RoPE type '<type>' is not supported"),
    ("integration/test_families.py unread forward-changing key", "attn_logit_softcapping"),
    ("integration/test_families.py llama with biases", "attention_bias=True"),
    ("unit/test_model_config.py RoPE types", "supported: default, linear, llama3"),
    ("unit/test_model_config.py RoPE types", "`dynamic` or `longrope`"),
    ("unit/test_model_config.py multimodal gemma3", "audio_config"),
    ("unit/test_model_config.py forward-changing keys", "does not implement"),
    ("unit/test_model_config.py forward-changing keys", "quantization_config"),
    ("unit/test_model_config.py forward-changing keys", "`sliding_window`"),
    ("unit/test_model_config.py forward-changing keys", "mlp_bias=True"),
    ("unit/test_model_config.py forward-changing keys", "hidden_act='gelu'"),
    ("unit/test_model_config.py forward-changing keys", "partial_rotary_factor=<value> is not supported"),
    ("unit/test_model_config.py unknown RoPE parameter", "RoPE parameters <keys> are not read"),
    ("unit/test_model_config.py gemma refusals", "use_bidirectional_attention=True"),
    ("unit/test_model_config.py gemma refusals", "hidden_activation"),
    ("unit/test_compiled_decode.py", "EXECUTOR_TORCH_COMPILE=on compiles CPU decode steps; the device is <device>"),
    ("unit/test_compiled_decode.py",
     "EXECUTOR_TORCH_COMPILE=on is not implemented with EXECUTOR_TENSOR_PARALLEL_SIZE > 1"),
    ("unit/test_sharding.py, integration/test_tensor_parallel.py", "does not divide"),
    ("unit/test_sharding.py, integration/test_tensor_parallel.py", "sizes that work: 1, 2, 4"),
    ("unit/test_attention_backends.py", "EXECUTOR_ATTENTION_BACKEND=triton needs a CUDA device"),
    ("unit/test_attention_backends.py", "TRITON_INTERPRET=1"),
    ("unit/test_cuda_graphs.py", "EXECUTOR_CUDA_GRAPHS='on': Input should be 'auto' or 'off'"),
    ("unit/test_fp8_kv_cache.py", "EXECUTOR_KV_CACHE_DTYPE='fp8': Input should be 'auto', 'fp8_e4m3' or 'fp8_e5m2'"),
    ("unit/test_fp8_kv_cache.py", "EXECUTOR_KV_CACHE_DTYPE='<value>' is not supported; supported: auto, fp8_e4m3, "
     "fp8_e5m2"),
    ("unit/test_fp8_kv_cache.py", "only one KV-cache scale per layer (per tensor) is implemented"),
    ("unit/test_fp8_kv_cache.py", "is not a usable KV-cache scale"),
]


def page_text() -> str:
    return " ".join(PAGE.read_text().split())


@pytest.mark.parametrize("source, fragment", ASSERTED, ids=[f"{s}: {f[:40]}" for s, f in ASSERTED])
def test_the_page_shows_what_the_start_up_tests_assert(source, fragment):
    assert " ".join(fragment.split()) in page_text(), f"{source} asserts {fragment!r}; docs/troubleshooting.md lacks it"


def _literal_parts(node: ast.expr) -> list[str] | None:
    """The constant pieces of a message built from literals and f-strings;
    None when the message is built some other way."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        return None if left is None or right is None else left + right
    return None


def start_up_messages() -> tuple[list[tuple[str, int, list[str]]], set[tuple[str, str]]]:
    """(file, line, literal parts) of every StartupError / UnsupportedConfig
    raised in the product code, and the (file, function) of those whose
    message is not built from literals."""
    found, dynamic = [], set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            tree = ast.parse(path.read_text())
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                            and node.func.id in START_UP_ERRORS and node.args):
                        parts = _literal_parts(node.args[0])
                        if parts is None:
                            dynamic.add((rel, func.name))
                        else:
                            found.append((rel, node.lineno, parts))
    return found, dynamic


def _words(part: str) -> str:
    """A literal piece as the page must show it: surrounding punctuation and
    spaces dropped, inner whitespace collapsed."""
    return " ".join(part.split()).strip(" :;,.()'\"")


def test_every_start_up_error_in_the_code_is_on_the_page():
    found, dynamic = start_up_messages()
    assert len(found) >= 30, f"only {len(found)} start-up errors found: has the code moved?"
    assert dynamic == DYNAMIC, f"messages not built from literals (check them by hand, then update DYNAMIC): {dynamic}"
    text = page_text()
    missing = [f"{file}:{line}: {_words(part)!r}" for file, line, parts in found for part in parts
               if len(re.sub(r"\W", "", _words(part))) >= 4 and _words(part) not in text]
    assert not missing, "docs/troubleshooting.md lacks these start-up messages:\n" + "\n".join(missing)
