# The OpenAI-compatible gateway: HTTP in front of the scheduler's public
# gRPC API. CPU only and torch-free like the scheduler: this image installs
# the base package and the gateway extra. Build from the repository root:
#
#   docker build -f docker/gateway.Dockerfile -t llmsched-gateway .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS gateway

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Dependencies first, from pyproject.toml alone (cached until it changes).
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN cd /tmp/build \
 && python3 requirements.py --extra gateway > requirements.txt \
 && python3 -m pip install -r requirements.txt

# Then the project without dependencies: only what the gateway runs.
COPY pyproject.toml README.md /tmp/src/
COPY llmsched /tmp/src/llmsched
COPY gateway_svc /tmp/src/gateway_svc
RUN python3 -m pip install --no-deps /tmp/src \
 && rm -rf /tmp/src /tmp/build \
 && python3 -c "import importlib.util, sys, gateway_svc.app; sys.exit('torch found in the gateway image' if importlib.util.find_spec('torch') else 0)"

RUN useradd --create-home --uid 10001 llmsched
USER llmsched
WORKDIR /home/llmsched

# 8080: the OpenAI-compatible API, /health and /metrics.
EXPOSE 8080
CMD ["python3", "-m", "gateway_svc"]
