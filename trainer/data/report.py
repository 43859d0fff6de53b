"""`relay data inspect` and `relay data plan`: what a dataset holds and what a rank will read.

Torch-free and GPU-free: both read the shards' small columns (inspect --verify also the tensor
byte lengths) and run the same BatchPlan as training, so the plan printed is the plan trained.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainer.data.formats import layout_of, resolve_datasets, tensor_nbytes
from trainer.data.index import BadRow, SampleIndex
from trainer.data.order import BatchPlan

_TRIPLES = ("vae_latent", "text_embedding")


def _stats(values: np.ndarray) -> dict:
    return {"min": int(values.min()), "median": float(np.median(values)), "max": int(values.max())}


def _dtypes_and_byte_errors(path, verify: bool) -> tuple[Counter, list[BadRow]]:
    """dtype strings of the tensor columns, and (with verify) rows whose bytes do not fit."""
    file = pq.ParquetFile(path)
    # Captions without embeddings store no text_embedding triple.
    triples = [t for t in _TRIPLES if f"{t}_dtype" in file.schema_arrow.names]
    dtypes: Counter = Counter()
    bad, offset = [], 0
    for group in range(file.num_row_groups):
        columns = [f"{t}_{part}" for t in triples for part in ("dtype", "shape")]
        if verify:
            columns += [f"{t}_bytes" for t in triples]
        table = file.read_row_group(group, columns=columns)
        for t in triples:
            dtypes.update(f"{t}:{d}" for d in table.column(f"{t}_dtype").to_pylist())
            if not verify:
                continue
            lengths = pc.binary_length(table.column(f"{t}_bytes")).to_pylist()
            for row, (size, shape, dtype) in enumerate(zip(
                    lengths, table.column(f"{t}_shape").to_pylist(),
                    table.column(f"{t}_dtype").to_pylist())):
                try:
                    expected = tensor_nbytes(shape or (), dtype or "")
                except ValueError as error:
                    bad.append(BadRow(path, offset + row, f"{t}: {error}"))
                    continue
                if size != expected:
                    bad.append(BadRow(path, offset + row,
                                      f"{t}: {size} bytes, {dtype} {shape} needs {expected}"))
        offset += table.num_rows
    return dtypes, bad


def inspect_data(data_path, *, patch_size: tuple[int, int, int], verify: bool = False) -> dict:
    """A summary of a data_path: layouts, shards, rows, shapes, token lengths, dtypes, bad rows.

    Raises FileNotFoundError / ValueError as SampleIndex does.
    """
    index = SampleIndex(data_path)
    shards = resolve_datasets(data_path)
    dtypes: Counter = Counter()
    bad = list(index.bad_rows)
    for path, _, _ in shards:
        found, errors = _dtypes_and_byte_errors(path, verify)
        dtypes.update(found)
        bad.extend(errors)
    roots = {path.parent for path, _, _ in shards}
    shapes = Counter(tuple(int(v) for v in s) for s in index.shape)
    video_tokens = index.video_tokens(tuple(patch_size))
    return {
        "layouts": sorted({layout_of(root.parent if root.name.startswith("worker_") else root)
                           for root in roots}),
        "shards": len(shards), "row_groups": int(len(index.blocks) - 1),
        "samples": len(index), "images": int(index.is_image.sum()),
        "datasets": np.bincount(index.dataset).tolist(),
        "shapes": [{"shape": list(s), "count": n} for s, n in shapes.most_common()],
        "text_embeddings": "stored" if index.has_text_embeddings else "none (captions only)",
        "text_tokens": _stats(index.text_len), "video_tokens": _stats(video_tokens),
        "patch_size": list(patch_size), "dtypes": dict(sorted(dtypes.items())),
        "verified_bytes": verify,
        "bad_rows": [{"shard": str(b.shard), "row": b.row, "reason": b.reason} for b in bad],
    }


def plan_rank(data_path, *, world_size: int, cp_size: int, seed: int, rank: int,
              batch_size: int = 1, token_budget: int | None = None, patch_size=(1, 2, 2),
              image_sample_prob: float | None = None, batches: int = 8,
              drop_last: bool = True) -> dict:
    """The first `batches` batches global rank `rank` reads, and the packing efficiency of one
    epoch of its first stream (tokens used / tokens budgeted).

    Raises ValueError for a rank outside the world, a world not divisible by cp_size, or data
    that cannot make the batches (BatchPlan's errors).
    """
    if world_size < 1 or cp_size < 1 or world_size % cp_size:
        raise ValueError(f"world size {world_size} is not a positive multiple of cp_size {cp_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    plan = BatchPlan(SampleIndex(data_path), dp_rank=rank // cp_size, dp_world=world_size // cp_size,
                     seed=seed, batch_size=batch_size, drop_last=drop_last,
                     token_budget=token_budget, patch_size=patch_size,
                     image_sample_prob=image_sample_prob)
    cursor, first = plan.initial_cursor(), []
    for _ in range(batches):
        stream = plan.stream_of_batch(cursor["batch"])
        indices, cursor = plan.next(cursor)
        first.append({"stream": stream, "samples": indices.tolist(),
                      "tokens": int(plan.tokens[indices].sum())})
    return {"dp_rank": rank // cp_size, "dp_world": world_size // cp_size,
            "samples_per_epoch": dict(plan.per_rank), "batches": first,
            "packing_efficiency": _packing_efficiency(plan) if token_budget else None}


def _packing_efficiency(plan: BatchPlan) -> float:
    stream = next(iter(plan.streams))
    cursor = plan.initial_cursor()
    used = packs = 0
    while cursor["streams"][stream]["position"] < plan.per_rank[stream]:
        indices, cursor = plan.next(cursor)
        used, packs = used + int(plan.tokens[indices].sum()), packs + 1
    return used / (packs * plan.token_budget)


def format_inspect(report: dict) -> str:
    """The inspect report as a few lines of text."""
    lines = [(f"layout {', '.join(report['layouts'])}: {report['samples']} samples "
              f"({report['images']} images) in {report['shards']} shards, "
              f"{report['row_groups']} row groups; per dataset {report['datasets']}"),
             "shapes [C, T, H, W]:"]
    lines += [f"  {s['shape']}: {s['count']}" for s in report["shapes"][:12]]
    if len(report["shapes"]) > 12:
        lines.append(f"  ... {len(report['shapes']) - 12} more")
    t, v = report["text_tokens"], report["video_tokens"]
    captions = (f"caption tokens min {t['min']} median {t['median']:g} max {t['max']}"
                if report["text_embeddings"] == "stored"
                else "caption embeddings: none stored (the trainer encodes the captions)")
    lines.append(f"{captions}; video tokens at patch {report['patch_size']} min {v['min']} "
                 f"median {v['median']:g} max {v['max']}")
    lines.append("dtypes: " + ", ".join(f"{k} x{n}" for k, n in report["dtypes"].items()))
    bad = report["bad_rows"]
    checked = "shapes and byte counts" if report["verified_bytes"] else "shapes (--verify: bytes too)"
    lines.append(f"bad rows ({checked}): {len(bad)}")
    lines += [f"  {b['shard']} row {b['row']}: {b['reason']}" for b in bad[:20]]
    return "\n".join(lines)


def format_plan(report: dict) -> str:
    """The plan report as a few lines of text."""
    lines = [f"dp rank {report['dp_rank']} of {report['dp_world']}; samples per epoch "
             + ", ".join(f"{k} {n}" for k, n in report["samples_per_epoch"].items())]
    for number, batch in enumerate(report["batches"]):
        lines.append(f"  batch {number} [{batch['stream']}] {batch['tokens']} tokens: {batch['samples']}")
    if report["packing_efficiency"] is not None:
        lines.append(f"packing efficiency over one epoch: {report['packing_efficiency']:.1%}")
    return "\n".join(lines)
