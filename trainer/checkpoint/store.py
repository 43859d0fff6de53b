"""Checkpoints that never lose work: atomic save, rotation, newest-readable resume.

A checkpoint is a directory `<output_dir>/checkpoint-<step>/` (layout: docs/checkpoints.md,
"What is on disk"). It is written as `checkpoint-<step>.tmp/`, and only after
every file is on disk does rank 0 write `COMPLETE` (JSON listing every file and its size) and
rename the directory into place. So a `checkpoint-<step>/` either holds a whole checkpoint or
was not made here; a crash leaves at worst a `.tmp` directory that nothing loads.

What is saved is generic: named *members*, each written with torch.distributed.checkpoint
(DCP) into its own sub-directory, so FSDP2-sharded state saves and reshards. A member is a
state dict, an object with `state_dict()`/`load_state_dict()` (`ModelMember(model)`,
`OptimizerMember(model, optimizer)`, an EMA), or a dict of those (one optimizer per role).
Beside them: `training_state.pt` (rank 0's step, schedulers, RNG states, ...; read back with
weights_only=True) and one data cursor JSON per data-parallel rank.

Resume (`find_resume_checkpoint`) takes the newest checkpoint that loads. Rank 0 chooses, every
rank follows; a checkpoint that fails on any rank is renamed `checkpoint-<step>.bad` and the
previous one is tried. If checkpoints exist and none loads, it raises: a silent fresh start
would throw the run's progress away.

Also exported here, so callers need one import: `capture_rng_state`/`restore_rng_state`
(trainer.checkpoint.rng), `load_warm_start`/`export_weights` (trainer.checkpoint.warm_start), and the on-disk
helpers of trainer.checkpoint.layout.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    COMPLETE_FILE,
    DATALOADER_DIR,
    QUARANTINE_REASON_FILE,
    describe_load_error,
    RESOLVED_CONFIG_FILE,
    TRAINING_STATE_FILE,
    CheckpointError,
    METADATA_FILE,
    CheckpointIncompatibleError,
    checkpoint_dir,
    checkpoint_step,
    expected_files,
    recorded_checksums,
    fsync_dir,
    list_checkpoints,
    member_checksums,
    prune_checkpoints,
    quarantine_checkpoint,
    read_complete,
    scan_output_dir,
    unique_sibling,
    validate_checkpoint,
    verify_bytes,
    verify_files,
    write_durably,
)
from trainer.checkpoint.checksums import ALGORITHM as CHECKSUM_ALGORITHM
from trainer.checkpoint.checksums import digest_file
from trainer.checkpoint.dcp_io import (
    iter_tensor_leaves,
    load_dcp_in_place,
    read_dcp_tensor_shapes,
    save_dcp,
)
from trainer.parallel.distributed import (all_gather_objects, broadcast_from_rank0, distributed_active,
                                 rank_in)

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_RESERVED_NAMES = {DATALOADER_DIR, COMPLETE_FILE, TRAINING_STATE_FILE, QUARANTINE_REASON_FILE}


# --------------------------------------------------------------------------------------------
# Members
# --------------------------------------------------------------------------------------------


class ModelMember:
    """A checkpoint member for a model (plain or FSDP2): saved as its state dict, loaded back into it.

    `trainable_only` (a LoRA run): only the parameters that require grad, the adapters; the
    frozen base is neither saved nor loaded (docs/lora.md). Loading stays strict for those:
    DCP fills exactly the keys `state_dict` returned, and a checkpoint lacking one fails.
    """

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False) -> None:
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=True) if trainable_only else None

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.options is None:
            set_model_state_dict(self.model, state_dict)
            return
        # The frozen keys are absent by design; every trainable one is present (DCP filled them).
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))


class OptimizerMember:
    """A checkpoint member for an optimizer, keyed by parameter names so it survives resharding.

    Loading restores param_groups (lr, betas, ...) as well as the moment tensors.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        # Initialises the state of an optimizer that never stepped, so a fresh one can be loaded into.
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _is_stateful(obj: Any) -> bool:
    return not isinstance(obj, Mapping) and hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def _expand_member(member: Any) -> tuple[Any, list[Callable[[], None]]]:
    """Replace each Stateful object in `member` (itself, or a value of a dict) by its state dict.

    Returns the plain state, which DCP saves or fills in place, and for loading the calls that
    hand each filled state dict back to its object.
    """
    finishers: list[Callable[[], None]] = []

    def expand(node: Any) -> Any:
        if _is_stateful(node):
            state = node.state_dict()
            finishers.append(lambda node=node, state=state: node.load_state_dict(state))
            return state
        if isinstance(node, Mapping):
            return {key: expand(value) for key, value in node.items()}
        return node

    return expand(member), finishers


