"""Secrets by value: no field relay renders into a job script may hold a credential's value.

pipeline.py keeps credentials out of `env:` by their names. The same value can still arrive
under another name (`WB: ${oc.env:WANDB_API_KEY}` in the cluster section, or a train.py
argument that interpolates a token), and would then be written in full into a script on
shared storage. So before rendering, every field's value is compared with the credentials in
the login node's environment. Messages name the field and the variable, never the value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping

SECRET_VARS = ("WANDB_API_KEY", "HF_TOKEN")
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")
# Shorter values are flags and counters (FOO_KEY=1), not credentials: matching them would
# refuse harmless scripts, and containing them says nothing.
MIN_SECRET_LENGTH = 8


def is_secret_name(name: str) -> bool:
    """Whether an environment variable of this name holds a credential."""
    upper = name.upper()
    return upper in SECRET_VARS or upper.endswith(SECRET_SUFFIXES)


def secret_values(environ: Mapping[str, str]) -> dict[str, str]:
    """{variable name: value} of the credentials in `environ` long enough to be one."""
    return {name: value for name, value in environ.items()
            if is_secret_name(name) and len(value.strip()) >= MIN_SECRET_LENGTH}


def fields_holding_secrets(fields: Iterable[tuple[str, Any]],
                           secrets: Mapping[str, str]) -> list[tuple[str, str]]:
    """(field, variable) for every field whose value equals or contains a secret's value."""
    found = []
    for field, value in fields:
        text = str(value)
        for name, secret in secrets.items():
            if secret.strip() in text:
                found.append((field, name))
                break
    return found


def resource_fields(resources: Any) -> Iterator[tuple[str, Any]]:
    """(field name, value) of every leaf of a Resources dataclass (`env.NAME`, `sbatch_extra.x`)."""
    for field in dataclasses.fields(resources):
        value = getattr(resources, field.name)
        if isinstance(value, Mapping):
            for key, inner in value.items():
                yield f"{field.name}.{key}", inner
        elif value is not None:
            yield field.name, value


def argv_fields(argv: Iterable[str], program: str) -> Iterator[tuple[str, str]]:
    """(`program --key`, value) for `--key=value` and `--key value` items of an argv."""
    items = list(argv)
    for index, item in enumerate(items):
        if item.startswith("--") and "=" in item:
            key, value = item.split("=", 1)
            yield f"{program} {key}", value
        elif not item.startswith("--"):
            before = items[index - 1] if index else ""
            yield (f"{program} {before}" if before.startswith("--") else program), item
