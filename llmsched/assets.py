"""Where the files that the tests, the benchmarks and the simulator read
lie in a checkout: the repository's own assets/ folder (assets/README.md
says what each is and its licence)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPO_ROOT / "assets"
# A real 260K-parameter Llama in HF format (MIT, llama2.c's tinyllamas).
STORIES260K = ASSETS / "models" / "stories260K"
# Slices of the Azure LLM 2023 and Mooncake traces; whole traces are given by path.
TRACES = ASSETS / "traces"
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
AZURE_CODE = TRACES / "azure_llm_2023_code.csv"
MOONCAKE_CONV = TRACES / "mooncake_conversation.jsonl"
