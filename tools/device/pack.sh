# Sourced by suite.sh. Only the first eight files of $OUT (by name) come back from the GPU
# machine: pack puts all of $OUT into $OUT/0-results.tgz, which sorts first, replacing it whole
# so that a command cut off mid-pack still returns the previous one.
pack() {
  tar -C "$OUT" --exclude=0-results.tgz --exclude=0-results.tgz.part -czf "$OUT/0-results.tgz.part" . \
    && mv "$OUT/0-results.tgz.part" "$OUT/0-results.tgz"
}
