"""Stages by name, and the one a run's arguments pick (no torch here).

`stage` names relay's own stages by name (trainer.stages.declarations), or a stage outside
relay's package by the import string of its declaration: `package.module:Class` (a
StageDeclaration subclass, made without arguments) or `package.module:NAME` (a declaration
object). A plug-in is imported on first use, in every process that reads the run's arguments
(`relay submit` / `relay run` on the login node, each stage's trainer, `relay sample` /
`eval` / `export`), from the Python path with the directory the process runs in added, so
PYTHONPATH or that directory finds it. Its declaration's module must import without torch:
the login node checks the run through it. `stage_of(args)` is what the rest of relay asks.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from trainer.config.plugins import PluginKind, load_plugin
from trainer.config.schema import ARGS, ConfigError
from trainer.stages.declaration import SamplingPlan, StageDeclaration
from trainer.stages.declarations import BUILTIN

# A run that does not say which stage (an old resolved-config.json) ran the schema's default.
DEFAULT_STAGE: str = ARGS["stage"].default
PLUGIN_FORM = "package.module:Class (or package.module:NAME of a declaration object)"

_STAGES: dict[str, StageDeclaration] = {declaration.name: declaration for declaration in BUILTIN}
_PLUGINS: dict[str, StageDeclaration] = {}


def stage_names() -> list[str]:
    """The names of relay's own stages."""
    return sorted(_STAGES)


def builtin_stages() -> list[StageDeclaration]:
    return [_STAGES[name] for name in stage_names()]


def get_stage(name: str) -> StageDeclaration:
    """The declaration `name` names: one of relay's stages, or a plug-in's import string.
    Raises ConfigError naming the known stages, the closest one and the plug-in form."""
    if name in _STAGES:
        return _STAGES[name]
    if isinstance(name, str) and ":" in name:
        if name not in _PLUGINS:
            _PLUGINS[name] = _load_plugin(name)
        return _PLUGINS[name]
    close = difflib.get_close_matches(str(name), stage_names(), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"stage {name!r} is not a known stage.{hint} Known: "
                      f"{', '.join(stage_names())}; a stage outside relay is named by its "
                      f"declaration as {PLUGIN_FORM} (docs/layout.md, \"Adding a stage\").")


def stage_of(args: Mapping[str, Any]) -> StageDeclaration:
    """The declaration of the stage a run's arguments name (`stage`)."""
    return get_stage(args.get("stage", DEFAULT_STAGE))


def build_stage(args, topo):
    """The stage object for args.stage, with its models, optimizers, schedulers and data: the
    builder its declaration names, from the parts trainer.build makes. Weights are random
    here: trainer.run_state then resumes or warm starts them."""
    return stage_of(args).build(args, topo)


def model_source_key(args: Mapping[str, Any]) -> str | None:
    """The key naming the weights the run's own model starts from (its student's for a stage
    with several roles: its stage declares it first), or None when it starts from nothing."""
    keys = stage_of(args).weight_keys
    if not keys or not keys[0].read(args):
        return None
    return keys[0].path


def sampling_plan(args) -> SamplingPlan:
    """The sampler of the run's stage and its settings (trainer.stages.declaration)."""
    return stage_of(args).sampling(args)


STAGE_PLUGIN = PluginKind(
    key="stage", known_as="stage", noun="stage declaration", owner="stage declaration",
    base=StageDeclaration, fix_where="in the YAML's training section",
    torch_goes="inside the modules its builder and warm-up loss name (import strings), as "
               "relay's own stages do")


def _load_plugin(spec: str) -> StageDeclaration:
    """The declaration `spec` names (trainer.config.plugins), which must name its builder."""
    target = load_plugin(spec, STAGE_PLUGIN, stage_names())
    if not target.builder:
        raise ConfigError(f"stage {spec!r}: its declaration names no builder (the import "
                          f"string of the function that builds the stage).")
    return target
