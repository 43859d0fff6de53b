"""The settings a checkpoint's saved state depends on, compared with a run that would resume it
(no torch here, so `--dry-run` and `relay submit` say it before a job starts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from trainer.checkpoint.layout import RESOLVED_CONFIG_FILE

# Arguments that decide what the saved state is (the stage's members, the optimizer, the EMA,
# the LoRA adapters' layers and rank): a change cannot be loaded.
STATE_SHAPING_KEYS = ("stage", "use_muon", "use_ema", "lora_rank", "lora_target_modules")


def saved_settings_problem(args: Mapping[str, Any], checkpoint: str | Path) -> str | None:
    """Why a run with `args` cannot resume `checkpoint`, from the arguments the checkpoint
    recorded (its resolved-config.json): one paragraph naming each key that differs. None when
    they agree or nothing is recorded (the load's own shape checks still apply)."""
    checkpoint = Path(checkpoint)
    try:
        saved = json.loads((checkpoint / RESOLVED_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    differ = [key for key in STATE_SHAPING_KEYS if key in saved and saved[key] != args.get(key)]
    if not differ:
        return None
    was = " and ".join(f"{key}: {json.dumps(saved[key])}" for key in differ)
    now = " and ".join(f"{key}: {json.dumps(args.get(key))}" for key in differ)
    return (f"output_dir {checkpoint.parent} holds {checkpoint.name}, saved with {was}; this run "
            f"has {now}, so its saved state cannot be loaded. Resume with {was}, or start the "
            f"new setting in another output_dir (with a warm start from this one).")
