"""train.py's command line and YAML, parsed and merged into a ResolvedArgs (no torch here).

Precedence (the contract in docs/config-reference.md): parser default < YAML < ``--key value``.
The YAML's top-level sections (``model``, ``training``, ...) are free-form and flattened; what
counts is the key. argparse runs with defaults suppressed, so a parser default can never beat a
YAML value: defaults are filled in last, only for keys nobody set. The keys themselves live in
trainer.config.schema; what a run is checked for before it starts, in trainer.preflight.

Public entry points:
  parse_cli(argv)                     -> (config path, dry_run, typed command-line values)
  read_config(path, overrides, cwd)   -> (ResolvedArgs, the keys the YAML and overrides set)
trainer.resolve turns them into a checked run (directory defaults, inherited architecture,
preflight).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import yaml

from trainer.config.schema import (ARGS, LEGACY_KEYS, MODEL_KEYS_IN_OVERRIDES, SECTIONS, Arg, ConfigError,
                            ResolvedArgs, closest_key)


# ---------------------------------------------------------------------------------------------
# Value conversion
# ---------------------------------------------------------------------------------------------

def _expected(arg: Arg) -> str:
    base = {
        "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
        "path": "a path string", "dict": "a mapping", "int_list": "a list of integers",
        "float_list": "a list of numbers", "str_list": "a list of strings",
        "path_or_dict": "a directory or a mapping {directory: repeat_count}",
    }[arg.kind]
    if arg.choices:
        base = "one of " + ", ".join(arg.choices)
    return base + (" or null" if arg.nullable else "")


def convert_value(arg: Arg, value: Any, where: str) -> Any:
    """Check and normalise one value; raise ConfigError naming the key and the expected type."""

    def bad() -> ConfigError:
        return ConfigError(
            f"{where}: `{arg.name}` must be {_expected(arg)}, got {value!r}. "
            f"Fix the value (see docs/config-reference.md)."
        )

    if value is None:
        if arg.nullable:
            return None
        raise bad()
    kind = arg.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise bad()
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        out: Any = value
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        out = float(value)
    elif kind in ("str", "path"):
        if not isinstance(value, str):
            raise bad()
        out = value
    elif kind == "dict":
        if not isinstance(value, dict):
            raise bad()
        out = value
    elif kind in ("int_list", "str_list"):
        item = int if kind == "int_list" else str
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            raise bad()
        out = list(value)
    elif kind == "float_list":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise bad()
        out = [float(v) for v in value]
    elif kind == "path_or_dict":
        if isinstance(value, str):
            out = value
        elif isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in value.items()
        ):
            out = dict(value)
        else:
            raise bad()
    else:  # pragma: no cover - schema error
        raise AssertionError(kind)
    if arg.choices and out not in arg.choices:
        raise bad()
    return out


_MISSING = object()


def _parse_cli_text(arg: Arg, text: str) -> Any:
    """Turn a command-line string into a value of the key's kind (YAML syntax for the rest)."""
    low = text.strip().lower()
    if arg.nullable and low in ("null", "none", "~"):
        return None
    if arg.kind == "bool":
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"command line: `--{arg.name}` must be true or false, got {text!r}.")
    if arg.kind in ("str", "path"):
        return text
    if arg.kind == "path_or_dict" and not text.lstrip().startswith("{"):
        return text
    try:
        # JSON first: PyYAML reads JSON's `1e-06` as a string (YAML 1.1 wants a dot in a float)
        value = json.loads(text)
    except ValueError:
        value = _MISSING
    try:
        value = yaml.safe_load(text) if value is _MISSING else value
    except yaml.YAMLError:
        raise ConfigError(
            f"command line: `--{arg.name}` must be {_expected(arg)}, got {text!r} "
            f"(write lists as [1,2] and mappings as {{key: value}})."
        ) from None
    if arg.kind == "float" and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    return value


# ---------------------------------------------------------------------------------------------
# YAML loading and flattening
# ---------------------------------------------------------------------------------------------

def _unknown_key_error(where: str, key: str) -> ConfigError:
    guess = closest_key(key, ARGS)
    hint = f" Did you mean `{guess}`?" if guess else ""
    return ConfigError(
        f"{where}: unknown key `{key}`.{hint} Every key must be a train.py argument; "
        f"see docs/config-reference.md for the list."
    )


def _translate_legacy(key: str, where: str) -> tuple[str, bool]:
    """Return (new_name, is_model_key). Warns once per use."""
    if key in LEGACY_KEYS:
        new = LEGACY_KEYS[key]
        warnings.warn(f"{where}: `{key}` is an old name; it is read as `{new}`. "
                      f"Rename it to silence this warning.", stacklevel=3)
        return new, new in MODEL_KEYS_IN_OVERRIDES
    return key, False