def _check_names(kind: str, names: Any) -> None:
    for name in names:
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in _RESERVED_NAMES or name.endswith(".tmp"):
            raise CheckpointError(
                f"checkpoint {kind} name {name!r} cannot be used: use letters, digits, '.', '_' or '-', "
                f"not one of {sorted(_RESERVED_NAMES)}"
            )


# --------------------------------------------------------------------------------------------
# Collectives (all no-ops in one process)
# --------------------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Topology:
    world_size: int
    dp_world: int
    dp_rank: int
    cp_size: int
    writes_cursor: bool  # cp rank 0 of each data-parallel group: the group shares one cursor


def _topology(world_size: int, dp_world: int, dp_rank: int, cp_size: int, cp_rank: int | None) -> _Topology:
    if min(world_size, dp_world, cp_size) < 1 or not 0 <= dp_rank < dp_world:
        raise CheckpointError(
            f"invalid topology: world_size={world_size}, dp_world={dp_world}, dp_rank={dp_rank}, cp_size={cp_size}"
        )
    if world_size % (dp_world * cp_size):
        raise CheckpointError(f"world_size {world_size} is not a multiple of dp_world {dp_world} x cp_size {cp_size}")
    if cp_size > 1 and cp_rank is None:
        raise CheckpointError(
            "with cp_size > 1 pass cp_rank: only cp rank 0 of a data-parallel group writes its data cursor"
        )
    return _Topology(world_size, dp_world, dp_rank, cp_size, writes_cursor=not cp_rank)


@dataclass
class _SaveJob:
    """Everything one save writes, captured on the training thread."""

    output_dir: Path
    step: int
    members: dict[str, Any]  # plain (possibly nested) state dicts
    training_state: dict[str, Any]
    dataloader_json: str | None  # None on ranks that do not write a cursor
    extra_files: dict[str, bytes]
    topology: _Topology
    config_digest: str
    model_config: dict[str, Any] | None
    save_total_limit: int
    process_group: dist.ProcessGroup | None
    protect: tuple[Path, ...] = ()  # checkpoints the prune after this save must keep


def _snapshot_training_state(training_state: dict[str, Any]) -> dict[str, Any]:
    """Copy the training state and prove now that it will load with weights_only=True.

    A training_state holding an arbitrary object (a Namespace, an optimizer) would save fine and
    then fail at resume, quarantining a checkpoint that cost hours: refuse it here instead.
    """
    buffer = io.BytesIO()
    torch.save(training_state, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            "training_state must hold only tensors, numbers, strings, lists, tuples and dicts (it "
            f"is read back with weights_only=True); it does not: {exc}. Store objects' "
            "state_dict() rather than the objects."
        ) from exc


def _prepare_job(output_dir: str | os.PathLike, step: int, *, members: Mapping[str, Any],
                 training_state: dict[str, Any], dataloader_state: Any, topology: _Topology,
                 config_digest: str, model_config: dict[str, Any] | None,
                 extra_files: Mapping[str, str | bytes] | None, save_total_limit: int,
                 process_group: dist.ProcessGroup | None,
                 protect: tuple[Path, ...] = ()) -> _SaveJob:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
    if not members:
        raise CheckpointError("a checkpoint needs at least one member, e.g. {'transformer': ModelMember(model)}")
    extra_files = dict(extra_files or {})
    _check_names("member", members)
    _check_names("extra file", extra_files)
    clashes = set(members) & set(extra_files)
    if clashes:
        raise CheckpointError(f"extra_files {sorted(clashes)} have the names of members")
    cursor = None
    if topology.writes_cursor:
        try:
            cursor = json.dumps(dataloader_state, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"dataloader_state must be JSON-serialisable: {exc}") from exc
    return _SaveJob(
        output_dir=Path(output_dir),
        step=step,
        members={name: _expand_member(member)[0] for name, member in members.items()},
        training_state=_snapshot_training_state(dict(training_state)),
        dataloader_json=cursor,
        extra_files={name: data.encode() if isinstance(data, str) else bytes(data)
                     for name, data in extra_files.items()},
        topology=topology,
        config_digest=config_digest,
        model_config=json.loads(json.dumps(model_config)) if model_config is not None else None,
        save_total_limit=save_total_limit,
        process_group=process_group,
        protect=tuple(protect),
    )


