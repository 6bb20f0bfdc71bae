#!/usr/bin/env bash
# The GPU machine's harness, one entry point (tools/device/README.md): that machine reaches no
# package index and takes at most 64 MiB sent along with each command.
#
#   bash tools/device/run.sh carry [video] [wrk] [extra requirement ...]   here: build what a command carries
#   bash tools/device/run.sh PART...              there: setup build builds tests nvdec bench kernels startup http streams isolation memory cache fusion
#
# Each job is a script beside this one (carry.sh, suite.sh; pack.sh is sourced by suite.sh),
# whose header lists its parts and knobs. They run from the repository root, where the carried
# .whlx, .cache and .data are.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  carry) shift; exec bash tools/device/carry.sh "$@" ;;
  *) exec bash tools/device/suite.sh "$@" ;;
esac
