"""Small files every part of relay writes (no torch here): JSON that is replaced atomically, so a
reader (`relay status`, a resumed job, a user's script) sees the old file or the new one, never
half of one."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as indented JSON to `path` (creating its directory) via a temp file + rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, target)


def replace_directory(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Publish the finished directory `tmp` as `out`, replacing what is there (the caller
    checked that it may): `out` is never half-written, only briefly absent."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.relay-replaced-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
