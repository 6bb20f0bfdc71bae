#!/usr/bin/env bash
# Issue #26 on the GPU machine, in one call: build the torch-cuda engine (timed), the GPU tests of
# the engine and of the serving warm-up, then whole processes timed from outside (bench/startup.py:
# predict of 10,000 JPEGs against Ultralytics in the same run, serve to ready, the warm loop, a
# fresh start), then the engine three ways (bench/torch_engines.py, reusing build-engine's package).
#   carry: [".whlx/site.tar.xz", ".cache", ".data"]   (.cache: the sample weights, YOLOPIPE_CACHE_DIR)
#   bash bench/device_startup.sh                      # PARTS=build,tests,startup,fresh,engines (all)
# Everything goes under $OUT, each log written as it goes, so a cut-off run keeps what it did.
set -uo pipefail
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-build,tests,startup,fresh,engines}
mkdir -p "$OUT" /tmp/site
xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache YOLOPIPE_REAL_GPU=1
want() { [[ ",$PARTS," == *",$1,"* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; command -v g++ gcc;
  python3 -c 'import torch; print("torch", torch.__version__)'; } 2>&1 | tee "$OUT/machine.log"

if want build; then  # AOTInductor: export (if needed) + trace + compile, about 1-2 minutes
  /usr/bin/time -f "build-engine: %e s wall" timeout "${BUILD_TIMEOUT:-300}" python3 -m app.cli build-engine \
    2>&1 | tee "$OUT/build-engine.log" | tail -8
  find .cache -path '*torch-cuda*' -name '*.json' -exec cat {} \; > "$OUT/torch-engine-manifest.json"
fi
if want tests; then  # builds its own engine once more (a first start), then loads it; ~3 minutes
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_torch_engine.py tests/gpu/test_batcher_gpu.py \
    -v -rs -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu-tests.log" | tail -20
fi
if want startup; then  # ~4 minutes: 10,000 copies, predict and Ultralytics twice each, serve twice, the warm loop
  timeout "${STARTUP_TIMEOUT:-420}" python3 bench/startup.py --images .data/images --copies 10000 --rounds 2 \
    --parts predict,ultralytics,serve,warm --out "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log" | tail -12
fi
if want fresh; then  # an empty artifacts folder and compiler caches: export + build + 256 images; then serve
  timeout "${FRESH_TIMEOUT:-420}" python3 bench/startup.py --images .data/images --copies 256 --rounds 1 \
    --parts fresh-predict,fresh-serve --out "$OUT/startup-fresh.json" 2>&1 | tee "$OUT/startup-fresh.log" | tail -8
fi
if want engines; then  # the package build-engine built, one for batch 64 only, torch.compile cold and warm, eager
  timeout "${ENGINES_TIMEOUT:-540}" python3 bench/torch_engines.py --reuse --batch 64 --out "$OUT/torch-engines.json" \
    2>&1 | tee "$OUT/torch-engines.log" | tail -30
fi
