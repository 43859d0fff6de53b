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
import importlib
import inspect
import os
import sys
from typing import Any, Mapping

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


def sampling_plan(args) -> SamplingPlan:
    """The sampler of the run's stage and its settings (trainer.stages.declaration)."""
    return stage_of(args).sampling(args)


def _load_plugin(spec: str) -> StageDeclaration:
    module_name, _, attribute = spec.partition(":")
    valid = all(part.isidentifier() for text in (module_name, attribute)
                for part in text.split("."))
    if not valid:
        raise ConfigError(f"stage {spec!r} is neither a known stage ({', '.join(stage_names())}) "
                          f"nor a plug-in of the form {PLUGIN_FORM}.")
    here = os.getcwd()  # relay's processes run in the directory relay was run in
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"stage {spec!r}: cannot import {module_name} ({exc}). Run relay "
                          f"from the directory that holds {module_name.split('.')[0]!r}, or "
                          f"add the directory that holds it to PYTHONPATH.") from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise ConfigError(f"stage {spec!r}: importing {module_name} failed "
                          f"({type(exc).__name__}: {exc}). Fix the module so that `python -c "
                          f"'import {module_name}'` succeeds.") from None
    target: Any = module
    try:
        for part in attribute.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise ConfigError(f"stage {spec!r}: module {module_name} has no attribute "
                          f"{attribute!r}.") from None
    if inspect.isclass(target) and issubclass(target, StageDeclaration):
        target = target()
    if not isinstance(target, StageDeclaration):
        raise ConfigError(f"stage {spec!r} names {type(target).__name__}, not a stage "
                          f"declaration: name a subclass of "
                          f"trainer.stages.declaration.StageDeclaration or an instance of one.")
    if not target.builder:
        raise ConfigError(f"stage {spec!r}: its declaration names no builder (the import "
                          f"string of the function that builds the stage).")
    return target
