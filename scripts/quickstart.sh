#!/usr/bin/env bash
# Sets everything up and runs the embedded default on this machine: the tiny pipeline's four
# stages on synthetic moving-shapes data (CPU is fine; about 5 minutes on two idle cores), then
# prints where each stage's samples and scores are and writes runs/tiny/plot.png (every
# stage's curves). Extra arguments go to `relay run` (e.g. --root DIR); the longer variant:
# .venv/bin/relay run config/pipeline/tiny-long.yaml
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/relay run config/pipeline/tiny.yaml "$@"
