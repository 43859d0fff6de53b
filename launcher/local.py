"""`relay run`: the same pipeline on this machine, without Slurm.

Each selected stage runs as a plain child process, `python -m trainer.train <argv>`, with the
argv `relay submit` would give the job, in the directory relay runs in; one after the other,
stopping at the first that does not complete. A child process (rather than submitit's local
executor) keeps train.py's progress on this terminal, Ctrl-C reaching it, and its exit code
the stage's verdict. pipeline.json is written as for a submission, with job_id null.

With cluster.warmup on, the kernel-cache warm-up runs first, as the Slurm warm-up job would:
`python -m trainer.warmup <stage argv>` per warmed stage (launcher.job.run_warmups), reports
in <root>/warmup/; a failed warm-up stops the run before any stage starts.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

from launcher.job import run_warmups
from launcher.pipeline import Pipeline, StageSpec
from launcher.record import build_record, now_iso, read_record_if_any, write_record

PREEMPTED = 75


def train_command(stage: StageSpec, python: str = sys.executable) -> list[str]:
    """The child process of a stage: its entry (train.py, or the encoder of an encode stage)
    through `-m`, so the repository need not be on PATH."""
    return [python, "-m", stage.entry, *stage.train_argv]


def _start_ranks(stage: StageSpec, cmd: list[str], workdir: str) -> list[subprocess.Popen]:
    """The processes of a stage: one for a train stage; for an encode stage one per rank its
    resources give (RANK / WORLD_SIZE / LOCAL_RANK set), each encoding its share."""
    if stage.kind != "encode" or stage.resources.world_size == 1:
        return [subprocess.Popen(cmd, cwd=workdir)]
    world = stage.resources.world_size
    per_node = max(1, world // stage.resources.nodes)
    attempt = uuid.uuid4().hex[:12]  # the ranks of this launch report under one name
    return [subprocess.Popen(cmd, cwd=workdir, env={
        **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node), "RELAY_ENCODE_ATTEMPT": attempt})
        for rank in range(world)]


def _wait_all(children: list[subprocess.Popen]) -> int:
    """The stage's exit code: the first non-zero one of its ranks (75, preempted, when one
    stopped and saved while the others completed), else 0."""
    codes = [child.wait() for child in children]
    return next((code for code in codes if code not in (0, PREEMPTED)), None) or \
        (PREEMPTED if PREEMPTED in codes else 0)


def process_identity(pid: int) -> dict:
    """What identifies a stage's process for `relay status`: pid, start time and host."""
    import socket

    import psutil

    return {"pid": pid, "pid_started": psutil.Process(pid).create_time(),
            "host": socket.gethostname()}


def explain_exit(stage: StageSpec, code: int, pipeline_path: str) -> str:
    """The message `relay run` prints when a stage ends with a non-zero code."""
    out = Path(stage.output_dir)
    error = None
    try:
        error = json.loads((out / "run-result.json").read_text()).get("error")
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    if code == PREEMPTED:
        saved = ("published every part it finished" if stage.kind == "encode"
                 else "saved a checkpoint")
        return (f"stage {stage.name} was interrupted and {saved} in {out}. Resume "
                f"with: relay run {shlex.quote(pipeline_path)} --from {stage.name}")
    what = {2: "bad configuration, or output_dir in use by another run",
            1: "training failed"}.get(code, f"exit code {code}")
    if code < 0:
        what = f"killed by signal {-code}"
    detail = f": {error}" if error else ""
    return (f"stage {stage.name} failed ({what}){detail}. Later stages were not run. "
            f"Log: {out / 'train.log'}")


def describe_samples(stage: StageSpec) -> str:
    """Where a stage's validation samples and scores are, or how to make them."""
    out = Path(stage.output_dir)
    manifests = []
    for path in out.glob("samples/step-*/manifest.json"):
        try:
            manifests.append((int(path.parent.name.split("-", 1)[1]), path))
        except ValueError:
            continue
    if not manifests:
        return (f"{stage.name}: no validation samples in {out}; score it with "
                f"`relay eval --checkpoint {shlex.quote(str(out))}`")
    step, path = max(manifests)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        manifest = {}
    # Scores sit at the top level, or per weights ({"weights": {"live": {...}, "ema": {...}}}).
    groups = {"": manifest} if isinstance(manifest, dict) else {}
    if isinstance(manifest, dict) and isinstance(manifest.get("weights"), dict):
        groups.update({f"{name} ": v for name, v in manifest["weights"].items() if isinstance(v, dict)})
    scores = []
    for prefix, group in groups.items():
        found = [f"{label} {group[key]:.0%}" for key, label in
                 (("colour_accuracy", "colour"), ("direction_accuracy", "direction"))
                 if isinstance(group.get(key), (int, float))]
        if found:
            scores.append(prefix + ", ".join(found))
    score = f" ({'; '.join(scores)})" if scores else ""
    return f"{stage.name}: samples of step {step} in {path.parent}{score}"


