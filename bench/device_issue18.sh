#!/usr/bin/env bash
# Issue #18 (NVDEC into the GPU pipeline) on the lent H200, in one call of the device tool:
#   carry: [".whlx/site.tar.xz", ".vid", ".cache"]
#     .whlx/site.tar.xz    the wheels the image lacks, unpacked (as bench/device_issue16.sh)
#     .vid/pynvc-site.tar.xz  PyNvVideoCodec 2.2.4 (cp312), unpacked: the wheel without its
#                          FFmpeg sources and duplicated libraries (3 MB instead of 27)
#     .vid/dance-48f.mp4   1.6 s of dance-1080p30.mp4 re-encoded as H.264 High (B-frames), 48 frames
#     .vid/dance-1080p30.mp4  the 10 s clip, for "bench" only
#     .cache/sample/best.pt   the sample weights
#   bash bench/device_issue18.sh tests [bench]
# Everything it writes goes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - || exit 1
xz -dc .vid/pynvc-site.tar.xz | tar -C /tmp/site -xf - || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache YOLOPIPE_REAL_GPU=1
export YOLOPIPE_NVDEC_CLIP=${YOLOPIPE_NVDEC_CLIP:-$PWD/.vid/dance-48f.mp4}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

for part in "$@"; do
  case "$part" in
    tests)  # the NV12 kernel on the real GPU, then NVDEC frames through the kernel and the pipeline
      timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest tests/kernels/test_nv12_kernel.py tests/kernels/test_nv12_input.py \
        tests/gpu/test_nvdec.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/nvdec-tests.log" | tail -40 ;;
    bench)  # NVDEC against OpenCV streams, and NVDEC + the NV12 kernel alone (no Ultralytics: see bench/README.md)
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/streams.py --clip .vid/dance-1080p30.mp4 \
        --streams "${STREAMS:-8,32,64}" --video-decode nvdec,opencv --nvdec-ceiling ${BENCH_ARGS:---no-ultralytics} \
        --out "$OUT/streams.json" 2>&1 | tee "$OUT/streams.log" | tail -30 ;;
    *) echo "unknown part $part (tests | bench)" >&2 ;;
  esac
done
