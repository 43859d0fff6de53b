"""The checksum of every checkpoint file: xxh3_64, computed while the bytes go by.

A flipped bit inside a shard keeps the file's size, so a size check cannot see it, and
torch.load does not check the CRC32 that torch.save writes into each record. COMPLETE
therefore records a checksum per file. xxh3_64 is not a cryptographic hash: it catches bit
rot, partial copies and overwrites, not an attacker who can also rewrite COMPLETE. It was
picked for speed: 11-25 GB/s on one core of the 2-core VM of docs/performance.md, where the
stdlib's zlib.crc32 does 1.7 GB/s, slower than that VM's disk.

Bytes are hashed in pieces as they go by, while they are still in the CPU cache. Where the
process has more than two cores (HASH_BESIDE), large writes and every read of a checkpoint
are hashed on a second thread instead, beside the write or the next read: xxhash's update and
the file's reads and writes all release the GIL, so the hash then costs no time. No file is
read twice to be hashed.

Torch-free: `relay status` and other login-node tools can verify a checkpoint too.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"
# Bytes are hashed and copied in pieces of this size, each hashed while it is still in the
# CPU cache. On the 2-core VM (docs/performance.md) 1 MiB writes reached the disk faster than
# 16 MiB ones; for reads, 256 KiB to 4 MiB made no difference that its noise let through.
PIECE = 1 << 20
_CHUNK = 16 << 20
# Writes of at least this many bytes are hashed beside the write, on a second thread. Below it,
# starting the thread costs more than the hash (xxh3 hashes 4 MiB in a fraction of a ms).
OVERLAP_MIN_BYTES = 4 * PIECE


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A hashing thread only pays when a core is free for it. On the shared 2-core VM of
# docs/performance.md it made saves 40% slower than hashing inline: each large write waited
# for the thread to get a core. With more cores than that, checkpoints hash on a second thread.
HASH_BESIDE = _usable_cores() > 2


def new_hasher() -> Any:
    """A streaming hasher: `update(bytes-like)`, then `hexdigest()`."""
    return xxhash.xxh3_64()


def digest_bytes(data: bytes | memoryview) -> str:
    """The checksum of `data`."""
    hasher = new_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def digest_file(path: str | os.PathLike) -> str:
    """The checksum of a file, read in chunks of up to 16 MiB into one reused buffer."""
    hasher = new_hasher()
    with open(path, "rb", buffering=0) as handle:
        # No larger than the file: zeroing 16 MiB for a .metadata of a few KB took 10 ms.
        buffer = bytearray(max(1, min(_CHUNK, os.fstat(handle.fileno()).st_size)))
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
    return hasher.hexdigest()


class BackgroundHasher:
    """Updates `hasher` on a thread of its own with the pieces fed to it, in the order fed.

    xxhash's update releases the GIL, so the feeding thread's reads or writes go on while the
    pieces are hashed. A piece must not change until `wait(its mark)` or `finish()` has returned.
    """

    def __init__(self, hasher: Any) -> None:
        self.hasher = hasher
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._fed = 0
        self._hashed = 0
        self._failed = False
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            if not self._failed:
                try:
                    self.hasher.update(piece)
                except BaseException:  # the digest misses bytes: finish() says so
                    self._failed = True
            with self._progress:
                self._hashed += 1
                self._progress.notify_all()

    def update(self, piece: Any) -> int:
        """Queue `piece`; return its mark, for `wait(mark)`."""
        self._fed += 1
        self._pieces.put(piece)
        return self._fed

    def wait(self, mark: int) -> None:
        """Return once the pieces up to `mark` are hashed: their memory may then be reused."""
        with self._progress:
            self._progress.wait_for(lambda: self._hashed >= mark)

    def finish(self) -> bool:
        """Hash what was fed, stop the thread; True if every piece went into `hasher`."""
        if self._thread.is_alive():
            self._pieces.put(None)
            self._thread.join()
        return not self._failed


class HashingWriter:
    """A binary file wrapper that hashes every byte written through it, in order.

    Offers what DCP's writer and pickle use (write, tell, flush, fileno, close). Anything
    else is passed to the file but makes the digest unusable (`hexdigest()` is then None): a
    seek would break the order. Callers then hash the file from disk instead.
    """

    _IN_ORDER = frozenset({"closed", "writable", "name", "mode", "raw"})

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._hasher = new_hasher()
        self._in_order = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if not HASH_BESIDE or len(view) < OVERLAP_MIN_BYTES:
            return self._write_pieces(view, hash_each=True)
        # A second thread hashes the whole buffer while this one writes it. It takes it in one
        # piece: handing it each 1 MiB piece woke it (and switched the GIL) once per piece,
        # and on busy cores each switch waited for the scheduler. That thread has finished
        # when write returns: the caller (torch's zip writer) may free `data` right after.
        beside = BackgroundHasher(self._hasher)
        beside.update(view)
        try:
            return self._write_pieces(view, hash_each=False)
        finally:
            if not beside.finish():
                self._in_order = False  # the caller hashes the file from disk instead

    def _write_pieces(self, view: memoryview, *, hash_each: bool) -> int:
        """Write `view` in PIECE calls (each hashed first if `hash_each`); the bytes written."""
        for start in range(0, len(view), PIECE):
            piece = view[start:start + PIECE]
            if hash_each:
                self._hasher.update(piece)  # while it is still in the cache
            written = self._raw.write(piece)
            if written is not None and written != len(piece):
                self._in_order = False  # a short write: the file is not what was hashed
                return start + written
        return len(view)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        # DCP fsyncs through fileno() before it closes a file: flush what Python still buffers
        # first, or that fsync misses it (the pickled .metadata, a few KB, was all buffered).
        self._raw.flush()
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        if name not in self._IN_ORDER:
            self._in_order = False
        return getattr(self._raw, name)

    def hexdigest(self) -> str | None:
        """The checksum of everything written, or None if the order may have been broken."""
        return self._hasher.hexdigest() if self._in_order else None