def _existing_checkpoint_matches(job: _SaveJob) -> bool:
    """Rank 0: does checkpoint-<step> already exist, intact, with the same members and topology?"""
    final = checkpoint_dir(job.output_dir, job.step)
    if not (final / COMPLETE_FILE).is_file():
        return False
    try:
        info = validate_checkpoint(final)
    except CheckpointError:
        return False
    topo = job.topology
    return sorted(info["members"]) == sorted(job.members) and (
        info["world_size"], info["dp_world"], info["cp_size"]
    ) == (topo.world_size, topo.dp_world, topo.cp_size)


def _should_skip(job: _SaveJob) -> bool:
    """Collective: every rank learns whether rank 0 found this step already saved."""
    skip = _existing_checkpoint_matches(job) if rank_in(job.process_group) == 0 else None
    skip = bool(broadcast_from_rank0(skip, job.process_group))
    if skip and rank_in(job.process_group) == 0:
        # The usual case: the final save lands on the step of the last interval save.
        log.info("checkpoint-%d already exists and is complete; not saving it again", job.step)
    return skip


def _run_phase(job: _SaveJob, what: str, action: Callable[[], None] | None) -> None:
    """Run this rank's part of one save phase, then make every rank agree on how it went.

    Every phase ends in an all-gather of errors, so a failure on one rank stops the save on all
    of them at the same point instead of leaving the others blocked in the next collective.
    """
    local_error = None
    if action is not None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = _describe(exc)
            log.error("checkpoint-%d: could not %s: %s", job.step, what, local_error)
    gathered = all_gather_objects(local_error, job.process_group)
    errors = [f"rank {rank}: {err}" for rank, err in enumerate(gathered) if err]
    if errors:
        if rank_in(job.process_group) == 0:
            shutil.rmtree(job.output_dir / f"checkpoint-{job.step}.tmp", ignore_errors=True)
        raise CheckpointError(
            f"checkpoint-{job.step} was not saved (could not {what}): {'; '.join(errors)}. "
            f"Earlier checkpoints are untouched. Check free space and permissions of {job.output_dir}."
        )


