"""Read torch.distributed.checkpoint (DCP) directories without unpickling arbitrary objects.

DCP stores its `.metadata` as a pickle and loads non-tensor values (an optimizer's param_groups)
with `torch.load(weights_only=False)`. A checkpoint directory is just files on shared storage,
so this module reads both through restricted loaders: the metadata unpickler accepts only
DCP's own metadata classes, and non-tensor values go through `torch.load(weights_only=True)`.
Everything that reads a DCP directory in relay goes through here. Files are written with
their checksums and read back verified against them (trainer.checkpoint.dcp_files).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from trainer.checkpoint.layout import METADATA_FILE, CheckpointError, verify_bytes
from trainer.checkpoint.dcp_files import DirectFileSystemReader, HashingFileSystemWriter
from trainer.parallel.distributed import distributed_active

# DCP warns on every single-process save/load; here that is deliberate (one process, a tool, a
# test), so the warning only teaches users to ignore warnings.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to",
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, refusing every class DCP itself does not put there."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never holds; "
            "refusing to unpickle it"
        )


class SafeFileSystemReader(DirectFileSystemReader):
    """A DCP reader whose metadata is read with the restricted unpickler (and whose tensors are
    read in place and verified: trainer.checkpoint.dcp_files)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        data = (Path(self.path) / name).read_bytes()
        self.verify_bytes(name, data)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            _set_by_path(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_by_path(root: Any, path: tuple, value: Any) -> None:
    """Assign `value` at the nested `path` (dict keys and list indices) inside `root`."""
    node = root
    for key in path[:-1]:
        if isinstance(node, dict) and key not in node:
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


def read_dcp_metadata(dcp_dir: str | os.PathLike) -> Metadata:
    """Return the parsed `.metadata` of a DCP directory.

    Raises FileNotFoundError (or another OSError) if it is missing or cannot be read, and
    pickle.UnpicklingError naming the file if it is corrupt or refers to classes a DCP
    checkpoint never holds.
    """
    try:
        return SafeFileSystemReader(str(dcp_dir)).read_metadata()
    except OSError:
        raise
    except Exception as exc:  # garbage unpickles into many error types; name the file in one
        raise pickle.UnpicklingError(
            f"{Path(dcp_dir) / METADATA_FILE} is not readable DCP metadata: "
            f"{type(exc).__name__}: {exc}") from exc


def read_dcp_tensor_shapes(dcp_dir: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Return {key: (global shape, dtype)} of every tensor a DCP directory stores."""
    metadata = read_dcp_metadata(dcp_dir)
    return {
        key: (entry.size, entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


class DCPError(RuntimeError):
    """A DCP save or load failed on one or more ranks.

    DCP raises CheckpointException, a BaseException that `except Exception` does not catch;
    every call here turns it into this ordinary exception, naming each failing rank.
    """


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


@contextlib.contextmanager
def _dcp_errors(what: str, dcp_dir: str | os.PathLike) -> Iterator[None]:
    try:
        yield
    except CheckpointException as exc:
        details = "; ".join(
            f"rank {rank}: {type(err).__name__}: {_first_line(err)}" for rank, (err, _) in sorted(exc.failures.items())
        )
        raise DCPError(f"{what} {dcp_dir} failed: {details}") from exc


def save_dcp(
    state_dict: dict[str, Any],
    dcp_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, str | None]:
    """Write `state_dict` as a DCP directory, every file fsynced. A collective under a process group.

    Returns {file name: checksum} of the files this rank wrote, hashed while writing (None
    where the writer could not hash in order: hash that file from disk). Raises DCPError on
    every rank if any rank failed to write.
    """
    writer = HashingFileSystemWriter(str(dcp_dir), sync_files=True)
    with _dcp_errors("saving", dcp_dir):
        dcp.save(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not distributed_active(),
        )
    return dict(writer.digests)


def load_dcp_in_place(
    state_dict: dict[str, Any],
    dcp_dir: str | os.PathLike,
    *,
    checksums: Mapping[str, str] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Fill `state_dict` (tensors, DTensors and nested dicts/lists) in place from a DCP directory.

    `checksums` ({file name: checksum}, from the checkpoint's COMPLETE) are verified for every
    file they name: each rank hashes the files it reads whole as it reads them, and the files
    no rank read whole are hashed from disk afterwards, shared out among the ranks. A
    collective when a process group is initialised: every rank of `process_group` must call
    it. Raises DCPError on every rank for a missing key, a shape mismatch, an unreadable shard
    or a checksum mismatch while reading on any rank, and CheckpointError on every rank for a
    mismatch found afterwards.
    """
    checksums = dict(checksums or {})
    reader = SafeFileSystemReader(str(dcp_dir), checksums=checksums)
    with _dcp_errors("loading", dcp_dir):
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=not distributed_active(),
        )
    if checksums:
        _verify_files_read_in_part(Path(dcp_dir), checksums, reader.verified, process_group)


def _verify_files_read_in_part(dcp_dir: Path, checksums: dict[str, str], verified: set[str],
                               group: dist.ProcessGroup | None) -> None:
    """Hash from disk the files of `checksums` that no rank verified while reading.

    A load onto another number of ranks reads parts of files, which cannot be hashed on the
    way. Collective; raises CheckpointError on every rank if any file does not match.
    """
    rank, world, read_whole = 0, 1, set(verified)
    if distributed_active():
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, sorted(verified), group=group)
        read_whole = {name for names in everyone for name in names}
    left = sorted(name for name in checksums if name not in read_whole and name != METADATA_FILE)
    error = None
    try:
        for name in left[rank::world]:
            verify_bytes(dcp_dir / name, None, checksums[name])
    except CheckpointError as exc:
        error = str(exc)
    errors = [error]
    if distributed_active():
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
    found = [f"rank {i}: {e}" for i, e in enumerate(errors) if e]
    if found:
        raise CheckpointError("; ".join(found))


def read_dcp_state_dict(dcp_dir: str | os.PathLike,
                        checksums: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor of a DCP directory into one plain, full, CPU state dict.

    For export and offline inspection: this process reads all shards, whatever the number of
    ranks that wrote them, and needs no process group. Non-tensor entries are skipped: a
    model's state dict has none. `checksums` ({file name: checksum}, from the checkpoint's
    COMPLETE) are verified for every file. Raises DCPError for an unreadable shard, and
    CheckpointError (or DCPError) for a checksum mismatch.
    """
    checksums = dict(checksums or {})
    verify_bytes(Path(dcp_dir) / METADATA_FILE, None, checksums.get(METADATA_FILE))
    shapes = read_dcp_tensor_shapes(dcp_dir)
    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    reader = SafeFileSystemReader(str(dcp_dir), checksums=checksums)
    with _dcp_errors("reading", dcp_dir):
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    if checksums:
        _verify_files_read_in_part(Path(dcp_dir), checksums, reader.verified, None)
    return state


def iter_tensor_leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (DCP key, tensor) for every tensor in a nested state dict.

    Keys join dict keys and list indices with "." as DCP's flattening does, so they compare
    directly with `read_dcp_tensor_shapes`.
    """
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from iter_tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from iter_tensor_leaves(value, f"{prefix}.{index}" if prefix else str(index))
