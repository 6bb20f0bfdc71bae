#!/usr/bin/env bash
# yolopipe on the GPU machine (no package index; at most 64 MiB sent along with each command, at
# most 10 minutes a command), in one command (tools/device/README.md: what to carry and what each
# part writes). Build the carry here first: bash tools/device/run.sh carry [video] [wrk].
#
#   bash tools/device/run.sh PART...      e.g.  bash tools/device/run.sh setup tests bench
#
# Parts run in the order given. Each writes under $OUT as it goes (a command cut off keeps what it
# did), runs under its own timeout, and adds "<log> rc=<status> <seconds> s" to $OUT/parts.txt.
# After each part all of $OUT is packed into $OUT/0-results.tgz: only the first eight files of
# $OUT (by name) come back from the machine, and that one sorts first.
#   setup    unpack .whlx/site.tar.xz into /tmp/site (SITE; once per machine); seed yolopipe's cache
#            (YOLOPIPE_CACHE_DIR, /tmp/yolopipe-cache: kept while the machine is warm) from .cache;
#            $OUT/machine.json
#   build    yolopipe build-engine --weights sample (what bench, streams and the tests then load) → $OUT/build.log
#            Every build of every part reads and writes bench/tuning/<card>.json where it is there
#            (YOLOPIPE_TUNING_CACHE): about 30-45 s for the batch-invariant package, about 90 s without one.
#   builds   tools/device/build_times.py: build-engine timed with no tuning cache (the default folder, on a
#            fresh machine), then from the cache it wrote (a fresh folder); BUILDS_ARGS=--cudnn adds the cuDNN build
#                                                   → $OUT/build-times.json, tuning-<card>.json, build-*.log
#   tests    pytest tests/kernels tests/gpu tests/tensorrt -v    → $OUT/gpu-tests.log
#   nvdec    pytest tests/gpu/test_nvdec.py on the clip (YOLOPIPE_NVDEC_CLIP=$CLIP) → $OUT/nvdec-tests.log
#   bench    yolopipe bench                                      → $OUT/bench.json, bench.log
#   kernels  bench/kernel_ab.py: the default engine, the cuDNN package and the as-trained stem variant in
#            CUDA graphs at batches 1, 16, 64, alternating, and their kernels → $OUT/kernel-ab.json, .log
#   startup  bench/startup.py: predict of 10,000 copies of the photos and Ultralytics on the same
#            folder, 2 rounds, serve to ready, the warm loop, the engine alone → $OUT/startup.json, startup.log
#   http     bench/http_load.py: load, soak, kill, sigterm, naive → $OUT/http-full.json, .log
#   streams  bench/streams.py: NVDEC+letterbox ceiling, paced NVDEC at 64 and 128 streams,
#            OpenCV at 16, Ultralytics' best case, more NVDEC streams while real time, fidelity
#                                                                → $OUT/streams.json, streams.log
#   isolation bench/nvdec_isolation.py on the clip: NVDEC sessions alone, as threads and as processes,
#            one knob at a time, then through yolopipe's reader (issue #46, goal 1) → $OUT/nvdec-isolation.json, .log
#   memory   bench/memory_probe.py: issue #30's bursts, 2 rounds  → $OUT/memory-bursts.json, .log
#   cache    the torch.compile cache, to carry next time as .whlx/torch-cache.tgz → $OUT/torch-cache.tgz
#   fusion   build-engine into a fresh folder with inductor's fusion decisions logged (TORCH_LOGS=fusion):
#            why each epilogue joined its template or not                → $OUT/fusion.log.gz
# Every part but setup runs setup first if this command has not. Knobs (environment): OUT (/tmp/out);
# <PART>_TIMEOUT seconds (SETUP 120, BUILD 420, BUILDS 540, TESTS 300, NVDEC 180, BENCH 360, KERNELS 360, STARTUP 360,
# HTTP 540, STREAMS 330, ISOLATION 330, MEMORY 420, FUSION 150);
# <PART>_ARGS more options for its command (BUILD_ARGS=--no-batch-invariant: the cuDNN package, ~100 s;
# KERNELS_ARGS, default "--cudnn --variant as-trained-stem");
# TEST_PATHS; STARTUP_ROUNDS (2); SOAK_MINUTES (3),
# DURATION (20 s a load row); NVDEC_STREAMS (64,128), OPENCV_STREAMS (16), CLIP
# (.data/video/dance-1080p30.mp4);
# YOLOPIPE_IMAGES (.data/images); BENCH_COMMIT (the commit a result records: the copy here has no git history).
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_REAL_GPU=1
export YOLOPIPE_CACHE_DIR=${YOLOPIPE_CACHE_DIR:-/tmp/yolopipe-cache} YOLOPIPE_IMAGES=${YOLOPIPE_IMAGES:-$PWD/.data/images}
export CLIP=${CLIP:-$PWD/.data/video/dance-1080p30.mp4}
# Every build here (build-engine, and the tests' and benchmarks' own) reads the card's committed tuning cache.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-')
if [ -z "${YOLOPIPE_TUNING_CACHE:-}" ] && [ -n "$card" ] && [ -f "bench/tuning/$card.json" ]; then
  export YOLOPIPE_TUNING_CACHE=$PWD/bench/tuning/$card.json
fi
usage="usage: bash tools/device/run.sh PART...   (parts: setup build builds tests nvdec bench kernels startup http streams isolation memory cache fusion)"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
status=0
ready=0

source tools/device/pack.sh  # pack: all of $OUT as $OUT/0-results.tgz

part() {  # part NAME TIMEOUT COMMAND...: the command under its timeout, its output in $OUT/NAME.log as it goes
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (at most ${limit} s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-40}"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/parts.txt"
  [ "$rc" = 0 ] || status=1
  pack
}

