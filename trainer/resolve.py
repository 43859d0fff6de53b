"""One run's arguments, resolved exactly as train.py, the launcher and the kernel warm-up see them
(torch-free, so the login node resolves every stage before anything is queued).

    YAML + overrides (trainer.config.args)
      -> what a diffusers pipeline directory supplies (trainer.encoders.directories)
      -> the architecture of the relay run it starts from (trainer.source_model)
      -> every check a run must pass (trainer.preflight)

Each step fills only what the YAML and the command line left unset. Raises ConfigError.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from trainer.config.args import parse_cli, read_config, strip_meta_flags
from trainer.config.schema import ResolvedArgs
from trainer.encoders.directories import pipeline_defaults
from trainer.models.registry import family_of
from trainer.preflight import text_encoder_uses, validate_args
from trainer.source_model import inherited_architecture
from trainer.stages.registry import stage_of


def resolve_config(config: str | None, overrides: list[str] | dict[str, Any] = (), *,
                   world_size: int | None = None, cwd: str | os.PathLike | None = None,
                   check_paths: bool = True, check_weights: bool = False,
                   written_before: tuple[str, ...] = (),
                   produced: dict[str, dict[str, Any]] | None = None,
                   pipeline_outputs: tuple[str, ...] | None = None) -> ResolvedArgs:
    """Resolve a YAML plus overrides exactly as train.py does. Raises ConfigError.

    `overrides` is either the command-line tokens (["--learning_rate", "3e-4"]) or a mapping of
    already-typed values (the launcher's pipeline YAML). Relative paths are made absolute against
    `cwd` (default: the current directory). check_weights also checks that the weights a warm
    start would read exist (for a run started on its own; a pipeline checks its own chain).
    written_before: pipeline directories an earlier stage writes first (preflight.validate_args).
    produced: {output_dir: model config} of earlier stages of a pipeline that have not written
    their checkpoints yet: a run starting from one inherits that architecture
    (trainer.source_model).
    pipeline_outputs: every stage's output_dir of the pipeline being validated
    (preflight.validate_args).
    """
    args, explicit = read_config(config, overrides, cwd=cwd)
    # A diffusers pipeline directory's components fill what the YAML and command line left unset.
    args.update(pipeline_defaults(args, explicit,
                                  needs_text_encoder=bool(text_encoder_uses(args)),
                                  draws_timesteps=stage_of(args).timestep_range_refusal is None,
                                  family_defaults=family_of(args).pipeline_defaults))
    # A relay run it starts from gives the architecture the YAML and command line left unset.
    args.update(inherited_architecture(args, produced))
    validate_args(args, world_size=world_size, check_paths=check_paths,
                  check_weights=check_weights, written_before=tuple(written_before),
                  pipeline_outputs=pipeline_outputs)
    return args


def resolve_args(argv: list[str] | None = None, *, world_size: int | None = None,
                 check_weights: bool = True) -> tuple[ResolvedArgs, bool]:
    """Parse train.py's command line: returns (args, dry_run). Raises ConfigError.

    check_weights: whether the warm-start sources must exist now (train.py; the kernel warm-up,
    which runs before the stages that write them and uses random weights, passes False)."""
    argv = sys.argv[1:] if argv is None else argv
    config, dry_run, _ = parse_cli(argv)
    return resolve_config(config, strip_meta_flags(argv), world_size=world_size,
                          check_weights=check_weights), dry_run
