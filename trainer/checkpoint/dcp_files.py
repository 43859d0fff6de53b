"""DCP storage with a checksum per file: hashed while written, verified while read.

`HashingFileSystemWriter` is DCP's FileSystemWriter with every output stream wrapped in a
`trainer.checkpoint.checksums.HashingWriter`, so each file's checksum is known when it is closed,
without reading it back. It also switches off the CRC32 that torch.save computes for each
zip record. torch.load never checks that CRC, and it cost a quarter of a save's time
(docs/performance.md); the per-file checksum replaces it.

`DirectFileSystemReader` replaces DCP's FileSystemReader.read_data, for two reasons:

- Speed. DCP's reader torch.loads every tensor into a freshly allocated tensor and then
  copies it into the destination. Fresh pages cost a page fault each, which made loads run
  at a third of the disk's speed. This reader finds where a saved tensor's bytes lie in its
  zip record and reads them straight into the destination tensor. For a destination on
  another device, or one that is not contiguous, it reads into one of two reused host buffers
  (pinned for a GPU) and copies from there; a copy to the GPU runs while the next tensor is
  read into the other buffer.
- Verification. It reads each file's items in offset order and hashes every byte on the
  way (on a second thread where a core is free for it: trainer.checkpoint.checksums.HASH_BESIDE), so a
  file read whole is verified without a second read. A checksum that does not match raises
  CheckpointError. Files a rank reads only in part (a resharded load) are left out of
  `verified`; trainer.checkpoint.dcp_io hashes those from disk after the load.

Anything unusual (a narrowed read, a transform, another dtype, a big-endian record) takes
DCP's own path, torch.load of the record, and is hashed all the same.
"""

from __future__ import annotations

import io
import os
from contextlib import closing, contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from trainer.checkpoint import checksums
from trainer.checkpoint.layout import CheckpointError, checksum_mismatch
from trainer.checkpoint.torch_record import locate_tensor_bytes

# A tensor record's zip entries before its bytes take a few hundred bytes: one page holds them.
_HEAD_BYTES = 4096
_HASH_PART = 16 << 20  # bytes of a read handed to the hashing thread at a time


# Every this many bytes written to a shard, the kernel is told to start writing them to disk.
WRITEBACK_BYTES = 4 << 20


class EarlyWriteback:
    """A file being written whose bytes go to disk while the rest of it is still written.

    Left alone, the kernel keeps a shard's bytes in the page cache until the fsync that closes
    it: the disk idles while the shard is serialised and hashed, then the fsync writes it all.
    posix_fadvise(DONTNEED) on the range just written starts its writeback and returns at once
    (on the 2-core VM, saves went from 1.2 to 1.9 GB/s: docs/performance.md). It drops only
    pages already on disk, so the bytes stay as written and the closing fsync still covers
    them; a shard just saved is not kept in the page cache.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._written = 0  # bytes written through this wrapper, from the start of the file
        self._kicked = 0  # writeback has been started for bytes [0, kicked)
        self._hinting = hasattr(os, "posix_fadvise")

    def write(self, data: Any) -> int | None:
        written = self._raw.write(data)
        self._written += memoryview(data).nbytes if written is None else written
        if self._hinting and self._written - self._kicked >= WRITEBACK_BYTES:
            self._raw.flush()  # a write error (a full disk) is raised here, as it should be
            try:
                os.posix_fadvise(self._raw.fileno(), self._kicked, self._written - self._kicked,
                                 os.POSIX_FADV_DONTNEED)
            except OSError:  # a filesystem that refuses the hint: the save goes on without it
                self._hinting = False
            self._kicked = self._written
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _HashingFileSystem(FileSystem):
    """DCP's local FileSystem, recording the checksum of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str | None] = {}  # file name -> checksum (None: hash from disk)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            stream = checksums.HashingWriter(EarlyWriteback(raw))
            yield stream  # type: ignore[misc]
        self.digests[Path(path).name] = stream.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        self.digests[Path(new_path).name] = self.digests.pop(Path(path).name, None)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.digests.pop(Path(path).name, None)


