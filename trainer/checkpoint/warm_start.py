"""Start a model from another run's weights (a warm start), and export weights for inference.

A warm start copies weights only: optimizer, LR schedule, step and data cursor start fresh. It
is used while the run's own output_dir holds no checkpoint (resume always wins). Sources, by
what `path` names:

- a plain state dict file: `.safetensors` (read tensor by tensor, as a directory's files), or
  a torch file (`.pt`, `.pth`, `.bin`) read with `torch.load(weights_only=True)`;
- a directory holding `model_state.pt`;
- a training checkpoint `checkpoint-<step>/`: its `ema/` member for `weights="ema"`, its
  `transformer/` member for `weights="live"`, or the member named by `member` (multi-role
  checkpoints: "student", "critic", ...);
- one member directory of a checkpoint (`.../checkpoint-<step>/transformer/`), read as DCP;
- an output_dir: its newest complete checkpoint, as above;
- a directory of safetensors files (a diffusers pipeline directory, its transformer/ folder,
  or a public release's folder): the shards its index names, or its one file, read tensor by
  tensor with `safe_open`, each copied into the model (into an FSDP2 shard: only the rank's
  part of it) before the next is read; the keys go through the model family's
  state-dict adapter ("original" when they look like the original Wan release's, else
  "diffusers").

An EMA member holds the same keys as the model (ema.py's contract), so both load the same way.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from trainer.checkpoint.layout import (
    COMPLETE_FILE,
    RESOLVED_CONFIG_FILE,
    CheckpointError,
    describe_load_error,
    member_checksums,
    read_complete,
    recorded_checksums,
    verify_bytes,
)
from trainer.checkpoint.layout import METADATA_FILE
from trainer.checkpoint.weights_source import (
    MODEL_CONFIG_FILE,
    WeightsSource,
    resolve_weights_source,
    safetensors_keys,
)
from trainer.checkpoint.dcp_io import (
    load_dcp_in_place,
    read_dcp_state_dict,
    read_dcp_tensor_shapes,
)
from trainer.runtime.files import follow_umask

def _read_plain_file(source: WeightsSource) -> dict[str, torch.Tensor]:
    try:
        if source.kind == "safetensors":
            from safetensors.torch import load_file

            state = load_file(str(source.path), device="cpu")
        else:
            state = torch.load(source.path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"could not read weights from {source.path}: "
                              f"{describe_load_error(exc)}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{source.path} is not a plain state dict (a mapping of names to tensors); if it "
            "wraps one (e.g. under 'state_dict'), save the inner dict"
        )
    return state


def read_weights(source: WeightsSource) -> dict[str, torch.Tensor]:
    """Return the full weights of `source` as a plain CPU state dict (reads every shard).

    A checkpoint member's files are verified against the checksums in its COMPLETE.
    """
    if source.kind == "dcp":
        try:
            return read_dcp_state_dict(source.path, checksums=_source_checksums(source))
        except Exception as exc:
            raise CheckpointError(f"could not read DCP weights from {source.path}: {exc}") from exc
    if source.kind == "safetensors_dir":
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in source.files:
            state.update(load_file(str(file), device="cpu"))
        return state
    return _read_plain_file(source)


def _source_checksums(source: WeightsSource) -> dict[str, str]:
    """The recorded checksums of a checkpoint member's files ({} if none are known)."""
    if source.checkpoint is None:
        return {}
    recorded = recorded_checksums(read_complete(source.checkpoint), source.checkpoint)
    return member_checksums(recorded, source.path.name)


