"""The checksum of every checkpoint file: xxh3_64, computed while the bytes go by.

A flipped bit inside a shard keeps the file's size, so a size check cannot see it, and
torch.load does not check the CRC32 that torch.save writes into each record. COMPLETE
therefore records a checksum per file. xxh3_64 is not a cryptographic hash: it catches bit
rot, partial copies and overwrites, not an attacker who can also rewrite COMPLETE. It was
picked for speed: 11-25 GB/s on one core of the 2-core VM of docs/performance.md, where the
stdlib's zlib.crc32 does 1.7 GB/s, slower than that VM's disk.

Bytes are hashed in pieces as they go by, while they are still in the CPU cache. Large writes
are hashed on a second thread, piece by piece beside the write of the same piece: xxhash's
update and the file's write both release the GIL, so the hash costs a save no time as long as
a second core is free. No file is read twice to be hashed.

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


def new_hasher() -> Any:
    """A streaming hasher: `update(bytes-like)`, then `hexdigest()`."""
    return xxhash.xxh3_64()


def digest_bytes(data: bytes | memoryview) -> str:
    """The checksum of `data`."""
    hasher = new_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def digest_file(path: str | os.PathLike) -> str:
    """The checksum of a file, read in 16 MiB chunks into one reused buffer."""
    hasher = new_hasher()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
    return hasher.hexdigest()


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
        if len(view) < OVERLAP_MIN_BYTES:
            return self._write_pieces(view, self._hasher.update)
        # A hashing thread takes each piece as this thread starts writing it, so both read it
        # from memory at about the same time. The thread has finished when write returns: the
        # caller (torch's zip writer) may free `data` right after.
        handed: queue.SimpleQueue = queue.SimpleQueue()

        def hash_pieces() -> None:
            try:
                while (piece := handed.get()) is not None:
                    self._hasher.update(piece)
            except BaseException:  # the digest misses bytes: the caller hashes the file from disk
                self._in_order = False

        hasher = threading.Thread(target=hash_pieces, name="checkpoint-hash", daemon=True)
        hasher.start()
        try:
            return self._write_pieces(view, handed.put)
        finally:
            handed.put(None)
            hasher.join()

    def _write_pieces(self, view: memoryview, hash_piece: Any) -> int:
        """Write `view` in PIECE calls, each piece handed to `hash_piece` first; the bytes written."""
        for start in range(0, len(view), PIECE):
            piece = view[start:start + PIECE]
            hash_piece(piece)
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
