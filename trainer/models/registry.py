"""Model families by name, and the one a run's arguments pick (no torch here).

`model_family` (default "dit") names the family; families register themselves with
`register_family`, relay's own at import of this module, others (a plug-in, a test) by calling it
before the run starts. `family_of(args)` and `model_config(args)` are what the rest of relay asks.
"""

from __future__ import annotations

import difflib
from typing import Any

from trainer.models.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` selectable as `model_family: <family.name>`; returns it."""
    _FAMILIES[family.name] = family
    return family


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family registered as `name`. Raises ValueError naming the closest registered one."""
    try:
        return _FAMILIES[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_FAMILIES), n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"model_family {name!r} is not a known model family.{hint} Known: "
                         f"{', '.join(family_names())}.") from None


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

    register_family(DiTFamily())
    register_family(WanFamily())


_register_builtin()
