# shellcheck shell=bash source-path=SCRIPTDIR
# The body shared by scripts/{pretrain,sft,stage1,stage2}.sh, sourced after their #SBATCH
# header with RELAY_STAGE_NAME and RELAY_ROOT set:
#
#   sbatch scripts/<stage>.sh [config.yaml] [--key value ...]
#
# The optional YAML comes first (default: config/$RELAY_STAGE_NAME.yaml), everything after it
# goes to train.py.
# What it does:
#   1. resolves the arguments with `train.py --dry-run` at the job's world size (a bad config
#      fails here, in seconds, before any rank starts) and reads output_dir from them;
#   2. sources slurm/env.sh (caches, NCCL/EFA, MASTER_ADDR/PORT) with RELAY_OUTPUT_DIR set;
#   3. runs `srun` (one task per GPU, i.e. per rank, as the header's --ntasks-per-node says)
#      in the background and waits; SIGUSR2 from `--signal=B:USR2@<lead>` reaches this shell
#      only, so the trap forwards it to srun, which passes it to every task: each rank saves
#      at its next step boundary and exits 75;
#   4. on exit code 75 requeues this job (`scontrol requeue $SLURM_JOB_ID`) while
#      SLURM_RESTART_COUNT < RELAY_MAX_REQUEUES (default 3); the requeued job resumes from
#      output_dir. Any other non-zero code fails the job.
# Environment: RELAY_ROOT (repository root; default $SLURM_SUBMIT_DIR), RELAY_PYTHON
# (default $RELAY_ROOT/.venv/bin/python, else python3), RELAY_MAX_REQUEUES, RELAY_NETWORK
# (efa|ib|tcp|none, see slurm/env.sh), WANDB_API_KEY and other secrets from your shell.
# Outside Slurm (`bash scripts/pretrain.sh ...`) it runs train.py as one process.
set -euo pipefail

cd "$RELAY_ROOT"
relay_config="config/${RELAY_STAGE_NAME}.yaml"
if [[ $# -gt 0 && "$1" != -* ]]; then
    relay_config="$1"
    shift
fi
if [[ -z "${RELAY_PYTHON:-}" ]]; then
    if [[ -x "$RELAY_ROOT/.venv/bin/python" ]]; then
        RELAY_PYTHON="$RELAY_ROOT/.venv/bin/python"
    else
        RELAY_PYTHON=python3
    fi
fi
relay_max_requeues="${RELAY_MAX_REQUEUES:-3}"
relay_ntasks="${SLURM_NTASKS:-1}"
echo "[relay] stage ${RELAY_STAGE_NAME}: ${relay_config} $* (job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0}, ${relay_ntasks} ranks)"

# 1. Validate at the job's world size and learn output_dir.
relay_resolved="$(RANK=0 WORLD_SIZE="$relay_ntasks" "$RELAY_PYTHON" -m trainer.train \
    --config "$relay_config" "$@" --dry-run)" || {
    echo "[relay] ${relay_config}: the configuration was rejected (see above); nothing ran." >&2
    exit 2
}
RELAY_OUTPUT_DIR="$(printf '%s' "$relay_resolved" | "$RELAY_PYTHON" -c \
    'import json, sys; print(json.load(sys.stdin)["output_dir"])')"
export RELAY_OUTPUT_DIR RELAY_PYTHON
mkdir -p -- "$RELAY_OUTPUT_DIR"

# 2. The job environment.
# shellcheck source=../slurm/env.sh
source "$RELAY_ROOT/slurm/env.sh" || exit 1

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    exec "$RELAY_PYTHON" -u -m trainer.train --config "$relay_config" "$@"
fi
# Keep the Slurm log findable from the run directory.
relay_log="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n 1)" || true
if [[ -n "$relay_log" ]]; then
    ln -sfn -- "$relay_log" "$RELAY_OUTPUT_DIR/slurm-${SLURM_JOB_ID}.out" || true
fi

# 3. One task per rank; forward the preemption signal to them through srun.
relay_srun_pid=""
# shellcheck disable=SC2317  # invoked by the trap below
relay_forward() {
    echo "[relay] batch shell got SIG$1: forwarding it to the ranks (srun pid ${relay_srun_pid:-none})"
    if [[ -n "$relay_srun_pid" ]]; then
        kill -s "$1" "$relay_srun_pid" 2>/dev/null || true
    fi
}
trap 'relay_forward USR2' USR2
# scancel signals every task itself; the trap keeps this shell alive until they have saved.
trap 'echo "[relay] batch shell got SIGTERM: waiting for the ranks"' TERM
srun --kill-on-bad-exit=1 --unbuffered "$RELAY_PYTHON" -u -m trainer.train \
    --config "$relay_config" "$@" &
relay_srun_pid=$!
# `wait` returns early whenever a trapped signal arrives: wait again until srun is gone.
while kill -0 "$relay_srun_pid" 2>/dev/null; do
    wait "$relay_srun_pid" || true
done
relay_rc=0
wait "$relay_srun_pid" || relay_rc=$?

# 4. Requeue after a preemption save.
if [[ "$relay_rc" -eq 75 ]]; then
    relay_restarts="${SLURM_RESTART_COUNT:-0}"
    # A cancelled job saves on SIGTERM too, but must stay cancelled: requeue only while
    # Slurm still counts this job as RUNNING (scontrol would requeue a cancelled one).
    relay_state="$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n 1)" || true
    if [[ "$relay_state" != "JobState=RUNNING" ]]; then
        echo "[relay] checkpoint saved, but the job is ${relay_state#JobState=} (cancelled?): not requeueing" >&2
        exit 1
    fi
    if ((relay_restarts < relay_max_requeues)); then
        echo "[relay] checkpoint saved; requeueing job $SLURM_JOB_ID (requeue $((relay_restarts + 1)) of at most $relay_max_requeues)"
        trap - TERM
        scontrol requeue "$SLURM_JOB_ID" || {
            echo "[relay] scontrol requeue $SLURM_JOB_ID failed (cancelled?); the checkpoint is in $RELAY_OUTPUT_DIR" >&2
            exit 1
        }
        exit 0
    fi
    echo "[relay] preempted again after $relay_restarts requeues (RELAY_MAX_REQUEUES=$relay_max_requeues); the checkpoint is in $RELAY_OUTPUT_DIR: resubmit to continue" >&2
    exit 1
fi
exit "$relay_rc"
