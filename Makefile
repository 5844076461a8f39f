# Two commands set everything up on a fresh machine:
#   make serve   install what is missing, run executor + scheduler + OpenAI gateway (tiny-random)
#   make test    install what is missing, run the whole suite
#   make docs    build the documentation site and serve it on http://127.0.0.1:8800
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# torch is pinned to 2.13.0; where a CPU wheel lies on local disk, pip
# takes it from there instead of a multi-GB CUDA build from the index.
PIP_FIND := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: install serve test protos docs docs-gen bench-kernels gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_FIND) -e '.[executor,gateway,router,test,bench,docs]'
	rm -f $(VENV)/.installed-*
	touch $@

serve: $(STAMP)
	$(BIN)/python -m llmsched.launch

# Parallel by default: the tests mostly wait on the processes they start,
# so two workers gain even on two cores (PYTEST_ARGS='-n 0' runs serially;
# a later -n wins). Tests that share a started stack run on one worker, and
# `alone` tests run with nothing beside them (tests/xdist_scheduling.py).
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=10 $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python -m devtools.genproto

# Port 8800: 8000 and 8001 are the services' metrics ports. The variable
# turns off mkdocs-material's end-of-life banner, which is not a build warning.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve --dev-addr 127.0.0.1:8800

# Rewrites the generated parts of docs/configuration.md (from the settings
# classes) and docs/grpc-api.md (from scheduler.proto's comments); a test
# fails when they are stale.
docs-gen: $(STAMP)
	$(BIN)/python -m devtools.docgen

bench-kernels: $(STAMP)
	$(BIN)/python -m bench.kernels

# GPU tests, P8, an end-to-end bench (Triton, CUDA graphs on and off) and
# P13 (tensor parallelism over NCCL) where torch sees two or more GPUs,
# JSON under bench_results/gpu/; fails at once without a CUDA device.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
