#!/usr/bin/env bash
# Issue #29 on the lent H200, in one call: quantization-aware distillation of both INT8 models on the
# GPU for the 84-image calibration set, scored with the PTQ models against FP32 on the held-out set of
# another distribution (bench/int8_heldout.py, made there from the carried data), CPU latency in the
# same run (bench/int8_libraries.py). NNCF and ModelOpt are not on that machine: their rows run on
# the CPU in a separate run (calibration/README.md says which file).
#
#   here, once:   bash bench/int8_qat_device.sh prepare      (.whl/, .cache/sample/best.pt, .data/: ~59 MB)
#   device call:  carry [".whl", ".cache", ".data"], command: bash bench/int8_qat_device.sh run
#
# Writes under $OUT: int8-qat.log, the result JSON, and the distilled CPU model (11 MB) to score here.
# Time: ~1.5 min PTQ (default options), ~1 min its PTQ again from the caches plus 4 min of
# distillation (--qat-minutes 4, both models), ~1.5 min scoring 108 images x 5 models and latency.
set -uo pipefail
part=${1:-run}
if [ "$part" = prepare ]; then
  set -e
  data=${DATA:-../shared/data}
  mkdir -p .data/video .data/cache/skimage .cache/sample .whl
  cp -r "$data/images" .data/
  cp "$data/video/dance.avi" "$data/video/dance-1080p30.mp4" .data/video/
  python3 -c "from pathlib import Path; from bench.int8_heldout import skimage_photos
for p in skimage_photos(Path('/tmp/int8-photo-cache')): Path('.data/cache/skimage', p.name).write_bytes(p.read_bytes())"
  cp "${YOLOPIPE_CACHE_DIR:-$HOME/.cache/yolopipe}/sample/best.pt" .cache/sample/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    numpy==2.4.6 ultralytics==8.4.190 ultralytics-thop==2.2.3 pydantic==2.12.5 pydantic-core==2.41.5 \
    annotated-types==0.7.0 typing-inspection==0.4.2 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    onnxslim==0.1.98 pycocotools==2.0.10
  du -sh .whl .cache .data
  exit 0
fi

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache
log="$OUT/int8-qat.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c "import torch, onnxruntime, pycocotools, ultralytics, skimage, matplotlib
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'ort', onnxruntime.__version__)
for name in ('nncf', 'modelopt'):
    try:
        __import__(name); print(name, 'importable')
    except ImportError:
        print(name, 'absent: its row runs on the CPU in a separate run')" 2>&1 | tee -a "$log"
timeout "${BENCH_TIMEOUT:-570}" python3 bench/int8_libraries.py --data .data --photo-cache .data/cache \
  --runs default,qat --qat-args "--qat-minutes ${QAT_MINUTES:-4}" --no-candidates --nncf auto \
  --keep /tmp/int8-models --out "$OUT" --tag "${TAG:--qat-h200}" 2>&1 | tee -a "$log"
cp /tmp/int8-models/qat-model.int8-cpu.onnx "$OUT/qat-h200-model.int8-cpu.onnx" 2>/dev/null || true
ls -la "$OUT"
