"""What a resume needs to know about the data, without torch and before any model exists.

- **Identity** (`data_identity`): which dataset a run trained on, from each shard's name (relative
  to its data_path directory), repeat, size in bytes and an xxh3 digest of its parquet footer
  (the footer holds every row group's offsets, sizes and column statistics, so other rows of
  the same count give another digest). Reading a footer costs two small reads per shard, no
  row data. A checkpoint records it (`data-identity.json`); a resume compares it with the data
  there now (`identity_changes`).
- **Position** (`position_problem`): whether a data cursor saved with one split (dp ranks,
  batch size) lands on a step boundary of this run's split, with the arithmetic when it does not.

The cursors themselves are trainer.data.loader's `DistributedBatchIterator.state_dict()`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from trainer.data.formats import resolve_datasets

IDENTITY_FILE = "data-identity.json"
_FOOTER_TAIL = 8  # a parquet file ends with the footer's length (4 bytes, little endian) + b"PAR1"


def _footer_digest(path: Path, size: int) -> str:
    """xxh3_64 of the file's parquet footer (hex); of its last bytes when it has no valid footer."""
    import xxhash

    with open(path, "rb") as f:
        if size < 12:
            return "short:" + xxhash.xxh3_64_hexdigest(f.read())
        f.seek(size - _FOOTER_TAIL)
        tail = f.read(_FOOTER_TAIL)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or length + 12 > size:
            return "nofooter:" + xxhash.xxh3_64_hexdigest(tail)
        f.seek(size - _FOOTER_TAIL - length)
        return xxhash.xxh3_64_hexdigest(f.read(length) + tail)


def data_identity(data_path) -> dict:
    """{"digest": hex, "shards": [{"dataset", "path", "repeat", "size", "footer"}, ...]} of the
    data a data_path names (a directory or a {directory: repeat} mapping), in reading order.

    Paths are relative to their data_path directory, so the same files moved elsewhere are the
    same data. Raises OSError / ValueError / FileNotFoundError as resolve_datasets does, or when
    a shard cannot be read.
    """
    entries = list(data_path.items()) if isinstance(data_path, Mapping) else [(data_path, 1)]
    roots = [Path(directory) for directory, _ in entries]
    shards = []
    for path, repeat, number in resolve_datasets(data_path):
        root = roots[number]
        name = path.name if root.is_file() else str(path.relative_to(root))
        size = path.stat().st_size
        shards.append({"dataset": number, "path": name, "repeat": repeat, "size": size,
                       "footer": _footer_digest(path, size)})
    import xxhash

    digest = xxhash.xxh3_64_hexdigest(json.dumps(shards, sort_keys=True).encode())
    return {"digest": digest, "shards": shards}


def identity_changes(saved: dict, now: dict, *, limit: int = 5) -> list[str]:
    """What differs between two identities, one short phrase per shard (at most `limit`, then a
    count of the rest); [] when they are the same data."""
    if saved.get("digest") == now.get("digest"):
        return []

    def key(shard):
        return shard["dataset"], shard["path"]

    before = {key(s): s for s in saved.get("shards", [])}
    after = {key(s): s for s in now.get("shards", [])}
    changes = []
    for k in sorted(set(before) | set(after)):
        old, new = before.get(k), after.get(k)
        where = k[1] if len({d for d, _ in before} | {d for d, _ in after}) == 1 else f"{k[1]} (data_path entry {k[0] + 1})"
        if old is None:
            changes.append(f"{where} is new ({new['size']} bytes)")
        elif new is None:
            changes.append(f"{where} is gone")
        elif old["size"] != new["size"]:
            changes.append(f"{where} changed size ({old['size']} -> {new['size']} bytes)")
        elif old["footer"] != new["footer"]:
            changes.append(f"{where} holds other rows (same size, another parquet footer)")
        elif old["repeat"] != new["repeat"]:
            changes.append(f"{where} is repeated {new['repeat']} times, was {old['repeat']}")
    if not changes:
        changes.append("the shards are read in another order")
    if len(changes) > limit:
        changes = changes[:limit] + [f"and {len(changes) - limit} more"]
    return changes


def _divisors(n: int) -> list[int]:
    """The divisors of `n` > 0 in increasing order ([] past 10**12: too many to try)."""
    if n <= 0 or n > 10**12:
        return []
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _streams(state: dict, check_epochs: bool):
    """(name, place, samples seen, epoch size, saved epoch length) of each stream of a cursor;
    the sizes are None when the cursor does not record them or epochs are not checked."""
    saved_dp = int(state["dp_world"])
    sizes, lengths = state.get("stream_sizes") or {}, state.get("epoch_lengths") or {}
    for name, place in sorted(state["cursor"].get("streams", {}).items()):
        size, length = (sizes.get(name), lengths.get(name)) if check_epochs else (None, None)
        if size is None or length is None:
            size = length = None
        yield name, place, int(place["position"]) * saved_dp, size, length


def _epoch_length(state: dict, size: int, global_batch: int) -> int:
    """An epoch of `size` samples cut to whole steps of `global_batch`."""
    if state.get("drop_last", True):
        return size // global_batch * global_batch
    return math.ceil(size / global_batch) * global_batch


