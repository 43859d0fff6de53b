"""Pipeline YAML -> validated stages: what each Slurm job will run, checked before any is submitted.

A pipeline YAML (OmegaConf, so `${...}` interpolation works) has these top-level keys:

    name: tiny                    # optional; job names are <name>-<stage> (default: file stem)
    root: runs/tiny               # optional; default pipeline dir (default runs/<name>); --root wins
    source: /models/Wan2.1-T2V-1.3B-Diffusers   # optional: the model the stages start from
    data: /data/wan-480p-latents  # optional: the dataset the stages read
    manifest: /data/clips.csv     # optional: raw media an encode stage turns into `data`
    cluster: {nodes: 1, ...}      # Slurm defaults for every stage (CLUSTER_DEFAULTS)
                                  # warmup: true -> a kernel-cache warm-up job runs first
    stages:                       # ordered: each stage runs after the previous one (afterok)
      pretrain:
        config: config/tiny/pretrain.yaml
        overrides: {max_steps: 600}          # train.py keys, typed as in a stage YAML
      sft:
        config: config/tiny/sft.yaml
        output_dir: ${root}/sft              # the default
        resources: {time: "02:00:00"}        # any cluster key, for this stage only
        overrides:
          pretrained_transformer_path: ${stages.pretrain.output_dir}

A stage of `kind: encode` (ENCODE_STAGE_KEYS, `encode_stage`) runs `python -m
trainer.encode` in every task instead of train.py: each rank encodes its share of
`manifest` through `pipeline`'s vae/ and text_encoder/ into its output_dir, which later stages
read as data_path (checked when they start).

Weights flow through interpolation: a stage names an earlier stage's output_dir, and the trainer
reads that run's newest complete checkpoint when the job starts. `source` and `data` are paths
(strings) that relay reads only through the stages' `${source}` / `${data}`: one line each to
edit when a pipeline's stages all start from one model directory and read one dataset
(config/pipeline/wan-distill-*.yaml). A diffusers pipeline directory an earlier stage writes
first (make_tiny_wan) is checked, as that stage's own folders are, when the stage starts. Relative paths (root, config,
output_dir and every path the stage YAMLs hold) are relative to the directory relay runs in,
exactly as for train.py; the jobs run there too. A relative `config/...` YAML (the pipeline's or a
stage's) that is not there is read from the copy installed with relay (launcher.resources), so
`relay run config/pipeline/tiny.yaml` works from any directory; relay says so in one line.

Entry point: `validate_pipeline(path, ...) -> Pipeline`; raises PipelineError listing every
problem found, so nothing is submitted until the whole pipeline is right.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

import yaml

from launcher.resources import resource_root, shipped_file

from trainer.config.schema import closest_key

PIPELINE_KEYS = ("name", "root", "source", "data", "manifest", "cluster", "stages")
# top-level paths the stages read through ${source} / ${data} / ${manifest}
PATH_KEYS = ("source", "data", "manifest")
STAGE_KEYS = ("kind", "config", "overrides", "output_dir", "resources", "job_name")
# A stage is a train.py run (kind: train, the default) or an encode of raw media (kind: encode:
# `python -m trainer.encode`, one rank per task, each its share of the manifest).
STAGE_KINDS = ("train", "encode")
ENCODE_STAGE_KEYS = ("kind", "manifest", "pipeline", "vae", "text_encoder", "rows_per_shard",
                     "text_max_tokens", "text_encoder_hidden_state_skip_layer", "make_tiny_wan",
                     "demo_clips", "output_dir", "resources", "job_name")
# The module each kind of stage runs in every task of its job.
STAGE_ENTRIES = {"train": "trainer.train", "encode": "trainer.encode"}
NETWORKS = ("efa", "ib", "tcp", "none")

# Every cluster key with its default. `tasks_per_node` is for CPU-only stages (gpus_per_node: 0):
# with GPUs there is always one task (one rank) per GPU.
CLUSTER_DEFAULTS: dict[str, Any] = {
    "partition": None,
    "account": None,
    "qos": None,
    "nodes": 1,
    "gpus_per_node": 0,
    "tasks_per_node": None,
    "cpus_per_task": None,
    "mem": None,
    "time": 60,
    "exclude": None,
    "constraint": None,
    "network": "tcp",
    "max_requeues": 3,
    "signal_lead_s": 120,
    "python": None,
    "env": {},
    "sbatch_extra": {},
    # The kernel-cache warm-up (docs/kernels.md): one 1-node, 1-task job before the first stage
    # that runs `python -m trainer.warmup` for each stage about to launch. `warmup` is per
    # stage like any cluster key (a stage's `resources: {warmup: false}` skips its warm-up);
    # `warmup_time` is the warm-up job's time limit and belongs to the cluster section only.
    "warmup": False,
    "warmup_time": 60,
}
CLUSTER_ONLY_KEYS = frozenset({"warmup_time"})
WARMUP_DIR = "warmup"  # <root>/warmup: the warm-up job's script, Slurm logs and reports
WARMUP_NAME = "warmup"  # its row in `relay status`, its entry in pipeline.json
# The warm-up job's --signal lead: it saves nothing, the signal only says why it is ending.
WARMUP_SIGNAL_LEAD_S = 60

# sbatch options relay sets itself; `sbatch_extra` may not set them behind its back.
MANAGED_SBATCH_OPTIONS = frozenset({
    "job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "mem", "time",
    "partition", "account", "qos", "exclude", "constraint", "signal", "requeue", "no-requeue",
    "dependency", "kill-on-invalid-dep", "output", "error", "open-mode", "array", "wrap",
})

# Names that look like credentials: they must come from the environment, never from a file that
# relay renders (the sbatch script) or writes (pipeline.json).
_SECRET_NAME = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
_STAGE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9_-]*$")
_MEM = re.compile(r"^[0-9]+(\.[0-9]+)?[KMGT]?B?$", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PipelineError(Exception):
    """The pipeline must not be submitted. `problems` holds one user-facing message per issue."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems))


