"""relay's trainer: one run of one stage.

    python trainer/train.py --config config/tiny/pretrain.yaml [--key value ...] [--dry-run]
    torchrun --nproc_per_node 8 -m trainer.train --config ...

Reads like the table of contents of a run: arguments -> topology -> data, model, optimizer ->
resume (or warm start, or fresh) -> loop with checkpoints -> run-result.json. Exit codes:
0 completed, 2 bad configuration or output_dir in use by another run, 1 failed,
trainer.runtime.preemption.PREEMPTED_EXIT_CODE preempted (saved, ready to be requeued).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python trainer/train.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.checkpoint import store as ckpt
from trainer import run_state
from trainer.resolve import resolve_args
from trainer.encoders.directories import tiny_wan_pending
from trainer.runtime.cuda_memory import configure_cuda_allocator
from trainer.parallel.distributed import (Topology, any_rank, barrier, destroy, init_distributed,
                                 ranks_per_node_from_env, world_size_from_env)
from trainer.runtime.environment import launch_manifest
from trainer.runtime.files import write_json
from trainer.runtime.health import HealthGate, HealthSettings
from trainer.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler, interrupts_deferred
from trainer.runtime.lock import RunLock, RunLockError, acquire_run_lock
from trainer.preflight import describe_plan
from trainer.config.schema import ConfigError, ResolvedArgs
from trainer.models.registry import family_of
from trainer.stages.base import NonFiniteError
from trainer.stages.registry import build_stage, stage_of
from trainer.runtime.tracking import MetricsWriter, Progress, WandbReporter
from trainer.evaluation.validation import ValidationSettings, run_validation

log = logging.getLogger("relay")


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    try:
        args, dry_run = resolve_args(argv, world_size=world_size_from_env())
        plan = describe_plan(args, world_size_from_env(), ranks_per_node_from_env())
    except ConfigError as exc:
        print(f"relay: config error: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        print(args.to_json())
        print(plan, file=sys.stderr)  # stdout stays the JSON
        return 0
    if tiny_wan_pending(args):
        # make_tiny_wan: write the pipeline, then resolve again, so its folders give the defaults
        # and are checked like any user's directory.
        _write_tiny_wan(args)
        try:
            args, _ = resolve_args(argv, world_size=world_size_from_env())
        except ConfigError as exc:
            print(f"relay: config error: {exc}", file=sys.stderr)
            return 2
    log.info("%s", plan)
    return run(args)


def _write_tiny_wan(args: ResolvedArgs) -> None:
    """Rank 0 writes the family's tiny pipeline at pretrained_transformer_path, or, for an
    expert folder (.../transformer, .../transformer_2), the two-expert A14B layout in its
    parent (renamed into place when complete); the other ranks wait for it."""
    from trainer.encoders.directories import tiny_wan_target

    path, boundary = tiny_wan_target(args.pretrained_transformer_path)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        log.info("make_tiny_wan: writing a tiny random Wan%s pipeline at %s",
                 " A14B (two experts)" if boundary is not None else "", path)
        family_of(args).write_tiny_pipeline(path, seed=args.seed, boundary_ratio=boundary)
        return
    deadline = time.monotonic() + 600
    while not (path / "model_index.json").is_file() and time.monotonic() < deadline:
        time.sleep(1.0)


def run(args: ResolvedArgs) -> int:
    """Train one stage to max_steps (or until preempted). Returns the process exit code."""
    configure_cuda_allocator()  # before init_distributed puts anything on a GPU
    topo = init_distributed(args.cp_size, args.dist_backend, hybrid_shard=args.hybrid_shard,
                            shard_group_size=args.shard_group_size)
    out = Path(args.output_dir)
    result = {"status": "failed", "step": 0, "last_checkpoint": None, "error": None}
    lock: RunLock | None = None
    refused = False  # another run holds output_dir: leave everything in it alone
    try:
        if topo.is_main:
            out.mkdir(parents=True, exist_ok=True)
        lock = _lock_output_dir(out, topo)
        barrier()
        _add_file_log(out, topo)
        handler = PreemptionHandler(signals=(args.preemption_signal, "SIGTERM"))
        handler.install()
        return _train(args, topo, out, handler, result)
    except RunLockError as exc:
        refused = True
        if topo.is_main:
            print(f"relay: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, ckpt.CheckpointError) as exc:
        result["error"] = str(exc)
        log.error("%s", exc)
        return 2 if isinstance(exc, ConfigError) else 1
    except NonFiniteError as exc:
        result["error"] = str(exc)
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        result.update(status="interrupted", error="interrupted (Ctrl-C) during a step; nothing "
                      "half-written was kept: the run resumes from its last checkpoint")
        log.error("interrupted: the run resumes from %s when started again",
                  result["last_checkpoint"] or "the start (no checkpoint yet)")
        return 130
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("training failed")
        return 1
    finally:
        if topo.is_main and out.is_dir() and not refused:
            try:
                write_json(out / "run-result.json", result)
            except OSError as exc:
                log.error("could not write %s: %s", out / "run-result.json", exc)
        if lock is not None:
            lock.release()
        if result["status"] in ("completed", "preempted"):
            # Every rank ends together: one that tore its process groups down while another
            # still used them aborted at exit ("terminate called without an active
            # exception", seen on cp ranks with gloo).
            barrier()
        destroy()


def _lock_output_dir(out: Path, topo: Topology) -> RunLock | None:
    """Rank 0 locks output_dir for the run (trainer.runtime.lock); every rank learns the outcome.

    Returns the lock on rank 0 (None elsewhere). Raises RunLockError on every rank when
    another run holds the directory.
    """
    lock, refusal = None, None
    if topo.is_main:
        try:
            lock = acquire_run_lock(out)
        except RunLockError as exc:
            refusal = exc
    if any_rank(refusal is not None):
        raise refusal or RunLockError("rank 0 could not lock the output_dir")
    return lock


def _train(args: ResolvedArgs, topo: Topology, out: Path, handler: PreemptionHandler,
           result: dict) -> int:
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    # A resume that cannot continue its data exactly is refused before a model exists.
    data = run_state.check_resume(args, topo, out)
    stage = build_stage(args, topo)
    # Training draws are keyed by sample (trainer.diffusion.sample_draws); what still uses the global
    # generator (Stage2's rollout noise) differs per data-parallel rank, and is the same on
    # the cp ranks of a group: they must feed the model the same whole samples.
    torch.manual_seed(args.seed + 1_000_003 * (topo.dp_rank + 1))
    manager = ckpt.CheckpointManager(out, save_total_limit=args.save_total_limit,
                                     async_save=args.async_checkpoint)
    start_step, resumed = run_state.resume_or_warm_start(args, topo, out, stage, data)
    result.update(step=start_step, last_checkpoint=resumed)
    if topo.is_main:  # only now: a run that fails to start leaves the previous run's files
        write_json(out / "resolved-config.json", dict(args))
        manifest = launch_manifest(topo)
        write_json(out / "launch-manifest.json", manifest)
    if start_step >= args.max_steps:
        manager.close()
        result["status"] = "completed"
        log.warning("nothing to train: %s is at step %d and max_steps is %d. Raise max_steps to "
                    "train on.", resumed, start_step, args.max_steps)
        return 0
    metrics = MetricsWriter(out, enabled=topo.is_main)
    metrics.truncate_after(start_step)
    validation = ValidationSettings.of(args)
    gate = HealthGate(HealthSettings.of(
        args, watches_samples=stage_of(args).health_watches_samples))
    gate.replay(metrics.path, start_step)
    tracker = WandbReporter(args, enabled=topo.is_main, resumed=resumed is not None)
    progress = Progress(args.max_steps, start_step, enabled=topo.is_main)
    last_saved = start_step
    status = "completed"
    step = start_step
    try:
        window_start, window_samples = time.perf_counter(), 0
        for step in range(start_step + 1, args.max_steps + 1):
            t0 = time.perf_counter()
            sparsity = _set_attention_sparsity(stage, args, step)
            numbers = stage.train_step(step)
            if sparsity is not None:
                numbers["video_attention_sparsity"] = sparsity
            step_time = time.perf_counter() - t0
            window_samples += numbers.pop("samples", 0)
            record = None
            validate = validation.due(step)
            if step % args.log_interval == 0 or step == args.max_steps or validate:
                elapsed = time.perf_counter() - window_start
                record = _metrics_record(step, numbers, step_time, window_samples, elapsed,
                                         stage, topo)
                if validate:
                    record.update(_validate(stage, validation, step, out, topo))
                metrics.write(record)
                tracker.log(record)
                window_start, window_samples = time.perf_counter(), 0
            progress.update(step, record)
            result["step"] = step
            preempted = any_rank(handler.requested)
            stop = gate.observe(step, {**numbers, **(record or {})})
            unhealthy = any_rank(stop is not None)  # validation scores live on rank 0 only
            # While a reading is unhealthy, the newest checkpoint saved before it outlives any
            # prune: it is what the run would go on from at a gentler setting.
            manager.keep = _last_healthy_checkpoint(out, gate.unhealthy_since())
            if (preempted or unhealthy or step % args.save_interval == 0
                    or step == args.max_steps):
                with interrupts_deferred():
                    result["last_checkpoint"] = run_state.save(manager, args, topo, stage, step, data)
                last_saved = step
            if unhealthy:
                status = "failed"
                if stop is not None:
                    message = f"{stop.message} {_kept_advice(out, step, manager.keep, stop.onset)}"
                    result.update(error=message, stop_reason={
                        **stop.to_json(), "message": message,
                        "healthy_checkpoint": str(manager.keep) if manager.keep else None})
                    log.error("%s", message)
                break
            if preempted:
                status = "preempted"
                log.warning("preemption signal %s: saved checkpoint-%d, exiting with code %d "
                            "for requeue", handler.signal_name, step, PREEMPTED_EXIT_CODE)
                break
        if last_saved != step:
            with interrupts_deferred():
                result["last_checkpoint"] = run_state.save(manager, args, topo, stage, step, data)
    finally:
        manager.close()
        progress.close()
        tracker.finish()
    result["status"] = status
    return {"preempted": PREEMPTED_EXIT_CODE, "failed": 1}.get(status, 0)


def _set_attention_sparsity(stage, args: ResolvedArgs, step: int) -> float | None:
    """Sparse video attention's sparsity for optimizer step `step`, set on the stage's models
    before the step (a function of the step, so a resume continues the ramp exactly); None
    when the run is dense (video_attention_sparsity 0)."""
    if args.video_attention_sparsity <= 0:
        return None
    from trainer.models.sparse_attention import current_sparsity, set_video_attention_sparsity

    sparsity = current_sparsity(args.video_attention_sparsity,
                                args.video_attention_sparsity_warmup_steps, step)
    for model in stage.roles.values():
        set_video_attention_sparsity(model, sparsity, args.video_attention_tile,
                                     args.video_attention_own_tile)
    return sparsity


def _last_healthy_checkpoint(out: Path, unhealthy_since: int | None) -> Path | None:
    """The newest complete checkpoint saved before step `unhealthy_since`; None when every
    reading is healthy or none was saved before it."""
    if unhealthy_since is None:
        return None
    before = [path for step, path in ckpt.scan_output_dir(out).marked if step < unhealthy_since]
    return before[-1] if before else None


def _kept_advice(out: Path, step: int, kept: Path | None, onset: int | None) -> str:
    """The sentence a gate's stop ends with: which checkpoint to go on from, and how."""
    if kept is None:
        return (f"Saved checkpoint-{step}; no checkpoint was saved before the first unhealthy "
                f"reading (step {onset}): start the stage again with the change above.")
    return (f"Saved checkpoint-{step} (the state at the stop); {kept.name}, the newest checkpoint "
            f"before the first unhealthy reading (step {onset}), is kept: to go on from it, move "
            f"the checkpoints after it out of {out} and run again with the change above.")


