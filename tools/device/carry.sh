#!/usr/bin/env bash
# Build HERE (not on the GPU machine) what tools/device/run.sh needs carried to the GPU machine,
# whose image lacks some packages and which reaches no package index (tools/device/README.md).
# Writes, git-ignored:
#   .whlx/site.tar.xz      the packages below, installed for CPython 3.12 (manylinux x86_64) into
#                          one folder and packed; the setup part unpacks it into /tmp/site
#   .cache/sample/best.pt  the sample weights (suite.sh sets YOLOPIPE_CACHE_DIR=.cache)
#   .data/images/          the 20 shared photos
#   .data/video/dance-1080p30.mp4  with "video": the clip of the streams part
#   .wrk/                  with "wrk": Debian's wrk and LuaJIT, unpacked (the http part's load generator)
# and prints the size of each and the total with the repository: a command on the GPU machine
# carries at most 64 MiB (carry: [".whlx", ".cache", ".data"], and ".wrk" for the http part).
#
#   bash tools/device/run.sh carry [video] [wrk] [extra requirement ...]
#
# Knobs: PYTHON (python3: the pip that downloads), SHARED_DATA (/work/shared/data: photos and
# clip), XZ_LEVEL (9), WHEELS (where the downloaded wheels are kept for the next build:
# ~/.cache/yolopipe/carry-wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
video=0 wrk=0 extra=()
for arg in "$@"; do
  case "$arg" in video) video=1 ;; wrk) wrk=1 ;; *) extra+=("$arg") ;; esac
done
PYTHON=${PYTHON:-python3}
SHARED_DATA=${SHARED_DATA:-/work/shared/data}

# What the GPU image lacks (seen there: torch, torchvision, cupy, numba + numba-cuda, numpy 2.5,
# onnx (so protobuf and ml_dtypes too), onnxruntime, opencv, httpx, psutil, typer, rich,
# prometheus-client are present). numpy 2.4.6: with the image's numpy 2.5, `import numba.cuda` fails.
packages=(
  "numpy==2.4.6"
  "ultralytics==8.4.190" "ultralytics-thop==2.2.3"
  "fastapi==0.128.0" "annotated-doc==0.0.7" "starlette==0.50.0" "pydantic==2.12.5" "pydantic-core==2.41.5"
  "annotated-types==0.7.0" "typing-inspection==0.4.2" "python-multipart==0.0.20"
  "uvicorn==0.38.0" "httptools==0.9.0" "pydantic-settings==2.16.3" "python-dotenv==1.2.4" "onnxslim==0.1.98"
  "pycocotools==2.0.10"                # the INT8 report's mAP50 (calibrate)
  "nvidia-nvimgcodec-cu13==0.9.0.20"   # GPU JPEG decode
  "pynvvideocodec==2.2.4"              # NVDEC (--video-decode nvdec, tests/gpu/test_nvdec.py)
  # KServe v2 clients (tritonclient.grpc and the part .http shares) and gRPC
  "tritonclient==2.73.0" "python-rapidjson==1.25" "grpcio==1.85.3" "protobuf==6.33.6"
)
packages+=(${extra[@]+"${extra[@]}"})
platforms=(--python-version 3.12 --implementation cp --only-binary=:all:
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

wheels=${WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/yolopipe/carry-wheels}
mkdir -p "$wheels" .whlx
"$PYTHON" -m pip download -q --no-deps "${platforms[@]}" -d "$wheels" "${packages[@]}"
site=.whlx/site
rm -rf "$site"
"$PYTHON" -m pip install -q --no-index --find-links "$wheels" --no-deps --no-compile "${platforms[@]}" \
  --target "$site" "${packages[@]}"

# Leave out what never loads there: nvImageCodec's Python modules for other Pythons and its JPEG
# 2000 / TIFF extensions (their libraries are absent; app/gpu/nvimgcodec.py skips them anyway),
# PyNvVideoCodec's FFmpeg sources, samples and the copies of its libraries under other names
# (wheels cannot hold links; the loader asks for the .so.N names), numpy's tests, scripts, caches.
find "$site/nvidia/nvimgcodec" -name 'nvimgcodec_impl.cpython-*' ! -name 'nvimgcodec_impl.cpython-312-*' -delete
rm -f "$site"/nvidia/nvimgcodec/extensions/libnvjpeg2k_ext.* "$site"/nvidia/nvimgcodec/extensions/libnvtiff_ext.*
rm -rf "$site/external" "$site/samples" "$site/benchmarks" "$site/bin"
find "$site/PyNvVideoCodec" -name 'lib*.so' -delete
find "$site/PyNvVideoCodec" -name 'lib*.so.*.*.*' -delete
find "$site/numpy" -type d -name tests -prune -exec rm -rf {} +
find "$site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$site" -cf - . | xz -T0 "-${XZ_LEVEL:-9}" > .whlx/site.tar.xz.part
mv .whlx/site.tar.xz.part .whlx/site.tar.xz
rm -rf "$site"

# The sample weights, fetched and verified by yolopipe itself if this machine lacks them.
weights=$(YOLO_OFFLINE=1 "$PYTHON" -c "from app.weights import sample_weights; print(sample_weights())")
mkdir -p .cache/sample
cp "$weights" .cache/sample/best.pt

mkdir -p .data/images
if [ -d "$SHARED_DATA/images" ]; then
  cp "$SHARED_DATA"/images/*.jpg .data/images/
else
  echo "no $SHARED_DATA/images: put the photos into .data/images yourself" >&2
fi
if [ "$video" = 1 ]; then
  mkdir -p .data/video
  cp "$SHARED_DATA/video/dance-1080p30.mp4" .data/video/
fi
if [ "$wrk" = 1 ]; then  # Debian's packages, unpacked: the GPU image has no wrk
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download wrk libluajit-5.1-2 libluajit-5.1-common >/dev/null)
  rm -rf .wrk && mkdir -p .wrk
  for f in "$debs"/*.deb; do dpkg -x "$f" .wrk; done
  rm -rf "$debs"
fi

mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
repo=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
carried=(.whlx .cache .data)
[ -d .wrk ] && carried+=(.wrk)
total=$(awk -v a="$repo" -v b="$(mib "${carried[@]}")" 'BEGIN {printf "%.1f", a + b}')
sizes=""
for p in .whlx/site.tar.xz .cache .data/images .data/video .wrk; do [ -e "$p" ] && sizes+="$p $(mib "$p"), "; done
echo "carry (MiB): ${sizes}the repository's files $repo; total $total of 64"
echo "carry with the command: [$(printf '"%s", ' "${carried[@]}" | sed 's/, $//')]"
awk -v t="$total" 'BEGIN {exit !(t > 64)}' && { echo "over the 64 MiB one command carries" >&2; exit 1; }
exit 0
