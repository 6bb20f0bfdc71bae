#!/usr/bin/env bash
# The harness of the lent GPU machine, one entry point (tools/device/README.md):
#
#   bash tools/device/run.sh carry [video] [wrk] [extra requirement ...]   here: build what a call carries
#   bash tools/device/run.sh PART...              there: setup tests bench folder http streams memory cache
#   PARTS=diag,build,engines bash tools/device/run.sh engine     there: issue #34's compiled engine
#   PARTS=build,startup bash tools/device/run.sh startup         there: issue #26's start-up
#
# Each job is a script beside this one (carry.sh, suite.sh, engine.sh, startup.sh; pack.sh is
# sourced by the last three), whose header lists its parts and knobs. They run from the
# repository root, where the carried .whlx, .cache and .data are.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  carry|engine|startup) job=$1; shift; exec bash "tools/device/$job.sh" "$@" ;;
  *) exec bash tools/device/suite.sh "$@" ;;
esac
