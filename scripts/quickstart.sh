#!/usr/bin/env bash
# Sets everything up and runs the embedded default on this machine: the tiny pipeline on
# synthetic moving-shapes data (CPU is fine), then prints where each stage's samples and
# scores are. Extra arguments go to `relay run` (e.g. --root DIR).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/relay run config/pipeline/tiny.yaml "$@"