unpack() {  # the carried packages into $SITE, unless a warm machine has this very tarball there
  local stamp
  set -o pipefail
  stamp=$(md5sum < .whlx/site.tar.xz) || return 1
  if [ "$(cat "$SITE/.carried" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE" && xz -dc .whlx/site.tar.xz | tar -C "$SITE" -xf - || return 1
    echo "$stamp" > "$SITE/.carried"
  fi
  mkdir -p "$YOLOPIPE_CACHE_DIR" && cp -rn .cache/. "$YOLOPIPE_CACHE_DIR/"  # the weights; built engines stay
  if [ -f .whlx/torch-cache.tgz ]; then tar -C "$YOLOPIPE_CACHE_DIR" -xzf .whlx/torch-cache.tgz; fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import json; from app.benchmark.machine import PACKAGES, machine_info, versions
carried = ('pynvvideocodec', 'tritonclient', 'grpcio', 'protobuf', 'pydantic')
print(json.dumps({'machine': machine_info(gpu=True), 'versions': versions(PACKAGES + carried)}, indent=1))" | tee "$OUT/machine.json"
}

export -f unpack
setup() {
  part setup "${SETUP_TIMEOUT:-120}" bash -c unpack
  ready=1
}

for name in "$@"; do
  case "$name" in setup|build|builds|tests|nvdec|bench|kernels|startup|http|streams|isolation|memory|cache|fusion) ;; *) echo "unknown part $name; $usage" >&2; exit 2 ;; esac
done
for name in "$@"; do
  [ "$name" = setup ] || [ "$ready" = 1 ] || setup
  case "$name" in
    setup)   setup ;;
    build)   part build "${BUILD_TIMEOUT:-420}" /usr/bin/time -f "build-engine: %e s wall" python3 -m app.cli build-engine --weights sample ${BUILD_ARGS:-} ;;
    builds)  part builds "${BUILDS_TIMEOUT:-540}" python3 tools/device/build_times.py --out "$OUT" ${BUILDS_ARGS:-} ;;
    nvdec)   YOLOPIPE_NVDEC_CLIP=$CLIP part nvdec-tests "${NVDEC_TIMEOUT:-180}" python3 -m pytest tests/gpu/test_nvdec.py -v -rs -p no:cacheprovider --durations=10 ;;
    tests)   part gpu-tests "${TESTS_TIMEOUT:-300}" python3 -m pytest ${TEST_PATHS:-tests/kernels tests/gpu tests/tensorrt} -v -rs -p no:cacheprovider --durations=15 ${TESTS_ARGS:-} ;;
    bench)   part bench "${BENCH_TIMEOUT:-360}" python3 -m app.benchmark --images "$YOLOPIPE_IMAGES" --out "$OUT/bench.json" ${BENCH_ARGS:-} ;;
    kernels) part kernel-ab "${KERNELS_TIMEOUT:-360}" python3 bench/kernel_ab.py --out "$OUT/kernel-ab.json" ${KERNELS_ARGS:---cudnn --variant as-trained-stem} ;;
    startup) part startup "${STARTUP_TIMEOUT:-360}" python3 bench/startup.py --images "$YOLOPIPE_IMAGES" --copies 10000 --rounds "${STARTUP_ROUNDS:-2}" --parts predict,ultralytics,serve,warm,bare --out "$OUT/startup.json" ${STARTUP_ARGS:-} ;;
    http)    part http-full "${HTTP_TIMEOUT:-540}" python3 bench/http_load.py --images "$YOLOPIPE_IMAGES" --parts load,soak,kill,sigterm --clients 64,256 --naive-clients 64 --naive-workers 4 --gpus 0 --duration "${DURATION:-20}" --warmup 3 --soak-minutes "${SOAK_MINUTES:-3}" --sample-s 5 --out "$OUT/http-full.json" ${HTTP_ARGS:-} ;;
    streams) part streams "${STREAMS_TIMEOUT:-330}" python3 bench/streams.py --clip "$CLIP" --nvdec-streams "${NVDEC_STREAMS:-64,128}" --opencv-streams "${OPENCV_STREAMS:-16}" --budget-s $(( ${STREAMS_TIMEOUT:-330} - 45 )) --out "$OUT/streams.json" ${STREAMS_ARGS:-} ;;
    isolation) part nvdec-isolation "${ISOLATION_TIMEOUT:-330}" python3 bench/nvdec_isolation.py --clip "$CLIP" --budget-s $(( ${ISOLATION_TIMEOUT:-330} - 45 )) --out "$OUT/nvdec-isolation.json" ${ISOLATION_ARGS:-} ;;
    memory)  part memory-bursts "${MEMORY_TIMEOUT:-420}" python3 bench/memory_probe.py --backend auto --rounds "${MEMORY_ROUNDS:-2}" --out "$OUT/memory-bursts.json" ${MEMORY_ARGS:-} ;;
    cache)   part cache 60 bash -c 'cd "$YOLOPIPE_CACHE_DIR" && find artifacts -path "*torch-cache*" -type f | tar -czf "$0/torch-cache.tgz" -T - && ls -la "$0/torch-cache.tgz"' "$OUT" ;;
    fusion)  part fusion "${FUSION_TIMEOUT:-150}" bash -c 'rm -rf /tmp/fusion-build && TORCH_LOGS=fusion TRITON_CACHE_DIR=/tmp/fusion-build/triton python3 -m app.cli build-engine --weights sample --artifacts-dir /tmp/fusion-build/artifacts 2>&1 | gzip > "$0/fusion.log.gz"; exit "${PIPESTATUS[0]}"' "$OUT" ;;
  esac
done
exit "$status"
