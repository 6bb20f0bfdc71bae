#!/usr/bin/env bash
# The last GPU call of 2026-12-01's second session (about 3 minutes of device time were left):
# the GPU tests of what changed (NV12 kernel and NVDEC into the pipeline, the pipeline's image
# path, the folder path, the batcher on the GPU), then the folder benchmark with the real detector.
#   carry: [".whlx/site.tar.xz", ".whlx/torch-cache.tgz", ".vid/pynvc-site.tar.xz", ".vid/dance-48f.mp4", ".cache", ".data"]
#   bash bench/device_final.sh
# Everything it writes goes under $OUT; the logs are written as they go, so a cut-off run keeps
# what it did (-v: one line per test, so a cut-off run still names its failures).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - || exit 1
xz -dc .vid/pynvc-site.tar.xz | tar -C /tmp/site -xf - || exit 1
if [ -f .whlx/torch-cache.tgz ]; then tar -C .cache -xzf .whlx/torch-cache.tgz; fi  # inductor cache of an earlier run
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache YOLOPIPE_REAL_GPU=1
export YOLOPIPE_NVDEC_CLIP=$PWD/.vid/dance-48f.mp4
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu-tests.log"

timeout "${TESTS_TIMEOUT:-90}" python3 -m pytest tests/kernels/test_nv12_kernel.py tests/kernels/test_nv12_input.py \
  tests/gpu/test_nvdec.py tests/gpu/test_gpu_pipeline.py tests/gpu/test_gpu_folder.py tests/gpu/test_batcher_gpu.py \
  -v -rs -p no:cacheprovider --durations=15 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -25

timeout "${FOLDER_TIMEOUT:-150}" python3 bench/folder_plumbing.py --real --images .data/images --rounds 1 \
  --out "$OUT/folder-plumbing.json" 2>&1 | tee "$OUT/folder-plumbing.log" | tail -12