@dataclasses.dataclass(frozen=True)
class Resources:
    """A stage's Slurm resources after merging cluster defaults and stage overrides."""

    partition: str | None
    account: str | None
    qos: str | None
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int | None
    mem: str | None
    time_min: int
    exclude: str | None
    constraint: str | None
    network: str
    max_requeues: int
    signal_lead_s: int
    python: str
    env: dict[str, str]
    sbatch_extra: dict[str, Any]
    warmup: bool = False  # warm this stage's kernels in the warm-up job
    warmup_time_min: int = 60  # the warm-up job's time limit (from the cluster section)

    @property
    def world_size(self) -> int:
        """Ranks of the job: one per GPU, or tasks_per_node per node on CPU."""
        return self.nodes * self.tasks_per_node


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage, validated: what its job runs (`train_argv`) and with which resources."""

    name: str
    config: str
    overrides: dict[str, Any]
    output_dir: str
    job_name: str
    resources: Resources
    train_argv: tuple[str, ...]
    args: Any  # trainer.config.args.ResolvedArgs: the arguments train.py will resolve
    depends_on: tuple[str, ...]
    plan: str = ""  # topology, global batch and memory per GPU (trainer.preflight.describe_plan)
    kind: str = "train"  # STAGE_KINDS

    @property
    def entry(self) -> str:
        """The module every task of the stage's job runs with `train_argv` (its main(argv))."""
        return STAGE_ENTRIES[self.kind]

    @property
    def work(self) -> str:
        """What the stage's max_steps count, for plans and tables."""
        return "files" if self.kind == "encode" else "steps"


@dataclasses.dataclass(frozen=True)
class WarmupRun:
    """One `python -m trainer.warmup <argv>` of the warm-up job: a stage's exact train.py argv."""

    stage: str
    argv: tuple[str, ...]
    report: str  # RELAY_WARMUP_REPORT: <root>/warmup/<stage>.json


