#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: the environment (scripts/setup.sh), the
# one-machine Slurm cluster the integration tests talk to (slurm/local/start.sh), then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k checkpoint`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash slurm/local/start.sh
exec .venv/bin/python -m pytest "$@"
