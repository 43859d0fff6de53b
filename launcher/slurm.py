"""Slurm side of the launcher: submitit parameters, the rendered sbatch script, submission.

One stage = one submitit job (launcher.job.StageJob): `sbatch` runs `srun` with one task per
GPU (one per node x tasks_per_node on CPU), and every task is a submitit Python process that
runs train.py in-process as one rank. Because each rank is itself an srun task, `--signal=USR2@lead`
reaches every rank directly (torchrun's agent would die on it; docs/cluster.md). Chaining:
`--dependency=afterok:<previous>` with `--kill-on-invalid-dep=yes`, so a failed stage cancels
the rest instead of leaving them pending forever. `--requeue` + `--open-mode=append` let a
preempted job requeue itself and keep one log.

With `cluster.warmup` on, one more job goes first: the kernel-cache warm-up
(launcher.job.WarmupJob), one node and one task, that runs `python -m trainer.warmup` for each
stage about to launch; the first stage waits for it (afterok, kill-on-invalid-dep), so a failed
warm-up stops the chain before 240 nodes start.

Pure functions (`executor_parameters`, `render_setup`, `render_sbatch` and their warm-up
counterparts) are what the golden tests lock; `submit_pipeline` and the query helpers call Slurm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from launcher.pipeline import Pipeline, StageSpec, WarmupSpec
from launcher.resources import ResourceError, resource_root
from launcher.secret_values import (argv_fields, fields_holding_secrets, resource_fields,
                                    secret_values)

SBATCH_FILE = "relay-job.sbatch"  # the rendered script, kept in each stage's output_dir
SLURM_DIR = "slurm"  # submitit's folder inside each output_dir: logs, pickles, submission files
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                           "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
                           "STAGE_OUT", "RESV_DEL_HOLD"})


class SlurmError(Exception):
    """Slurm refused or could not be reached. The message says what it answered."""


class SecretValueError(SlurmError):
    """A field to be rendered into a job script holds a credential from the environment."""


def refuse_secret_values(where: str, fields) -> None:
    """Raise SecretValueError naming each field of `fields` ((name, value) pairs) whose value
    equals or contains a credential of this process's environment."""
    found = fields_holding_secrets(fields, secret_values(os.environ))
    if found:
        named = "; ".join(f"`{field}` holds the value of ${name}" for field, name in found)
        raise SecretValueError(
            f"{where}: {named}. relay does not write credentials into the sbatch script, which "
            f"is kept on shared storage. Remove the field (or the interpolation that filled it) "
            f"from the YAML: the job inherits {', '.join(sorted({n for _, n in found}))} from "
            f"the environment of `relay submit`.")


def slurm_folder(stage: StageSpec) -> Path:
    """submitit's folder for a stage: `<output_dir>/slurm`."""
    return Path(stage.output_dir) / SLURM_DIR


def slurm_signal(stage: StageSpec) -> str:
    """`--signal` value: the stage's preemption signal (train.py's key), `signal_lead_s` early."""
    name = str(stage.args.get("preemption_signal", "SIGUSR2")).upper()
    name = name[3:] if name.startswith("SIG") else name
    return f"{name}@{stage.resources.signal_lead_s}"


def render_setup(stage: StageSpec, *, repo_root: str | Path | None = None) -> list[str]:
    """The shell lines the batch script runs before `srun`: exports, then slurm/env.sh
    (`repo_root`/slurm/env.sh; by default this checkout's, or the copy installed with relay).

    Every value is shlex-quoted. Secrets never appear here: they reach the job through the
    environment sbatch inherits from `relay submit`.
    """
    r = stage.resources
    exports = {"RELAY_NETWORK": r.network, "RELAY_OUTPUT_DIR": stage.output_dir,
               "RELAY_STAGE": stage.name, "RELAY_MAX_REQUEUES": str(r.max_requeues), **r.env}
    # The command each rank runs, for whoever reads this file; JSON escapes every newline, so
    # no value can leave the comment.
    return _setup_lines(["# train.py " + json.dumps(list(stage.train_argv), ensure_ascii=True)],
                        exports, repo_root)


def _setup_lines(comments: list[str], exports: dict[str, str],
                 repo_root: str | Path | None) -> list[str]:
    """`repo_root`: where slurm/env.sh is; None: this checkout's, else the one installed with
    relay (launcher.resources). Raises SlurmError when there is none."""
    if repo_root is None:
        try:
            repo_root = resource_root()
        except ResourceError as exc:
            raise SlurmError(str(exc)) from None
    lines = list(comments)
    lines += [f"export {name}={shlex.quote(value)}" for name, value in exports.items()]
    env_sh = shlex.quote(str(Path(repo_root) / "slurm" / "env.sh"))
    lines.append(f"source {env_sh} || {{ echo 'relay: slurm/env.sh failed' >&2; exit 1; }}")
    return lines