def _write_and_commit(job: _SaveJob) -> Path:
    """Write every file of `job` into checkpoint-<step>.tmp, then publish it. All ranks call this."""
    group = job.process_group
    is_rank0 = rank_in(group) == 0
    tmp = job.output_dir / f"checkpoint-{job.step}.tmp"
    final = checkpoint_dir(job.output_dir, job.step)

    def prepare() -> None:
        if tmp.exists():
            log.warning("removing %s left by an earlier unfinished save of the same step", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _run_phase(job, "create the temporary directory", prepare if is_rank0 else None)
    # Every file's checksum, taken while it is written (None: the writer could not hash it).
    digests: dict[str, str | None] = {}
    for name, state in job.members.items():
        def write_member(state=state, name=name) -> None:
            written = save_dcp(state, tmp / name, process_group=group)
            digests.update({f"{name}/{file}": digest for file, digest in written.items()})

        _run_phase(job, f"write member {name!r}", write_member)

    def write_small_files() -> None:
        if is_rank0:
            buffer = io.BytesIO()
            torch.save({"format": CHECKPOINT_FORMAT, "state": job.training_state}, buffer)
            digests[TRAINING_STATE_FILE] = write_durably(tmp / TRAINING_STATE_FILE, buffer.getvalue())
            for name, data in job.extra_files.items():
                digests[name] = write_durably(tmp / name, data)
        if job.dataloader_json is not None:
            cursor = f"{DATALOADER_DIR}/{job.topology.dp_rank}.json"
            digests[cursor] = write_durably(tmp / cursor, job.dataloader_json.encode())

    _run_phase(job, "write training state and data cursors", write_small_files)
    every_rank = {rel: digest for part in all_gather_objects(digests, group) for rel, digest in part.items()}
    _run_phase(job, "publish the checkpoint",
               (lambda: _publish(job, tmp, final, every_rank)) if is_rank0 else None)
    if is_rank0:
        log.info("saved %s", final)
        if job.save_total_limit >= 1:
            prune_checkpoints(job.output_dir, job.save_total_limit, protect=(final, *job.protect))
    return final


def _publish(job: _SaveJob, tmp: Path, final: Path, digests: dict[str, str | None]) -> None:
    """Rank 0: list every file with its size and checksum, write COMPLETE, rename tmp into
    place. `digests` are the checksums the writers took; a file without one is hashed from
    disk.

    Every file's writer fsynced it before this. Rank 0 does not sync them again: on a network
    filesystem an fsync of a file another node wrote flushes nothing of that node's, and it
    costs a round trip per file (thousands of files at the scale of config/pretrain.yaml).
    """
    files: dict[str, int] = {}
    checksums: dict[str, str] = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            rel = path.relative_to(tmp).as_posix()
            files[rel] = path.stat().st_size
            checksums[rel] = digests.get(rel) or digest_file(path)
        elif path.is_dir():
            fsync_dir(path)
    missing = [rel for rel in expected_files(list(job.members), job.topology.dp_world) if rel not in files]
    if missing:
        raise CheckpointError(f"files missing after every rank finished writing: {missing}")
    topo = job.topology
    complete = {
        "format": CHECKPOINT_FORMAT,
        "step": job.step,
        "world_size": topo.world_size,
        "dp_world": topo.dp_world,
        "cp_size": topo.cp_size,
        "members": list(job.members),
        "config_digest": job.config_digest,
        "model_config": job.model_config,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "files": files,
        "checksum": CHECKSUM_ALGORITHM,
        "checksums": checksums,
    }
    write_durably(tmp / COMPLETE_FILE, json.dumps(complete, indent=2, sort_keys=True).encode())
    fsync_dir(tmp)
    replaced = _move_existing_aside(final) if final.exists() else None
    os.rename(tmp, final)
    fsync_dir(job.output_dir)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _move_existing_aside(final: Path) -> Path | None:
    """Make room for a new checkpoint-<step>; return a directory to delete after the rename."""
    try:
        validate_checkpoint(final)
    except CheckpointError as exc:
        # Nothing resume would load anyway: keep it for inspection.
        if quarantine_checkpoint(final, f"replaced by a new save of the same step ({exc})") is None:
            raise
        return None
    # Intact but with other members or topology (else the save was skipped): superseded.
    aside = unique_sibling(final, ".deleting")
    os.rename(final, aside)
    log.warning("replacing %s (other members or topology) with a new save of the same step", final.name)
    return aside


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    members: Mapping[str, Any],
    training_state: dict[str, Any],
    dataloader_state: Any,
    dp_rank: int = 0,
    dp_world: int = 1,
    world_size: int = 1,
    cp_size: int = 1,
    cp_rank: int | None = None,
    config_digest: str = "",
    model_config: dict[str, Any] | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    save_total_limit: int = 0,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save one checkpoint synchronously and publish it atomically; return `checkpoint-<step>/`.

    A collective when a process group is initialised: every rank calls it with its own
    `members` (its shards) and `dataloader_state` (its data-parallel rank's cursor, JSON; with
    cp_size > 1 pass `cp_rank`, and only cp rank 0 writes it). Rank 0's `training_state` (step,
    schedulers' state_dict, RNG states: anything weights_only-loadable) and `extra_files`
    ({name: text}, e.g. resolved-config.json) are written. `model_config` is recorded in
    COMPLETE for `export_weights`. If checkpoint-<step> is already complete with the same
    members and topology, nothing is written. After publishing, rank 0 prunes to
    `save_total_limit` (< 1 keeps all). For saves that overlap training use `CheckpointManager`.

    Raises CheckpointError (on every rank) for a bad argument or if anything could not be
    written; earlier checkpoints are untouched and no partial checkpoint-<step>/ appears.
    """
    with CheckpointManager(output_dir, save_total_limit=save_total_limit,
                           process_group=process_group) as manager:
        return manager.save(step, members=members, training_state=training_state,
                            dataloader_state=dataloader_state, dp_rank=dp_rank, dp_world=dp_world,
                            world_size=world_size, cp_size=cp_size, cp_rank=cp_rank,
                            config_digest=config_digest, model_config=model_config,
                            extra_files=extra_files)


@dataclass
class SaveTiming:
    """How long one save held up the training thread, and how long it took in all."""

    step: int
    blocked_s: float  # time save() took on the training thread (waiting + staging, or everything)
    waited_s: float  # of which: waiting for the previous save to finish
    total_s: float | None = None  # from save() to published; None while in flight


def _new_stager():
    """The host-memory stager of background saves.

    Pinned buffers make the device->host copy fast and are reused save after save where torch
    keeps them (safe: one save in flight); the copy stays synchronous, so save() returns holding
    a consistent snapshot.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(
        use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
        use_async_staging=False, use_non_blocking_copy=False))


