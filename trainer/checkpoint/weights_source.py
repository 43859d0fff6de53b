"""Which file or DCP directory a warm-start or export path means (no torch here).

`resolve_weights_source(path, weights=...)` answers, for every kind of path trainer.checkpoint.warm_start
reads (a state-dict file, a directory with model_state.pt, a checkpoint-<step>/, one of its
member directories, an output_dir, a directory of safetensors files: a diffusers pipeline
directory, its transformer/ folder, or a public release's folder), where the weights are, or
raises CheckpointError saying why there are none. `relay submit` calls it on the login node
before anything is queued.
"""

from __future__ import annotations

import os
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.layout import (
    COMPLETE_FILE,
    METADATA_FILE,
    CheckpointError,
    list_checkpoints,
    validate_checkpoint,
)

MODEL_STATE_FILE = "model_state.pt"
MODEL_CONFIG_FILE = "model_config.json"
WEIGHTS_CHOICES = ("ema", "live")
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
SAFETENSORS_INDEX = DIFFUSERS_WEIGHTS + ".index.json"
_LIVE_MEMBER = "transformer"
_EMA_MEMBER = "ema"


@dataclass(frozen=True)
class WeightsSource:
    """Where warm-start or export weights are read from."""

    # "safetensors", "torch" (a plain state dict file), "dcp" (a checkpoint member) or
    # "safetensors_dir" (a directory of safetensors files: one, or the shards an index names)
    kind: str
    path: Path  # the file, the member's DCP directory, or the safetensors directory
    member: str | None = None  # checkpoint member, for "dcp"
    checkpoint: Path | None = None  # the checkpoint-<step>/ holding the member, if any
    files: tuple[Path, ...] = ()  # the safetensors files, for "safetensors_dir"

    def describe(self) -> str:
        return f"{self.path} (member {self.member!r})" if self.member else str(self.path)


def resolve_weights_source(
    path: str | os.PathLike, *, weights: str, member: str | None = None
) -> WeightsSource:
    """Work out which file or DCP directory `path` means (see the module docstring).

    `member`, when given, names the checkpoint member to read and wins over `weights`.
    Raises CheckpointError when the path does not exist, names no usable weights, names a
    checkpoint that fails validation, or lacks the member asked for (e.g. EMA asked, none saved).
    """
    if weights not in WEIGHTS_CHOICES:
        raise CheckpointError(f"weights must be one of {WEIGHTS_CHOICES}, got {weights!r}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"warm-start path {path} does not exist")
    if path.is_file():
        return WeightsSource("safetensors" if path.suffix == ".safetensors" else "torch", path)
    if (path / MODEL_STATE_FILE).is_file():
        return WeightsSource("torch", path / MODEL_STATE_FILE)
    if (path / COMPLETE_FILE).is_file():
        return _checkpoint_member(path, weights=weights, member=member)
    if (path / METADATA_FILE).is_file():
        return _member_directory(path, weights=weights, member=member)
    checkpoints = list_checkpoints(path)
    if checkpoints:
        return _checkpoint_member(checkpoints[-1], weights=weights, member=member)
    if path.name.startswith("checkpoint-"):
        raise CheckpointError(f"{path} has no {COMPLETE_FILE} marker: it is not a finished checkpoint")
    source = _safetensors_directory(path)
    if source is not None:
        return source
    raise CheckpointError(
        f"{path} holds no weights: expected a .safetensors/.pt file, a directory with "
        f"{MODEL_STATE_FILE}, a checkpoint-<step>/ directory, one of its member directories, an "
        f"output_dir with at least one complete checkpoint, or a diffusers directory whose "
        f"transformer/ holds {DIFFUSERS_WEIGHTS} (or shards and {SAFETENSORS_INDEX})"
    )


def _safetensors_directory(path: Path) -> WeightsSource | None:
    """A diffusers pipeline directory (its transformer/ folder), a transformer/ folder, or a
    folder of safetensors files (the original release's): the shards its index names, its
    diffusion_pytorch_model.safetensors, or every *.safetensors in it. None when it holds none
    and is no pipeline directory; CheckpointError when an index is unreadable or names a shard
    that is missing, or a pipeline directory's transformer/ holds no weights."""
    pipeline = (path / "model_index.json").is_file() or (path / "transformer").is_dir()
    root = path / "transformer" if pipeline else path
    indexes = sorted(root.glob("*.safetensors.index.json")) if root.is_dir() else []
    if indexes:
        index = root / SAFETENSORS_INDEX if (root / SAFETENSORS_INDEX).is_file() else indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"the safetensors index {index} is not readable: {exc!r}. "
                                  f"Download the directory again.") from None
        missing = [name for name in names if not (root / name).is_file()]
        if missing:
            raise CheckpointError(
                f"the safetensors index {index} names shard file(s) that are missing from "
                f"{root}: {', '.join(missing)}. The download is incomplete: fetch the missing "
                f"shards (or the whole directory) again")
        return WeightsSource("safetensors_dir", root, files=tuple(root / name for name in names))
    if (root / DIFFUSERS_WEIGHTS).is_file():
        return WeightsSource("safetensors_dir", root, files=(root / DIFFUSERS_WEIGHTS,))
    files = tuple(sorted(root.glob("*.safetensors"))) if root.is_dir() else ()
    if files:
        return WeightsSource("safetensors_dir", root, files=files)
    if pipeline:
        raise CheckpointError(
            f"{path} is a diffusers pipeline directory, but {root} holds no safetensors weights "
            f"({DIFFUSERS_WEIGHTS}, or shards with {SAFETENSORS_INDEX}). The download is "
            f"incomplete: fetch transformer/ again")
    return None