def executor_parameters(stage: StageSpec, *, dependency: str | None = None,
                        repo_root: str | Path | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for a stage (keys of submitit's sbatch renderer).

    `dependency` is the job id (or a placeholder) of the stage this one waits for. Raises
    SecretValueError when a field holds a credential's value.
    """
    refuse_secret_values(f"stage {stage.name}", [
        ("output_dir", stage.output_dir), ("job_name", stage.job_name),
        *resource_fields(stage.resources), *argv_fields(stage.train_argv, "train.py")])
    return _parameters(stage.resources, job_name=stage.job_name, signal=slurm_signal(stage),
                       setup=render_setup(stage, repo_root=repo_root), dependency=dependency)


def _parameters(r, *, job_name: str, signal: str, setup: list[str],
                dependency: str | None) -> dict[str, Any]:
    """submitit parameters of one job with Resources `r`, shared by stages and the warm-up."""
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": r.nodes,
        "ntasks_per_node": r.tasks_per_node,
        "time": r.time_min,
        "signal_delay_s": r.signal_lead_s,
        "setup": setup,
        "stderr_to_stdout": True,  # one log per rank: <output_dir>/slurm/<jobid>_<rank>_log.out
        "wckey": None,  # submitit's default tags jobs "submitit"; leave the site's default
        # A rank that dies takes the step down instead of leaving the others in a collective.
        "srun_args": ["--kill-on-bad-exit=1"],
        "additional_parameters": {
            "requeue": True,
            "signal": signal,
            **r.sbatch_extra,
        },
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "mem", "exclude", "constraint"):
        value = getattr(r, key)
        if value is not None:
            params[key] = value
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    if dependency is not None:
        params["dependency"] = f"afterok:{dependency}"
        params["additional_parameters"]["kill_on_invalid_dep"] = "yes"
    return params


def submitit_command(python: str, folder: str | Path) -> str:
    """What each srun task runs: submitit's entry point on the stage's folder (quoted)."""
    return f"{shlex.quote(python)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def render_sbatch(stage: StageSpec, *, dependency: str | None = None,
                  repo_root: str | Path | None = None) -> str:
    """The sbatch script submitit submits for `stage`, as text (no Slurm needed).

    Raises ValueError when submitit rejects a parameter.
    """
    from submitit.slurm.slurm import _make_sbatch_string

    folder = slurm_folder(stage)
    params = executor_parameters(stage, dependency=dependency, repo_root=repo_root)
    return _make_sbatch_string(command=submitit_command(stage.resources.python, folder),
                               folder=folder, **params)


# ---------------------------------------------------------------------------------------------
# The kernel-cache warm-up job
# ---------------------------------------------------------------------------------------------

def warmup_folder(warmup: WarmupSpec) -> Path:
    """submitit's folder for the warm-up job: `<root>/warmup/slurm`."""
    return Path(warmup.directory) / SLURM_DIR


def render_warmup_setup(warmup: WarmupSpec, *, repo_root: str | Path | None = None) -> list[str]:
    """The warm-up job's lines before `srun`: the commands it runs (as comments), the cluster's
    exports, then slurm/env.sh, so the kernel caches are the ones every stage uses.

    No RELAY_OUTPUT_DIR: the warm-up writes into no stage's output_dir.
    """
    r = warmup.resources
    comments = [f"# warm-up {run.stage}: trainer.warmup "
                + json.dumps(list(run.argv), ensure_ascii=True) for run in warmup.runs]
    exports = {"RELAY_NETWORK": r.network, "RELAY_STAGE": "warmup", **r.env}
    return _setup_lines(comments, exports, repo_root)


def warmup_executor_parameters(warmup: WarmupSpec, *,
                               repo_root: str | Path | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of the warm-up job: the first of the chain, so it
    depends on nothing. Requeued like a stage when preempted (warming up twice is harmless).
    Raises SecretValueError when a field holds a credential's value."""
    r = warmup.resources
    refuse_secret_values("the warm-up job", [
        ("job_name", warmup.job_name), *resource_fields(r),
        *(field for run in warmup.runs for field in argv_fields(run.argv, f"{run.stage}: train.py"))])
    return _parameters(r, job_name=warmup.job_name, signal=f"USR2@{r.signal_lead_s}",
                       setup=render_warmup_setup(warmup, repo_root=repo_root), dependency=None)


def render_warmup_sbatch(warmup: WarmupSpec, *, repo_root: str | Path | None = None) -> str:
    """The sbatch script submitit submits for the warm-up job, as text (no Slurm needed)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = warmup_folder(warmup)
    params = warmup_executor_parameters(warmup, repo_root=repo_root)
    return _make_sbatch_string(command=submitit_command(warmup.resources.python, folder),
                               folder=folder, **params)


# ---------------------------------------------------------------------------------------------
# Talking to Slurm
# ---------------------------------------------------------------------------------------------

def require_slurm() -> None:
    """Raise SlurmError unless sbatch, srun and sacct are on PATH."""
    missing = [tool for tool in ("sbatch", "srun", "sacct", "squeue") if shutil.which(tool) is None]
    if missing:
        raise SlurmError(f"{', '.join(missing)} not found: this machine is not a Slurm login "
                         f"node. Run the pipeline here with `relay run` instead.")


@dataclasses.dataclass(frozen=True)
class SubmittedStage:
    name: str
    job_id: str
    sbatch: str
    depends_on: tuple[str, ...]
    warmup: bool = False  # the kernel-cache warm-up job, not a stage


def _submit_job(job, *, folder: Path, python: str, max_requeues: int, parameters: dict,
                what: str, keep_as: Path) -> str:
    """Submit one callable through submitit; copy its rendered script to `keep_as`.

    Returns the job id. Raises SlurmError with sbatch's answer when the submission is refused.
    """
    import submitit

    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=folder, python=shlex.quote(python),
                                      max_num_timeout=max_requeues)
    executor.update_parameters(**parameters)
    try:
        submitted = executor.submit(job)
    except (subprocess.CalledProcessError, submitit.core.utils.FailedSubmissionError,
            submitit.core.utils.FailedJobError, OSError) as exc:
        detail = getattr(exc, "output", None) or getattr(exc, "stderr", None) or exc
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        raise SlurmError(f"sbatch refused {what}: {' '.join(str(detail).split())}") from None
    keep_as.write_text(Path(submitted.paths.submission_file).read_text())
    return str(submitted.job_id)


def submit_stage(stage: StageSpec, *, dependency: str | None, workdir: str | Path,
                 repo_root: str | Path | None = None) -> SubmittedStage:
    """Submit one stage through submitit; keep its rendered script as <output_dir>/relay-job.sbatch.

    Raises SlurmError with sbatch's answer when the submission is refused.
    """
    from launcher.job import StageJob

    job = StageJob(stage=stage.name, train_argv=list(stage.train_argv),
                   workdir=str(workdir), output_dir=stage.output_dir,
                   max_requeues=stage.resources.max_requeues,
                   preemption_signal=str(stage.args.get("preemption_signal", "SIGUSR2")),
                   entry=stage.entry)
    sbatch = Path(stage.output_dir) / SBATCH_FILE
    job_id = _submit_job(job, folder=slurm_folder(stage), python=stage.resources.python,
                         max_requeues=stage.resources.max_requeues,
                         parameters=executor_parameters(stage, dependency=dependency,
                                                        repo_root=repo_root),
                         what=f"stage {stage.name}", keep_as=sbatch)
    return SubmittedStage(name=stage.name, job_id=job_id, sbatch=str(sbatch),
                          depends_on=stage.depends_on)


def submit_warmup(warmup: WarmupSpec, *, workdir: str | Path,
                  repo_root: str | Path | None = None) -> SubmittedStage:
    """Submit the warm-up job; keep its script as <root>/warmup/relay-job.sbatch.

    Raises SlurmError with sbatch's answer when the submission is refused.
    """
    from launcher.job import WarmupJob

    sbatch = Path(warmup.directory) / SBATCH_FILE
    job_id = _submit_job(WarmupJob.from_spec(warmup, workdir=str(workdir)),
                         folder=warmup_folder(warmup), python=warmup.resources.python,
                         max_requeues=warmup.resources.max_requeues,
                         parameters=warmup_executor_parameters(warmup, repo_root=repo_root),
                         what="the warm-up job", keep_as=sbatch)
    return SubmittedStage(name="warmup", job_id=job_id, sbatch=str(sbatch), depends_on=(),
                          warmup=True)


def submit_pipeline(pipeline: Pipeline, *, repo_root: str | Path | None = None,
                    on_submit=None) -> list[SubmittedStage]:
    """Submit the pipeline's stages in order, each after the previous one (afterok).

    With a warm-up (pipeline.warmup), it is submitted first and the first stage waits for it.
    All or nothing: every job's parameters are rendered before the first is submitted (a
    SecretValueError submits nothing); when a submission fails, the jobs already submitted are
    cancelled and SlurmError is raised. `on_submit(SubmittedStage)` is called after each.
    """
    refuse_pipeline_secrets(pipeline)
    done: list[SubmittedStage] = []
    try:
        if pipeline.warmup is not None:
            submitted = submit_warmup(pipeline.warmup, workdir=pipeline.workdir,
                                      repo_root=repo_root)
            done.append(submitted)
            if on_submit is not None:
                on_submit(submitted)
        for stage in pipeline.stages:
            dependency = done[-1].job_id if done and (stage.depends_on or done[-1].warmup) else None
            submitted = submit_stage(stage, dependency=dependency, workdir=pipeline.workdir,
                                     repo_root=repo_root)
            done.append(submitted)
            if on_submit is not None:
                on_submit(submitted)
    except BaseException:
        if done:
            cancel_jobs([s.job_id for s in done])
        raise
    return done


def refuse_pipeline_secrets(pipeline: Pipeline) -> None:
    """Raise SecretValueError if any job of `pipeline` would render a credential's value."""
    if pipeline.warmup is not None:
        warmup_executor_parameters(pipeline.warmup)
    for stage in pipeline.stages:
        executor_parameters(stage)


def cancel_jobs(job_ids: list[str]) -> None:
    """scancel the given jobs (already finished ones are ignored). Raises SlurmError."""
    ids = [str(j) for j in job_ids if j]
    if not ids:
        return
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SlurmError(f"scancel {' '.join(ids)} failed: {proc.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job: state (first word, e.g. CANCELLED), and the rest."""

    job_id: str
    state: str
    exit_code: str | None = None
    elapsed: str | None = None
    reason: str | None = None
    requeues: int | None = None


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """Parse `sacct -X -D -n -P -o JobIDRaw,State,ExitCode,Elapsed,Reason` (one line a run).

    A requeued job has one line per run (-D); the last is the current one and the count minus
    one is the number of requeues.
    """
    runs: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 5 or not fields[0]:
            continue
        runs.setdefault(fields[0], []).append(fields)
    out = {}
    for job_id, rows in runs.items():
        last = rows[-1]
        reason = last[4] if last[4] not in ("", "None") else None
        out[job_id] = JobInfo(job_id=job_id, state=(last[1].split() or ["UNKNOWN"])[0],
                              exit_code=last[2] or None, elapsed=last[3] or None, reason=reason,
                              requeues=len(rows) - 1)
    return out


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """Parse `squeue -h -o %i|%T|%r|%M` (id, state, reason, elapsed)."""
    out = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 4:
            continue
        reason = fields[2] if fields[2] not in ("", "None") else None
        out[fields[0]] = JobInfo(job_id=fields[0], state=fields[1], reason=reason, elapsed=fields[3])
    return out


def query_jobs(job_ids: list[str]) -> dict[str, JobInfo]:
    """Current Slurm view of `job_ids`: squeue for live jobs (fresher), sacct for the rest.

    Jobs Slurm does not know (yet) are left out. Never raises.
    """
    ids = [str(j) for j in job_ids if j]
    if not ids:
        return {}
    joined = ",".join(ids)
    accounting = parse_sacct(_run(["sacct", "-X", "-D", "-n", "-P", "-j", joined,
                                   "-o", "JobIDRaw,State,ExitCode,Elapsed,Reason"]))
    queue = parse_squeue(_run(["squeue", "-h", "-j", joined, "-t", "all", "-o", "%i|%T|%r|%M"]))
    out = {}
    for job_id in ids:
        acct, live = accounting.get(job_id), queue.get(job_id)
        if live is not None and (acct is None or live.state in ACTIVE_STATES):
            requeues = acct.requeues if acct else None
            restarts = _restart_count(job_id)
            out[job_id] = dataclasses.replace(
                live, requeues=restarts if restarts is not None else requeues,
                exit_code=acct.exit_code if acct else None)
        elif acct is not None:
            # sacct's Reason is often "None" where squeue still says why (DependencyNeverSatisfied).
            reason = acct.reason or (live.reason if live else None)
            restarts = _restart_count(job_id)
            out[job_id] = dataclasses.replace(acct, reason=reason, requeues=max(
                restarts or 0, acct.requeues or 0))
    return out


def _restart_count(job_id: str) -> int | None:
    """`Restarts=` of `scontrol show job` (kept for MinJobAge after the job ends), or None."""
    text = _run(["scontrol", "-o", "show", "job", job_id])
    for token in text.split():
        if token.startswith("Restarts="):
            try:
                return int(token.split("=", 1)[1])
            except ValueError:
                return None
    return None