def load_yaml_config(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML config, resolve interpolation, and flatten its sections.

    Returns {key: value} of argparse keys. Raises ConfigError for a missing or unreadable file,
    an unknown key, a key set twice, or an interpolation that does not resolve.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist. Pass an existing YAML with --config.")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({_one_line(exc)}). "
                          f"A key written twice in one section is also rejected here.") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_one_line(exc)}. Fix the interpolation or set the "
                          f"environment variable it reads.") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got "
                          f"{type(raw).__name__}.")
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    legacy_model: dict[str, Any] = {}

    def put(key: str, value: Any, section: str | None) -> None:
        where = f"{path}" + (f", section `{section}`" if section else "")
        key, is_model = _translate_legacy(key, where)
        if is_model:
            legacy_model[key] = value
            return
        if key not in ARGS:
            raise _unknown_key_error(where, key)
        if key in flat:
            raise ConfigError(f"{path}: `{key}` is set twice (in {origin[key]} and in "
                              f"{section or 'the top level'}). Keep one.")
        flat[key] = convert_value(ARGS[key], value, where)
        origin[key] = f"section `{section}`" if section else "the top level"

    for top, value in raw.items():
        if str(top) in SECTIONS and not isinstance(value, dict):
            raise ConfigError(
                f"{path}: `{top}` is a section and must hold keys (e.g. `{top}:` followed by "
                f"indented `key: value` lines), but it holds {value!r}. Indent the keys under it.")
        if isinstance(value, dict) and top not in ARGS and top not in LEGACY_KEYS:
            for key, inner in value.items():
                put(str(key), inner, str(top))
        else:
            put(str(top), value, None)
    if legacy_model:
        overrides = dict(flat.get("transformer_config_overrides", {}))
        for key, value in legacy_model.items():
            if key in overrides:
                raise ConfigError(f"{path}: `{key}` is set twice (old top-level name and inside "
                                  f"transformer_config_overrides). Keep the one in the overrides.")
            overrides[key] = value
        flat["transformer_config_overrides"] = overrides
    if "transformer_config_overrides" in flat:
        flat["transformer_config_overrides"] = _translate_override_keys(
            flat["transformer_config_overrides"], str(path))
    return flat