def run_local_warmup(pipeline: Pipeline, *, python: str = sys.executable,
                     echo: Callable[[str], None] = print) -> int:
    """The kernel-cache warm-up of `relay run`: 0 when every warmed stage is ok, else the
    failing warm-up's exit code (1 when it has none), after saying why."""
    spec = pipeline.warmup
    echo(f"relay run: kernel warm-up of {', '.join(spec.stages)} -> {spec.directory}")
    runs = [{"stage": r.stage, "argv": list(r.argv), "report": r.report} for r in spec.runs]
    try:
        # The report JSON stays in its file; the terminal gets the progress log and a summary.
        result = run_warmups(runs, directory=spec.directory, python=python,
                             workdir=pipeline.workdir, echo=echo, show_reports=False,
                             prefix="relay run")
    except KeyboardInterrupt:
        echo("relay run: interrupted during the kernel warm-up.")
        return 130
    if result["status"] != "ok":
        echo(f"relay run: {result['error']}. No stage was run.")
        code = result["stages"][result["failed"]]["code"]
        return code if isinstance(code, int) and code > 0 else 1
    echo("relay run: kernel warm-up done. Reports:")
    for stage, entry in result["stages"].items():
        echo(f"  {stage}: {entry['report']}")
    return 0


def run_pipeline_locally(pipeline: Pipeline, *, python: str = sys.executable,
                         echo: Callable[[str], None] = print) -> int:
    """Run the selected stages one after the other; return 0, or the failing stage's exit code."""
    previous = read_record_if_any(pipeline.root)
    launched: dict[str, dict] = {}
    warmup = None
    if pipeline.warmup is not None:
        warmup = {"job_id": None, "sbatch": None, "launched_at": now_iso()}
        write_record(pipeline.root, build_record(pipeline, launched, mode="local",
                                                 previous=previous, warmup=warmup))
        code = run_local_warmup(pipeline, python=python, echo=echo)
        if code != 0:
            return code
    for stage in pipeline.stages:
        launched[stage.name] = {"job_id": None, "sbatch": None, "launched_at": now_iso()}
        write_record(pipeline.root, build_record(pipeline, launched, mode="local",
                                                 previous=previous, warmup=warmup))
        cmd = train_command(stage, python)
        echo(f"relay run: stage {stage.name} -> {stage.output_dir}")
        echo("  " + shlex.join(cmd))
        children = _start_ranks(stage, cmd, pipeline.workdir)
        # `relay status` tells a running stage from a killed one by this process (rank 0's).
        launched[stage.name].update(process_identity(children[0].pid))
        write_record(pipeline.root, build_record(pipeline, launched, mode="local",
                                                 previous=previous, warmup=warmup))
        try:
            code = _wait_all(children)
        except KeyboardInterrupt:
            for child in children:
                child.terminate()  # SIGTERM: the trainer saves at the step boundary and exits
            for child in children:
                child.wait()
            echo(f"relay run: interrupted during stage {stage.name}.")
            return 130
        if code != 0:
            echo(f"relay run: {explain_exit(stage, code, pipeline.path)}")
            return code
        echo(f"relay run: stage {stage.name} completed.")
    echo("relay run: all stages completed. Samples and scores:")
    for stage in pipeline.stages:
        echo("  " + (describe_encoded(stage) if stage.kind == "encode" else describe_samples(stage)))
    return 0


def describe_encoded(stage: StageSpec) -> str:
    """What an encode stage wrote: files encoded, bad files and where they are listed."""
    from trainer.data.manifest import SUMMARY_FILE, encode_progress

    done, total, bad = encode_progress(stage.output_dir)
    return (f"{stage.name}: {done - bad} of {total} files encoded into {stage.output_dir}, "
            f"{bad} bad (listed in {Path(stage.output_dir) / SUMMARY_FILE})")
