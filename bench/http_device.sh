#!/usr/bin/env bash
# The whole HTTP benchmark on the lent GPU machine, in ONE call of the device tool (~8.5 min):
# yolopipe on 1 GPU at 64 and 256 clients (and /v2 REST and gRPC ModelInfer at 64), a 3-minute soak at twice the 64-client capacity,
# kill -9 of the inference worker under load, SIGTERM under load, then the naive Ultralytics
# server with 4 workers at 64 clients. Writes $OUT/http-full.json and its log.
#   Once, here:  ../shared/device/wheels.sh grpcio==1.85.3 protobuf==6.33.6
#                                             (.whl/: fastapi, uvicorn, ultralytics, httpx, grpcio, ...)
#                ../shared/device/wrk.sh      (.wrk/: Debian's wrk and LuaJIT)
#                bash bench/h2load.sh         (.h2load/: Debian's h2load, for the gRPC row)
#                the sample weights (and any artifacts) in .cache/ (YOLOPIPE_CACHE_DIR), photos in .data/images
#   Then:        carry [".whl", ".wrk", ".h2load", ".cache", ".data"]; command: bash bench/http_device.sh
# Knobs: SOAK_MINUTES (3), DURATION (20 s a row), HTTP_TIMEOUT (540 s), HTTP_ARGS (more options).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
timeout "${HTTP_TIMEOUT:-540}" python3 bench/http_load.py --images "${YOLOPIPE_IMAGES:-$PWD/.data/images}" \
  --parts load,soak,kill,sigterm --clients 64,256 --naive-clients 64 --naive-workers 4 --gpus 0 \
  --duration "${DURATION:-20}" --warmup 3 --soak-minutes "${SOAK_MINUTES:-3}" --sample-s 5 ${HTTP_ARGS:-} \
  --out "$OUT/http-full.json" 2>&1 | tee "$OUT/http-full.log" | tail -40