def _directory_keys(source: WeightsSource, family) -> tuple[dict[str, tuple[int, ...]],
                                                             dict[str, tuple[Path, str]], str]:
    """(model key -> stored shape, model key -> (file, stored key), layout) of a safetensors
    directory, from the files' headers; keys mapped through `family`'s adapter."""
    stored_keys = {file: safetensors_keys(file) for file in source.files}
    every = [key for keys in stored_keys.values() for key in keys]
    # The family recognises the releases it reads (Wan: diffusers' or the original layout).
    layout = family.source_layout(every) if family is not None else "relay"
    adapter = family.state_dict_adapter(layout) if family is not None else None
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, tuple[Path, str]] = {}
    for file, keys in stored_keys.items():
        for key, shape in keys.items():
            mapped = adapter.to_relay(key) if adapter is not None else key
            if mapped is None:
                continue
            shapes[mapped], where[mapped] = shape, (file, key)
    return shapes, where, layout


# Called with (key, bytes) for each whole tensor the safetensors reader holds, before it is
# copied into the model (one at a time): what a rank materialises beyond its own shards while
# weights stream in (tests/test_streamed_warm_start.py measures it through this).
LOAD_OBSERVERS: list = []


def _load_tensors(model: torch.nn.Module, keys: list[str],
                  where: dict[str, tuple[Path, str]]) -> None:
    """Load `keys` into `model` (plain or FSDP2-sharded) from safetensors files, one tensor at
    a time: each is read whole with safe_open and copied into the model's tensor in the model's
    dtype, or, into an FSDP2 shard (a DTensor), only the part this rank holds
    (torch.distributed.tensor.distribute_tensor of the whole onto the shard's mesh and
    placements, cut locally: every rank reads the same file, so nothing is sent). A rank holds
    its shards and at most one whole tensor, never the whole model."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(where[key][0], []).append(key)
    for file, file_keys in by_file.items():
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"could not read weights from {file}: "
                                  f"{describe_load_error(exc)}") from exc
        with handle:
            for key in file_keys:
                try:
                    whole = handle.get_tensor(where[key][1])
                except Exception as exc:
                    raise CheckpointError(f"could not read weights from {file}: "
                                          f"{describe_load_error(exc)}") from exc
                for observer in LOAD_OBSERVERS:
                    observer(key, whole.nbytes)
                target = targets.get(key)
                if target is None:  # a name only torch's state-dict API resolves
                    set_model_state_dict(model, {key: whole}, options=StateDictOptions(
                        full_state_dict=True, strict=False))
                elif isinstance(target, DTensor):
                    part = distribute_tensor(whole, target.device_mesh, target.placements,
                                             src_data_rank=None)
                    with torch.no_grad():
                        target.to_local().copy_(part.to_local())
                    del part
                else:
                    with torch.no_grad():
                        target.copy_(whole)
                del whole


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def load_warm_start(
    path: str | os.PathLike,
    model: torch.nn.Module,
    *,
    weights: str,
    member: str | None = None,
    allow_missing: Iterable[str] = (),
    allow_unexpected: Iterable[str] = (),
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    family=None,
) -> dict[str, Any]:
    """Load weights from `path` into `model` (plain or FSDP2-sharded); return a report to log.

    `weights` is "ema" or "live" (which member of a training checkpoint; ignored for plain
    files); `member` names another member ("student", "critic") and wins over it.
    `allow_missing` / `allow_unexpected` are fnmatch patterns ("head.*") for model keys
    the source may lack (they keep their initialisation) and source keys the model may lack.
    A key whose shape differs is an error unless `allow_missing` matches it (then it is
    skipped like a missing one). With `strict=False`, other missing/unexpected keys are only
    reported. DCP sources are read shard-by-shard as a collective when a process group is
    initialised; torch files are read whole on every rank; safetensors (a file, or a
    directory whose keys are mapped through `family`'s state-dict adapter,
    trainer.models.family.ModelFamily; None: the keys as stored) are read one tensor at a time
    on every rank, each rank keeping only its shard of it (`_load_tensors`).

    Returns {"source", "member", "weights", "loaded", "missing", "unexpected",
    "skipped_shape_mismatch"} (the last four are lists of keys). Raises CheckpointError naming
    the offending keys and shapes.
    """
    allow_missing, allow_unexpected = tuple(allow_missing), tuple(allow_unexpected)
    source = resolve_weights_source(path, weights=weights, member=member)
    target = get_model_state_dict(model)
    plain: dict[str, torch.Tensor] | None = None
    layout = None
    if source.kind == "safetensors_dir":
        stored, where, layout = _directory_keys(source, family)
    elif source.kind == "dcp":
        recorded = _source_checksums(source)
        try:
            verify_bytes(source.path / METADATA_FILE, None, recorded.get(METADATA_FILE))
            stored = {key: tuple(shape) for key, (shape, _) in read_dcp_tensor_shapes(source.path).items()}
        except Exception as exc:
            raise CheckpointError(f"could not read DCP metadata of {source.path}: {exc}") from exc
    elif source.kind == "safetensors":  # relay's model.safetensors: streamed like a directory
        try:
            stored = safetensors_keys(source.path)
        except CheckpointError as exc:
            raise CheckpointError(f"could not read weights from {source.path}: {exc}") from None
        where = {key: (source.path, key) for key in stored}
    else:
        plain = _read_plain_file(source)
        stored = {key: tuple(value.shape) for key, value in plain.items()}

    missing = sorted(key for key in target if key not in stored)
    unexpected = sorted(key for key in stored if key not in target)
    mismatched = sorted(key for key in target if key in stored and tuple(target[key].shape) != stored[key])
    skipped_mismatch = [key for key in mismatched if _matches(key, allow_missing)]
    refused_mismatch = [key for key in mismatched if key not in skipped_mismatch]
    if refused_mismatch:
        details = ", ".join(
            f"{key}: source {stored[key]}, model {tuple(target[key].shape)}" for key in refused_mismatch[:10]
        )
        raise CheckpointError(
            f"warm start from {source.describe()}: shape mismatch for {len(refused_mismatch)} key(s): {details}. "
            "The source was trained with another architecture; fix the model config, or add the keys "
            "to allow_missing to keep their fresh initialisation."
        )
    if strict:
        bad_missing = [key for key in missing if not _matches(key, allow_missing)]
        bad_unexpected = [key for key in unexpected if not _matches(key, allow_unexpected)]
        if bad_missing or bad_unexpected:
            raise CheckpointError(
                f"warm start from {source.describe()} does not fit the model: "
                f"missing from the source {bad_missing[:20]}{' ...' if len(bad_missing) > 20 else ''}, "
                f"not in the model {bad_unexpected[:20]}{' ...' if len(bad_unexpected) > 20 else ''}. "
                "If that is intended, add fnmatch patterns to allow_missing / allow_unexpected "
                "(e.g. 'head.*')."
            )

    keys = [key for key in target if key in stored and key not in skipped_mismatch]
    if source.kind == "dcp":
        subset = {key: target[key] for key in keys}
        try:
            load_dcp_in_place(subset, source.path, checksums=recorded, process_group=process_group)
        except Exception as exc:
            raise CheckpointError(f"could not load DCP weights from {source.path}: {exc}") from exc
        set_model_state_dict(model, subset, options=StateDictOptions(strict=False))
    elif source.kind in ("safetensors_dir", "safetensors"):
        _load_tensors(model, keys, where)
    else:
        subset = {key: plain[key] for key in keys}
        set_model_state_dict(model, subset, options=StateDictOptions(full_state_dict=True, strict=False))
    return {
        "source": str(source.path),
        "member": source.member,
        "weights": weights if source.kind == "dcp" else "as stored",
        **({"layout": layout, "files": [str(f) for f in source.files]} if layout else {}),
        "loaded": keys,
        "missing": missing,
        "unexpected": unexpected,
        "skipped_shape_mismatch": skipped_mismatch,
    }


def export_weights(
    path: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    weights: str,
    member: str | None = None,
    model_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the weights `path` names (as for `load_warm_start`) to one safetensors file.

    `state`: write these weights instead of reading them from `path` (a LoRA run's merged
    base and adapters, trainer.evaluation.lora_export). Also writes `model_config.json` beside `out_file`: `model_config` if given, else the one
    recorded in the checkpoint's COMPLETE marker, else the run's resolved-config.json (every
    argument, the model's among them). Both files are written to a temporary name
    (`<name>.tmp`) and renamed into place; the temporaries are removed whatever happens.
    Returns `out_file`. Raises CheckpointError when the source is unusable, no model config
    can be found (pass model_config), `out_file` or the config beside it is a directory, either
    already exists and `overwrite` is False, or the files cannot be written.
    """
    from safetensors.torch import save_file

    out_file = Path(out_file)
    config_file = out_file.parent / MODEL_CONFIG_FILE
    _check_export_target(out_file, config_file, overwrite)
    source = resolve_weights_source(path, weights=weights, member=member)
    config = model_config if model_config is not None else _recorded_model_config(source)
    if config is None:
        raise CheckpointError(
            f"no model config recorded for {source.describe()} (no model_config in {COMPLETE_FILE}, "
            f"no {RESOLVED_CONFIG_FILE}): pass model_config explicitly"
        )
    if state is None:  # else the caller's weights (a LoRA run's merged ones)
        state = read_weights(source)
    # safetensors refuses tensors that share memory (tied weights): give each its own copy.
    tensors = {key: value.detach().to("cpu").contiguous().clone() for key, value in state.items()}
    metadata = {"source": str(source.path), "member": source.member or "", "weights": weights}
    tmp = out_file.with_name(out_file.name + ".tmp")
    tmp_config = config_file.with_name(config_file.name + ".tmp")
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        follow_umask(tmp)  # safetensors creates it 0600; an export is as readable as the umask says
        tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, out_file)
        os.replace(tmp_config, config_file)
    except OSError as exc:
        raise CheckpointError(
            f"could not write the export {out_file} ({exc.strerror or exc}); nothing partial "
            f"was left there. Free space or choose another output path.") from None
    finally:
        for leftover in (tmp, tmp_config):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                pass  # e.g. a directory of that name: not ours to remove
    return out_file


