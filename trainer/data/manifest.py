"""An encode stage's manifest and what its output directory says (no torch here, so the login
node validates an encode stage and `relay status` shows its progress).

A manifest is a CSV with `path` and `caption` columns, or a JSON list of such objects; relative
paths are relative to the manifest. An encode run writes `encode-plan.json` (its split: entries,
world_size, rows_per_shard), one `part-r<rank>-<part>.json` record per published part (rows
encoded, bad files) and, once every part of every rank is there, `encode-summary.json`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

PLAN_FILE = "encode-plan.json"  # the split: entries, world_size, rows_per_shard
SUMMARY_FILE = "encode-summary.json"  # written once every part of every rank is published


class EncodeError(Exception):
    """Encoding cannot start (bad manifest, models, or a changed split); the message says why."""


def read_manifest(path) -> list[dict]:
    """[{"path", "caption"}] of a CSV or JSON manifest, paths made absolute.

    Raises EncodeError for a missing file, a missing column, or JSON that is not a list.
    """
    path = Path(path)
    if not path.is_file():
        raise EncodeError(f"manifest {path} does not exist")
    if path.suffix == ".json":
        entries = json.loads(path.read_text())
        if not isinstance(entries, list):
            raise EncodeError(f"{path} must hold a JSON list of {{path, caption}} objects")
    else:
        with path.open(newline="") as handle:
            entries = list(csv.DictReader(handle))
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict) or "path" not in entry or "caption" not in entry:
            raise EncodeError(f"{path} entry {number} needs 'path' and 'caption', got {entry!r}")
    return [{"path": str((path.parent / e["path"]).resolve()), "caption": str(e["caption"])}
            for e in entries]


def encode_progress(out_dir) -> tuple[int, int | None, int]:
    """(files done, files in the manifest or None before the first rank started, bad files)
    of an encode output directory, from its published part records."""
    out = Path(out_dir)
    try:
        total = json.loads((out / PLAN_FILE).read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        total = None
    done = bad = 0
    for record in out.glob("part-r*.json"):
        try:
            part = json.loads(record.read_text())
            done += part["rows"] + len(part["bad"])
            bad += len(part["bad"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return done, total, bad


def parts_expected(split: dict) -> int:
    """How many parts every rank of `split` publishes in all."""
    world, rows, entries = split["world_size"], split["rows_per_shard"], split["entries"]
    return sum(math.ceil(len(range(r, entries, world)) / rows) for r in range(world))
