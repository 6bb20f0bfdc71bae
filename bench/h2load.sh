#!/usr/bin/env bash
# An HTTP/2 (gRPC) load generator for the GPU machine: Debian's h2load (nghttp2-client, C) and the
# libraries it needs, unpacked into .h2load/ of the current checkout (git-ignored) so that it can
# travel with `carry: [".h2load"]` (about 2 MB); bench/grpc_client.py finds it there.
# There: LD_LIBRARY_PATH=$PWD/.h2load/usr/lib/x86_64-linux-gnu .h2load/usr/bin/h2load --version
set -euo pipefail
dest=${H2LOAD_DIR:-.h2load}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pkgs=(nghttp2-client libnghttp2-14 libev4 libjemalloc2 libssl3)
(cd "$tmp" && apt-get download "${pkgs[@]}" >/dev/null 2>&1) \
  || { apt-get update >/dev/null 2>&1; (cd "$tmp" && apt-get download "${pkgs[@]}" >/dev/null); }
mkdir -p "$dest"
for f in "$tmp"/*.deb; do dpkg -x "$f" "$tmp/root"; done
mkdir -p "$dest/usr/bin" "$dest/usr/lib/x86_64-linux-gnu"
cp "$tmp/root/usr/bin/h2load" "$dest/usr/bin/"
cp -P "$tmp"/root/usr/lib/x86_64-linux-gnu/lib{nghttp2,ev,jemalloc,ssl,crypto}.so* "$dest/usr/lib/x86_64-linux-gnu/"
LD_LIBRARY_PATH="$dest/usr/lib/x86_64-linux-gnu" "$dest/usr/bin/h2load" --version
du -sh "$dest"
