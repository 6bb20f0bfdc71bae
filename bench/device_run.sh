#!/usr/bin/env bash
# The GPU suite and benchmarks on the lent H200, in one call of the device tool:
#   carry: [".whl", ".cache", ".data"]   (wheels the image lacks, the sample weights, photos;
#   for GPU JPEG decode add nvidia-nvimgcodec-cu13 to the wheels: ../shared/device/wheels.sh)
#   bash bench/device_run.sh tests|bench|http ...   (the soak: bench/http_device.sh)
# Everything it writes goes under $OUT (the device tool brings it back).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache YOLOPIPE_REAL_GPU=1
export YOLOPIPE_IMAGES=${YOLOPIPE_IMAGES:-$PWD/.data/images}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, torchvision, numba, numpy, cv2; print('torch', torch.__version__, 'tv', torchvision.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'cv2', cv2.__version__)"
python3 -c "from nvidia import nvimgcodec; print('nvimgcodec', nvimgcodec.__version__)" 2>&1 | tail -1

for part in "$@"; do
  case "$part" in
    tests)
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest ${TEST_PATHS:-tests/kernels tests/gpu tests/tensorrt} -q -rs -m "not slow" \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -60 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" python3 -m app.benchmark --images "$YOLOPIPE_IMAGES" --out "$OUT/latency.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/latency.log" | tail -60 ;;
    http)  # load and kill parts; the soak needs a call of its own: bench/http_device.sh
      timeout "${HTTP_TIMEOUT:-300}" python3 bench/http_load.py ${HTTP_ARGS:-} --images "$YOLOPIPE_IMAGES" \
        --out "$OUT/http.json" 2>&1 | tee "$OUT/http.log" | tail -40 ;;
  esac
done