def _validate(stage, settings: ValidationSettings, step: int, out: Path,
              topo: Topology) -> dict:
    """Rank 0 samples, scores and writes; a failure is logged, never fatal to training.

    A sharded model needs every rank in each forward (the blocks' all-gathers), so then every
    rank samples the same seeded captions; only rank 0 decodes, scores and keeps the files.
    """
    scores: dict = {}
    if topo.is_main or topo.fsdp_mesh is not None:
        try:
            scores = run_validation(stage, settings, step, out, stage.data.latent_shape,
                                    main=topo.is_main)
        except Exception:
            log.exception("validation at step %d failed; training goes on", step)
    barrier()
    return scores


def _metrics_record(step: int, numbers: dict, step_time: float, samples: int, elapsed: float,
                    stage, topo: Topology) -> dict:
    import psutil

    tokens = samples * getattr(stage, "tokens_per_sample", 0) * topo.dp_world
    record = {"step": step, **numbers, "step_time_s": step_time,
              "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
              "host_mem_gb": psutil.Process().memory_info().rss / 2**30,
              "peak_device_mem_gb": (torch.cuda.max_memory_allocated() / 2**30
                                     if torch.cuda.is_available() else 0.0)}
    return record


def _setup_logging() -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def _add_file_log(out: Path, topo: Topology) -> None:
    if topo.is_main:
        handler = logging.FileHandler(out / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