def _check_export_target(out_file: Path, config_file: Path, overwrite: bool) -> None:
    """Refuse an export onto a directory, or onto existing files unless `overwrite`."""
    for target in (out_file, config_file):
        if target.is_dir():
            raise CheckpointError(
                f"{target} is a directory, and an export writes one file there: give the path "
                f"of the file to write, e.g. {out_file / 'model.safetensors'}" if target == out_file
                else f"{target} is a directory, and an export writes {MODEL_CONFIG_FILE} beside "
                f"{out_file.name}: choose an output path in another directory.")
    existing = [str(t) for t in (out_file, config_file) if t.exists() or t.is_symlink()]
    if existing and not overwrite:
        raise CheckpointError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: an "
            f"export does not replace files unless asked. Choose another output path, or "
            f"replace {'it' if len(existing) == 1 else 'them'} on purpose with relay export "
            f"--force (overwrite=True).")
    if out_file.parent.exists() and not out_file.parent.is_dir():
        raise CheckpointError(f"{out_file.parent} is a file, not a directory: choose an output "
                              f"path in a directory.")


def _recorded_model_config(source: WeightsSource) -> dict[str, Any] | None:
    candidates: list[Path] = []
    if source.checkpoint is not None:
        recorded = read_complete(source.checkpoint).get("model_config")
        if recorded is not None:
            return recorded
        candidates += [source.checkpoint / RESOLVED_CONFIG_FILE, source.checkpoint.parent / RESOLVED_CONFIG_FILE]
    else:
        candidates.append(source.path.parent / MODEL_CONFIG_FILE)
    for candidate in candidates:
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{candidate} is not readable JSON: {exc}") from exc
    return None
