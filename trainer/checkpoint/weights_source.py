"""Which file or DCP directory a warm-start or export path means (no torch here).

`resolve_weights_source(path, weights=...)` answers, for every kind of path trainer.checkpoint.warm_start
reads (a state-dict file, a directory with model_state.pt, a checkpoint-<step>/, one of its
member directories, an output_dir, a directory of safetensors files: a diffusers pipeline
directory, its transformer/ folder, or a public release's folder), where the weights are, or
raises CheckpointError saying why there are none (a safetensors file cut short, too, from its
header and size). `relay submit` calls it on the login node before anything is queued.
`stored_shapes` gives a safetensors source's tensors under the model's keys, from the headers,
as the warm start will read them, so preflight can compare them with the model config.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
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
        if path.suffix == ".safetensors":
            check_safetensors_complete(path)
            return WeightsSource("safetensors", path)
        return WeightsSource("torch", path)
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
        files = tuple(root / name for name in names)
    elif (root / DIFFUSERS_WEIGHTS).is_file():
        files = (root / DIFFUSERS_WEIGHTS,)
    else:
        files = tuple(sorted(root.glob("*.safetensors"))) if root.is_dir() else ()
    if files:
        for file in files:
            check_safetensors_complete(file)
        return WeightsSource("safetensors_dir", root, files=files)
    if pipeline:
        raise CheckpointError(
            f"{path} is a diffusers pipeline directory, but {root} holds no safetensors weights "
            f"({DIFFUSERS_WEIGHTS}, or shards with {SAFETENSORS_INDEX}). The download is "
            f"incomplete: fetch transformer/ again")
    return None


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """(the header's tensor entries, the bytes the file must have: the 8-byte length, the
    header and the data its entries' offsets cover). Raises CheckpointError when the header
    cannot be read."""
    try:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            available = os.fstat(handle.fileno()).st_size - 8
            if size > available:
                raise ValueError(f"the header is {size} bytes but the file ends {available} "
                                 f"bytes after its length")
            header = json.loads(handle.read(size))
        entries = {key: value for key, value in header.items() if key != "__metadata__"}
        end = max((int(value["data_offsets"][1]) for value in entries.values()), default=0)
        for value in entries.values():
            tuple(value["shape"])
        return entries, 8 + size + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError,
            struct.error) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc!r}") from None


def safetensors_keys(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a safetensors file, from its header (no torch, no data
    read). Raises CheckpointError for a file that is not safetensors."""
    entries, _ = _safetensors_header(file)
    return {key: tuple(value["shape"]) for key, value in entries.items()}


def check_safetensors_complete(file: Path) -> None:
    """Raise CheckpointError unless `file` holds every byte its header describes, no more and no
    less (what safetensors itself requires before reading a tensor): a download or copy that
    stopped early leaves a file cut short, which only the load at job start would find."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if length is None or length > size - 8:
        raise CheckpointError(
            f"{file} ends inside its safetensors header ({size} bytes"
            + ("" if length is None else f", a header of {length}")
            + "): it is cut short (a download or copy that stopped early) or not a safetensors "
              "file. Fetch the file again")
    _, expected = _safetensors_header(file)
    if size < expected:
        raise CheckpointError(
            f"{file} is cut short: its header describes {expected} bytes but the file has "
            f"{size}, so its last tensors are missing (a download or copy that stopped early). "
            f"Fetch the file again")
    if size > expected:
        raise CheckpointError(
            f"{file} has {size} bytes but its header describes {expected}: it is not a whole "
            f"safetensors file (safetensors refuses to read it). Fetch the file again")


# Keys only the original Wan release (or ComfyUI's copy of it) has: a directory holding one is
# in the "original" layout (trainer.checkpoint.warm_start reads it the same way).
ORIGINAL_LAYOUT_MARKERS = (".self_attn.", ".cross_attn.", "head.head.", "model.diffusion_model.")


def stored_shapes(source: WeightsSource, family=None) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """(model key -> stored shape, layout) of a safetensors source, from the headers alone: a
    directory's keys mapped through `family`'s state-dict adapter for the layout they are in
    ("original" or "diffusers"), a single file's as stored (layout None), as
    trainer.checkpoint.warm_start maps them. Raises CheckpointError for an unreadable header,
    ValueError when `family` has no adapter for the directory's layout."""
    if source.kind == "safetensors":
        return safetensors_keys(source.path), None
    if source.kind != "safetensors_dir":
        raise ValueError(f"{source.describe()} is not a safetensors source")
    stored = {file: safetensors_keys(file) for file in source.files}
    layout = "original" if any(marker in key for keys in stored.values() for key in keys
                               for marker in ORIGINAL_LAYOUT_MARKERS) else "diffusers"
    adapter = family.state_dict_adapter(layout) if family is not None else None
    shapes: dict[str, tuple[int, ...]] = {}
    for keys in stored.values():
        for key, shape in keys.items():
            mapped = adapter.to_relay(key) if adapter is not None else key
            if mapped is not None:
                shapes[mapped] = shape
    return shapes, layout


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


_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def weights_fit_problem(stored: dict[str, tuple[int, ...]], linears: dict[str, tuple[int, int]],
                        config: dict, where: str | os.PathLike, *, origin: str,
                        allow_missing: tuple[str, ...] = (),
                        allow_unexpected: tuple[str, ...] = ()) -> str | None:
    """Why weights stored as `stored` (model key -> shape, stored_shapes) are of another
    architecture than the model whose linear layers are `linears` (name -> (in, out)
    features: the family's linear_shapes of `config`, which `origin` gives), or None: blocks
    (`blocks.<i>.`) in another number than the model's, or a linear weight held in another
    shape. Keys matching `allow_missing` / `allow_unexpected` (fnmatch patterns, as the warm
    start takes them) are left out. Keys the weights lack while their blocks and shapes agree
    are the load's to name. The text ends with how to fix it."""
    def allowed(key: str, patterns) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)

    missing, mismatched = [], []
    for name, (fan_in, fan_out) in linears.items():
        key = f"{name}.weight"
        if allowed(key, allow_missing):
            continue
        if key not in stored:
            missing.append(key)
        elif tuple(stored[key]) != (fan_out, fan_in):
            mismatched.append(f"{key} is {list(stored[key])} in the weights, "
                              f"{[fan_out, fan_in]} in the model")
    model_blocks = {int(m.group(1)) for name in linears if (m := _BLOCK.match(name))}
    held = sorted({int(m.group(1)) for key in stored if (m := _BLOCK.match(key))})
    missing = [key for key in missing if held and (m := _BLOCK.match(key))
               and int(m.group(1)) not in held]  # the blocks the weights do not have
    unexpected = [key for key in sorted(stored) if (m := _BLOCK.match(key))
                  and int(m.group(1)) not in model_blocks and not allowed(key, allow_unexpected)]
    from_file = origin.endswith(".json")
    if missing or unexpected:
        layers = config.get("num_layers", len(model_blocks))
        what = (f"{len(missing)} linear weights missing, e.g. {missing[0]}" if missing else
                f"{len(unexpected)} weights the model has no place for, e.g. {unexpected[0]}")
        text = (f"{origin} gives num_layers {layers}, but the weights in {where} hold "
                f"{len(held)} blocks (blocks.{held[0]} to blocks.{held[-1]}), so the warm start "
                f"would fail when the job starts ({what}).")
        fix = (f" {origin} and the weights beside it do not belong together (an edited "
               f"config.json, or files of two downloads): fetch the directory again, or set "
               f"num_layers to {len(held)} in {origin} if these are the weights you want."
               if from_file else
               f" Set num_layers: {len(held)} in transformer_config_overrides, or point "
               f"pretrained_transformer_path at weights of {layers} "
               f"block{'s' if layers != 1 else ''}.")
        return text + fix
    if mismatched:
        fix = (f" {origin} and the weights beside it do not belong together: fetch the "
               f"directory again." if from_file else
               " Set the architecture in transformer_config_overrides to the weights' (or "
               "point pretrained_transformer_path at weights of this architecture).")
        return (f"the weights in {where} have other shapes than the model {origin} describes "
                f"({'; '.join(mismatched[:3])}"
                f"{f'; and {len(mismatched) - 3} more' if len(mismatched) > 3 else ''}), so the "
                f"warm start would fail when the job starts." + fix)
    return None
