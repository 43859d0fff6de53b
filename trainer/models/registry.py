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
from typing import Any

from trainer.config.plugins import PLUGIN_FORM, PluginKind, load_plugin
from trainer.config.schema import ConfigError
from trainer.models.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}
_BUILTIN: set[str] = set()



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


FAMILY_PLUGIN = PluginKind(
    key="model_family", known_as="model family", noun="model family", owner="family",
    base=ModelFamily, fix_where="in the YAML's model section", error=FamilyError,
    torch_goes="and the model's nn.Module inside the family's build(), as relay's own "
               "families do")


def _load_plugin(spec: str) -> ModelFamily:
    """The family `spec` ("package.module:attribute") names (trainer.config.plugins), registered
    under `spec` and its own name."""
    family = load_plugin(spec, FAMILY_PLUGIN, family_names())
    own = getattr(family, "name", None)
    attribute = spec.partition(":")[2]
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


def data_widths(args):
    """What the run's data must fit of its model (trainer.data.checks): the family's geometry of
    the run's model config and the file it comes from; None when the config itself is wrong
    (its own check names what). A trainer.data.checks.ModelWidths."""
    from trainer.data.checks import ModelWidths

    try:
        geometry = family_of(args).geometry(model_config(args))
        return ModelWidths(int(geometry.latent_channels), int(geometry.text_dim),
                           tuple(geometry.patch_size), model_config_file(args))
    except (KeyError, TypeError, ValueError):
        return None


def _register_builtin() -> None:
    from trainer.models.dit.family import DiTFamily
    from trainer.models.wan.family import WanFamily

    for family in (DiTFamily(), WanFamily()):
        register_family(family)
        _BUILTIN.add(family.name)


_register_builtin()
