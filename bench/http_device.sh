#!/usr/bin/env bash
# The HTTP benchmark on the lent GPU machine, in one call of the device tool.
#   Once, here:  ../shared/device/wheels.sh   (.whl/: fastapi, uvicorn, ultralytics, ...)
#                ../shared/device/wrk.sh      (.wrk/: Debian's wrk and LuaJIT)
#   Then:        carry [".whl", ".cache", ".data", ".wrk"]
#                command: bash bench/http_device.sh                 (load + kill, ~5 min)
#                         PARTS=soak CAPACITY=<req/s of c=64> SOAK_MINUTES=7 bash bench/http_device.sh
#   (a device call runs 10 minutes at most: the soak goes in a call of its own)
# Everything it writes goes under $OUT (the device tool brings it back).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 YOLO_OFFLINE=1 YOLOPIPE_CACHE_DIR=$PWD/.cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
parts=${PARTS:-load,kill}
extra=()
[ -n "${CAPACITY:-}" ] && extra+=(--capacity "$CAPACITY")
timeout "${HTTP_TIMEOUT:-590}" python3 bench/http_load.py --images "${YOLOPIPE_IMAGES:-$PWD/.data/images}" \
  --parts "$parts" --soak-minutes "${SOAK_MINUTES:-7}" "${extra[@]}" ${HTTP_ARGS:-} \
  --out "$OUT/http-${parts//,/-}.json" 2>&1 | tee "$OUT/http-${parts//,/-}.log" | tail -40
