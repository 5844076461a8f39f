# The scheduler: public gRPC API, request state, KV block tables. CPU only,
# and it must never have torch: this image installs the base package and
# nothing of the executor. Build from the repository root:
#
#   docker build -f docker/scheduler.Dockerfile -t llmsched-scheduler .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS scheduler

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Dependencies first, from pyproject.toml alone (cached until it changes):
# the base list only, no optional extra.
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN cd /tmp/build \
 && python3 requirements.py > requirements.txt \
 && python3 -m pip install -r requirements.txt

# Then the project, without dependencies. Only the packages the scheduler
# runs are copied, so nothing in the image can even try to import the
# executor's modules.
COPY pyproject.toml README.md /tmp/src/
COPY llmsched /tmp/src/llmsched
COPY scheduler_svc /tmp/src/scheduler_svc
RUN python3 -m pip install --no-deps /tmp/src \
 && rm -rf /tmp/src /tmp/build \
 && python3 -c "import importlib.util, sys, scheduler_svc.__main__; sys.exit('torch found in the scheduler image' if importlib.util.find_spec('torch') else 0)"

RUN useradd --create-home --uid 10001 llmsched
USER llmsched
WORKDIR /home/llmsched

# 50051: public llmsched.v1.Scheduler API; 8000: Prometheus /metrics.
EXPOSE 50051 8000
CMD ["python3", "-m", "scheduler_svc"]
