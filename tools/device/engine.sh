#!/usr/bin/env bash
# Issue #34 on the lent GPU machine: the compiled engine, from why it crashed to what it serves.
#   carry: [".whlx", ".cache", ".data", ".wrk", ".dev"]   (run.sh carry wrk; .dev: py-spy's wheel)
#   CODE=$(git rev-parse --short HEAD) PARTS=diag,build,engines bash tools/device/run.sh engine
# Parts (in this order, each under its own timeout, each log under $OUT as it goes):
#   diag     bench/aoti_loading.py: a toy package linked two ways, loaded six ways → aoti-loading.json
#   build    yolopipe build-engine (timed; prints what it built and its load time) → build-engine.log
#   engines  bench/torch_engines.py: the candidates (a)-(d) side by side            → engine-candidates.json
#   startup  bench/startup.py: predict 10,000 JPEGs and serve, Ultralytics beside   → startup.json
#   http     bench/http_load.py: /v1, OIP and gRPC at c=64 and c=256                → http.json
#   tests    the GPU suite                                                         → gpu-tests.log
#   profile  predict of 10,000 JPEGs under py-spy (raw stacks, per thread), with the output
#            file's line count every 0.25 s: where the time after the first result goes
#                                                                → predict-profile.txt, predict-lines.txt
# yolopipe's cache (weights, artifacts) is /tmp/yolopipe-cache, seeded from .cache, so a later part
# finds the engine `build` built. All of $OUT is packed into $OUT/0-results.tgz after each part.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
export OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-diag,build,engines}
mkdir -p "$OUT" /tmp/site
source tools/device/pack.sh
trap pack EXIT
if [ ! -f /tmp/site/.carried ]; then
  xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - && touch /tmp/site/.carried || exit 1
fi
if ls .dev/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .dev/py_spy-*.whl >/dev/null 2>&1
  export PATH=$PATH:/tmp/pyspy/bin
fi
CACHE=/tmp/yolopipe-cache
mkdir -p "$CACHE" && cp -rn .cache/. "$CACHE/"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$CACHE YOLOPIPE_REAL_GPU=1
export YOLOPIPE_CODE=${CODE:-unknown}
want() { [[ ",$PARTS," == *",$1,"* ]]; }
part() {  # part NAME TIMEOUT COMMAND...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (at most ${limit} s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/parts.txt"
  pack
}
{ echo "code $YOLOPIPE_CODE"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'; } \
  2>&1 | tee "$OUT/machine.log"

want diag && part aoti-loading "${DIAG_TIMEOUT:-420}" python3 bench/aoti_loading.py --out "$OUT/aoti-loading.json"
want build && part build-engine "${BUILD_TIMEOUT:-300}" /usr/bin/time -f "build-engine: %e s wall" \
  python3 -m app.cli build-engine --weights sample
want engines && part engine-candidates "${ENGINES_TIMEOUT:-420}" python3 bench/torch_engines.py --reuse --images .data/images \
  --out "$OUT/engine-candidates.json" ${ENGINES_ARGS:-}
want startup && part startup "${STARTUP_TIMEOUT:-360}" python3 bench/startup.py --images .data/images \
  --copies 10000 --rounds "${STARTUP_ROUNDS:-1}" --parts predict,ultralytics,serve --out "$OUT/startup.json"
want http && part http "${HTTP_TIMEOUT:-300}" python3 bench/http_load.py --images .data/images --parts load \
  --clients 64,256 --gpus 0 --duration "${DURATION:-15}" --warmup 3 --no-naive --out "$OUT/http.json" ${HTTP_ARGS:-}
want tests && part gpu-tests "${TESTS_TIMEOUT:-300}" python3 -m pytest ${TEST_PATHS:-tests/kernels tests/gpu tests/tensorrt} \
  -v -rs -p no:cacheprovider --durations=15
if want profile; then
  mkdir -p /tmp/copies && i=0
  while [ "$i" -lt 500 ]; do for f in .data/images/*.jpg; do cp "$f" "/tmp/copies/$i-$(basename "$f")"; done; i=$((i + 1)); done
  rm -f /tmp/p.jsonl && t0=$(date +%s.%N)
  ( while sleep 0.25; do echo "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN {printf "%.2f", a - b}') $(wc -l < /tmp/p.jsonl 2>/dev/null || echo 0)"; done ) \
    > "$OUT/predict-lines.txt" 2>/dev/null &
  watcher=$!
  part predict-profile "${PROFILE_TIMEOUT:-150}" py-spy record -r 200 --threads --idle -f raw -o "$OUT/predict-profile.txt" \
    -- python3 -m app.cli predict /tmp/copies --weights sample --out /tmp/p.jsonl --verbose
  kill "$watcher"
  pack
fi
exit 0