def _translate_override_keys(overrides: dict, where: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        new = LEGACY_KEYS.get(key, key)
        if new != key:
            warnings.warn(f"{where}: transformer_config_overrides.`{key}` is an old name; it is "
                          f"read as `{new}`.", stacklevel=3)
        if new in out:
            raise ConfigError(f"{where}: transformer_config_overrides sets `{new}` twice "
                              f"(once as `{key}`). Keep one.")
        out[new] = value
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2
        raise ConfigError(f"command line: {message}. Run with --help for every key.")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser: `--config`, `--dry-run`, and one `--key` per schema entry.

    Defaults are suppressed: a parsed namespace holds only what the command line gave.
    """
    parser = _Parser(
        prog="train.py", allow_abbrev=False, argument_default=argparse.SUPPRESS,
        description="relay trainer. Precedence: parser default < YAML (--config) < --key value.",
    )
    parser.add_argument("--config", help="YAML file; top-level sections group keys.")
    parser.add_argument("--dry-run", action="store_true",
                        help="Print the resolved arguments as JSON and exit 0.")
    for section, args in SECTIONS.items():
        group = parser.add_argument_group(section)
        for arg in args:
            group.add_argument(f"--{arg.name}", type=str, metavar=arg.kind.upper(),
                               help=f"{arg.help} (default: {arg.default!r})".replace("%", "%%"))
    return parser


def _split_legacy_cli(argv: list[str]) -> list[str]:
    """Rewrite `--old_name` to `--new_name` (warning) before argparse sees it."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, eq, rest = token[2:].partition("=")
            if name in LEGACY_KEYS and LEGACY_KEYS[name] not in MODEL_KEYS_IN_OVERRIDES:
                warnings.warn(f"command line: `--{name}` is an old name; read as "
                              f"`--{LEGACY_KEYS[name]}`.", stacklevel=3)
                token = f"--{LEGACY_KEYS[name]}{eq}{rest}"
        out.append(token)
    return out


def parse_cli(argv: list[str]) -> tuple[str | None, bool, dict[str, Any]]:
    """Return (config path, dry_run, {key: converted value}) from the command line."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(_split_legacy_cli(list(argv)))
    if unknown:
        first = next((u for u in unknown if u.startswith("--")), unknown[0])
        key = first.lstrip("-").split("=")[0]
        if first.startswith("--"):
            raise _unknown_key_error("command line", key)
        raise ConfigError(f"command line: unexpected argument {first!r}. Keys are given as "
                          f"`--key value`; the YAML goes after --config.")
    values = vars(namespace)
    config = values.pop("config", None)
    dry_run = values.pop("dry_run", False)
    converted = {}
    for key, text in values.items():
        arg = ARGS[key]
        text = _interpolate_cli_text(key, text)
        converted[key] = convert_value(arg, _parse_cli_text(arg, text), "command line")
    return config, dry_run, converted


def _interpolate_cli_text(key: str, text: str) -> str:
    """A command-line value with its `${...}` resolved as OmegaConf resolves the YAML's
    (`${oc.env:VAR}`, `${oc.env:VAR,default}`), so `--output_dir '${oc.env:SCRATCH}/run'` means
    what it means in a YAML. Raises ConfigError for an unset variable without a default, or an
    interpolation that names another key (there is no config to look it up in)."""
    if "${" not in text:
        return text
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        value = OmegaConf.to_container(OmegaConf.create({"value": text}), resolve=True)["value"]
    except OmegaConfBaseException as exc:
        variable = text.split("${oc.env:", 1)[1].split("}", 1)[0].split(",", 1)[0] \
            if "${oc.env:" in text else None
        if variable is not None and variable.strip() not in os.environ:
            raise ConfigError(
                f"command line: `--{key} {text}` reads the environment variable "
                f"{variable.strip()}, which is not set. Set it (export {variable.strip()}=...), "
                f"give it a default (`${{oc.env:{variable.strip()},<default>}}`), or write the "
                f"value out.") from None
        raise ConfigError(
            f"command line: `--{key} {text}` cannot be resolved ({_one_line(exc)}). On the "
            f"command line `${{...}}` may only read the environment (`${{oc.env:VAR}}`); "
            f"references to other keys work in the YAML only.") from None
    return value if isinstance(value, str) else json.dumps(value)


# ---------------------------------------------------------------------------------------------
# Resolution and validation
# ---------------------------------------------------------------------------------------------

def _absolute_paths(values: dict[str, Any], base: Path) -> None:
    for key, value in list(values.items()):
        arg = ARGS[key]
        if value is None:
            continue
        if arg.kind == "path":
            values[key] = str((base / os.path.expanduser(value)).resolve())
        elif arg.kind == "path_or_dict":
            if isinstance(value, str):
                values[key] = str((base / os.path.expanduser(value)).resolve())
            else:
                values[key] = {str((base / os.path.expanduser(k)).resolve()): v
                               for k, v in value.items()}


def merge_args(yaml_values: dict[str, Any], cli_values: dict[str, Any]) -> ResolvedArgs:
    """Defaults < YAML < CLI. Defaults fill only keys that neither source set."""
    merged: dict[str, Any] = {}
    for name, arg in ARGS.items():
        merged[name] = json.loads(json.dumps(arg.default))  # a fresh copy of lists and dicts
    merged.update(yaml_values)
    merged.update(cli_values)
    return ResolvedArgs(merged)


def read_config(config: str | None, overrides: list[str] | dict[str, Any] = (), *,
                cwd: str | os.PathLike | None = None) -> tuple[ResolvedArgs, set[str]]:
    """A YAML plus overrides parsed and merged (defaults < YAML < overrides), relative paths made
    absolute against `cwd` (default: the current directory). Returns the arguments and the keys
    the YAML or the overrides set. Raises ConfigError. What a run then derives and is checked
    for is trainer.resolve's.

    `overrides` is either the command-line tokens (["--learning_rate", "3e-4"]) or a mapping of
    already-typed values (the launcher's pipeline YAML)."""
    if isinstance(overrides, dict):
        cli = {}
        for key, value in overrides.items():
            key, _ = _translate_legacy(key, "overrides")
            if key not in ARGS:
                raise _unknown_key_error("overrides", key)
            cli[key] = convert_value(ARGS[key], value, "overrides")
    else:
        _, _, cli = parse_cli(list(overrides))
    yaml_values = load_yaml_config(config) if config else {}
    args = merge_args(yaml_values, cli)
    args["config"] = str(Path(config).resolve()) if config else None
    _absolute_paths_skip_config(args, Path(cwd) if cwd else Path.cwd())
    return args, set(yaml_values) | set(cli)


def _absolute_paths_skip_config(args: ResolvedArgs, base: Path) -> None:
    values = {k: v for k, v in args.items() if k in ARGS}
    _absolute_paths(values, base)
    args.update(values)


def strip_meta_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == "--config":
            skip = True
            continue
        if token.startswith("--config=") or token == "--dry-run":
            continue
        out.append(token)
    return out
