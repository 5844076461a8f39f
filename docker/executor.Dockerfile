# The executor: model weights, KV-cache pool, forward pass. Build from the
# repository root (docker-compose.yml does):
#
#   docker build -f docker/executor.Dockerfile -t llmsched-executor:gpu .
#   docker build -f docker/executor.Dockerfile --build-arg TORCH_FLAVOR=cpu -t llmsched-executor:cpu .
#
# TORCH_FLAVOR picks where torch comes from:
#   gpu  the official CUDA PyTorch image, whose torch is used as it is
#        (never reinstalled). Its torch must be the version pyproject.toml
#        pins; the build checks. Drivers too old for CUDA 12.6, or GPUs
#        newer than it knows (Blackwell), need another tag of the same
#        torch, e.g. --build-arg PYTORCH_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
#   cpu  slim Python 3.11 plus the pinned torch from the PyTorch CPU wheel
#        index: a few hundred MB instead of several GB, for machines
#        without an NVIDIA GPU (docker-compose.cpu.yml).
ARG TORCH_FLAVOR=gpu
ARG PYTORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- torch from the CUDA PyTorch image -------------------------------------
FROM ${PYTORCH_IMAGE} AS torch-gpu
# Recent PyTorch images use the distribution's Python, which refuses pip
# installs without this (PEP 668); the image is the environment.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
# Triton (the default attention backend on CUDA) compiles a small C launcher
# the first time a kernel runs: it needs a C compiler and Python's headers,
# and the runtime image has neither.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
 && rm -rf /var/lib/apt/lists/*

# ---- torch from the PyTorch CPU wheel index --------------------------------
FROM ${PYTHON_IMAGE} AS torch-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY pyproject.toml docker/requirements.py /tmp/build/
# The torch pin is read from pyproject.toml, so it lives in one place.
RUN python3 -m pip install --index-url https://download.pytorch.org/whl/cpu \
        "$(python3 /tmp/build/requirements.py --extra executor --only torch)"

# ---- the executor itself, on either -----------------------------------------
FROM torch-${TORCH_FLAVOR} AS executor
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1

# Dependencies first, from pyproject.toml alone (cached until it changes):
# the base list plus the executor extra, without torch, under constraints
# that hold the image's torch and triton where they are.
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN cd /tmp/build \
 && python3 requirements.py --check-installed torch \
 && python3 requirements.py --extra executor --exclude torch > requirements.txt \
 && python3 requirements.py --pin-installed torch triton > constraints.txt \
 && python3 -m pip install -r requirements.txt -c constraints.txt

# Then the project, without dependencies (they are all there). No tests,
# no scheduler: the image holds what the executor runs.
COPY pyproject.toml README.md /tmp/src/
COPY llmsched /tmp/src/llmsched
COPY executor_svc /tmp/src/executor_svc
COPY llmsched_kernels /tmp/src/llmsched_kernels
RUN python3 -m pip install --no-deps /tmp/src \
 && rm -rf /tmp/src /tmp/build \
 && python3 -c "import executor_svc.__main__, llmsched_kernels"

# An unprivileged user with a home, where Triton keeps its kernel cache.
RUN useradd --create-home --uid 10001 llmsched
USER llmsched
WORKDIR /home/llmsched

# The step channel is unauthenticated: the image binds loopback (the
# settings' default) unless EXECUTOR_HOST says otherwise; compose sets
# 0.0.0.0 on its private network.
EXPOSE 50052 8001
CMD ["python3", "-m", "executor_svc"]
