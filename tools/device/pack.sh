# Sourced by suite.sh. Only the first eight files of $OUT (by name) come back from the GPU
# machine: pack puts all of $OUT into $OUT/0-results.tgz, which sorts first, replacing it whole
# so that a command cut off mid-pack still returns the previous one.
# $OUT/models/ is left out: files brought back whole (the int8 part's models, 12-15 MB each).
pack() {
  tar -C "$OUT" --exclude=0-results.tgz --exclude=0-results.tgz.part --exclude=./models -czf "$OUT/0-results.tgz.part" . \
    && mv "$OUT/0-results.tgz.part" "$OUT/0-results.tgz"
}
