"""What a checkpoint directory looks like on disk, and how to judge one without loading it.

Names (`checkpoint-<step>/`, `.tmp`, `.bad`, `.deleting`), the COMPLETE marker, validation,
listing, quarantine and pruning, durable file writes and file checksums. No torch, no process
groups: this is what `relay status` and the warm-start reader share with the trainer. Layout
and rules: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from trainer.checkpoint import checksums

log = logging.getLogger("trainer.checkpoint.store")

CHECKPOINT_FORMAT = 1
COMPLETE_FILE = "COMPLETE"
TRAINING_STATE_FILE = "training_state.pt"
DATALOADER_DIR = "dataloader"
RESOLVED_CONFIG_FILE = "resolved-config.json"
QUARANTINE_REASON_FILE = "QUARANTINE_REASON"

_COMPLETE_RE = re.compile(r"^checkpoint-(\d+)$")
_TMP_RE = re.compile(r"^checkpoint-(\d+)\.tmp$")
_BAD_RE = re.compile(r"^checkpoint-(\d+)\.bad(\.\d+)?$")
_DELETING_RE = re.compile(r"^checkpoint-(\d+)\.deleting(\.\d+)?$")
_REQUIRED_COMPLETE_KEYS = ("format", "step", "world_size", "dp_world", "cp_size", "members", "files")
METADATA_FILE = ".metadata"  # DCP's own marker inside each member directory


class CheckpointError(Exception):
    """A checkpoint could not be saved, found, validated or loaded. The message says how to fix it."""


class CheckpointIncompatibleError(CheckpointError):
    """The checkpoint is intact but this run cannot use it (topology, members, shapes).

    Resume never quarantines a checkpoint for this: the fix is in the run's configuration.
    """


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """The published directory of the checkpoint at `step` (`<output_dir>/checkpoint-<step>`)."""
    return Path(output_dir) / f"checkpoint-{int(step)}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step in a `checkpoint-<step>` directory name. Raises CheckpointError for other names."""
    match = _COMPLETE_RE.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not named checkpoint-<step>")
    return int(match.group(1))


@dataclass
class OutputDirScan:
    """The checkpoint-like directories of an output_dir, by kind."""

    marked: list[tuple[int, Path]] = field(default_factory=list)  # checkpoint-N/ holding COMPLETE
    unmarked: list[Path] = field(default_factory=list)  # checkpoint-N/ without COMPLETE
    unfinished: list[Path] = field(default_factory=list)  # checkpoint-N.tmp/
    quarantined: list[Path] = field(default_factory=list)  # checkpoint-N.bad*/
    deleting: list[Path] = field(default_factory=list)  # checkpoint-N.deleting*/ (an interrupted prune)

    @property
    def has_any(self) -> bool:
        """Whether this output_dir has ever held a checkpoint (so a fresh start would lose work)."""
        return bool(self.marked or self.unmarked or self.unfinished or self.quarantined)


