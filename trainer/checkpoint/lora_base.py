"""The base weights a LoRA run adapts, recorded by reference: path and content digest (torch-free).

A LoRA checkpoint holds the adapters only (docs/lora.md); the frozen base stays where
`pretrained_transformer_path` points. So every checkpoint records which base it was trained
on, in `lora-base.json`, and a resume, `relay sample/eval` and `relay export` refuse a base
whose bytes changed since the run started: the adapters would silently be applied to other
weights.

The reference: the path as configured, the files it resolves to (trainer.checkpoint.
weights_source: the safetensors shards of a diffusers directory with their config.json, a
checkpoint member's DCP files, or one state-dict file), each with its size and mtime, and the
xxh3_64 digest of their contents (`digest`). The content digest is what is compared, so a base
copied or moved elsewhere (new mtimes, another path) is the same base, and a file rewritten
with other values of the same size is not. Reading every byte costs one pass over the base
(docs/lora.md gives the rate), paid once when a run first starts: a later start whose files
show the recorded sizes and mtimes takes the recorded digest without reading them again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainer.checkpoint.checksums import ALGORITHM, digest_bytes, digest_file
from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.weights_source import resolve_weights_source

BASE_FILE = "lora-base.json"


def base_files(path: str | os.PathLike, weights: str = "live") -> tuple[Path, list[Path]]:
    """(the directory the names are relative to, the files that hold the base `path` names).
    Raises CheckpointError when `path` names no weights."""
    source = resolve_weights_source(path, weights=weights)
    if source.kind == "safetensors_dir":
        files = list(source.files)
        root = source.path
        config = root / "config.json"
        if not config.is_file() and (root / "transformer" / "config.json").is_file():
            config = root / "transformer" / "config.json"
        if config.is_file():
            files.append(config)  # the architecture the weights are read as
    elif source.kind == "dcp":
        root = source.path
        files = sorted(p for p in source.path.rglob("*") if p.is_file())
    else:
        root = source.path.parent
        files = [source.path]
    return root, sorted(set(files))


def base_reference(path: str | os.PathLike, weights: str = "live",
                   previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reference of the base at `path` (module docstring). With `previous` (a recorded
    reference) whose files have the same names, sizes and mtimes, its digest is taken as it
    is; otherwise every file is read. Raises CheckpointError when `path` names no weights or
    a file cannot be read."""
    root, files = base_files(path, weights)
    entries = []
    for file in files:
        stat = file.stat()
        entries.append({"name": os.path.relpath(file, root), "size": stat.st_size,
                        "mtime_ns": stat.st_mtime_ns})
    if previous is not None and previous.get("files") == entries and previous.get("digest"):
        digest = previous["digest"]
    else:
        try:
            parts = [f"{e['name']}\0{e['size']}\0{digest_file(f)}" for e, f in zip(entries, files)]
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
        digest = digest_bytes("\n".join(parts).encode())
    return {"path": str(path), "weights": weights, "root": str(root), "files": entries,
            "algorithm": ALGORITHM, "digest": digest}


def describe_change(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """None when `current` holds the bytes `recorded` does; else what differs, in words."""
    if recorded.get("digest") == current.get("digest"):
        return None
    old = {e["name"]: e for e in recorded.get("files", [])}
    new = {e["name"]: e for e in current.get("files", [])}
    parts = []
    gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if gone:
        parts.append(f"{', '.join(gone[:5])} {'is' if len(gone) == 1 else 'are'} gone")
    if added:
        parts.append(f"{', '.join(added[:5])} {'is' if len(added) == 1 else 'are'} new")
    resized = [n for n in sorted(set(old) & set(new)) if old[n]["size"] != new[n]["size"]]
    if resized:
        parts.append("other sizes: " + ", ".join(
            f"{n} {old[n]['size']} -> {new[n]['size']} bytes" for n in resized[:5]))
    if not parts:
        parts.append("the same files and sizes with other contents")
    return "; ".join(parts)


def read_recorded_base(checkpoint: Path) -> dict[str, Any] | None:
    """The base reference a checkpoint recorded, or None (not a LoRA checkpoint)."""
    try:
        recorded = json.loads((Path(checkpoint) / BASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and "digest" in recorded else None


def check_base(path: str | os.PathLike, weights: str, recorded: dict[str, Any] | None,
               what: str) -> dict[str, Any]:
    """The current reference of the base at `path`; raises CheckpointError, in one paragraph,
    when `recorded` (what `what` was trained on) differs from it."""
    current = base_reference(path, weights, previous=recorded)
    change = None if recorded is None else describe_change(recorded, current)
    if change:
        raise CheckpointError(
            f"the LoRA base changed since {what} was trained on it: {recorded.get('path')} was "
            f"{recorded.get('root')} with digest {recorded.get('digest')}, and "
            f"{path} now holds {current['root']} with digest {current['digest']} ({change}). "
            f"The adapters only mean something on the weights they were trained with: point "
            f"pretrained_transformer_path at that base (a copy elsewhere is fine), or start a "
            f"new LoRA run on the new base in another output_dir.")
    return current