class CheckpointManager:
    """Saves one run's checkpoints, synchronously or with at most one save in flight.

    With `async_save=True`, `save()` waits for the previous save to finish, copies the members
    to CPU memory (the only time training is blocked) and returns; a background thread writes
    and publishes the checkpoint. `wait()` finishes the save in flight; `close()` waits too:
    call it before exiting. A background save's error is raised by the next `wait()`, `save()`
    or `close()`. `timings` records every save's blocked and total time.

    Create it on every rank at the same point. Async saves use their own gloo process group so
    the background thread's collectives never interleave with the training thread's (and DCP's
    async path needs a CPU backend).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        save_total_limit: int = 0,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit
        self.async_save = async_save
        if process_group is None and async_save and distributed_active():
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None
        if async_save:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-checkpoint")
            self._stager = _new_stager()
        self._in_flight: Future | None = None
        self._in_flight_step: int | None = None
        # A checkpoint no prune may delete while it is set (the health gate's newest one saved
        # before the run turned unhealthy); None: pruning follows save_total_limit alone.
        self.keep: Path | None = None
        self.timings: list[SaveTiming] = []

    @property
    def in_flight(self) -> bool:
        """True while a background save has not been waited for."""
        return self._in_flight is not None

    def save(
        self,
        step: int,
        *,
        members: Mapping[str, Any],
        training_state: dict[str, Any],
        dataloader_state: Any,
        dp_rank: int = 0,
        dp_world: int = 1,
        world_size: int = 1,
        cp_size: int = 1,
        cp_rank: int | None = None,
        config_digest: str = "",
        model_config: dict[str, Any] | None = None,
        extra_files: Mapping[str, str | bytes] | None = None,
    ) -> Path:
        """Save a checkpoint at `step`; return the path it has (async: will have) once published.

        Arguments as for `save_checkpoint`. Raises CheckpointError for a bad argument, a failed
        synchronous save, or the previous background save's failure.
        """
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        job = _prepare_job(
            self.output_dir, step, members=members, training_state=training_state,
            dataloader_state=dataloader_state,
            topology=_topology(world_size, dp_world, dp_rank, cp_size, cp_rank),
            config_digest=config_digest, model_config=model_config, extra_files=extra_files,
            save_total_limit=self.save_total_limit, process_group=self.process_group,
            protect=(Path(self.keep),) if self.keep is not None else (),
        )
        final = checkpoint_dir(self.output_dir, step)
        if _should_skip(job):
            return final
        if self._executor is None:
            _write_and_commit(job)
            blocked = time.perf_counter() - started
            self.timings.append(SaveTiming(step, blocked, waited, blocked))
            return final
        try:
            job.members = self._stage(job.members)
        except Exception as exc:
            # The checkpoint is still written, synchronously: a save never fails for want of a copy.
            log.warning("could not stage checkpoint-%d in host memory for a background save "
                        "(%s: %s); saving it synchronously", step, type(exc).__name__, exc)
            _write_and_commit(job)
            blocked = time.perf_counter() - started
            self.timings.append(SaveTiming(step, blocked, waited, blocked))
            return final
        timing = SaveTiming(step, time.perf_counter() - started, waited)

        def write_in_background() -> Path:
            try:
                return _write_and_commit(job)
            finally:
                timing.total_s = time.perf_counter() - started

        self._in_flight = self._executor.submit(write_in_background)
        self._in_flight_step = step
        self.timings.append(timing)
        return final

    def _stage(self, members: dict[str, Any]) -> dict[str, Any]:
        """Copy every member to host memory in one pass (one snapshot; shared tensors copied once).

        torch 2.11's DefaultStager closes itself after each stage, emptying the copy table that its
        next stage needs (KeyError: <class 'type'>), while 2.13's keeps it and its pinned buffers
        for reuse. One retry with a fresh stager serves both: the failed call stops at the
        top-level dict, before any tensor is copied.
        """
        try:
            return self._stager.stage(members)
        except Exception:
            self._stager.close()
            self._stager = _new_stager()
            return self._stager.stage(members)

    def wait(self) -> Path | None:
        """Finish the save in flight, if any; return its path. Raises CheckpointError if it failed."""
        future, step = self._in_flight, self._in_flight_step
        if future is None:
            return None
        self._in_flight, self._in_flight_step = None, None
        try:
            return future.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"background save of step {step} failed: {_describe(exc)}") from exc

    def close(self) -> None:
        """Finish the save in flight and release the background thread. Safe to call twice."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Loading and resuming
