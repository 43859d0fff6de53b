"""A run's state on disk: resume, warm start and save, for every stage.

The only place that turns a stage's declared members (roles, optimizers, EMAs, schedulers, data
cursor) and warm-start sources into checkpoint reads and writes. Stages say *what* they hold and
*what* they start from; this module decides how it is saved, found and loaded, so a new stage
gets resume, fallback to the previous checkpoint and exact RNG/data restore without writing any
of it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trainer.checkpoint import store as ckpt
from trainer.parallel.distributed import Topology, all_gather_objects
from trainer.runtime.files import write_json
from trainer.optim.optimizers import resume_lr_scheduler
from trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from trainer.config.schema import ConfigError, ResolvedArgs, model_config
from trainer.checkpoint.warm_start import load_warm_start

log = logging.getLogger("relay")


# Arguments that decide what the saved optimizer state is: a change cannot be loaded, and the
# error should name the key rather than a tensor that does not fit.
STATE_SHAPING_KEYS = ("stage", "use_muon", "use_ema")


def resume_or_warm_start(args: ResolvedArgs, topo: Topology, out: Path,
                         stage) -> tuple[int, str | None]:
    """Resume from output_dir's newest readable checkpoint, else warm start, else fresh.

    Returns (the step to continue after, the checkpoint resumed from or None). Raises
    CheckpointError when checkpoints exist and none loads (never a silent fresh start), and
    CheckpointIncompatibleError naming the key when this run's arguments cannot load one.
    """
    loaded: dict = {}

    def load(path: Path) -> None:
        _check_state_shaping_keys(path, args)
        loaded["state"], loaded["cursor"] = ckpt.load_checkpoint(
            path, stage_members(stage), dp_rank=topo.dp_rank, dp_world=topo.dp_world,
            cp_size=args.cp_size, resume_data_state=args.resume_data_state)

    path = ckpt.find_resume_checkpoint(out, load)
    if path is not None:
        return _restore(args, topo, stage, path, loaded["state"], loaded["cursor"]), str(path)
    if stage.warm_start_sources():
        report = warm_start(stage)
        if topo.is_main:
            write_json(out / "warm-start.json", report)
        log.info("warm start from %s (%s weights): %d tensors loaded", report["source"],
                 report["weights"], len(report.get("loaded", [])))
        return 0, None
    log.info("no checkpoint in %s: starting fresh", out)
    return 0, None


def _check_state_shaping_keys(checkpoint: Path, args: ResolvedArgs) -> None:
    """Refuse, naming the key, a resume whose optimizer / EMA / stage differ from the saver's."""
    try:
        saved = json.loads((checkpoint / "resolved-config.json").read_text())
    except (OSError, ValueError):
        return  # no record to compare with: the shape checks of load_checkpoint still apply
    for key in STATE_SHAPING_KEYS:
        if key in saved and saved[key] != args[key]:
            raise ckpt.CheckpointIncompatibleError(
                f"{checkpoint.name} was saved with {key}: {json.dumps(saved[key])}, this run "
                f"has {key}: {json.dumps(args[key])}, so its saved state cannot be loaded. Resume "
                f"with {key}: {json.dumps(saved[key])}, or start the new setting in a new "
                f"output_dir with a warm start from this one.")


def _restore(args: ResolvedArgs, topo: Topology, stage, path: Path, state: dict,
             cursor) -> int:
    """Everything beyond the DCP members: schedules, stage counters, RNG, data position."""
    for name, sched_state in state.get("schedulers", {}).items():
        changed = resume_lr_scheduler(stage.schedulers[name], sched_state)
        if changed:
            log.warning("%s: peak learning rate(s) changed since %s was saved (%s); the "
                        "schedule goes on from step %d with the new value(s)", name,
                        path.name, ", ".join(f"{old:g} -> {new:g}" for old, new in changed),
                        state["step"])
    stage.load_extra_state(state.get("extra", {}))
    rng = state["rng"]
    restore_rng_state(rng[str(topo.rank)] if str(topo.rank) in rng else rng["0"])
    if cursor is not None:
        _warn_if_global_batch_changed(path, cursor, args, topo)
        try:
            stage.data.load_state_dict(cursor)
        except ValueError as exc:
            raise ConfigError(f"cannot continue the data stream of {path}: {exc}. Or set "
                              "resume_data_state: false to restart the data.") from exc
    else:
        log.warning("resume_data_state is false: the data stream RESTARTS from the top; "
                    "model, optimizer and schedule are resumed from %s", path)
    log.info("resumed from %s (step %d)", path, state["step"])
    _log_config_changes(path, args)
    return int(state["step"])


