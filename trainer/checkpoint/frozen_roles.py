"""Frozen roles kept out of checkpoints and recorded by reference (torch-free).

Stage2's teacher never changes, yet saving it into every checkpoint costs its whole size (about
5.7 GB at Wan2.1-1.3B in float32, 57 GB at 14B) for bytes the run already has where
`teacher_init_path` points. So by default (`save_frozen_teacher: false`) a Stage2 checkpoint
holds the student, its EMA, the critic and both optimizers, and `frozen-roles.json` records the
source each frozen role was loaded from: the reference of trainer.checkpoint.lora_base (the
path, the files it resolves to, their content digest). A resume loads the role from that source
again, and a source whose bytes changed since the save is refused before any model is built:
the run would otherwise go on against another teacher without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.lora_base import base_reference, describe_change

FROZEN_FILE = "frozen-roles.json"


def read_recorded_frozen(checkpoint: str | Path) -> dict[str, dict[str, Any]]:
    """role -> source reference of the roles `checkpoint` left out ({}: it saved every role)."""
    try:
        recorded = json.loads((Path(checkpoint) / FROZEN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {role: ref for role, ref in recorded.items()
            if isinstance(ref, dict) and "digest" in ref}


def check_frozen_sources(args: Mapping[str, Any], checkpoint: Path | None,
                         frozen: Mapping[str, tuple[str, str, str]]) -> dict[str, dict[str, Any]]:
    """The references of this run's frozen roles now, to record in its checkpoints: `frozen`,
    role -> (source path, weights, the key that names the path) of the roles its stage keeps
    out of its checkpoints (StageDeclaration.frozen_roles). Raises
    CheckpointError, in one paragraph, when a source cannot be read, or when `checkpoint` (the
    one a resume starts from) left a role out and that role's source changed since (checked
    also when this run saves that role itself: the resume loads it from its source). A role
    the checkpoint left out that this run has no source for (no `<role>_init_path`) is not
    needed by it and is not checked."""
    recorded = read_recorded_frozen(checkpoint) if checkpoint is not None else {}
    references = {}
    for role in sorted(set(frozen) | set(recorded)):
        source = frozen.get(role) or _declared_source(args, role)
        if source is None:
            continue
        path, weights, key = source
        saved = recorded.get(role)
        try:
            current = base_reference(path, weights, previous=saved)
        except CheckpointError as exc:
            raise CheckpointError(
                f"the run loads its frozen {role} from {key} ({path}) at every start, "
                f"a resume included, but it cannot be read: {exc}. Point {key} at "
                f"those weights (a copy elsewhere is fine)"
                + (f"; {checkpoint.name} does not hold the {role}" if saved else "")
                + ".") from None
        change = describe_change(saved, current) if saved else None
        if change:
            raise CheckpointError(
                f"the frozen {role} changed since {checkpoint.name} was saved: it was loaded "
                f"from {saved.get('root')} (digest {saved.get('digest')}), and {key} "
                f"{path} now holds {current['root']} (digest {current['digest']}; {change}). "
                f"The checkpoint does not hold the {role} (frozen roles are kept out of "
                f"checkpoints and loaded again from their source), so resuming would go on "
                f"against other weights. Point {key} at the weights the run started from (a "
                f"copy elsewhere is fine), or start a new run in another output_dir.")
        if role in frozen:
            references[role] = current
    return references


def _declared_source(args: Mapping[str, Any], role: str) -> tuple[str, str, str] | None:
    """A role's own source keys (`<role>_init_path`), where the run names one."""
    key = f"{role}_init_path"
    if not args.get(key):
        return None
    return args[key], args.get(f"{role}_init_weights", "ema"), key
