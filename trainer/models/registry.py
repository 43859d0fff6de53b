"""Model families by name, and the one a run's arguments pick (no torch here).

`model_family` (default "dit") names the family: a registered name (relay's own register at
import of this module; a script may call `register_family` before it runs train.main), or a
plug-in outside relay's package, `package.module:Class` (a ModelFamily subclass, or an instance
of one). A plug-in is imported on first use, in every process that asks (the login node's
`relay submit` / `relay run`, each stage's trainer, `relay sample` / `export`), from the Python
path with the directory the process runs in added (relay's jobs run in the directory relay was
run in), so PYTHONPATH or that directory finds it. `family_of(args)` and `model_config(args)`
are what the rest of relay asks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from typing import Any

from trainer.config.schema import ConfigError
from trainer.models.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}
_BUILTIN: set[str] = set()
_REFUSED: dict[str, str] = {}  # plug-ins refused for what their import did (stays true)

PLUGIN_FORM = "package.module:Class"


class FamilyError(ConfigError):
    """`model_family` names no family relay can use; the message says what failed and how to
    fix it (one paragraph), and the run is refused as a configuration error."""


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` selectable as `model_family: <family.name>`; returns it."""
    _FAMILIES[family.name] = family
    return family


def family_names() -> list[str]:
    """The short names of the registered families (a plug-in's once it is loaded)."""
    return sorted(name for name in _FAMILIES if ":" not in name)