def _first_break(state: dict, global_batch: int, check_epochs: bool) -> tuple | None:
    """The first rule a global batch breaks, stream by stream: ("position", name, place, seen)
    or ("epoch", name, place, seen, size, saved length, new length); None when it keeps them all."""
    for name, place, seen, size, saved_length in _streams(state, check_epochs):
        if seen % global_batch:
            return "position", name, place, seen
        if size is not None and _epoch_length(state, size, global_batch) != saved_length:
            return ("epoch", name, place, seen, size, saved_length,
                    _epoch_length(state, size, global_batch))
    return None


def _offers(state: dict, global_batch: int, saved_global: int, check_epochs: bool) -> list[str]:
    """The global batches to suggest instead of `global_batch`: the saved run's, and those just
    below and just above `global_batch`, each keeping every rule on every stream."""
    # A batch that keeps the rules divides every position and every saved epoch length.
    common = 0
    for _, _, seen, _, saved_length in _streams(state, check_epochs):
        common = math.gcd(common, seen, saved_length or 0)
    fits = [d for d in _divisors(common)
            if d != saved_global and _first_break(state, d, check_epochs) is None]
    below = [d for d in fits if d < global_batch]
    above = [d for d in fits if d > global_batch]
    saved = (saved_global and _first_break(state, saved_global, check_epochs) is None)
    return (([f"the saved run's {saved_global}"] if saved else [])
            + ([str(below[-1])] if below else []) + ([str(above[0])] if above else []))


def position_problem(state: dict, *, dp_world: int, batch_size: int, grad_accum: int,
                     token_budget: int | None, checkpoint: str,
                     saved_grad_accum: int | None = None, check_epochs: bool = True) -> str | None:
    """Why the data cursor `state` (data rank 0's, as saved) cannot be continued exactly by a run
    of `dp_world` data-parallel ranks, `batch_size` per rank and `grad_accum` micro-batches a
    step; None when it can.

    The saved position is global: p samples into its epoch on each of the saved dp ranks are
    p x dp samples of the epoch's one order. This run continues there only if that is a whole
    number of its steps (global batch = batch_size x grad_accum x dp_world), and if the epoch,
    cut to whole steps, keeps its length (`check_epochs`, from the sizes the cursor records).
    Packs are cut per rank, so a packed cursor continues only on the same number of ranks.
    The text is one paragraph without the advice to restart the data (callers add theirs).
    """
    saved_dp, saved_batch = state.get("dp_world"), state.get("batch_size")
    cursor = state.get("cursor")
    if saved_dp is None or cursor is None:
        return None  # a cursor from before streams: trainer.data.loader upgrades it
    saved_budget = state.get("token_budget")
    if saved_budget or token_budget:
        if saved_budget != token_budget:
            return (f"{checkpoint} was saved with packing_token_budget {saved_budget}, this run "
                    f"has {token_budget}: the packs, and so the saved data position, would be "
                    f"other samples. Resume with packing_token_budget {saved_budget}")
        if saved_dp != dp_world:
            return (f"{checkpoint} was saved on {saved_dp} data-parallel rank(s) with packing "
                    f"(packing_token_budget {token_budget}); each rank cuts its own share of the "
                    f"order into packs, so that position has no equivalent on {dp_world} "
                    f"rank(s). Resume with {saved_dp} data-parallel ranks (world size / cp_size)")
        return None
    global_batch = batch_size * grad_accum * dp_world
    saved_global = (saved_batch or 0) * (saved_grad_accum or 1) * saved_dp
    broken = _first_break(state, global_batch, check_epochs)
    if broken is None:
        return None
    split = (f"train_batch_size {batch_size} x gradient_accumulation_steps {grad_accum} x "
             f"dp {dp_world}")
    offer = _offers(state, global_batch, saved_global, check_epochs)
    example = f", e.g. {' or '.join(offer)}" if offer else ""
    kind, name, place, seen = broken[:4]
    stream = "" if name == "all" else f" of the {name} stream"
    sizes = {n: (size, length) for n, _, _, size, length in _streams(state, check_epochs)}
    size, saved_length = sizes[name]
    if kind == "position":
        keeps = (f" and cuts each epoch{stream} of {size} samples to {saved_length}"
                 if size is not None else "")
        return (f"{checkpoint} was saved at sample {seen} of epoch {place['epoch']}{stream}; "
                f"with global batch {global_batch} ({split}) the next step would start at "
                f"{seen}/{global_batch} = {seen / global_batch:g} steps, so steps would no "
                f"longer end where the epoch does (one would train on fewer samples). "
                f"Resume with a global batch that divides {seen}{keeps}{example}")
    length = broken[6]
    divides = f" and divides {seen} (the saved position)" if seen else ""
    return (f"{checkpoint} cut each epoch{stream} of {size} samples to {saved_length} "
            f"(whole steps of its global batch{f' {saved_global}' if saved_global else ''}); "
            f"with global batch {global_batch} ({split}) an epoch would hold {length}, so "
            f"the saved epoch's order would not be continued. Resume with a global batch "
            f"that cuts {size} samples to {saved_length}{divides}{example}")