def safetensors_keys(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a safetensors file, from its header (no torch, no data
    read). Raises CheckpointError for a file that is not safetensors."""
    try:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        return {key: tuple(value["shape"]) for key, value in header.items() if key != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc!r}") from None


def _wanted_member(weights: str, member: str | None) -> str:
    return member or (_EMA_MEMBER if weights == "ema" else _LIVE_MEMBER)


def _checkpoint_member(checkpoint: Path, *, weights: str, member: str | None) -> WeightsSource:
    try:
        info = validate_checkpoint(checkpoint)
    except CheckpointError as exc:
        # Someone else's run: report, never quarantine or silently fall back to an older one.
        raise CheckpointError(
            f"warm-start checkpoint {checkpoint} is not usable: {exc}. Point at an intact "
            "checkpoint-<step>/ directory instead."
        ) from exc
    name = _wanted_member(weights, member)
    if name not in info["members"]:
        if member is None and weights == "ema":
            raise CheckpointError(
                f"EMA weights were asked for, but {checkpoint} has no 'ema' member (it holds "
                f"{info['members']}): the run that wrote it kept no EMA. Use weights=live."
            )
        raise CheckpointError(f"{checkpoint} has no member {name!r} (it holds {info['members']})")
    return WeightsSource("dcp", checkpoint / name, name, checkpoint)


def _member_directory(directory: Path, *, weights: str, member: str | None) -> WeightsSource:
    parent = directory.parent
    if (parent / COMPLETE_FILE).is_file():
        try:
            validate_checkpoint(parent)
        except CheckpointError as exc:
            raise CheckpointError(f"warm-start checkpoint {parent} is not usable: {exc}") from exc
    wanted = _wanted_member(weights, member)
    # Naming transformer/ while asking for EMA (or ema/ while asking for live) is a contradiction.
    if directory.name in (_LIVE_MEMBER, _EMA_MEMBER) and directory.name != wanted:
        raise CheckpointError(
            f"{directory} holds {directory.name!r} weights but weights={weights!r} asks for {wanted!r}: "
            "point at the checkpoint directory, or at its matching member directory"
        )
    checkpoint = parent if (parent / COMPLETE_FILE).is_file() else None
    return WeightsSource("dcp", directory, directory.name, checkpoint)
