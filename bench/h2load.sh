#!/usr/bin/env bash
# An HTTP/2 (gRPC) load generator for the GPU machine: Debian's h2load (nghttp2-client, C) and the
# libraries it needs beyond a usual image, unpacked into .h2load/ of the current checkout
# (git-ignored) so that it can travel with `carry: [".h2load"]` (about 1 MB); bench/grpc_client.py
# finds it there. It links OpenSSL 3 (libssl.so.3), which an image with Python 3.10+ has; where
# it does not, H2LOAD_SSL=1 bundles Debian's too (5 MB more).
# There: LD_LIBRARY_PATH=$PWD/.h2load/usr/lib/x86_64-linux-gnu .h2load/usr/bin/h2load --version
set -euo pipefail
dest=${H2LOAD_DIR:-.h2load}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pkgs=(nghttp2-client libnghttp2-14 libev4 libjemalloc2)
libs=(nghttp2 ev jemalloc)
if [ "${H2LOAD_SSL:-0}" = 1 ]; then pkgs+=(libssl3); libs+=(ssl crypto); fi
(cd "$tmp" && apt-get download "${pkgs[@]}" >/dev/null 2>&1) \
  || { apt-get update >/dev/null 2>&1; (cd "$tmp" && apt-get download "${pkgs[@]}" >/dev/null); }
for f in "$tmp"/*.deb; do dpkg -x "$f" "$tmp/root"; done
rm -rf "$dest"
mkdir -p "$dest/usr/bin" "$dest/usr/lib/x86_64-linux-gnu"
cp "$tmp/root/usr/bin/h2load" "$dest/usr/bin/"
for lib in "${libs[@]}"; do cp -P "$tmp"/root/usr/lib/x86_64-linux-gnu/lib"$lib".so* "$dest/usr/lib/x86_64-linux-gnu/"; done
LD_LIBRARY_PATH="$dest/usr/lib/x86_64-linux-gnu" "$dest/usr/bin/h2load" --version
du -sh "$dest"