def scan_output_dir(output_dir: Path) -> OutputDirScan:
    """Sort the entries of `output_dir` by kind (empty if it does not exist); marked by step."""
    scan = OutputDirScan()
    if not output_dir.is_dir():
        return scan
    for entry in output_dir.iterdir():
        if not entry.is_dir():
            continue
        name = entry.name
        if match := _COMPLETE_RE.match(name):
            if (entry / COMPLETE_FILE).is_file():
                scan.marked.append((int(match.group(1)), entry))
            else:
                scan.unmarked.append(entry)
        elif _TMP_RE.match(name):
            scan.unfinished.append(entry)
        elif _BAD_RE.match(name):
            scan.quarantined.append(entry)
        elif _DELETING_RE.match(name):
            scan.deleting.append(entry)
    scan.marked.sort()
    return scan


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Return the complete checkpoints (those holding COMPLETE) in `output_dir`, oldest step first.

    Only the marker is checked here; `validate_checkpoint` checks the files. A missing
    output_dir gives an empty list.
    """
    return [path for _, path in scan_output_dir(Path(output_dir)).marked]


def read_complete(path: str | os.PathLike) -> dict[str, Any]:
    """Return the parsed COMPLETE marker of a checkpoint directory.

    Raises CheckpointError if it is missing, not JSON, or lacks a required field.
    """
    marker = Path(path) / COMPLETE_FILE
    try:
        info = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {COMPLETE_FILE} marker: it is not a finished checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{marker} is unreadable or not JSON ({exc})") from exc
    if not isinstance(info, dict) or any(key not in info for key in _REQUIRED_COMPLETE_KEYS):
        missing = [k for k in _REQUIRED_COMPLETE_KEYS if not isinstance(info, dict) or k not in info]
        raise CheckpointError(f"{marker} lacks required fields {missing}")
    if not isinstance(info["files"], dict) or not isinstance(info["members"], list):
        raise CheckpointError(f"{marker} has malformed 'files' or 'members'")
    return info


def validate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint directory without loading it; return its COMPLETE info.

    Checks: COMPLETE parses; its step matches the directory name; every recorded file exists
    with the recorded size (catches truncated or missing shards); every member has DCP
    metadata; training_state.pt and one data cursor per data-parallel rank are listed.
    Raises CheckpointError naming the first problem found.
    """
    path = Path(path)
    info = read_complete(path)
    if _COMPLETE_RE.match(path.name) and checkpoint_step(path) != info["step"]:
        raise CheckpointError(f"{path} records step {info['step']} in {COMPLETE_FILE}, not {checkpoint_step(path)}")
    for rel, size in info["files"].items():
        file = path / rel
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{file} is listed in {COMPLETE_FILE} but missing") from None
        if actual != size:
            raise CheckpointError(
                f"{file} has {actual} bytes, {COMPLETE_FILE} recorded {size} (truncated or overwritten)"
            )
    expected = expected_files(info["members"], int(info["dp_world"]))
    unlisted = [rel for rel in expected if rel not in info["files"]]
    if unlisted:
        raise CheckpointError(f"{path}/{COMPLETE_FILE} does not list required files {unlisted}")
    return info


def recorded_checksums(info: dict[str, Any], path: str | os.PathLike) -> dict[str, str] | None:
    """{file: checksum} from a COMPLETE marker's `info`; None for a checkpoint saved before
    relay recorded checksums, or with a kind of checksum this relay does not compute (logged:
    such a checkpoint is checked by size only, not set aside)."""
    if "checksums" not in info:
        return None
    if info.get("checksum") != checksums.ALGORITHM or not isinstance(info["checksums"], dict):
        log.warning("%s records checksums of kind %r; this relay computes %s: its files are "
                    "checked by size only", Path(path) / COMPLETE_FILE, info.get("checksum"),
                    checksums.ALGORITHM)
        return None
    return info["checksums"]


def member_checksums(recorded: dict[str, str] | None, member: str) -> dict[str, str]:
    """The checksums of one member's files, keyed by their names inside its directory."""
    prefix = f"{member}/"
    return {rel[len(prefix):]: digest for rel, digest in (recorded or {}).items()
            if rel.startswith(prefix)}


def checksum_mismatch(file: Path, actual: str, expected: str) -> CheckpointError:
    """The error for a file whose bytes no longer match the checksum in COMPLETE."""
    return CheckpointError(
        f"{file}: checksum mismatch ({checksums.ALGORITHM} of the file {actual}, {COMPLETE_FILE} "
        f"recorded {expected}): the file changed after it was saved (bit rot, a bad copy, an "
        "overwrite)")


def verify_files(path: str | os.PathLike, recorded: dict[str, str], files: Iterable[str]) -> None:
    """Hash each of `files` (relative to checkpoint `path`) and compare it with `recorded`.

    Files without a recorded checksum are skipped. Raises CheckpointError naming the first
    file whose bytes do not match.
    """
    for rel in files:
        expected = recorded.get(rel)
        if expected is not None:
            verify_bytes(Path(path) / rel, None, expected)


def verify_bytes(file: Path, data: bytes | None, expected: str | None) -> None:
    """Compare `data` (read from `file`; None: read the file) with its recorded checksum.

    `expected` None (nothing recorded) passes. Raises CheckpointError on a mismatch.
    """
    if expected is None:
        return
    actual = checksums.digest_file(file) if data is None else checksums.digest_bytes(data)
    if actual != expected:
        raise checksum_mismatch(file, actual, expected)


