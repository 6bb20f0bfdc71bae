#!/usr/bin/env bash
# Issue #26 on the GPU machine: build the torch-cuda engine (timed), whole processes timed from
# outside (bench/startup.py: predict of 10,000 JPEGs against Ultralytics in the same run, serve to
# ready, the warm loop; then a fresh start), the engine three ways (bench/torch_engines.py, reusing
# build-engine's package), and the GPU tests of the engine and of the serving warm-up.
#   carry: [".whlx/site.tar.xz", ".cache", ".data"]   (.cache: the sample weights)
#   PARTS=build,startup bash tools/device/run.sh startup  # then PARTS=engines,fresh; PARTS=tests; PARTS=fresh-serve
# yolopipe's cache (weights, artifacts, compiled kernels) lives in /tmp/yolopipe-cache, seeded from
# .cache: a later call on the still-warm machine finds the engine an earlier call built.
# Everything goes under $OUT, each log written as it goes, so a cut-off run keeps what it did, and
# is packed into $OUT/0-results.tgz at the end (the device tool returns only $OUT's first eight files).
set -uo pipefail
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-build,startup,engines,fresh,tests,fresh-serve}
mkdir -p "$OUT" /tmp/site
xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - || exit 1
CACHE=/tmp/yolopipe-cache
mkdir -p "$CACHE" && cp -rn .cache/. "$CACHE/"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$CACHE YOLOPIPE_REAL_GPU=1
want() { [[ ",$PARTS," == *",$1,"* ]]; }
source "$(dirname "$0")/pack.sh"  # pack: all of $OUT as $OUT/0-results.tgz
trap pack EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; command -v g++ gcc;
  python3 -c 'import torch; print("torch", torch.__version__)'; } 2>&1 | tee "$OUT/machine.log"

if want build; then  # AOTInductor: export (if needed) + trace + compile, about 1-2 minutes
  /usr/bin/time -f "build-engine: %e s wall" timeout "${BUILD_TIMEOUT:-240}" python3 -m app.cli build-engine \
    2>&1 | tee "$OUT/build-engine.log" | tail -8
  find "$CACHE" -path '*torch-cuda*' -name '*.json' -exec cat {} \; > "$OUT/torch-engine-manifest.json"
fi
if want tests; then  # builds its own engine once more (a first start), then loads it; ~3 minutes
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest tests/gpu/test_torch_engine.py tests/gpu/test_batcher_gpu.py \
    -v -rs -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu-tests.log" | tail -20
fi
if want startup; then  # ~4 minutes: 10,000 copies, predict and Ultralytics twice each, serve twice, the warm loop
  timeout "${STARTUP_TIMEOUT:-360}" python3 bench/startup.py --images .data/images --copies 10000 --rounds 2 \
    --parts predict,ultralytics,serve,warm --out "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log" | tail -12
fi
if want fresh; then  # an empty artifacts folder and compiler caches: export + build + 256 images, ~2-3 minutes
  timeout "${FRESH_TIMEOUT:-300}" python3 bench/startup.py --images .data/images --copies 256 --rounds 1 \
    --parts fresh-predict --out "$OUT/startup-fresh.json" 2>&1 | tee "$OUT/startup-fresh.log" | tail -8
fi
if want fresh-serve; then  # the same for serve, to the first 200 of /readyz
  timeout "${FRESH_TIMEOUT:-300}" python3 bench/startup.py --images .data/images --copies 20 --rounds 1 \
    --parts fresh-serve --out "$OUT/startup-fresh-serve.json" 2>&1 | tee "$OUT/startup-fresh-serve.log" | tail -8
fi
if want engines; then  # the package build-engine built, one for batch 64 only, torch.compile cold and warm, eager
  reuse=$(find "$CACHE" -path '*torch-cuda*' -name 'fp16.b1-64.json' | grep -q . && echo --reuse)
  timeout "${ENGINES_TIMEOUT:-420}" python3 bench/torch_engines.py $reuse --batch 64 --out "$OUT/torch-engines.json" \
    2>&1 | tee "$OUT/torch-engines.log" | tail -30
fi