def get_family(name: str) -> ModelFamily:
    """The family registered as `name`, or the plug-in `name` names ("package.module:Class",
    imported and registered under both its spec and its own name on first use). Raises
    FamilyError (a ConfigError) saying what failed and how to fix it: an unknown name with the
    closest registered one, a plug-in module not on the path, an attribute it lacks, an object
    that is not a family."""
    try:
        return _FAMILIES[name]
    except (KeyError, TypeError):
        pass
    if isinstance(name, str) and ":" in name:
        return _load_plugin(name)
    close = difflib.get_close_matches(str(name), list(_FAMILIES), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise FamilyError(f"model_family {name!r} is not a known model family.{hint} Known: "
                      f"{', '.join(family_names())}; a family outside relay is named by its "
                      f"class as `{PLUGIN_FORM}` (docs/model.md, \"Adding a family\"). Set "
                      f"model_family in the YAML's model section.")


def _load_plugin(spec: str) -> ModelFamily:
    """Import the module of `spec` ("package.module:attribute") from the Python path plus the
    current directory, take the ModelFamily it names (a subclass is instantiated without
    arguments) and register it under `spec` and its own name."""
    module_name, _, attribute = spec.partition(":")
    if not _is_dotted_name(module_name) or not _is_dotted_name(attribute):
        raise FamilyError(f"model_family {spec!r} is neither a known model family "
                          f"({', '.join(family_names())}) nor a plug-in of the form "
                          f"`{PLUGIN_FORM}` (a module path, a colon, the name of a ModelFamily "
                          f"subclass in it). Fix model_family in the YAML's model section.")
    if spec in _REFUSED:
        raise FamilyError(_REFUSED[spec])
    where = _search_note()
    torch_before = "torch" in sys.modules
    try:
        importlib.invalidate_caches()
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise FamilyError(
                f"model_family {spec!r}: no module named {missing!r} on the Python path "
                f"({where}). Run relay from the directory that holds "
                f"{module_name.split('.')[0]!r}, or add the directory that holds it to "
                f"PYTHONPATH.") from None
        raise FamilyError(_import_failed(spec, module_name, exc)) from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise FamilyError(_import_failed(spec, module_name, exc)) from None
    if not torch_before and "torch" in sys.modules:
        _REFUSED[spec] = (
            f"model_family {spec!r}: importing {module_name} ({_file_of(module)}) imports torch. "
            f"relay imports the family's module on the login node (relay submit, relay run) to "
            f"check a run before it starts, where it never imports torch: keep that module "
            f"torch-free and import torch and the model's nn.Module inside the family's build(), "
            f"as relay's own families do.")
        raise FamilyError(_REFUSED[spec])
    target: Any = module
    try:
        for part in attribute.split("."):
            target = getattr(target, part)
    except AttributeError:
        offered = _families_in(module)
        hint = (f" It defines {', '.join(offered)}: name one as {module_name}:{offered[0]}."
                if offered else f" It defines no ModelFamily subclass.")
        raise FamilyError(f"model_family {spec!r}: module {module_name} ({_file_of(module)}) has "
                          f"no attribute {attribute!r}.{hint}") from None
    if inspect.isclass(target) and issubclass(target, ModelFamily):
        try:
            family = target()
        except Exception as exc:
            raise FamilyError(
                f"model_family {spec!r}: {attribute}() failed ({type(exc).__name__}: {exc}). "
                f"relay makes the family with no arguments: implement every abstract method of "
                f"trainer.models.family.ModelFamily and give __init__ defaults.") from None
    elif isinstance(target, ModelFamily):
        family = target
    else:
        what = (f"the class {target.__name__}" if inspect.isclass(target)
                 else f"a value of type {type(target).__name__}")
        raise FamilyError(f"model_family {spec!r} names {what}, not a model family. Name a "
                          f"subclass of trainer.models.family.ModelFamily (or an instance of "
                          f"one) in {module_name}: `{module_name}:<Class>`.")
    own = getattr(family, "name", None)
    if not isinstance(own, str) or not own or ":" in own:
        raise FamilyError(f"model_family {spec!r}: the family's `name` is {own!r}; set `name` "
                          f"on the class to a short name without a colon (it is how messages "
                          f"and checkpoints call it).")
    taken = _FAMILIES.get(own)
    if taken is not None and (own in _BUILTIN or type(taken) is not type(family)):
        raise FamilyError(f"model_family {spec!r} is named {own!r}, the name of another model "
                          f"family ({type(taken).__module__}.{type(taken).__qualname__}). Give "
                          f"{attribute} a `name` of its own.")
    _FAMILIES[own] = family
    _FAMILIES[spec] = family
    return family


def _is_dotted_name(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _search_note() -> str:
    """Make the current directory importable (relay's processes run in the directory relay was
    run in) and say where modules are looked for."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.append(here)
    note = f"the directory relay runs in, {here}"
    extra = os.environ.get("PYTHONPATH")
    return f"{note}; PYTHONPATH {extra}" if extra else f"{note}; PYTHONPATH is not set"


def _import_failed(spec: str, module_name: str, exc: BaseException) -> str:
    missing = getattr(exc, "name", None)
    torch_hint = (" relay imports the family's module on the login node, where torch may be "
                  "absent: import torch and the model's nn.Module inside the family's build()."
                  if missing == "torch" or (missing or "").startswith("torch.") else "")
    return (f"model_family {spec!r}: importing {module_name} failed ({type(exc).__name__}: "
            f"{exc}).{torch_hint} Fix the module so that `python -c 'import {module_name}'` "
            f"succeeds in the directory relay runs in.")


def _file_of(module) -> str:
    return getattr(module, "__file__", None) or "a namespace package"


def _families_in(module) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if inspect.isclass(value) and issubclass(value, ModelFamily)
                  and value is not ModelFamily and not inspect.isabstract(value)
                  and value.__module__ == module.__name__)


def family_of(args) -> ModelFamily:
    """The family a run's resolved arguments name (`model_family`)."""
    return get_family(getattr(args, "model_family", None) or "dit")


def model_config(args) -> dict[str, Any]:
    """The complete model config of a run: the family's defaults < transformer_config_overrides
    < the top-level settings the family reads. Raises ValueError for an unknown key."""
    return family_of(args).config(args.transformer_config_overrides, args)


def model_config_file(args) -> str | None:
    """The file the run's architecture is read from (a diffusers directory's
    transformer/config.json, see WanFamily.config), or None when the overrides give it."""
    return family_of(args).config_file(args)


def _register_builtin() -> None:
    from trainer.models.dit.family import DiTFamily
    from trainer.models.wan.family import WanFamily

    for family in (DiTFamily(), WanFamily()):
        register_family(family)
        _BUILTIN.add(family.name)


_register_builtin()