# --------------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike,
    members: Mapping[str, Any],
    *,
    dp_rank: int = 0,
    dp_world: int = 1,
    cp_size: int = 1,
    resume_data_state: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint's members in place; return (training_state, this dp rank's data cursor).

    `members` as for `save_checkpoint`: state dicts are filled in place, Stateful objects
    (`ModelMember(model)`, `OptimizerMember(...)`) are filled and then loaded into their model
    or optimizer. A collective when a process group is initialised. The cursor is None when
    `resume_data_state` is False: then the data-parallel topology is not checked and the data
    stream restarts (the caller should say so loudly).

    When dp_world differs from the saved one, every rank gets data rank 0's cursor: relay's
    data position is global (trainer.data), and the iterator converts it to the new split.

    Every file read is checked against the checksum COMPLETE records for it: shards as they
    are read (a shard no rank reads whole is hashed from disk afterwards), the small files
    before they are parsed.

    Raises CheckpointIncompatibleError (the checkpoint is fine, this run's configuration is
    not) when a member is absent or a tensor is absent or shaped differently. Raises
    CheckpointError (or DCPError) when a checksum does not match, and CheckpointError or another
    exception when a file is corrupt.
    """
    path = Path(path)
    # Stateful members produce their state dicts on every rank, before any rank can fail.
    expanded = {name: _expand_member(member) for name, member in members.items()}
    recorded: dict[str, str] = {}  # file -> checksum from COMPLETE (empty: none recorded)

    def check() -> None:
        info = read_complete(path)
        _check_compatible(path, info, members, dp_world, cp_size, resume_data_state)
        recorded.update(_recorded_or_note(path, info, process_group))
        # Verified before it is read: a flipped bit could pass for a changed model shape.
        verify_files(path, recorded, [f"{name}/{METADATA_FILE}" for name in expanded])
        for name, (state, _) in expanded.items():
            _check_member_shapes(path / name, state)

    # Every rank checks, then all agree, so that no rank enters DCP's collectives alone.
    _raise_if_any_rank_failed(_attempt(check), process_group)
    for name, (state, finishers) in expanded.items():
        # All ranks agree on errors, a checksum mismatch included.
        load_dcp_in_place(state, path / name, process_group=process_group,
                          checksums=member_checksums(recorded, name))

        def finish(finishers=finishers) -> None:
            for apply in finishers:
                apply()

        _raise_if_any_rank_failed(_attempt(finish), process_group)

    # Rank-local reads last: no collective follows, so a failure here cannot strand other ranks.
    state_file = path / TRAINING_STATE_FILE
    try:
        data = state_file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{state_file} is unreadable ({exc})") from exc
    verify_bytes(state_file, data, recorded.get(TRAINING_STATE_FILE))
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{state_file} is unreadable "
                              f"({describe_load_error(exc)})") from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{state_file} is not a training state of format {CHECKPOINT_FORMAT}")
    cursor = None
    if resume_data_state:
        same_split = read_complete(path)["dp_world"] == dp_world
        rel = f"{DATALOADER_DIR}/{dp_rank if same_split else 0}.json"
        try:
            text = (path / rel).read_bytes()
            verify_bytes(path / rel, text, recorded.get(rel))
            cursor = json.loads(text)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"data cursor {path / rel} is unreadable: {exc}") from exc
    return payload["state"], cursor


def _recorded_or_note(path: Path, info: dict[str, Any],
                      group: dist.ProcessGroup | None) -> dict[str, str]:
    """The checksums COMPLETE records; for an older checkpoint without any, a note and {}."""
    if "checksums" not in info and rank_in(group) == 0:
        log.warning("%s records no checksums (saved by an older relay): its files are checked "
                    "by size only", path.name)
    return recorded_checksums(info, path) or {}


def _check_compatible(path: Path, info: dict[str, Any], members: Mapping[str, Any], dp_world: int,
                      cp_size: int, resume_data_state: bool) -> None:
    """Raise CheckpointIncompatibleError if this run cannot use the checkpoint described by `info`."""
    absent = [name for name in members if name not in info["members"]]
    if absent:
        raise CheckpointIncompatibleError(
            f"{path} has no member(s) {absent} (it holds {info['members']}). Every role and member "
            "this run declares must be in the checkpoint: resume with the configuration that "
            "wrote it, or start the new configuration from a warm start in a new output_dir."
        )
    if resume_data_state and (info["dp_world"], info["cp_size"]) != (dp_world, cp_size):
        # Elastic resume: DCP reshards the members; the data position is global, so data rank
        # 0's cursor is handed to every rank and the data iterator converts it (or refuses).
        log.warning("%s was saved with dp_world=%s, cp_size=%s; this run has dp_world=%s, "
                    "cp_size=%s: resharding the weights and optimizer state and continuing the "
                    "global data stream from the saved position", path.name, info["dp_world"],
                    info["cp_size"], dp_world, cp_size)
    unused = [name for name in info["members"] if name not in members]
    if unused:
        log.info("%s: not loading member(s) %s (this run does not use them)", path.name, unused)


def _attempt(action: Callable[[], None]) -> Exception | None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - handed to _raise_if_any_rank_failed
        return exc
    return None


def _raise_if_any_rank_failed(local: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if `local` is an error on any rank (one process: re-raise it as is).

    The error is CheckpointIncompatibleError if any rank found the configuration does not fit,
    else CheckpointError; its message names each failing rank.
    """
    if not distributed_active():
        if local is not None:
            raise local
        return
    kind = None if local is None else ("incompatible" if isinstance(local, CheckpointIncompatibleError) else "failed")
    outcomes = all_gather_objects(None if local is None else (kind, _describe(local)), group)
    failures = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if not failures:
        return
    message = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in failures)
    if any(k == "incompatible" for _, (k, _) in failures):
        raise CheckpointIncompatibleError(message) from local
    raise CheckpointError(message) from local


