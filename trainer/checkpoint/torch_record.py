"""Where a tensor's raw bytes lie in the zip record that torch.save wrote, found from its head.

torch.save writes a zip archive: `<archive>/data.pkl` (a short pickle: the storage's dtype,
key and size, the tensor's offset, shape and strides), a few small records (`byteorder`, ...),
then `<archive>/data/<key>`, the storage's bytes, uncompressed. All of that except the bytes
fits in the record's first few hundred bytes. The entries' sizes come only after their data
(zip data descriptors), so the entries cannot be walked by size; each is found by its local
header's signature and name instead. The zip directory at the end of the record is never
read: a loader can then read the whole record front to back.

`locate_tensor_bytes` returns None for anything it does not recognise (a dtype without a
legacy storage name, a view into a larger storage, another byte order). The caller then
takes torch.load's path. The pickle is read by an unpickler that knows three names and
builds nothing but a description.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

# torch.save names a storage by these legacy classes for the dtypes that have one.
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_SIZE = 30


@dataclass(frozen=True)
class TensorBytes:
    """A contiguous tensor's bytes inside its record."""

    offset: int  # from the start of the record
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def locate_tensor_bytes(head: bytes) -> TensorBytes | None:
    """Describe the tensor record whose first bytes are `head`, or None if it is not a plain
    contiguous tensor whose bytes start within `head`."""
    entries = _entries(head)
    if not entries:
        return None
    archive = next(iter(entries)).split("/", 1)[0]
    pickled = entries.get(f"{archive}/data.pkl")
    order = entries.get(f"{archive}/byteorder")
    if pickled is None or order is None:
        return None
    if head[order:order + len(sys.byteorder)] != sys.byteorder.encode():
        return None
    try:
        layout = _LayoutUnpickler(io.BytesIO(head[pickled:])).load()
    except Exception:  # noqa: BLE001 - not a pickle this reader knows: let torch.load read it
        return None
    if not isinstance(layout, _Layout):
        return None
    start = entries.get(f"{archive}/data/{layout.key}")
    contiguous = tuple(torch.empty(layout.shape, device="meta").stride()) == layout.stride
    if start is None or layout.offset != 0 or not contiguous \
            or math.prod(layout.shape) != layout.numel:
        return None
    return TensorBytes(start, layout.numel * layout.dtype.itemsize, layout.dtype, layout.shape)


def _entries(head: bytes) -> dict[str, int]:
    """{entry name: where its data starts} for the zip entries whose headers are in `head`,
    the first at offset 0."""
    entries: dict[str, int] = {}
    at = 0 if head.startswith(_LOCAL_HEADER) else -1
    while at >= 0 and at + _LOCAL_HEADER_SIZE <= len(head):
        name_length, extra_length = struct.unpack_from("<HH", head, at + 26)
        name_end = at + _LOCAL_HEADER_SIZE + name_length
        try:
            name = head[at + _LOCAL_HEADER_SIZE:name_end].decode("utf-8")
        except UnicodeDecodeError:
            name = ""
        if "/" in name and name_end <= len(head):
            entries.setdefault(name, name_end + extra_length)
        at = head.find(_LOCAL_HEADER, at + 4)
    return entries


@dataclass(frozen=True)
class _Layout:
    dtype: torch.dtype
    key: str
    numel: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _describe_tensor(storage: Any, offset: int, shape: Any, stride: Any, *_: Any) -> _Layout:
    dtype, key, numel = storage
    return _Layout(dtype, key, int(numel), int(offset), tuple(shape), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a tensor's data.pkl into a _Layout; refuses every other class."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _describe_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> tuple[torch.dtype, str, int]:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("not a storage reference")
        return dtype, str(key), int(numel)