def expected_files(members: list[str], dp_world: int) -> list[str]:
    """The files every checkpoint with these members and data-parallel ranks must hold."""
    return (
        [f"{name}/{METADATA_FILE}" for name in members]
        + [TRAINING_STATE_FILE]
        + [f"{DATALOADER_DIR}/{rank}.json" for rank in range(dp_world)]
    )


def unique_sibling(path: Path, suffix: str) -> Path:
    """`path` + suffix, or + suffix + ".<n>" with the first free n."""
    candidate = path.with_name(path.name + suffix)
    index = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}{suffix}.{index}")
        index += 1
    return candidate


def quarantine_checkpoint(path: str | os.PathLike, reason: str) -> Path | None:
    """Rename a checkpoint that failed to `checkpoint-<step>.bad` (or `.bad.<n>` if taken).

    Writes the reason into `QUARANTINE_REASON` inside it. Nothing is deleted: rename the
    directory back to retry it. Returns the new path, or None if the rename failed (logged).
    """
    path = Path(path)
    target = unique_sibling(path, ".bad")
    try:
        os.rename(path, target)
        fsync_dir(path.parent)
    except OSError as exc:
        log.warning("could not quarantine %s as %s (%s); it is skipped for this run", path, target.name, exc)
        return None
    try:
        (target / QUARANTINE_REASON_FILE).write_text(f"{datetime.now(timezone.utc).isoformat()} {reason}\n")
    except OSError:
        pass  # the rename is what matters; the reason is also in the log
    log.warning("quarantined %s as %s: %s", path.name, target.name, reason)
    return target


def prune_checkpoints(
    output_dir: str | os.PathLike, keep: int, *,
    protect: str | os.PathLike | tuple[str | os.PathLike, ...] | None = None
) -> list[Path]:
    """Delete the oldest complete checkpoints so that `keep` remain; return what was deleted.

    `keep < 1` keeps everything. The newest complete checkpoint and `protect` (the one just
    written, and any other the caller must keep) are never deleted; `.tmp`, `.bad` and unmarked directories are never touched.
    A directory is first renamed `checkpoint-<step>.deleting` so a half-deleted checkpoint can
    never be mistaken for a complete one. A failed delete is logged and skipped: it must never
    stop training. Leftover `.deleting` directories from an interrupted prune are removed too.
    """
    output_dir = Path(output_dir)
    scan = scan_output_dir(output_dir)
    doomed: list[Path] = list(scan.deleting)
    if keep >= 1 and len(scan.marked) > keep:
        protected = {scan.marked[-1][1].resolve()}
        if protect is not None:
            kept = protect if isinstance(protect, (tuple, list)) else (protect,)
            protected.update(Path(p).resolve() for p in kept)
        for _, path in scan.marked[:-keep]:
            if path.resolve() in protected:
                continue
            aside = unique_sibling(path, ".deleting")
            try:
                os.rename(path, aside)
            except OSError as exc:
                log.warning("could not prune %s (%s); keeping it, training goes on", path, exc)
                continue
            doomed.append(aside)
    deleted = []
    for path in doomed:
        try:
            shutil.rmtree(path)
        except Exception as exc:  # noqa: BLE001 - any failure to delete is only a warning
            log.warning("could not delete %s (%s); delete it by hand, training goes on", path, exc)
            continue
        deleted.append(path)
        log.info("pruned %s", path.name.split(".deleting")[0])
    return deleted


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (best effort: some filesystems refuse)."""
    # A rename or a new file is durable only once its directory entry is.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on directories
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> str:
    """Write `data` to `path` (creating parents) and fsync it; return its checksum."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return checksums.digest_bytes(data)


def describe_load_error(exc: BaseException) -> str:
    """One line saying why torch.load(weights_only=True) refused or failed on a file.

    torch's message for a file that holds code opens with advice to retry with
    weights_only=False, which would run that code; relay never does that, so the message keeps
    only the cause (the blocked global, or the first line that is not that advice).
    """
    lines = [line.strip() for line in str(exc).replace("WeightsUnpickler error:", "\n").splitlines()
             if line.strip()]
    blocked = [line for line in lines if "global" in line.lower()]
    cause = (blocked or [line for line in lines if "weights_only" not in line] or [""])[0]
    if blocked:
        cause = (f"{cause[:200]} (the file holds code, not only tensors; relay loads with "
                 f"weights_only=True and never runs it)")
    return f"{type(exc).__name__}: {cause[:300]}"
