#!/bin/bash
# Stage2 (DMD via SGF) as one Slurm job.
#   sbatch scripts/stage2.sh [config.yaml] [--key value ...]     (default config: config/stage2.yaml)
# Only this header (its #SBATCH lines and RELAY_STAGE_NAME) differs between the stage scripts;
# the body is scripts/_stage.sh. Edit the header for your cluster (add --partition/--account/
# --qos/--exclude as it needs), or override it on the command line:
#   sbatch --nodes=1 scripts/stage2.sh config/tiny/stage2.yaml
#SBATCH --job-name=relay-stage2
#SBATCH --nodes=240
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR2@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
RELAY_STAGE_NAME=stage2  # the default config is config/$RELAY_STAGE_NAME.yaml
# From here on every stage script is the same: find the repository, run scripts/_stage.sh.
# Under sbatch this file runs from a copy in Slurm's spool directory: find the repository
# through RELAY_ROOT or the directory sbatch was called from, never through $0.
RELAY_ROOT="$(cd "${RELAY_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" && pwd)"
if [[ ! -f "$RELAY_ROOT/scripts/_stage.sh" ]]; then
    echo "relay: $RELAY_ROOT is not the relay repository: run sbatch from its root or set RELAY_ROOT" >&2
    exit 2
fi
# shellcheck source-path=SCRIPTDIR source=_stage.sh
source "$RELAY_ROOT/scripts/_stage.sh"
