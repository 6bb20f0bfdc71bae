# yolopipe: YOLOv8 detection over HTTP on an NVIDIA GPU (TensorRT, torch-cuda fallback).
#
#   docker build -t yolopipe .
#   docker run --gpus '"device=0"' -p 8000:8000 -p 8001:8001 -v yolopipe-artifacts:/artifacts \
#       -v "$PWD/weights:/weights:ro" -e YOLOPIPE_WEIGHTS=/weights/best.pt yolopipe
#
# One container per host: one inference worker per GPU it sees, HTTP (8000) and gRPC (8001) workers in
# front; see docker/compose.yaml.

# 25.10: CUDA 13.0, TensorRT 10.13, Ubuntu 24.04, Python 3.12.
ARG TENSORRT_TAG=25.10-py3
FROM nvcr.io/nvidia/tensorrt:${TENSORRT_TAG}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/yolopipe \
    PATH=/opt/yolopipe/bin:$PATH \
    YOLO_OFFLINE=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=32 \
    YOLOPIPE_HOST=0.0.0.0 \
    YOLOPIPE_PORT=8000 \
    YOLOPIPE_ARTIFACTS_DIR=/artifacts

# A virtual environment that still sees the image's TensorRT Python bindings.
RUN python3 -m venv --system-site-packages /opt/yolopipe

WORKDIR /opt/yolopipe-src
COPY pyproject.toml README.md ./
COPY app ./app
# uvloop + httptools: uvicorn's fast event loop and HTTP parser. TensorRT from PyPI only when
# the base image's bindings are not importable. (DL3013: "." is this project, whose dependency
# ranges live in pyproject.toml.)
# hadolint ignore=DL3013
RUN pip install ".[cuda13]" "uvloop==0.23.0" "httptools==0.9.0" \
    && (python -c "import tensorrt" || pip install "tensorrt-cu13>=10.13")

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin yolopipe \
    && mkdir -p /artifacts \
    && chown 10001:10001 /artifacts
USER 10001:10001
WORKDIR /home/yolopipe

# Exported models, INT8 models and built engines (engine files are specific to a GPU and TensorRT version).
VOLUME ["/artifacts"]
EXPOSE 8000 8001

HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('YOLOPIPE_PORT', '8000') + '/healthz', timeout=2)"]

# SIGTERM: uvicorn stops accepting, finishes in-flight requests, then the batcher drains.
STOPSIGNAL SIGTERM
ENTRYPOINT ["yolopipe"]
CMD ["serve"]
