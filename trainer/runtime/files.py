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
    # a name of this writer's own: ranks that publish the same small file at once (the encode
    # plan) must not rename each other's temp file away
    tmp = target.with_name(f"{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
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


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc/self/status), else by
    setting it and putting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(*paths: str | os.PathLike) -> None:
    """Give files written by a library that makes them private (safetensors, diffusers'
    save_pretrained: 0600) the mode open() gives a new file: 0666 less the umask."""
    mode = 0o666 & ~_umask()
    for path in paths:
        os.chmod(path, mode)