def _check_member_shapes(dcp_dir: Path, state: Any) -> None:
    """Raise CheckpointIncompatibleError if a tensor of `state` is absent or shaped differently on disk.

    Checked before loading so that a changed model configuration is reported as such and not
    mistaken for a corrupt checkpoint (which resume would quarantine). An unreadable .metadata
    raises its own error, which is corruption.
    """
    stored = read_dcp_tensor_shapes(dcp_dir)
    wanted = {key: tuple(tensor.shape) for key, tensor in iter_tensor_leaves(state)}
    missing = sorted(key for key in wanted if key not in stored)
    mismatched = [f"{key}: checkpoint {tuple(stored[key][0])}, run {shape}"
                  for key, shape in wanted.items() if key in stored and tuple(stored[key][0]) != shape]
    if missing or mismatched:
        more = " ..." if len(missing) > 10 else ""
        raise CheckpointIncompatibleError(
            f"{dcp_dir} does not fit this run's {dcp_dir.name}: "
            + (f"missing keys {missing[:10]}{more}; " if missing else "")
            + (f"shape mismatches {mismatched[:10]}; " if mismatched else "")
            + "resume with the model configuration that wrote it (a new architecture needs a warm start)."
        )
    unexpected = sorted(set(stored) - set(wanted))
    if unexpected:
        log.warning("%s holds %d tensor(s) this run does not use, e.g. %s", dcp_dir, len(unexpected), unexpected[:5])


