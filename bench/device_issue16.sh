#!/usr/bin/env bash
# Issue #16 on the lent H200, in one call of the device tool (parts in the order given):
#   carry: [".whlx", ".cache", ".data"]
#     .whlx/site.tar.xz  the wheels the image lacks, unpacked (cp312; ../shared/device/README.md,
#                        "A smaller carry"), plus py_spy-*.whl for the folder profile
#     .cache/sample/best.pt  the sample weights;  .data/images  the 20 shared photos
#   bash bench/device_issue16.sh probe bench tests folder
# Everything it writes goes under $OUT (at most 8 files come back).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
xz -dc .whlx/site.tar.xz | tar -C /tmp/site -xf - || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache YOLOPIPE_REAL_GPU=1
export YOLOPIPE_IMAGES=${YOLOPIPE_IMAGES:-$PWD/.data/images}
if [ -f .whlx/torch-cache.tgz ]; then tar -C .cache -xzf .whlx/torch-cache.tgz; fi  # inductor cache of a run before
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

for part in "$@"; do
  case "$part" in
    probe)
      timeout "${PROBE_TIMEOUT:-150}" python3 bench/decode_overlap_probe.py --images "$YOLOPIPE_IMAGES" \
        --out "$OUT/probe.json" 2>&1 | tee /tmp/probe.log | tail -40 ;;
    probe-conn)  # the decode under load with 8 and 32 CUDA work queues (one process each)
      timeout "${PROBE_TIMEOUT:-150}" python3 bench/decode_overlap_probe.py --images "$YOLOPIPE_IMAGES" --only connections \
        --out "$OUT/probe-connections.json" 2>&1 | tail -20 ;;
    tests)
      timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest ${TEST_PATHS:-tests/kernels tests/gpu} -q -rs \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -40 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" python3 -m app.benchmark --images "$YOLOPIPE_IMAGES" --out "$OUT/bench.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -45 ;;
    folder)  # predict_folder under py-spy: the samples that hold the GIL, as collapsed stacks
      python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whlx/py_spy-*.whl >/dev/null 2>&1
      spy=(); [ -x /tmp/pyspy/bin/py-spy ] && spy=(/tmp/pyspy/bin/py-spy record --gil -r 200 -f raw -o "$OUT/folder-gil.txt" --)
      timeout "${FOLDER_TIMEOUT:-150}" "${spy[@]}" python3 bench/folder_profile.py --images "$YOLOPIPE_IMAGES" \
        --count 10000 --batch 128 2>&1 | tee "$OUT/folder.log" | tail -15 ;;
    predict)  # what a GPU `yolopipe predict` prints on varied JPEGs (progressive, 4:1:1, CMYK, EXIF) + photos
      mkdir -p /tmp/varied && cp "$YOLOPIPE_IMAGES"/*.jpg /tmp/varied/
      python3 -c "from app.benchmark.workloads import varied_jpegs
for n, d in varied_jpegs(): open('/tmp/varied/' + n, 'wb').write(d)"
      timeout "${PREDICT_TIMEOUT:-120}" python3 -c "import sys; from app.cli import main; sys.argv[0] = 'yolopipe'; main()" \
        predict /tmp/varied --out /tmp/predict.jsonl --batch 128 > "$OUT/predict.log" 2>&1
      echo "predict rc=$?"; cat "$OUT/predict.log" | tail -30 ;;
    cache)  # the inductor/triton cache, to carry into the next call (.whlx/torch-cache.tgz)
      (cd .cache && find artifacts -path '*torch-cache*' -type f | tar -czf "$OUT/torch-cache.tgz" -T -) ;
      ls -la "$OUT/torch-cache.tgz" ;;
  esac
done
