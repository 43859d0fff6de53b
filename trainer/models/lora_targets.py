"""Which linear layers a LoRA adapts, and how many parameters the adapters hold (torch-free).

Shared by the login-node checks (trainer.checks.stage, the memory estimate) and the
module half (trainer.models.lora), so a target list means the same modules on both sides.

An entry of `lora_target_modules` matches a module name
- as an fnmatch pattern of the whole name when it holds `*`, `?` or `[` (`blocks.*.ffn.net.2`);
- otherwise when the name equals it or ends in `.<entry>` (`to_q`, `attn1.to_out.0`), peft's
  own rule for a list of names.
An empty list means the model family's default (`ModelFamily.lora_target_modules`).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable

_PATTERN_CHARS = set("*?[")


def entry_matches(entry: str, name: str) -> bool:
    """Whether the target entry `entry` names the module `name` (rules above)."""
    if _PATTERN_CHARS & set(entry):
        return fnmatch.fnmatchcase(name, entry)
    return name == entry or name.endswith("." + entry)


def target_entries(args, family) -> tuple[str, ...]:
    """The run's target entries: lora_target_modules, else the family's default (may be ())."""
    given = tuple(args.get("lora_target_modules") or ())
    return given or tuple(family.lora_target_modules)


def match_targets(linear_names: Iterable[str], entries: Iterable[str],
                  all_names: Iterable[str] | None = None) -> list[str]:
    """The linear module names the entries select, in the order given.

    `all_names` (every module name, linear or not) lets the error say that an entry names a
    module that is not linear. Raises ValueError naming each entry that selects no linear
    layer, so a typo never trains a LoRA on nothing.
    """
    linear_names = list(linear_names)
    entries = list(entries)
    chosen = [name for name in linear_names if any(entry_matches(e, name) for e in entries)]
    unmatched = [e for e in entries if not any(entry_matches(e, name) for name in linear_names)]
    if unmatched:
        others = [e for e in unmatched
                  if all_names is not None and any(entry_matches(e, n) for n in all_names)]
        detail = "; ".join(
            f"{e!r} names {'a module that is not nn.Linear' if e in others else 'no module'}"
            for e in unmatched)
        examples = ", ".join(sorted({n.split(".")[-1] for n in linear_names})[:12])
        raise ValueError(f"lora_target_modules: {detail}. The model's linear layers end in: "
                         f"{examples}")
    return chosen


def adapter_param_count(shapes: dict[str, tuple[int, int]], targets: Iterable[str],
                        rank: int) -> int:
    """Parameters of rank-`rank` adapters on `targets`: r x (in + out) for each (A and B)."""
    return sum(rank * (shapes[name][0] + shapes[name][1]) for name in targets)


def lora_scale(args: Any) -> float:
    """lora_alpha / lora_rank, the factor of B A (lora_alpha null: 1)."""
    alpha = args.get("lora_alpha")
    rank = args["lora_rank"]
    return 1.0 if alpha is None else float(alpha) / rank


def lora_alpha(args: Any) -> float:
    alpha = args.get("lora_alpha")
    return float(args["lora_rank"] if alpha is None else alpha)


def lora_enabled(args: Any) -> bool:
    """Whether the run trains LoRA adapters (lora_rank > 0) rather than every weight; `args`
    is a mapping or resolved arguments (either has `get`), or a namespace of attributes."""
    rank = args.get("lora_rank") if hasattr(args, "get") else getattr(args, "lora_rank", None)
    return int(rank or 0) > 0