def find_resume_checkpoint(
    output_dir: str | os.PathLike,
    load_fn: Callable[[Path], Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Path | None:
    """Resume from the newest checkpoint in `output_dir` that loads; return its path, or None.

    Rank 0 picks the newest complete checkpoint that passes `validate_checkpoint` and tells
    every rank; every rank calls `load_fn(path)` (which loads, e.g. via `load_checkpoint`,
    keeping what it needs); then all ranks agree on the outcome. A checkpoint that fails
    validation, or loading on any rank, is quarantined as `checkpoint-<step>.bad` with the
    reason logged, and the next older one is tried. Directories `checkpoint-<step>` without
    COMPLETE are reported and never loaded. After a successful load rank 0 removes leftover
    `.tmp` directories (unfinished saves). A collective when a process group is initialised.

    `load_fn` must not fail on one rank before a collective the others enter (they would
    wait forever): `load_checkpoint` agrees internally, so do rank-local work that may fail
    (applying data cursors, say) after it returns.

    Returns None only when `output_dir` never held a checkpoint (a fresh start). Raises
    CheckpointError when checkpoints exist (complete, unmarked, unfinished or quarantined) but
    none loads, and CheckpointIncompatibleError, quarantining nothing, when `load_fn` finds
    this run's configuration does not fit the checkpoint.
    """
    output_dir = Path(output_dir)
    is_rank0 = rank_in(process_group) == 0
    skip: set[Path] = set()  # rank 0: failed checkpoints that could not be renamed
    first = True
    while True:
        choice: tuple[str | None, str | None] = (None, None)
        if is_rank0:
            choice = _choose_candidate(output_dir, skip, report=first)
        first = False
        path_str, refusal = broadcast_from_rank0(choice, process_group)
        if refusal is not None:
            raise CheckpointError(refusal)
        if path_str is None:
            return None
        path = Path(path_str)
        outcome: tuple[str, str] | None = None
        try:
            load_fn(path)
        except CheckpointIncompatibleError as exc:
            outcome = ("incompatible", str(exc))
        except Exception as exc:  # noqa: BLE001 - any load failure means: try the previous one
            outcome = ("failed", _describe(exc))
            log.warning("rank %d could not load %s: %s", rank_in(process_group), path, outcome[1])
        failures = [(rank, o) for rank, o in enumerate(all_gather_objects(outcome, process_group)) if o is not None]
        if not failures:
            if is_rank0:
                log.info("resuming from %s", path)
                _remove_unfinished_saves(output_dir)
            return path
        incompatible = [message for _, (kind, message) in failures if kind == "incompatible"]
        if incompatible:
            raise CheckpointIncompatibleError(incompatible[0])
        if is_rank0:
            reason = "load failed: " + "; ".join(f"rank {rank}: {message}" for rank, (_, message) in failures)
            if quarantine_checkpoint(path, reason) is None:
                skip.add(path)


def _choose_candidate(output_dir: Path, skip: set[Path], *, report: bool) -> tuple[str | None, str | None]:
    """Rank 0: (newest valid checkpoint, None); (None, None) for a fresh start; or (None, refusal)."""
    scan = scan_output_dir(output_dir)
    if report:
        for path in scan.unmarked:
            log.warning("%s has no %s marker: not a finished checkpoint, never loaded (inspect or "
                        "remove it)", path, COMPLETE_FILE)
        for path in scan.unfinished:
            log.warning("%s is an unfinished save (the job stopped while writing it); ignored", path)
    for _, path in reversed(scan.marked):
        if path in skip:
            continue
        try:
            validate_checkpoint(path)
        except CheckpointError as exc:
            if quarantine_checkpoint(path, f"validation failed: {exc}") is None:
                skip.add(path)
            continue
        return str(path), None
    if not scan.has_any and not skip:
        return None, None
    if scan.unfinished and not (scan.marked or scan.unmarked or scan.quarantined or skip):
        # Only interrupted first saves: no checkpoint was ever published, so there is no
        # progress to protect. A requeued job that died in its first save must not need a person.
        log.warning("%s holds only unfinished saves %s and no checkpoint was ever published: "
                    "starting fresh (they are removed)", output_dir,
                    sorted(p.name for p in scan.unfinished))
        _remove_unfinished_saves(output_dir)
        return None, None
    scan = scan_output_dir(output_dir)
    found = sorted({p.name for p in scan.quarantined + scan.unmarked + scan.unfinished} | {p.name for p in skip})
    return None, (
        f"{output_dir} holds checkpoints but none can be loaded: {found}. Refusing to start fresh, "
        "which would silently discard the run's progress. The log says why each failed, and each "
        f".bad directory holds a {QUARANTINE_REASON_FILE} file. To retry one, rename it back to "
        "checkpoint-<step>; to start from scratch on purpose, use a new output_dir or move these "
        "directories away."
    )


def _remove_unfinished_saves(output_dir: Path) -> None:
    # Safe because no other job writes into this output_dir while this one resumes.
    for path in scan_output_dir(output_dir).unfinished:
        try:
            shutil.rmtree(path)
            log.info("removed unfinished save %s", path.name)
        except OSError as exc:
            log.warning("could not remove unfinished save %s (%s)", path, exc)


__all__ = [
    "CHECKPOINT_FORMAT",
    "COMPLETE_FILE",
    "DATALOADER_DIR",
    "QUARANTINE_REASON_FILE",
    "RESOLVED_CONFIG_FILE",
    "TRAINING_STATE_FILE",
    "CheckpointError",
    "CheckpointIncompatibleError",
    "CheckpointManager",
    "ModelMember",
    "OptimizerMember",
    "SaveTiming",
    "checkpoint_dir",
    "checkpoint_step",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "quarantine_checkpoint",
    "read_complete",
    "save_checkpoint",
    "validate_checkpoint",
]
