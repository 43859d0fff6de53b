"""The architecture a run inherits from the relay run it starts from (no torch here).

A stage that starts from another relay run (its output_dir, a checkpoint-<step>/, one of its
member directories, or a `relay export` file with model_config.json beside it) builds the model
that run recorded, so its YAML needs only what the stage itself changes: the family's
`run_config_keys` (causal chunks, the second time input, the attention kernel). A key the
stage's transformer_config_overrides sets still wins. A diffusers directory defines the
architecture through the family (its transformer/config.json), not through this module.

Under `relay submit` and `relay run` a stage may start from the output_dir of an earlier stage
that has not run yet: it inherits the config that stage was validated with (`produced`), the
config the earlier stage will record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from trainer.checkpoint.layout import CheckpointError, list_checkpoints, read_complete
from trainer.checkpoint.weights_source import MODEL_CONFIG_FILE
from trainer.models.registry import family_of
from trainer.stages.registry import model_source_key


def recorded_model_config(path: str | Path) -> dict[str, Any] | None:
    """The model config a relay run recorded for the weights at `path` (the COMPLETE marker of
    the checkpoint it names, or of an output_dir's newest complete one; model_config.json
    beside an exported file), or None when `path` is none of those or records none."""
    path = Path(path)
    try:
        if path.is_file():
            beside = path.parent / MODEL_CONFIG_FILE
            return json.loads(beside.read_text()) if beside.is_file() else None
        for checkpoint in (path, path.parent):
            if checkpoint.name.startswith("checkpoint-") and (checkpoint / "COMPLETE").is_file():
                return read_complete(checkpoint).get("model_config")
        checkpoints = list_checkpoints(path)
        return read_complete(checkpoints[-1]).get("model_config") if checkpoints else None
    except (OSError, ValueError, CheckpointError):
        return None  # the weights check reports an unreadable source


def inherited_architecture(args: Mapping[str, Any],
                           produced: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """{"transformer_config_overrides": ...} with the architecture the run's source recorded
    under the keys the run set itself; {} when the source records none (a diffusers
    directory, a plain state dict, nothing yet). `produced`: {output_dir: model config} of
    earlier stages of a pipeline that have not written their checkpoints yet."""
    key = model_source_key(args)
    source = args.get(key) if key else None
    if source is None:
        return {}
    recorded = recorded_model_config(source)
    if recorded is None and key != "pretrained_transformer_path":
        # A diffusers directory as, e.g., Stage2's student: its config.json, as the family
        # reads pretrained_transformer_path's itself.
        recorded = _directory_config(args, source)
    if recorded is None:
        recorded = next((config for directory, config in (produced or {}).items()
                         if _is_within(source, directory)), None)
    if not isinstance(recorded, dict):
        return {}
    family = family_of(args)
    overrides = dict(args.get("transformer_config_overrides") or {})
    keep = set(family.defaults()) - set(family.run_config_keys) - set(overrides)
    inherited = {k: v for k, v in recorded.items() if k in keep}
    if not inherited:
        return {}
    return {"transformer_config_overrides": {**inherited, **overrides}}


def _directory_config(args: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """The architecture of a checkpoint directory the family reads (a diffusers directory's
    transformer/config.json), or None when `source` is none it reads."""
    if not Path(source).is_dir():
        return None
    try:
        return family_of(args).config_from_dir(str(source))
    except ValueError:
        return None


def _is_within(path: str, directory: str) -> bool:
    path, directory = Path(path), Path(directory)
    return path == directory or directory in path.parents
