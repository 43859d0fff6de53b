"""`<root>/pipeline.json`: which job runs which stage where (the contract in docs/pipeline.md, "The pipeline directory").

    {"pipeline": <path>, "name": ..., "submitted_at": ..., "root": ..., "workdir": ...,
     "stages": {"<name>": {"output_dir": ..., "job_id": ... (null under relay run),
                           "depends_on": [...], "sbatch": <path or null>, "launched": ...,
                           "config": ..., "max_steps": ..., "job_name": ...}}}

Stages appear in pipeline order. A stage this launch did not run (`--from`, `--only`) keeps the
entry of the launch that ran it, so `relay status` still shows it.

With cluster.warmup on, a top-level "warmup" entry describes this launch's kernel-cache warm-up
(absent when the launch had none; "stages" is unchanged by it):

    "warmup": {"job_id": ... (null under relay run), "job_name": ..., "sbatch": <path or null>,
               "directory": <root>/warmup, "launched": "slurm" | "local", "launched_at": ...,
               "before": <the first stage, which waits for it>, "stages": [...],
               "reports": {"<stage>": <root>/warmup/<stage>.json},
               "result": <root>/warmup/warmup-result.json}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from launcher.pipeline import Pipeline

RECORD_FILE = "pipeline.json"


class RecordError(Exception):
    """The pipeline root holds no readable pipeline.json. The message says where it looked."""


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def build_record(pipeline: Pipeline, launched: dict[str, dict[str, Any]], *, mode: str,
                 previous: dict[str, Any] | None = None,
                 warmup: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline.json content after launching the stages in `launched`.

    launched: stage name -> {"job_id": str | None, "sbatch": str | None}. mode: "slurm" or
    "local". warmup: the warm-up's {"job_id", "sbatch", "launched_at"} once it was launched
    (pipeline.warmup says what it runs). Pure: the caller writes it.
    """
    old_stages = (previous or {}).get("stages", {}) if isinstance(previous, dict) else {}
    specs = {s.name: s for s in pipeline.stages}
    stages: dict[str, Any] = {}
    for name, output_dir in pipeline.output_dirs.items():
        if name in launched:
            spec = specs[name]
            stages[name] = {
                "output_dir": output_dir,
                "job_id": launched[name].get("job_id"),
                "depends_on": list(spec.depends_on),
                "sbatch": launched[name].get("sbatch"),
                "launched": mode,
                "launched_at": launched[name].get("launched_at", now_iso()),
                # relay run only: the stage's process, so `relay status` can tell it runs.
                **{k: launched[name][k] for k in ("pid", "pid_started", "host")
                   if k in launched[name]},
                "config": spec.config,
                "max_steps": spec.args.get("max_steps"),
                "job_name": spec.job_name,
            }
        elif isinstance(old_stages.get(name), dict) and old_stages[name].get("output_dir") == output_dir:
            stages[name] = old_stages[name]
        else:
            stages[name] = {"output_dir": output_dir, "job_id": None, "depends_on": [],
                            "sbatch": None, "launched": None}
    record = {
        "pipeline": pipeline.path,
        "name": pipeline.name,
        "submitted_at": now_iso(),
        "mode": mode,
        "root": pipeline.root,
        "workdir": pipeline.workdir,
        "stages": stages,
    }
    spec = getattr(pipeline, "warmup", None)
    if spec is not None and warmup is not None:
        from launcher.job import WARMUP_RESULT

        record["warmup"] = {
            "job_id": warmup.get("job_id"),
            "job_name": spec.job_name,
            "sbatch": warmup.get("sbatch"),
            "directory": spec.directory,
            "launched": mode,
            "launched_at": warmup.get("launched_at", now_iso()),
            "before": spec.before,
            "stages": spec.stages,
            "reports": {run.stage: run.report for run in spec.runs},
            "result": str(Path(spec.directory) / WARMUP_RESULT),
        }
    return record


def write_record(root: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write `<root>/pipeline.json` atomically (a reader never sees half a file)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / RECORD_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_record(root: str | os.PathLike) -> dict[str, Any]:
    """Parse `<root>/pipeline.json`. Raises RecordError when it is missing or unreadable."""
    path = Path(root) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"{path} does not exist: {root} is not a pipeline root (relay submit "
                          f"and relay run write it).") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path} is unreadable: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("stages"), dict):
        raise RecordError(f"{path} has no `stages` mapping.")
    return record


def read_record_if_any(root: str | os.PathLike) -> dict[str, Any] | None:
    """Like read_record, but None when there is none (a fresh root)."""
    try:
        return read_record(root)
    except RecordError:
        return None
