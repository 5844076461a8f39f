"""Quantized checkpoints through both real services: an FP8 checkpoint with
block scales (tests/quantized.py) serves HF transformers' greedy tokens on
the same checkpoint, alone and 4 at once, with its weights kept FP8 in the
executor (tests/unit/test_fp8_checkpoints.py checks the layers and
refusals in process)."""

from __future__ import annotations

import pytest

from tests.families import CASES, make_checkpoint, prompts
from tests.integration.test_families import EXECUTOR_ENV, SCHEDULER_ENV, check_against_hf
from tests.integration.conftest import start_services
from tests.quantized import write_fp8


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    plain = make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))
    path = str(write_fp8(plain, tmp_path_factory.mktemp("fp8") / "llama", (32, 32)))
    services, client = start_services(path, executor_env=EXECUTOR_ENV, scheduler_env=SCHEDULER_ENV)
    yield path, client
    client.channel.close()
    services.stop()


def test_fp8_block_checkpoint_serves_hfs_greedy_tokens_alone_and_concurrently(fp8_llama):
    path, client = fp8_llama
    check_against_hf(path, client, prompts(1, min_len=12, max_len=12, seed=4))
    check_against_hf(path, client, prompts(4, min_len=5, max_len=30, seed=5))
