"""A part of a run named in the YAML by its import string, `package.module:Class` (a model
family, a stage), found and checked the same way for every kind (torch-free).

The module is imported from the Python path plus the directory relay runs in (where `relay
run`'s children start and a Slurm job changes to). It must import without torch: relay imports
it on the login node (`relay submit`, `relay run`) to check a run before anything is queued.
Every way this can fail is one ConfigError paragraph that says what failed and how to fix it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

from trainer.config.schema import ConfigError

PLUGIN_FORM = "package.module:Class"


@dataclass(frozen=True)
class PluginKind:
    """What a plug-in of one kind is: the YAML key naming it, the class it must be (or subclass),
    where relay's docs explain it, and where its torch code belongs."""

    key: str            # "model_family", "stage"
    known_as: str       # what relay's own are called: "model family", "stage"
    noun: str           # what a plug-in names: "model family", "stage declaration"
    owner: str          # whose module it is: "family", "stage declaration"
    base: type
    torch_goes: str     # "and the model's nn.Module inside the family's build(), as ..."
    fix_where: str      # where the key is set: "in the YAML's model section"
    error: type = ConfigError


_REFUSED: dict[str, str] = {}  # plug-ins refused for what their import did (stays true)


def is_plugin_spec(text: Any) -> bool:
    return isinstance(text, str) and ":" in text


def load_plugin(spec: str, kind: PluginKind, known: list[str]) -> Any:
    """The object `spec` ("package.module:attribute") names: a subclass of kind.base is made
    with no arguments, an instance is taken as it is. `known`: the names relay knows, for the
    message of a spec that is not of the plug-in form. Raises kind.error."""
    module_name, _, attribute = spec.partition(":")
    if not _is_dotted_name(module_name) or not _is_dotted_name(attribute):
        raise kind.error(f"{kind.key} {spec!r} is neither a known {kind.known_as} "
                         f"({', '.join(known)}) nor a plug-in of the form `{PLUGIN_FORM}` (a "
                         f"module path, a colon, the name of a {kind.base.__name__} subclass in "
                         f"it). Fix {kind.key} {kind.fix_where}.")
    refused = _REFUSED.get(f"{kind.key}={spec}")
    if refused:
        raise kind.error(refused)
    module = _import(spec, module_name, kind)
    target: Any = module
    try:
        for part in attribute.split("."):
            target = getattr(target, part)
    except AttributeError:
        offered = _classes_in(module, kind.base)
        hint = (f" It defines {', '.join(offered)}: name one as {module_name}:{offered[0]}."
                if offered else f" It defines no {kind.base.__name__} subclass.")
        raise kind.error(f"{kind.key} {spec!r}: module {module_name} ({_file_of(module)}) has "
                         f"no attribute {attribute!r}.{hint}") from None
    if inspect.isclass(target) and issubclass(target, kind.base):
        try:
            return target()
        except Exception as exc:
            raise kind.error(
                f"{kind.key} {spec!r}: {attribute}() failed ({type(exc).__name__}: {exc}). "
                f"relay makes the {kind.owner} with no arguments: implement every abstract "
                f"method of {kind.base.__module__}.{kind.base.__name__} and give __init__ "
                f"defaults.") from None
    if isinstance(target, kind.base):
        return target
    what = (f"the class {target.__name__}" if inspect.isclass(target)
            else f"a value of type {type(target).__name__}")
    raise kind.error(f"{kind.key} {spec!r} names {what}, not a {kind.noun}. Name a subclass of "
                     f"{kind.base.__module__}.{kind.base.__name__} (or an instance of one) in "
                     f"{module_name}: `{module_name}:<Class>`.")


def _import(spec: str, module_name: str, kind: PluginKind):
    where = _search_note()
    torch_before = "torch" in sys.modules
    try:
        importlib.invalidate_caches()
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise kind.error(
                f"{kind.key} {spec!r}: no module named {missing!r} on the Python path "
                f"({where}). Run relay from the directory that holds "
                f"{module_name.split('.')[0]!r}, or add the directory that holds it to "
                f"PYTHONPATH.") from None
        raise kind.error(_import_failed(spec, module_name, exc, kind)) from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise kind.error(_import_failed(spec, module_name, exc, kind)) from None
    if not torch_before and "torch" in sys.modules:
        message = (
            f"{kind.key} {spec!r}: importing {module_name} ({_file_of(module)}) imports torch. "
            f"relay imports the {kind.owner}'s module on the login node (relay submit, relay "
            f"run) to check a run before it starts, where it never imports torch: keep that "
            f"module torch-free and import torch {kind.torch_goes}.")
        _REFUSED[f"{kind.key}={spec}"] = message
        raise kind.error(message)
    return module


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


def _import_failed(spec: str, module_name: str, exc: BaseException, kind: PluginKind) -> str:
    missing = getattr(exc, "name", None)
    torch_hint = (f" relay imports the {kind.owner}'s module on the login node, where torch may "
                  f"be absent: import torch {kind.torch_goes.split(', as')[0]}."
                  if missing == "torch" or (missing or "").startswith("torch.") else "")
    return (f"{kind.key} {spec!r}: importing {module_name} failed ({type(exc).__name__}: "
            f"{exc}).{torch_hint} Fix the module so that `python -c 'import {module_name}'` "
            f"succeeds in the directory relay runs in.")


def _file_of(module) -> str:
    return getattr(module, "__file__", None) or "a namespace package"


def _classes_in(module, base: type) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if inspect.isclass(value) and issubclass(value, base)
                  and value is not base and not inspect.isabstract(value)
                  and value.__module__ == module.__name__)
