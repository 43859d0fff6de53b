#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: the environment (scripts/setup.sh), the
# one-machine Slurm cluster the integration tests talk to (slurm/local/start.sh), then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k checkpoint`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash slurm/local/start.sh
# Two workers (RELAY_TEST_WORKERS): much of the suite waits on child processes and Slurm rather
# than computing, so two cores finish it sooner; the Slurm tests share one worker (conftest.py).
exec .venv/bin/python -m pytest -n "${RELAY_TEST_WORKERS:-2}" --dist loadgroup "$@"
