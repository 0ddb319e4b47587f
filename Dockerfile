# One image for both roles: `kvhandoff prefill` and `kvhandoff decode` (compose.yaml, deploy/k8s).
#
#   docker build -t kvhandoff:latest .          # torch from PyPI: the CUDA build on Linux x86_64
#   docker build -t kvhandoff:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#       --build-arg WITH_COMPILER=0 .
#
# Offline (no image registry, no network in the build; what scripts/compose_smoke.sh does):
#
#   bash scripts/base_image.sh                  # kvhandoff-base:bookworm, debootstrapped locally
#   bash scripts/gather_wheels.sh               # wheels/ + wheels/requirements.txt, on the host
#   docker build --network none -t kvhandoff:cpu --build-arg BASE_IMAGE=kvhandoff-base:bookworm \
#       --build-arg WITH_COMPILER=0 .
#
# When wheels/requirements.txt exists, every Python package comes from wheels/ (pip --no-index);
# otherwise from the index as above. The GPU driver comes from the NVIDIA container toolkit at
# run time (compose `driver: nvidia`, Kubernetes `nvidia.com/gpu`); the CUDA libraries come with
# the torch wheel. No secrets are baked in: TLS files and the API token come at run time.
# No `# syntax=` line on purpose: it would make BuildKit pull a frontend image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Lets scripts/compose_smoke.sh find this stage's superseded (untagged) images and remove them.
LABEL org.kvhandoff.stage=build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvhandoff/venv/bin:$PATH
RUN python3 -m venv /opt/kvhandoff/venv

# Dependencies first, in their own layer: they are most of the image and change least often.
COPY wheels/ /tmp/wheels/
RUN if [ -f /tmp/wheels/requirements.txt ]; then \
        pip install --no-index --find-links /tmp/wheels -r /tmp/wheels/requirements.txt; \
    elif [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

# Only the package's own sources (setuptools finds these packages; see pyproject.toml).
COPY pyproject.toml /tmp/src/
COPY common /tmp/src/common
COPY prefill_svc /tmp/src/prefill_svc
COPY decode_svc /tmp/src/decode_svc
COPY conformance /tmp/src/conformance
COPY bench /tmp/src/bench
COPY kvhandoff_cli /tmp/src/kvhandoff_cli
RUN if [ -f /tmp/wheels/requirements.txt ]; then \
        set -- --no-index --find-links /tmp/wheels; \
    fi; \
    pip install "$@" /tmp/src \
    && python -c "import kvhandoff_cli.health_probe, kvhandoff_cli.main"

FROM ${BASE_IMAGE}
LABEL org.kvhandoff.stage=service
# Triton compiles a small launcher with the system C compiler the first time a kernel runs on
# CUDA; a CPU image does not need one (WITH_COMPILER=0). A base that already has `cc` (e.g.
# BASE_INCLUDE=gcc,libc6-dev bash scripts/base_image.sh) needs no apt-get here.
ARG WITH_COMPILER=1
RUN if [ "$WITH_COMPILER" = 1 ] && ! command -v cc >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/kvhandoff/venv/bin:$PATH
COPY --from=build /opt/kvhandoff/venv /opt/kvhandoff/venv
COPY deploy/docker/entrypoint.sh /usr/local/bin/kvhandoff-entrypoint

# Models are mounted read-only at /models (compose `:ro`, Kubernetes `readOnly: true`).
RUN useradd --uid 10001 --create-home --home-dir /home/kvhandoff kvhandoff \
    && mkdir -p /models
USER 10001
ENV HOME=/home/kvhandoff
WORKDIR /home/kvhandoff

# decode API, prefill handoff, decode and prefill /metrics (defaults; all configurable).
EXPOSE 50051 50061 9451 9461
STOPSIGNAL SIGTERM
# Works without compose (which overrides it with the service's own port): SERVING on
# KVHANDOFF_PORT, or on either role's default port (the entrypoint's) when that is unset.
# The services bind 127.0.0.1 unless KVHANDOFF_HOST says otherwise (compose, k8s: 0.0.0.0).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD python -m kvhandoff_cli.health_probe --timeout 2 "127.0.0.1:${KVHANDOFF_PORT:-50051}" \
        || python -m kvhandoff_cli.health_probe --timeout 2 "127.0.0.1:${KVHANDOFF_PORT:-50061}"
ENTRYPOINT ["kvhandoff-entrypoint"]
CMD ["kvhandoff", "--help"]