class HashingFileSystemWriter(FileSystemWriter):
    """A FileSystemWriter whose `digests` maps each file it wrote to its checksum (or None)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    @property
    def digests(self) -> dict[str, str | None]:
        return self.fs.digests

    def write_data(self, plan: Any, planner: Any) -> Future:
        # FileSystemWriter writes synchronously inside write_data: the switch covers every record.
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(previous)


class DirectFileSystemReader(FileSystemReader):
    """A FileSystemReader that reads tensors in place and verifies files against `checksums`.

    `checksums` maps file names of the DCP directory to their recorded checksums (empty: no
    verification). After a load, `verified` holds the files this reader hashed whole and found
    intact.
    """

    def __init__(self, path: str | os.PathLike, checksums: Mapping[str, str] | None = None) -> None:
        super().__init__(path)
        self.checksums = dict(checksums or {})
        self.verified: set[str] = set()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        staging = _Staging()
        for name, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            self._read_file(name, items, planner, staging)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list[Any], planner: LoadPlanner,
                   staging: "_Staging") -> None:
        expected = self.checksums.get(name)
        filled = []  # (item, target): committed once the copies into them have finished
        with open(Path(self.path) / name, "rb", buffering=0) as handle, \
                closing(_HashingReader(handle, hashing=expected is not None)) as stream:
            for item in items:
                info = self.storage_data[item.storage_index]
                stream.seek(info.offset)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(stream.read_exact(info.length)))
                else:
                    target = planner.resolve_tensor(item).detach()
                    _read_tensor(stream, info, item, target, staging)
                    filled.append((item, target))
            digest = stream.digest_if_whole(os.fstat(handle.fileno()).st_size)
        staging.wait()
        for item, target in filled:
            planner.commit_tensor(item, target)
        if digest is not None:
            self._check(name, digest)

    def verify_bytes(self, name: str, data: bytes) -> None:
        """Check the whole content of file `name` against its recorded checksum, if any."""
        if name in self.checksums:
            self._check(name, checksums.digest_bytes(data))

    def _check(self, name: str, digest: str) -> None:
        if digest != self.checksums[name]:
            raise checksum_mismatch(Path(self.path) / name, digest, self.checksums[name])
        self.verified.add(name)


class _HashingReader:
    """Reads a file and hashes its bytes, as long as the reads follow each other in order.

    With `checksums.HASH_BESIDE` the bytes are hashed on a second thread, each read while the
    next one runs; `close()` stops that thread. Otherwise each 1 MiB piece is hashed right
    after it is read, while it is still in the cache.
    """

    def __init__(self, handle: IO[bytes], *, hashing: bool) -> None:
        self._handle = handle
        self._hasher = checksums.new_hasher() if hashing else None
        self._beside = checksums.BackgroundHasher(self._hasher) \
            if hashing and checksums.HASH_BESIDE else None
        self._position = 0  # where the next read starts
        self._hashed_to = 0  # bytes [0, hashed_to) went to the hasher, in order
        self._mark = 0  # the background hasher's mark of the last bytes fed to it

    def seek(self, offset: int) -> None:
        if offset != self._position:
            self._handle.seek(offset)
            self._position = offset

    def _hash(self, data: Any) -> None:
        if self._hasher is not None and self._position == self._hashed_to:
            if self._beside is not None:
                self._mark = self._beside.update(data)
            else:
                self._hasher.update(data)
            self._hashed_to += len(data)
        self._position += len(data)

    def hashed_mark(self) -> int:
        """A mark for the bytes read so far, for `wait_hashed`."""
        return self._mark

    def wait_hashed(self, mark: int) -> None:
        """Return once the bytes read up to `mark` are hashed: their memory may then be reused."""
        if self._beside is not None:
            self._beside.wait(mark)

    def read_exact(self, n: int) -> bytearray:
        data = bytearray(n)
        self.readinto_exact(memoryview(data))
        return data

    def readinto_exact(self, view: memoryview) -> None:
        if self._beside is None:
            for start in range(0, len(view), checksums.PIECE):
                piece = view[start:start + checksums.PIECE]
                self._fill(piece)
                self._hash(piece)
            return
        # The hashing thread takes the read in parts of 16 MiB, each hashed while the next is
        # read, so at most one part is left to hash when a file's last read ends. Handing it
        # each 1 MiB piece instead woke it (and switched the GIL) 300 times per 300 MB; on busy
        # cores each switch waited for the scheduler.
        for start in range(0, len(view), _HASH_PART):
            part = view[start:start + _HASH_PART]
            for offset in range(0, len(part), checksums.PIECE):
                self._fill(part[offset:offset + checksums.PIECE])
            self._hash(part)

    def _fill(self, piece: memoryview) -> None:
        filled = 0
        while filled < len(piece):
            got = self._handle.readinto(piece[filled:])
            if not got:
                raise CheckpointError(f"{self._handle.name} ended early: truncated")
            filled += got

    def digest_if_whole(self, size: int) -> str | None:
        """The file's checksum if every byte was hashed in order, else None. Closes the reader."""
        complete = self._beside is None or self._beside.finish()
        if self._hasher is None or not complete or self._hashed_to != size:
            return None
        return self._hasher.hexdigest()

    def close(self) -> None:
        if self._beside is not None:
            self._beside.finish()