@dataclasses.dataclass(frozen=True)
class WarmupSpec:
    """The kernel-cache warm-up job that runs before the first launched stage."""

    job_name: str
    directory: str  # <root>/warmup
    resources: Resources  # one node, one task, one GPU (or one CPU task)
    runs: tuple[WarmupRun, ...]
    before: str  # the first launched stage: it waits for the warm-up (afterok)

    @property
    def stages(self) -> list[str]:
        return [run.stage for run in self.runs]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A validated pipeline: the selected stages in order, plus every stage's output_dir."""

    path: str
    name: str
    root: str
    workdir: str
    stages: list[StageSpec]
    output_dirs: dict[str, str]  # every stage of the file, in order (selected or not)
    notes: list[str]  # warnings worth printing (a stage that will resume, ...)
    warmup: WarmupSpec | None = None  # cluster.warmup: the job that runs before the first stage

    def stage(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Small pure helpers (the unit tests live here)
# ---------------------------------------------------------------------------------------------

def _unknown(where: str, key: str, valid) -> str:
    guess = closest_key(str(key), [str(v) for v in valid])
    hint = f" Did you mean `{guess}`?" if guess else ""
    return f"{where}: unknown key `{key}`.{hint} Valid keys: {', '.join(valid)}."


def parse_time_minutes(value: Any) -> int:
    """Slurm time limit in whole minutes, from minutes (int) or "[D-]HH:MM:SS" / "MM:SS".

    Seconds round up. Raises ValueError for anything else or a limit under one minute.
    """
    if isinstance(value, bool):
        raise ValueError(f"time must be minutes or \"HH:MM:SS\", got {value!r}")
    if isinstance(value, int):
        minutes = value
    elif isinstance(value, str) and re.fullmatch(r"(\d+-)?\d+(:\d+){1,2}", value.strip()):
        text = value.strip()
        days = 0
        if "-" in text:
            d, text = text.split("-", 1)
            days = int(d)
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 2:  # MM:SS, as Slurm reads it
            hours, mins, secs = 0, parts[0], parts[1]
        else:
            hours, mins, secs = parts
        if mins >= 60 and len(parts) == 3 or secs >= 60:
            raise ValueError(f"time {value!r}: minutes and seconds must be below 60")
        minutes = days * 1440 + hours * 60 + mins + math.ceil(secs / 60)
    elif isinstance(value, str) and value.strip().isdigit():
        minutes = int(value.strip())
    else:
        raise ValueError(f"time must be minutes (an integer) or \"HH:MM:SS\", got {value!r}")
    if minutes < 1:
        raise ValueError(f"time must be at least one minute, got {value!r}")
    return minutes


def format_override(value: Any, kind: str) -> str:
    """The command-line text train.py reads back as exactly `value` (see trainer.config.args).

    Strings and paths are taken verbatim by train.py; everything else is YAML flow syntax.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind in ("str", "path") or (kind == "path_or_dict" and isinstance(value, str)):
        return str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, allow_unicode=True).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text


def render_train_argv(config: str, overrides: Mapping[str, Any]) -> list[str]:
    """train.py's arguments for a stage: `--config FILE --key=value ...`.

    `--key=value` (not two tokens) so a value starting with "-" is never read as an option.
    Unknown keys are passed through; train.py (and validation) reject them.
    """
    from trainer.config.schema import ARGS, LEGACY_KEYS

    argv = ["--config", str(config)]
    for key, value in overrides.items():
        arg = ARGS.get(LEGACY_KEYS.get(key, key))
        argv.append(f"--{key}={format_override(value, arg.kind if arg else 'str')}")
    return argv


def select_stages(names: list[str], *, from_stage: str | None = None,
                  only: str | None = None) -> list[str]:
    """The stages to launch, in order: all, `from_stage` and those after it, or `only`.

    Raises PipelineError for an unknown stage name (with the closest one) or both options.
    """
    if from_stage and only:
        raise PipelineError("--from and --only exclude each other: pick one.")
    wanted = from_stage or only
    if wanted is None:
        return list(names)
    if wanted not in names:
        guess = closest_key(str(wanted), [str(n) for n in names])
        hint = f" Did you mean `{guess}`?" if guess else ""
        raise PipelineError(f"no stage named `{wanted}`.{hint} Stages: {', '.join(names)}.")
    if only:
        return [only]
    return names[names.index(wanted):]


def _is_within(path: str, directory: str) -> bool:
    p, d = Path(path), Path(directory)
    return p == d or d in p.parents


def _clean_text(value: Any, where: str, problems: list[str], *, allow_none: bool = True) -> str | None:
    """A string value that will reach an sbatch line: no newlines or control characters."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        problems.append(f"{where} must be a string, got {value!r}.")
        return None
    text = str(value)
    if _CONTROL.search(text):
        problems.append(f"{where} contains a newline or control character: {text!r}.")
        return None
    if text == "":
        problems.append(f"{where} is empty; leave it out or set null instead.")
        return None
    return text


def merge_resources(cluster: Mapping[str, Any], overrides: Mapping[str, Any] | None, where: str,
                    problems: list[str], *, default_python: str) -> Resources | None:
    """Cluster defaults < pipeline `cluster:` < a stage's `resources:`, checked.

    Appends a message per problem to `problems` and returns None when any was found.
    """
    before = len(problems)
    merged = dict(CLUSTER_DEFAULTS)
    for source, label in ((cluster, "cluster"), (overrides or {}, f"{where}.resources")):
        if not isinstance(source, Mapping):
            problems.append(f"{label} must be a mapping of cluster keys, got {source!r}.")
            continue
        for key, value in source.items():
            if key not in CLUSTER_DEFAULTS:
                problems.append(_unknown(label, key, list(CLUSTER_DEFAULTS)))
                continue
            if key in CLUSTER_ONLY_KEYS and label != "cluster":
                problems.append(f"{label}: `{key}` applies to the whole pipeline (there is one "
                                f"warm-up job): set it in the `cluster:` section.")
                continue
            merged[key] = value

    def integer(key: str, minimum: int, nullable: bool = False) -> int | None:
        value = merged[key]
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            problems.append(f"{where}: `{key}` must be an integer >= {minimum}"
                            f"{' or null' if nullable else ''}, got {value!r}.")
            return None
        return value

    nodes = integer("nodes", 1)
    gpus = integer("gpus_per_node", 0)
    tasks = integer("tasks_per_node", 1, nullable=True)
    if gpus and tasks is not None and tasks != gpus:
        problems.append(f"{where}: `tasks_per_node` ({tasks}) is for CPU-only stages; with "
                        f"gpus_per_node {gpus} every GPU is one task. Remove tasks_per_node.")
    tasks_per_node = gpus if gpus else (tasks or 1)
    cpus = integer("cpus_per_task", 1, nullable=True)
    max_requeues = integer("max_requeues", 0)
    lead = integer("signal_lead_s", 1)
    try:
        time_min = parse_time_minutes(merged["time"])
    except ValueError as exc:
        problems.append(f"{where}: {exc}.")
        time_min = None
    if time_min is not None and lead is not None and lead >= time_min * 60:
        problems.append(f"{where}: signal_lead_s ({lead} s) must be shorter than the time limit "
                        f"({time_min} min), or the save signal comes before the job starts.")
    warmup = merged["warmup"]
    if not isinstance(warmup, bool):
        problems.append(f"{where}: `warmup` must be true or false, got {warmup!r}.")
    try:
        warmup_time = parse_time_minutes(merged["warmup_time"])
    except ValueError as exc:
        problems.append(f"{where}: warmup_{exc}.")
        warmup_time = None
    if warmup_time is not None and warmup_time * 60 <= WARMUP_SIGNAL_LEAD_S:
        problems.append(f"{where}: `warmup_time` must be at least 2 minutes, got "
                        f"{merged['warmup_time']!r}.")
    mem = merged["mem"]
    if mem is not None:
        if isinstance(mem, int) and not isinstance(mem, bool) and mem >= 0:
            mem = f"{mem}G" if mem else "0"  # 0: all of the node's memory
        elif not (isinstance(mem, str) and _MEM.match(mem.strip())):
            problems.append(f"{where}: `mem` must be Slurm memory like \"64G\" or \"500M\" (an "
                            f"integer means GB), got {mem!r}.")
            mem = None
        else:
            mem = mem.strip()
    network = merged["network"]
    if not isinstance(network, str) or network.lower() not in NETWORKS:
        problems.append(f"{where}: `network` must be one of {', '.join(NETWORKS)}, got {network!r}.")
    texts = {k: _clean_text(merged[k], f"{where}: `{k}`", problems)
             for k in ("partition", "account", "qos", "exclude", "constraint")}
    python = _clean_text(merged["python"], f"{where}: `python`", problems) or default_python

    env: dict[str, str] = {}
    if not isinstance(merged["env"], Mapping):
        problems.append(f"{where}: `env` must be a mapping NAME: value, got {merged['env']!r}.")
    else:
        for name, value in merged["env"].items():
            name = str(name)
            if not _ENV_NAME.match(name):
                problems.append(f"{where}: env name `{name}` is not a valid variable name.")
            elif _SECRET_NAME.search(name):
                problems.append(f"{where}: env `{name}` looks like a secret; it would be written "
                                f"into the rendered sbatch script. Export it in your shell before "
                                f"`relay submit` instead: Slurm passes your environment to the job.")
            elif value is None or isinstance(value, (dict, list)):
                problems.append(f"{where}: env `{name}` must be a string or number, got {value!r}.")
            else:
                text = "true" if value is True else "false" if value is False else str(value)
                if _CONTROL.search(text):
                    problems.append(f"{where}: env `{name}` contains a newline or control character.")
                env[name] = text
    extra: dict[str, Any] = {}
    if not isinstance(merged["sbatch_extra"], Mapping):
        problems.append(f"{where}: `sbatch_extra` must be a mapping option: value.")
    else:
        for option, value in merged["sbatch_extra"].items():
            option = str(option)
            flag = option.replace("_", "-")
            if not _SBATCH_OPTION.match(option):
                problems.append(f"{where}: sbatch_extra option `{option}` is not an sbatch long option name.")
            elif flag in MANAGED_SBATCH_OPTIONS:
                problems.append(f"{where}: sbatch_extra may not set `{flag}`: relay sets it (use the "
                                f"cluster key of that name, if there is one).")
            elif value is True:
                extra[option] = True
            else:
                text = _clean_text(value, f"{where}: sbatch_extra `{option}`", problems, allow_none=False)
                if text is not None:
                    extra[option] = text
    if len(problems) > before:
        return None
    return Resources(
        partition=texts["partition"], account=texts["account"], qos=texts["qos"], nodes=nodes,
        gpus_per_node=gpus, tasks_per_node=tasks_per_node, cpus_per_task=cpus, mem=mem,
        time_min=time_min, exclude=texts["exclude"], constraint=texts["constraint"],
        network=network.lower(), max_requeues=max_requeues, signal_lead_s=lead, python=python,
        env=env, sbatch_extra=extra, warmup=warmup, warmup_time_min=warmup_time)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def load_pipeline_yaml(path: str | os.PathLike, *, root: str | None = None) -> dict[str, Any]:
    """Read a pipeline YAML, fill each stage's default output_dir, resolve interpolation.

    `root` (the --root option) replaces the file's root before interpolation, so every
    `${root}` and default output_dir follows it. Returns plain containers. Raises PipelineError.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"pipeline file {path} does not exist.")
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise PipelineError(f"{path}: not valid YAML ({' '.join(str(exc).split())}).") from None
    if not isinstance(cfg, DictConfig):
        raise PipelineError(f"{path}: the top level must be a mapping with `stages:`.")
    problems = [_unknown(str(path), str(k), PIPELINE_KEYS) for k in cfg.keys() if k not in PIPELINE_KEYS]
    stages = cfg.get("stages")
    if not isinstance(stages, DictConfig) or len(stages) == 0:
        problems.append(f"{path}: `stages:` must be a non-empty mapping of stage name -> "
                        f"{{config, overrides, ...}}.")
        raise PipelineError(problems)
    name = cfg.get("name") or path.stem
    if not isinstance(name, str) or not _STAGE_NAME.match(name):
        problems.append(f"{path}: `name` {name!r} must be letters, digits, '-' or '_' "
                        f"(it becomes part of every job name).")
    for key in PATH_KEYS:
        value = OmegaConf.to_container(cfg, resolve=False).get(key)
        if key in cfg and (value is None or isinstance(value, (dict, list, bool))
                           or str(value).strip() == ""):
            problems.append(f"{path}: `{key}` must be a path (a string), got {value!r}; the "
                            f"stages read it as ${{{key}}}. Set it, or remove the line.")
    if root is not None:
        cfg.root = str(root)
    elif cfg.get("root") is None:
        cfg.root = f"runs/{name}"
    for stage_name in list(stages.keys()):
        stage = stages[stage_name]
        if not _STAGE_NAME.match(str(stage_name)):
            problems.append(f"stage name {str(stage_name)!r} must start with a letter and hold "
                            f"only letters, digits, '-' or '_' (it names a directory and a job).")
            continue
        if not isinstance(stage, DictConfig):
            problems.append(f"stage {stage_name}: must be a mapping with at least `config:`.")
            continue
        kind = stage.get("kind", "train")
        if kind not in STAGE_KINDS:
            problems.append(f"stage {stage_name}: `kind` {kind!r} is not a kind of stage; use "
                            f"one of {', '.join(STAGE_KINDS)} (train is the default).")
            continue
        allowed = ENCODE_STAGE_KEYS if kind == "encode" else STAGE_KEYS
        for key in stage.keys():
            if key not in allowed:
                problems.append(_unknown(f"stage {stage_name} (kind {kind})", str(key), allowed))
        # Unresolved: an interpolation must not be evaluated before every default is in place.
        if OmegaConf.to_container(stage, resolve=False).get("output_dir") is None:
            stage.output_dir = "${root}/" + str(stage_name)
    if problems:
        raise PipelineError(problems)
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise PipelineError(f"{path}: {' '.join(str(exc).split())}. Fix the interpolation "
                            f"(stage names and keys are case-sensitive).") from None
    data["name"] = name
    return data


def _absolute(path: Any, base: Path) -> str:
    return str((base / os.path.expanduser(str(path))).resolve())


def _config_file(path: Any, base: Path, shipped: list[str]) -> str:
    """A pipeline or stage YAML, absolute: relative to `base` like every path of a pipeline;
    a relative `config/...` path that is not there is read from the copy relay ships
    (launcher.resources), and appended to `shipped`."""
    local = _absolute(path, base)
    if not Path(local).exists():
        copy = shipped_file(path)
        if copy is not None:
            shipped.append(str(path))
            return str(copy)
    return local


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def validate_pipeline(path: str | os.PathLike, *, root: str | None = None,
                      from_stage: str | None = None, only: str | None = None,
                      cwd: str | os.PathLike | None = None, check_paths: bool = True,
                      python: str | None = None) -> Pipeline:
    """Load a pipeline and validate every selected stage as its job will run it.

    Checks, before anything is submitted: unknown keys (closest-key hint), missing stage YAMLs,
    each stage's train.py arguments with its world size (nodes x tasks per node), cluster
    values, duplicated or nested output_dirs, and warm-start paths: a path inside the output_dir
    of an earlier stage of this submission is produced by it; any other must exist now (for
    `--from sft`, pretrain's output_dir must hold a complete checkpoint). With cluster.warmup
    on, also plans the warm-up job (`Pipeline.warmup`, see plan_warmup).

    Returns the Pipeline (selected stages only in `stages`). Raises PipelineError listing every
    problem, each prefixed with its stage.
    """
    from trainer.resolve import resolve_config
    from trainer.models.registry import model_config
    from trainer.preflight import describe_plan
    from trainer.config.schema import ConfigError

    base = Path(cwd).resolve() if cwd else Path.cwd()
    shipped: list[str] = []  # relative config/... paths read from relay's own copy
    path = Path(_config_file(path, base, shipped))
    data = load_pipeline_yaml(path, root=root)
    names = [str(n) for n in data["stages"]]
    selected = select_stages(names, from_stage=from_stage, only=only)
    problems: list[str] = []
    notes: list[str] = []
    cluster = data.get("cluster") or {}
    default_python = python or sys.executable

    output_dirs: dict[str, str] = {}
    for name in names:
        raw = data["stages"][name]["output_dir"]
        text = _clean_text(raw, f"stage {name}: `output_dir`", problems)
        if text is not None:
            output_dirs[name] = _absolute(text, base)
    seen: dict[str, str] = {}
    for name, out in output_dirs.items():
        for other, other_out in seen.items():
            if out == other_out:
                problems.append(f"stages {other} and {name} share output_dir {out}: each stage "
                                f"needs its own (it resumes from whatever checkpoints are there).")
            elif _is_within(out, other_out) or _is_within(other_out, out):
                problems.append(f"output_dir of {name} ({out}) and of {other} ({other_out}) are "
                                f"nested: give each stage a separate directory.")
        seen[name] = out

    # The cluster section once; then each stage's resources on top of it (or, when the cluster
    # section is broken, on top of the defaults, so its problems are not repeated per stage).
    cluster_problems: list[str] = []
    cluster_resources = merge_resources(cluster, None, "cluster", cluster_problems,
                                        default_python=default_python)
    problems.extend(cluster_problems)
    specs: list[StageSpec] = []
    previous: str | None = None
    # Pipeline directories a launched stage writes before it reads them (make_tiny_wan): later
    # stages' vae_path / text_encoder / weights inside one are checked when they start.
    written: list[str] = []
    written_before: dict[str, tuple[str, ...]] = {}
    # The model config each validated stage will record in its checkpoints: a later stage
    # started from its output_dir inherits that architecture (trainer.source_model).
    produced: dict[str, dict[str, Any]] = {}
    for name in selected:
        stage = data["stages"][name]
        where = f"stage {name}"
        resources = merge_resources({} if cluster_problems else cluster, stage.get("resources"),
                                    where, problems, default_python=default_python)
        if cluster_problems:
            resources = None
        if stage.get("kind") == "encode":
            if name in output_dirs and resources is not None:
                spec = encode_stage(name, stage, data.get("source"), resources,
                                    output_dirs[name], f"{data['name']}-{name}", base,
                                    check_paths, problems, previous)
                if spec is not None:
                    specs.append(spec)
                    written.append(spec.output_dir)  # its data is checked when a stage reads it
                    written_before[name] = tuple(written)
                    previous = name
            continue
        config = stage.get("config")
        if not isinstance(config, str) or not config:
            problems.append(f"{where}: `config:` (the stage's train YAML) is missing.")
            continue
        config_path = _config_file(config, base, shipped)
        if not Path(config_path).is_file():
            problems.append(f"{where}: config {config_path} does not exist. Relative paths are "
                            f"relative to the directory relay runs in ({base}).")
            continue
        overrides = stage.get("overrides") or {}
        if not isinstance(overrides, dict):
            problems.append(f"{where}: `overrides` must be a mapping key: value, got {overrides!r}.")
            continue
        if "output_dir" in overrides:
            problems.append(f"{where}: set output_dir at the stage level (`output_dir:`), not in "
                            f"overrides: the pipeline needs to know it.")
            continue
        job_name = _clean_text(stage.get("job_name") or f"{data['name']}-{name}",
                               f"{where}: `job_name`", problems)
        if name not in output_dirs or resources is None or job_name is None:
            continue
        overrides = dict(overrides)
        overrides["output_dir"] = output_dirs[name]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the job prints them; the plan need not
                args = resolve_config(config_path, overrides, world_size=resources.world_size,
                                      cwd=base, check_paths=check_paths,
                                      written_before=tuple(written), produced=produced,
                                      pipeline_outputs=tuple(output_dirs.values()))
                plan = describe_plan(args, resources.world_size, resources.tasks_per_node)
                produced[output_dirs[name]] = model_config(args)
        except ConfigError as exc:
            problems.append(f"{where}: {exc}")
            continue
        overrides = _absolute_path_overrides(overrides, args)
        argv = render_train_argv(config_path, overrides)
        problems.extend(_check_argv_round_trip(where, config_path, argv, args, base, produced))
        written_before[name] = tuple(written)
        from trainer.encoders.directories import tiny_wan_pending

        if tiny_wan_pending(args):
            written.append(str(args.pretrained_transformer_path))
        specs.append(StageSpec(
            name=name, config=config_path, overrides=overrides, output_dir=output_dirs[name],
            job_name=job_name, resources=resources, train_argv=tuple(argv), args=args,
            depends_on=(previous,) if previous else (), plan=plan))
        previous = name

    if shipped:
        print(f"relay: {', '.join(shipped)}: not under {base}, so read from the copy installed "
              f"with relay ({resource_root() / 'config'})", file=sys.stderr)
    if check_paths:
        invalid = [n for n in selected if n not in {s.name for s in specs}]
        for spec in (s for s in specs if s.kind == "train"):
            problems.extend(check_weight_sources(spec, specs, output_dirs, notes,
                                                 invalid=invalid,
                                                 written_before=written_before.get(spec.name, ())))
    root_dir = _absolute(data["root"], base)
    warmup = None
    if not problems and cluster_resources is not None:
        warmup = plan_warmup(data["name"], root_dir, specs, cluster_resources, output_dirs,
                             problems)
    if problems:
        raise PipelineError(problems)
    return Pipeline(path=str(path), name=data["name"], root=root_dir, workdir=str(base),
                    stages=specs, output_dirs=output_dirs, notes=notes, warmup=warmup)


def encode_stage(name: str, stage: Mapping[str, Any], source: str | None, resources: Resources,
                 output_dir: str, default_job_name: str, base: Path, check_paths: bool,
                 problems: list[str], previous: str | None) -> StageSpec | None:
    """An encode stage (`kind: encode`), validated: its manifest read (entries counted), its
    VAE and text encoder directories (`pipeline`, by default the pipeline's `source`; or `vae`
    and `text_encoder`) complete, and its output_dir free of parts of another split. Appends
    to `problems` and returns None when it cannot run."""
    from trainer.config.schema import ResolvedArgs
    from trainer.data.manifest import PLAN_FILE, EncodeError, read_manifest
    from trainer.encoders.directories import encoder_dirs

    where = f"stage {name}"
    before = len(problems)
    manifest = _clean_text(stage.get("manifest"), f"{where}: `manifest`", problems,
                           allow_none=False)
    paths = {key: _clean_text(stage.get(key, source if key == "pipeline" else None),
                              f"{where}: `{key}`", problems)
             for key in ("pipeline", "vae", "text_encoder")}
    numbers = {}
    for key, default, least in (("rows_per_shard", 64, 1), ("text_max_tokens", 512, 1),
                                ("text_encoder_hidden_state_skip_layer", 0, 0),
                                ("demo_clips", 0, 0)):
        value = stage.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            problems.append(f"{where}: `{key}` must be an integer >= {least}, got {value!r}.")
        numbers[key] = value
    make_tiny = stage.get("make_tiny_wan", False)
    if not isinstance(make_tiny, bool):
        problems.append(f"{where}: `make_tiny_wan` must be true or false, got {make_tiny!r}.")
    job_name = _clean_text(stage.get("job_name") or default_job_name, f"{where}: `job_name`",
                           problems)
    if len(problems) > before:
        return None
    manifest = _absolute(manifest, base)
    paths = {k: _absolute(v, base) if v is not None else None for k, v in paths.items()}
    entries = numbers["demo_clips"] or None
    if check_paths:
        if not (numbers["demo_clips"] and not Path(manifest).exists()):
            try:
                entries = len(read_manifest(manifest))
            except (EncodeError, OSError, ValueError) as exc:
                problems.append(f"{where}: {exc}. Give `manifest` a CSV with path and caption "
                                f"columns, or a JSON list of {{path, caption}} (docs/data.md).")
        pending = make_tiny and paths["pipeline"] is not None and \
            not (Path(paths["pipeline"]) / "model_index.json").is_file()
        if not pending:
            try:
                encoder_dirs(paths["pipeline"], paths["vae"], paths["text_encoder"],
                             names={"pipeline": "`pipeline`", "vae_path": "`vae`",
                                    "text_encoder": "`text_encoder`"})
            except ValueError as exc:
                problems.append(f"{where}: {exc}.")
        plan_file = Path(output_dir) / PLAN_FILE
        if plan_file.is_file():
            import json

            split = json.loads(plan_file.read_text())
            wanted = {"world_size": resources.world_size, "rows_per_shard": numbers["rows_per_shard"]}
            if any(split.get(k) != v for k, v in wanted.items()):
                problems.append(
                    f"{where}: {output_dir} holds parts encoded as world_size "
                    f"{split.get('world_size')}, rows_per_shard {split.get('rows_per_shard')}; "
                    f"this stage would encode as world_size {resources.world_size}, "
                    f"rows_per_shard {numbers['rows_per_shard']}, and a part is one rank's "
                    f"share. Keep the split it was started with, or choose another output_dir.")
    if len(problems) > before:
        return None
    argv = ["--manifest", manifest, "--out", output_dir,
            "--rows-per-shard", str(numbers["rows_per_shard"]),
            "--text-max-tokens", str(numbers["text_max_tokens"]),
            "--skip-layer", str(numbers["text_encoder_hidden_state_skip_layer"])]
    for key, flag in (("pipeline", "--pipeline"), ("vae", "--vae"),
                      ("text_encoder", "--text-encoder")):
        if paths[key] is not None:
            argv += [flag, paths[key]]
    argv += ["--make-tiny-wan"] if make_tiny else []
    argv += ["--demo-clips", str(numbers["demo_clips"])] if numbers["demo_clips"] else []
    world = resources.world_size
    share = f", {math.ceil(entries / world)} a rank at most" if entries else ""
    through = [paths[key] or (f"{paths['pipeline']}/{folder}" if paths["pipeline"] else "?")
               for key, folder in (("vae", "vae"), ("text_encoder", "text_encoder"))]
    plan = (f"encode {entries if entries is not None else 'the'} files of {manifest} over "
            f"{world} rank(s){share}, parts of {numbers['rows_per_shard']} files, through "
            f"{through[0]} and {through[1]}")
    args = ResolvedArgs(stage="encode", max_steps=entries, output_dir=output_dir,
                        preemption_signal="SIGUSR2", manifest=manifest, **paths, **numbers,
                        make_tiny_wan=make_tiny)
    return StageSpec(name=name, config=manifest, overrides={}, output_dir=output_dir,
                     job_name=job_name, resources=dataclasses.replace(resources, warmup=False),
                     train_argv=tuple(argv), args=args,
                     depends_on=(previous,) if previous else (), plan=plan, kind="encode")


def plan_warmup(name: str, root: str, specs: list[StageSpec], cluster: Resources,
                output_dirs: dict[str, str], problems: list[str]) -> WarmupSpec | None:
    """The warm-up job of this launch, or None (warm-up off, or nothing to warm).

    Warms every launched stage whose resources say `warmup` (every objective has a warm-up
    loss in trainer.warmup). The job has one node and one
    task (one GPU when a warmed stage uses GPUs) with the cluster section's partition, account,
    qos, constraint, env, network and sbatch_extra. Appends to `problems` when <root>/warmup
    would collide with a stage.
    """
    wanted = [s for s in specs if s.resources.warmup]
    if not wanted:
        return None
    directory = str(Path(root) / WARMUP_DIR)
    before = len(problems)
    if WARMUP_NAME in output_dirs:
        problems.append(f"stage {WARMUP_NAME}: the name is taken by the kernel warm-up job "
                        f"(cluster.warmup is on); rename the stage.")
    for stage, out in output_dirs.items():
        if _is_within(out, directory) or _is_within(directory, out):
            problems.append(f"stage {stage}: output_dir {out} and the warm-up directory "
                            f"{directory} overlap; move the stage's output_dir.")
    if len(problems) > before:
        return None
    runs = [WarmupRun(stage=spec.name, argv=spec.train_argv,
                      report=str(Path(directory) / f"{spec.name}.json")) for spec in wanted]
    gpus = 1 if any(s.resources.gpus_per_node for s in wanted) else 0
    resources = dataclasses.replace(
        cluster, nodes=1, gpus_per_node=gpus, tasks_per_node=1, time_min=cluster.warmup_time_min,
        signal_lead_s=WARMUP_SIGNAL_LEAD_S)
    return WarmupSpec(job_name=f"{name}-{WARMUP_NAME}", directory=directory, resources=resources,
                      runs=tuple(runs), before=specs[0].name)


def _absolute_path_overrides(overrides: dict[str, Any], args) -> dict[str, Any]:
    """Path overrides as the absolute paths train.py resolved them to (cwd-independent argv)."""
    from trainer.config.schema import ARGS

    out = {}
    for key, value in overrides.items():
        arg = ARGS.get(key)
        if arg is not None and arg.kind in ("path", "path_or_dict") and value is not None:
            value = args[key]
        out[key] = value
    return out


def _check_argv_round_trip(where: str, config: str, argv: list[str], args, base: Path,
                           produced: dict[str, dict[str, Any]]) -> list[str]:
    """The job passes `argv` to train.py: it must resolve to what was validated (starting from
    what the earlier stages will have written, `produced`)."""
    from trainer.resolve import resolve_config
    from trainer.config.schema import ConfigError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = resolve_config(config, argv[2:], cwd=base, check_paths=False,
                                   produced=produced)
    except ConfigError as exc:
        return [f"{where}: the rendered train.py command line does not parse ({exc}); "
                f"report this as a relay bug."]
    differ = sorted(k for k in set(args) | set(again) if args.get(k) != again.get(k))
    if differ:
        return [f"{where}: overrides {differ} do not survive the train.py command line "
                f"unchanged; report this as a relay bug."]
    return []


def weight_path_keys(args) -> list[str]:
    """train.py keys that name weights to start from: every path key except output_dir and
    vae_path (a VAE directory, which preflight checks itself)."""
    from trainer.config.schema import ARGS

    return [k for k, a in ARGS.items() if a.kind == "path" and k not in ("output_dir", "vae_path")
            and args.get(k) is not None]


def weights_choice(args, key: str) -> str:
    """Which weights (live | ema) the path `key` is read with: its `*_weights` sibling key."""
    sibling = "pretrained_weights" if key == "pretrained_transformer_path" else (
        key[: -len("_path")] + "_weights" if key.endswith("_path") else None)
    value = args.get(sibling) if sibling else None
    return value if value in ("live", "ema") else "live"


def has_complete_checkpoint(output_dir: str | os.PathLike) -> bool:
    """Whether `output_dir` holds at least one checkpoint-<step>/ with its COMPLETE marker."""
    from trainer.checkpoint.layout import list_checkpoints

    return bool(list_checkpoints(output_dir))


def check_weight_sources(spec: StageSpec, launched: list[StageSpec], output_dirs: dict[str, str],
                         notes: list[str], *, invalid: list[str] = (),
                         written_before: tuple[str, ...] = ()) -> list[str]:
    """Problems with the weights `spec` starts from (empty when fine).

    A path inside the output_dir of a stage launched before it in this submission is fine (that
    stage produces it). Any other path must hold usable weights now. `invalid`: stages of this
    submission that failed validation (a path of theirs is reported as such, not as missing).
    `written_before`: pipeline directories an earlier stage writes (make_tiny_wan): a path in
    one is fine.
    Appends a note when the stage's own output_dir already has checkpoints (it will resume,
    not warm start).
    """
    from trainer.checkpoint.layout import CheckpointError
    from trainer.checkpoint.weights_source import resolve_weights_source

    if has_complete_checkpoint(spec.output_dir):
        notes.append(f"stage {spec.name}: {spec.output_dir} already holds checkpoints, so the job "
                     f"RESUMES from the newest one (its warm start is not used). Pick another "
                     f"--root to start over.")
        return []
    order = [s.name for s in launched]
    problems = []
    from trainer.encoders.directories import tiny_wan_pending

    for key in weight_path_keys(spec.args):
        value = spec.args[key]
        if key == "pretrained_transformer_path" and tiny_wan_pending(spec.args):
            continue  # make_tiny_wan: the stage writes it before reading it
        if any(_is_within(value, d) for d in written_before):
            continue  # an earlier stage writes it (make_tiny_wan)
        producer = next((n for n, d in output_dirs.items() if _is_within(value, d)), None)
        if producer in invalid:
            problems.append(f"stage {spec.name}: `{key}` ({value}) is stage {producer}'s "
                            f"output_dir, and stage {producer} failed validation (above): fix "
                            f"{producer} and this stage can start from it.")
            continue
        if producer in order:
            if order.index(producer) < order.index(spec.name):
                continue
            problems.append(f"stage {spec.name}: `{key}` ({value}) is in the output_dir of stage "
                            f"{producer}, which does not run before it.")
            continue
        try:
            resolve_weights_source(value, weights=weights_choice(spec.args, key))
        except CheckpointError as exc:
            hint = ""
            if producer is not None:
                hint = (f" It is stage {producer}'s output_dir, which this submission does not "
                        f"run: run {producer} first, or submit with --from {producer}.")
            problems.append(f"stage {spec.name}: `{key}`: {exc}.{hint}")
    return problems
