# One image for both roles: `kvhandoff prefill` and `kvhandoff decode` (compose.yaml, deploy/k8s).
#
#   docker build -t kvhandoff:latest .          # torch from PyPI: the CUDA build on Linux x86_64
#   docker build -t kvhandoff:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# The GPU driver comes from the NVIDIA container toolkit at run time (compose `driver: nvidia`,
# Kubernetes `nvidia.com/gpu`); the CUDA libraries come with the torch wheel.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles a small launcher with the system C compiler the first time a kernel runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is most of the image and changes least often.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /opt/kvhandoff
COPY . .
RUN pip install . && python -c "import kvhandoff_cli.health_probe, kvhandoff_cli.main"

RUN useradd --uid 10001 --create-home --home-dir /home/kvhandoff kvhandoff
USER 10001
ENV HOME=/home/kvhandoff
WORKDIR /home/kvhandoff

# decode API, prefill handoff, decode and prefill /metrics (defaults; all configurable).
EXPOSE 50051 50061 9451 9461
STOPSIGNAL SIGTERM
CMD ["kvhandoff", "--help"]
