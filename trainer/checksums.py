"""The checksum of every checkpoint file: xxh3_64, computed while the bytes go by.

A flipped bit inside a shard keeps the file's size, so a size check cannot see it, and
torch.load does not check the CRC32 that torch.save writes into each record. COMPLETE
therefore records a checksum per file. xxh3_64 is not a cryptographic hash: it catches bit
rot, partial copies and overwrites, not an attacker who can also rewrite COMPLETE. It was
picked for speed: 11-25 GB/s on one core of the 2-core VM of docs/performance.md, where the
stdlib's zlib.crc32 does 1.7 GB/s, slower than that VM's disk.

Bytes are hashed in pieces, each right before it is written or right after it is read, while
it is still in the CPU cache. No file is read twice to be hashed.

Torch-free: `relay status` and other login-node tools can verify a checkpoint too.
"""

from __future__ import annotations

import os
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"
# Bytes are hashed and copied in pieces of this size, each hashed while it is still in the
# CPU cache. On the 2-core VM (docs/performance.md) 1 MiB writes reached the disk faster than
# 16 MiB ones; for reads, 256 KiB to 4 MiB made no difference that its noise let through.
PIECE = 1 << 20
_CHUNK = 16 << 20


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
        for start in range(0, len(view), PIECE):
            piece = view[start:start + PIECE]
            self._hasher.update(piece)
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