class _Staging:
    """Two host buffers, taken in turn, for tensors that cannot be read in place.

    A tensor bound for the GPU is read into one buffer and copied from it asynchronously
    (the buffers are pinned for that), so the next tensor is read into the other buffer while
    the copy runs. A buffer is reused only once its last copy has finished. Copies into CPU
    tensors finish before they return; they take the same path.
    """

    def __init__(self) -> None:
        self._slots = [_StagingSlot(), _StagingSlot()]
        self._turn = 0

    def take(self, nbytes: int, device: torch.device) -> "_StagingSlot":
        """A slot whose `bytes` holds at least `nbytes` and is no longer copied from or hashed."""
        slot = self._slots[self._turn]
        self._turn ^= 1
        slot.wait()
        slot.reserve(nbytes, pinned=device.type == "cuda")
        return slot

    def wait(self) -> None:
        """Return once every copy out of the buffers has finished."""
        for slot in self._slots:
            slot.wait()


class _StagingSlot:
    def __init__(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self._pinned = False
        self._copied: Any = None  # a CUDA event recorded after the last copy out, until waited
        self._hashing: tuple[_HashingReader, int] | None = None  # (reader, mark) of its bytes

    def reserve(self, nbytes: int, *, pinned: bool) -> None:
        # A pinned buffer serves CPU targets too: pinning is slow, so it is never undone.
        if self.bytes.numel() < nbytes or (pinned and not self._pinned):
            self.bytes = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._pinned = pinned

    def copy_to(self, target: torch.Tensor) -> None:
        """Copy the first bytes of the buffer, as `target`'s dtype and shape, into `target`."""
        nbytes = target.numel() * target.element_size()
        source = self.bytes[:nbytes].view(target.dtype).view(target.shape)
        if target.device.type != "cuda":
            target.copy_(source)
            return
        target.copy_(source, non_blocking=True)  # from pinned memory: returns at once
        self._copied = torch.cuda.Event()
        self._copied.record()

    def held_until_hashed(self, stream: _HashingReader) -> None:
        """The bytes just read into this slot are being hashed by `stream`'s thread."""
        self._hashing = (stream, stream.hashed_mark())

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._hashing is not None:
            stream, mark = self._hashing
            stream.wait_hashed(mark)
            self._hashing = None


def _read_tensor(stream: _HashingReader, info: Any, item: Any, target: torch.Tensor,
                 staging: _Staging) -> None:
    """Fill `target` from the record at `info` (the stream is at its start), reading the
    tensor's bytes in place where the record allows it."""
    head = stream.read_exact(min(info.length, _HEAD_BYTES))
    # Small records too: torch.loading each took a third of a ms, which for the hundreds of
    # norms and biases of a transformer was 40% of a load from the page cache.
    found = locate_tensor_bytes(bytes(head)) \
        if not info.transform_descriptors and not any(item.storage_offsets) else None
    if found is None or found.dtype != target.dtype or found.shape != tuple(item.lengths) \
            or found.shape != tuple(target.shape) or found.offset > len(head) \
            or found.offset + found.nbytes > info.length:
        # DCP's way: load the whole record, narrow it, copy it into the target.
        record = torch.load(io.BytesIO(head + stream.read_exact(info.length - len(head))),
                            map_location="cpu", weights_only=True)
        record = _narrow(record, item.storage_offsets, item.lengths)
        if record.shape != target.shape:
            raise CheckpointError(f"{item.storage_index.fqn}: stored {tuple(record.shape)}, "
                                  f"needed {tuple(target.shape)}")
        target.copy_(record)
        return
    in_place = target.device.type == "cpu" and target.is_contiguous()
    slot = None
    if not in_place:
        # Waits only for this slot's last tensor, two reads back: the one just read into the
        # other slot is hashed (and copied to the GPU) while this one is read.
        slot = staging.take(found.nbytes, target.device)
    raw = target.view(-1).view(torch.uint8) if slot is None else slot.bytes[:found.nbytes]
    view = memoryview(raw.numpy())
    # The head already holds the first of the tensor's bytes; the rest goes straight in.
    early = min(len(head) - found.offset, found.nbytes)
    view[:early] = head[found.offset:found.offset + early]
    stream.readinto_exact(view[early:])
    if slot is not None:
        slot.copy_to(target)
        slot.held_until_hashed(stream)
    consumed = len(head) + found.nbytes - early
    stream.read_exact(info.length - consumed)  # the zip entries after the tensor's bytes


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The block of `tensor` starting at `offsets` with sizes `lengths`."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor
