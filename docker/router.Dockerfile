# The SGLang Model Gateway (PyPI sglang-router: a Rust router inside a
# wheel), for many replicas behind one endpoint (docker-compose.yml's
# `replicas` profile). The version is the one pyproject.toml pins.
#
#   docker build -f docker/router.Dockerfile -t llmsched-router .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS router

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

COPY pyproject.toml docker/requirements.py /tmp/build/
RUN cd /tmp/build \
 && python3 requirements.py --extra router --only sglang-router > requirements.txt \
 && python3 -m pip install -r requirements.txt \
 && rm -rf /tmp/build

RUN useradd --create-home --uid 10001 llmsched
USER llmsched
WORKDIR /home/llmsched

# 30000: the router's OpenAI API; 29000: its Prometheus /metrics.
EXPOSE 30000 29000
ENTRYPOINT ["python3", "-m", "sglang_router.launch_router"]