def _warn_if_global_batch_changed(path: Path, cursor: dict, args: ResolvedArgs,
                                  topo: Topology) -> None:
    """Say at start when a resume cannot follow the saved trajectory exactly: samples per
    micro-batch round (batch x dp ranks) changed, so steps group the stream differently."""
    saved = cursor.get("batch_size", 0) * cursor.get("dp_world", 0)
    now = args.train_batch_size * topo.dp_world
    if saved and saved != now:
        log.warning("%s: a micro-batch round held %d samples (train_batch_size %d x %d dp "
                    "ranks); this run's holds %d (%d x %d): the data stream continues from the "
                    "saved sample position, but steps now group other samples, so the loss "
                    "trajectory is not the saved run's. Keep train_batch_size x dp ranks "
                    "the same for an exact continuation.", path.name, saved,
                    cursor["batch_size"], cursor["dp_world"], now, args.train_batch_size,
                    topo.dp_world)


def warm_start(stage) -> dict:
    """Load every source the stage declares into its role (weights only), then let the stage
    finish (EMA restart, Stage1's E_r copy). Returns the report written to warm-start.json:
    the single source's own report, or, for several roles, one entry per role under "roles".
    Raises CheckpointError from the first source that does not fit."""
    sources = stage.warm_start_sources()
    reports = {s.role: load_warm_start(s.path, stage.roles[s.role], weights=s.weights,
                                       allow_missing=s.allow_missing,
                                       allow_unexpected=s.allow_unexpected) for s in sources}
    stage.after_warm_start(reports)
    if len(sources) == 1:
        return reports[sources[0].role]
    return {
        "source": "; ".join(f"{role} {r['source']}" for role, r in reports.items()),
        "weights": ", ".join(f"{s.role} {s.weights}" for s in sources),
        "loaded": [f"{role}/{key}" for role, r in reports.items() for key in r["loaded"]],
        "roles": reports,
    }


def stage_members(stage) -> dict[str, object]:
    """Everything DCP saves for a stage: model roles, optimizers, EMAs."""
    members: dict[str, object] = {name: ckpt.ModelMember(model)
                                  for name, model in stage.model_members().items()}
    optimizers = {role: ckpt.OptimizerMember(stage.roles[role], opt)
                  for role, opt in stage.optimizers.items()}
    members["optimizer"] = next(iter(optimizers.values())) if len(optimizers) == 1 else optimizers
    emas = {role: ema.state_dict() for role, ema in stage.emas.items()}
    if len(emas) == 1:
        members["ema"] = next(iter(emas.values()))
    elif emas:
        members["ema"] = emas
    return members


def save(manager: ckpt.CheckpointManager, args: ResolvedArgs, topo: Topology, stage,
         step: int) -> str:
    """Save checkpoint-<step> (a collective); returns its path."""
    rng = all_gather_objects(capture_rng_state())  # rank 0 writes every rank's RNG state
    training_state = {
        "step": step,
        "schedulers": {k: s.state_dict() for k, s in stage.schedulers.items()},
        "rng": {str(i): r for i, r in enumerate(rng)},
        "extra": stage.extra_state(),
    }
    path = manager.save(step, members=stage_members(stage), training_state=training_state,
                        dataloader_state=stage.data.state_dict(), dp_rank=topo.dp_rank,
                        dp_world=topo.dp_world, world_size=topo.world_size,
                        cp_size=args.cp_size, cp_rank=topo.cp_rank,
                        config_digest=args.digest(),
                        model_config=model_config(args),
                        extra_files={"resolved-config.json": json.dumps(dict(args), indent=2)})
    return str(path)


def _log_config_changes(checkpoint: Path, args: ResolvedArgs) -> None:
    """Warn, key by key, where this run's arguments differ from those that saved `checkpoint`."""
    try:
        saved = json.loads((checkpoint / "resolved-config.json").read_text())
    except (OSError, ValueError):
        return  # checkpoints written by other tools carry no config: nothing to compare
    now = json.loads(json.dumps(dict(args), default=str))  # the saved file's JSON types

    def shown(value) -> str:
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    changed = [f"{key} {shown(saved.get(key))} -> {shown(now.get(key))}"
               for key in sorted(set(saved) | set(now)) if saved.get(key) != now.get(key)]
    if changed:
        log.warning("%s was saved with other arguments; this run uses: %s", checkpoint.name,
                    "; ".join(changed))
