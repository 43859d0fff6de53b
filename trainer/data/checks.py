"""The data of a run, checked before the job starts (torch-free; docs/data.md, "Checked before
a job starts").

`scan_data` reads every shard's parquet footer and, per shard, the small columns (latent and
caption shapes, media type) that the training index reads too, plus the tensor bytes of a
bounded sample of row groups (`byte_budget`), in a few threads. `data_problems` turns the scan
and the run's arguments into one short paragraph per problem, each naming the file, the key
and the fix, so `train.py --dry-run`, `relay resolve` and `relay submit` refuse broken data in
one pass instead of a traceback at the job's start. `batching` says how the run's micro-batches
are made from the data: stacked batches of one latent shape, or packs whose token budget is
derived from the data when a stream holds several shapes and `packing_token_budget` is null.

A scan is cached per process and data_path, so preflight, the plan and the data builder of one
process read the footers once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainer.data.formats import (
    missing_columns,
    shards_of_directory,
    stores_text_embeddings,
    tensor_nbytes,
)

# Tensor bytes read to compare rows' shapes with their bytes: all of a small dataset, a spread
# of row groups (the first of every shard first) of a large one.
BYTE_BUDGET = 64 * 2**20
THREADS = 4  # for a shared filesystem's latency; pyarrow's own pool is off per file
# Problems of one kind listed one by one before the rest are counted in one line.
LISTED = 5
_TRIPLES = ("vae_latent", "text_embedding")


@dataclass
class ShardFacts:
    """What one shard holds: per usable row its latent shape [C, T, H, W], caption tokens and
    width (0 when the data stores no embeddings), image flag; or why it cannot be read."""

    path: Path
    entry: str
    error: str | None = None
    missing: list[str] = field(default_factory=list)
    has_text: bool = True
    shape: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    text_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    text_width: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    is_image: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    bad_rows: int = 0
    byte_errors: list[str] = field(default_factory=list)
    group_bytes: list[int] = field(default_factory=list)  # stored tensor bytes per row group


@dataclass
class DataScan:
    entries: list[tuple[str, int]]
    shards: list[ShardFacts]
    empty_entries: list[tuple[str, int, str]]   # (directory, repeat, why)
    rows_verified: int = 0
    rows: int = 0
    seconds: float = 0.0

    @property
    def readable(self) -> list[ShardFacts]:
        return [s for s in self.shards if s.error is None and not s.missing]

    def column(self, name: str) -> np.ndarray:
        parts = [getattr(s, name) for s in self.readable]
        return np.concatenate(parts) if parts else getattr(ShardFacts(Path(), ""), name)


def _entries(data_path) -> list[tuple[str, int]]:
    if isinstance(data_path, dict):
        return [(str(k), v) for k, v in data_path.items()]
    return [(str(data_path), 1)]


def _shape_arrays(column: pa.ChunkedArray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(values [N, width] of lists that hold `width` ints (3-long latents become [C, 1, H, W]),
    usable [N]) of a list column, without a Python loop per row."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(array)
    out = np.zeros((n, width), np.int64)
    if n == 0:
        return out, np.zeros(0, bool)
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lengths = np.diff(offsets)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    start = offsets[:-1]
    full = valid & (lengths == width)
    if full.any():
        out[full] = values[start[full, None] + np.arange(width)]
    usable = full
    if width == 4:  # an image [C, H, W] is one frame
        image = valid & (lengths == 3)
        if image.any():
            picked = values[start[image, None] + np.arange(3)]
            out[image] = np.column_stack([picked[:, 0], np.ones(len(picked), np.int64),
                                          picked[:, 1], picked[:, 2]])
        usable = full | image
    return out, usable


def _read_shard(path: Path, entry: str, caption_tokens: int) -> ShardFacts:
    facts = ShardFacts(path=path, entry=entry)
    try:
        file = pq.ParquetFile(path, pre_buffer=False)
        names = file.schema_arrow.names
        facts.missing = missing_columns(names)
        if facts.missing:
            return facts
        facts.has_text = stores_text_embeddings(names)
        columns = ["vae_latent_shape"] + (["text_embedding_shape"] if facts.has_text else [])
        columns += ["media_type"] if "media_type" in names else []
        table = file.read(columns=columns, use_threads=False)  # its pool costs more here
        meta = file.metadata
        for group in range(meta.num_row_groups):
            chunks = meta.row_group(group)
            facts.group_bytes.append(sum(
                chunks.column(i).total_compressed_size for i in range(chunks.num_columns)
                if chunks.column(i).path_in_schema in {f"{t}_bytes" for t in _TRIPLES}))
    except (OSError, pa.ArrowException, ValueError) as error:
        facts.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        return facts
    shape, usable = _shape_arrays(table.column("vae_latent_shape"), 4)
    n = table.num_rows
    if facts.has_text:
        text, text_ok = _shape_arrays(table.column("text_embedding_shape"), 2)
        usable &= text_ok
    else:  # captions without embeddings: planned at the text encoder's length
        text = np.tile(np.array([[caption_tokens, 0]], np.int64), (n, 1))
    if "media_type" in columns:
        media = table.column("media_type").to_numpy(zero_copy_only=False)
        known = np.array([m is not None for m in media], bool)
        is_image = np.where(known, media == "image", shape[:, 1] == 1)
    else:
        is_image = shape[:, 1] == 1
    facts.bad_rows = int(n - usable.sum())
    facts.shape, facts.is_image = shape[usable], is_image[usable].astype(bool)
    facts.text_len, facts.text_width = text[usable, 0], text[usable, 1]
    return facts


def _verify_bytes(facts: ShardFacts, groups: list[int]) -> int:
    """Compare the byte length of every tensor in `groups` with its shape and dtype; returns
    the rows checked. Mismatches go to facts.byte_errors."""
    file = pq.ParquetFile(facts.path, pre_buffer=False)
    triples = [t for t in _TRIPLES if f"{t}_bytes" in file.schema_arrow.names]
    columns = ["id"] + [f"{t}_{p}" for t in triples for p in ("bytes", "shape", "dtype")]
    first_row = np.concatenate([[0], np.cumsum(
        [file.metadata.row_group(g).num_rows for g in range(file.metadata.num_row_groups)])])
    checked = 0
    for group in groups:
        try:
            table = file.read_row_group(group, columns=columns, use_threads=False)
        except (OSError, pa.ArrowException) as error:
            facts.byte_errors.append(f"row group {group} is unreadable ({type(error).__name__}: "
                                     f"{str(error).strip().splitlines()[0]})")
            continue
        ids = table.column("id").to_pylist()
        for t in triples:
            sizes = pc.binary_length(table.column(f"{t}_bytes")).to_pylist()
            shapes = table.column(f"{t}_shape").to_pylist()
            dtypes = table.column(f"{t}_dtype").to_pylist()
            for row, (size, shape, dtype) in enumerate(zip(sizes, shapes, dtypes)):
                if shape is None:
                    continue  # a row without a shape is left out of training (a bad row)
                try:
                    expected = tensor_nbytes(shape, dtype or "")
                except ValueError as error:
                    facts.byte_errors.append(f"row {first_row[group] + row} (id {ids[row]}): "
                                             f"{t}_dtype: {error}")
                    continue
                if size != expected:
                    facts.byte_errors.append(
                        f"row {first_row[group] + row} (id {ids[row]}): {t}_shape {list(shape)} "
                        f"{dtype} needs {expected} bytes but {t}_bytes holds "
                        f"{'none' if size is None else size}")
        checked += table.num_rows
    return checked


def _byte_plan(shards: list[ShardFacts], budget: int) -> dict[int, list[int]]:
    """Which row groups have their tensor bytes verified: the first row group of every shard,
    in a spread order (every stride-th shard first), then the second ones, ... while the
    stored bytes fit `budget`; the whole dataset when it fits."""
    plan: dict[int, list[int]] = {}
    usable = [i for i, s in enumerate(shards) if s.error is None and not s.missing]
    if not usable:
        return plan
    stride = max(1, int(np.sqrt(len(usable))))
    spread = [usable[j] for start in range(stride) for j in range(start, len(usable), stride)]
    spent, depth = 0, 0
    deepest = max(len(shards[i].group_bytes) for i in usable)
    while depth < deepest:
        for i in spread:
            sizes = shards[i].group_bytes
            if depth >= len(sizes):
                continue
            if spent + sizes[depth] > budget and plan:
                return plan
            spent += sizes[depth]
            plan.setdefault(i, []).append(depth)
        depth += 1
    return plan


def discover(data_path) -> tuple[list[tuple[str, int]], list[tuple[Path, str]], list]:
    """(entries, [(shard, its entry)], [(entry, repeat, why)] for entries without shards)."""
    entries = _entries(data_path)
    found: list[tuple[Path, str]] = []
    empty = []
    for directory, repeat in entries:
        root = Path(directory)
        if root.is_file() and root.suffix == ".parquet":
            found.append((root, directory))
        elif not root.is_dir():
            empty.append((directory, repeat, "does not exist (or is not a directory)"))
        else:
            shards = shards_of_directory(root)
            if not shards:
                empty.append((directory, repeat, "holds no *.parquet files"))
            found.extend((path, directory) for path in shards)
    return entries, found, empty


def scan_data(data_path, *, caption_tokens: int = 0, byte_budget: int = BYTE_BUDGET,
              threads: int = THREADS, discovered=None) -> DataScan:
    """Read what the checks need from every shard of `data_path` (a directory or a mapping
    {directory: repeat}); never raises for bad data, it is recorded in the scan."""
    started = time.perf_counter()
    entries, found, empty = discovered or discover(data_path)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        facts = list(pool.map(lambda item: _read_shard(*item, caption_tokens), found))
        plan = _byte_plan(facts, byte_budget)
        verified = sum(pool.map(lambda item: _verify_bytes(facts[item[0]], item[1]), plan.items()))
    scan = DataScan(entries=entries, shards=facts, empty_entries=empty, rows_verified=verified)
    scan.rows = sum(len(s.shape) + s.bad_rows for s in scan.readable)
    scan.seconds = time.perf_counter() - started
    return scan


_CACHE: dict[str, DataScan] = {}


def cached_scan(data_path, caption_tokens: int) -> DataScan:
    """scan_data once per process for one data_path, caption length and set of shard files
    (names, sizes, modification times: a shard written again is read again)."""
    discovered = discover(data_path)
    stats = []
    for path, _ in discovered[1]:
        try:
            stat = path.stat()
            stats.append((str(path), stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((str(path), -1, -1))
    key = json.dumps([data_path, caption_tokens, stats], sort_keys=True, default=str)
    if key not in _CACHE:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = scan_data(data_path, caption_tokens=caption_tokens, discovered=discovered)
    return _CACHE[key]


@dataclass(frozen=True)
class ModelWidths:
    """What the data must fit of the run's model (its family's geometry, given by the caller:
    trainer.models.registry.data_widths): latent channels, caption width, patch size, and the
    file its architecture is read from (None: the YAML's overrides give it)."""

    latent_channels: int
    text_dim: int
    patch_size: tuple[int, int, int]
    origin: str | None = None


def sample_tokens(shape: np.ndarray, text_len: np.ndarray, patch_size) -> np.ndarray:
    """Joint tokens per sample, as trainer.data.order.sample_tokens counts them."""
    pt, ph, pw = patch_size
    video = np.maximum(shape[:, 1] // pt, 1) * (shape[:, 2] // ph) * (shape[:, 3] // pw)
    return video + text_len


def _listed(items: list[str]) -> list[str]:
    if len(items) <= LISTED:
        return items
    return items[:LISTED] + [f"... and {len(items) - LISTED} more of the same kind."]


def _shards_by(scan: DataScan, values: dict[Path, set]) -> dict[int, list[Path]]:
    found: dict[int, list[Path]] = {}
    for path, seen in values.items():
        for value in seen:
            found.setdefault(int(value), []).append(path)
    return found


def _where(paths: list[Path], total: int) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} other shards (of {total})"


def data_problems(args, scan: DataScan, model: ModelWidths | None) -> list[str]:
    """One paragraph per problem the data of `args` would meet at the job's start or later;
    `model` None when the model config itself is wrong (its own check names what)."""
    problems = []
    for directory, repeat, why in scan.empty_entries:
        name = (f"data_path entry `{directory}` (repeat {repeat})" if isinstance(args.data_path, dict)
                else f"data_path {directory}")
        problems.append(f"{name} {why}. Point it at the directory of its parquet shards, or "
                        f"remove it from data_path.")
    unreadable = [s for s in scan.shards if s.error is not None]
    problems += _listed([
        f"{s.path} (data_path entry {s.entry}) is not a readable parquet file ({s.error}): it "
        f"is truncated or was not written completely. Write it again (relay data encode, or "
        f"the preprocessing that made it), or move it out of {s.entry}." for s in unreadable])
    problems += _listed([
        f"{s.path} lacks the column(s) {', '.join(s.missing)} of the data contract (docs/data.md, "
        f"\"Layouts\"): it is not a relay or FastVideo shard. Re-encode it, or move it out of "
        f"data_path entry {s.entry}." for s in scan.shards if s.error is None and s.missing])
    readable = scan.readable
    stored = {s.has_text for s in readable}
    if len(stored) > 1:
        with_text = [s.path for s in readable if s.has_text]
        without = [s.path for s in readable if not s.has_text]
        problems.append(
            f"{_where(without, len(readable))} store(s) captions without caption embeddings "
            f"(text_embedding_*) but {_where(with_text, len(readable))} store(s) them: a run "
            f"reads one kind. Encode every dataset of data_path the same way (relay data "
            f"encode), or drop the columns from all.")
    for s in readable:
        for error in _listed(s.byte_errors):
            problems.append(f"{s.path}, {error}: the row's shape or bytes are wrong (the shape "
                            f"decides how the bytes are read). Encode the sample again, or drop "
                            f"the row from the shard.")
    if not readable or model is None:
        return problems
    in_channels, text_dim, patch = model.latent_channels, model.text_dim, model.patch_size
    origin = model.origin
    channels = _shards_by(scan, {s.path: set(np.unique(s.shape[:, 0]).tolist()) for s in readable})
    for count, paths in sorted(channels.items()):
        if count != in_channels:
            problems.append(
                f"the latents in {_where(paths, len(readable))} have {count} channels "
                f"(vae_latent_shape [C, T, H, W]) but the model's in_channels is {in_channels}. "
                + (f"The architecture comes from {origin} (pretrained_transformer_path): its "
                   f"weights take {in_channels}-channel latents, so point data_path at latents "
                   f"of that model's VAE, or start from a model made for {count}-channel latents."
                   if origin else
                   f"Set in_channels: {count} in transformer_config_overrides (the YAML's model "
                   f"section) for data of this VAE, or point data_path at latents of the model's "
                   f"{in_channels}-channel VAE."))
    widths = _shards_by(scan, {s.path: set(np.unique(s.text_width).tolist())
                               for s in readable if s.has_text})
    for width, paths in sorted(widths.items()):
        if width != text_dim:
            problems.append(
                f"the caption embeddings in {_where(paths, len(readable))} are {width} wide "
                f"(text_embedding_shape [L, D]) but the model's text_dim is {text_dim}. "
                + (f"The architecture comes from {origin} (pretrained_transformer_path): encode "
                   f"the captions with that model's {text_dim}-wide text encoder (relay data "
                   f"encode)." if origin else
                   f"Set text_dim: {width} in transformer_config_overrides (the YAML's model "
                   f"section), or encode the captions with the model's text encoder (relay data "
                   f"encode)."))
    shape, text_len = scan.column("shape"), scan.column("text_len")
    if len(shape) == 0:
        return problems + [f"data_path ({len(readable)} shards) holds no usable rows "
                           f"(every row's vae_latent_shape or text_embedding_shape is null or "
                           f"malformed; relay data inspect lists them)."]
    problems += _caption_cut_problems(args, scan, model)
    budget = args.get("packing_token_budget")
    tokens = sample_tokens(shape, text_len, patch)
    if budget is not None and tokens.max() > budget:
        problems.append(
            f"packing_token_budget {budget} is below the {int(tokens.max())} joint tokens of "
            f"the data's largest sample ({int((tokens > budget).sum())} samples exceed it; "
            f"video tokens at patch size {list(patch)} plus caption tokens). Set "
            f"packing_token_budget to at least {int(tokens.max())}, or null to derive it from "
            f"the data.")
    prob = args.get("image_sample_prob")
    if prob is not None:
        images = scan.column("is_image")
        for name, needed, present in (("video", prob < 1, (~images).any()),
                                      ("image", prob > 0, images.any())):
            if needed and not present:
                problems.append(
                    f"image_sample_prob is {prob} but the data holds no {name} samples. Set "
                    f"image_sample_prob: {0.0 if name == 'image' else 1.0} (or null), or add "
                    f"{name} data to data_path.")
    return problems


def captions_cut(args, scan: DataScan, model: ModelWidths | None) -> tuple[int, int, int]:
    """(captions the run would cut to text_max_tokens, captions counted, the longest's tokens).

    Stored caption embeddings are cut only in stacked batches (a pack keeps every caption
    whole); captions stored as text are encoded to text_max_tokens, so they are cut in any
    batch, and are counted through the run's tokenizer when one can be loaded here."""
    stored = np.concatenate([s.text_len for s in scan.readable if s.has_text] or
                            [np.zeros(0, np.int64)])
    raw = _raw_caption_lengths(args, scan)
    lengths = np.concatenate([stored, raw])
    longest = int(lengths.max()) if len(lengths) else 0
    limit = args.text_max_tokens
    cut = int((raw > limit).sum())
    if batching(args, model).budget is None:
        cut += int((stored > limit).sum())
    return cut, len(lengths), longest


def _raw_caption_lengths(args, scan: DataScan) -> np.ndarray:
    """The token counts of captions stored without embeddings, through the tokenizer of the
    run's text_encoder directory; none when the data stores embeddings, the encoder is the
    stand-in (refused for such data by preflight) or transformers is not installed here."""
    shards = [s for s in scan.readable if not s.has_text]
    if not shards or args.get("text_encoder", "standin") == "standin":
        return np.zeros(0, np.int64)
    try:
        from transformers import AutoTokenizer

        from trainer.encoders.directories import tokenizer_dir

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(args.text_encoder)),
                                                  local_files_only=True)
        counts = []
        for shard in shards:
            captions = pq.read_table(shard.path, columns=["caption"]).column("caption").to_pylist()
            ids = tokenizer([c or "" for c in captions], truncation=False)["input_ids"]
            counts.append(np.array([len(i) for i in ids], np.int64))
    except Exception:  # noqa: BLE001 - no tokenizer here: the job's encoder still cuts at the limit
        return np.zeros(0, np.int64)
    return np.concatenate(counts)


def _caption_cut_problems(args, scan: DataScan, model: ModelWidths | None) -> list[str]:
    if args.get("allow_caption_truncation"):
        return []
    cut, rows, longest = captions_cut(args, scan, model)
    if not cut:
        return []
    limit = args.text_max_tokens
    stored = any(s.has_text for s in scan.readable)
    packs = (", or packing_token_budget (packs keep every stored caption at its own length)"
             if stored else "")
    return [f"{cut} of the {rows} captions of the data are longer than text_max_tokens {limit} "
            f"(the longest has {longest} tokens): the run would train on their first {limit} "
            f"tokens only. Set text_max_tokens: {longest} to keep them whole{packs}, or "
            f"allow_caption_truncation: true to train on the cut captions on purpose."]


@dataclass(frozen=True)
class Batching:
    """How micro-batches are made: `budget` None for stacked batches, else packs of at most
    that many joint tokens; `derived` when the budget comes from the data, not the key."""

    budget: int | None
    derived: bool
    line: str


def _streams(scan: DataScan, image_prob) -> dict[str, np.ndarray]:
    everything = np.ones(len(scan.column("shape")), bool)
    if image_prob is None:
        return {"all": everything}
    images = scan.column("is_image")
    streams = {"video": ~images, "image": images}
    wanted = {"video": image_prob < 1, "image": image_prob > 0}
    return {name: rows for name, rows in streams.items() if wanted[name] and rows.any()}


def batching(args, model: ModelWidths | None) -> Batching:
    """Stacked batches, packs of packing_token_budget, or packs of a budget derived from the
    data: when a stream (trainer.data.order.BatchPlan) holds samples of several latent shapes,
    which cannot stack, and the key is null, the budget is train_batch_size x the joint tokens
    of the data's largest sample (at the `model`'s patch size), the most a stacked batch of the
    largest shape would hold. `model` None (a model config that is wrong, which preflight
    reports): stacked."""
    budget = args.get("packing_token_budget")
    tbs = args.train_batch_size
    if budget is not None:
        return Batching(budget, False, f"batches: packs of <= {budget} joint tokens "
                                       f"(packing_token_budget)")
    stacked = Batching(None, False, f"batches: stacked, {tbs} samples of one latent shape")
    if args.get("synthetic_data") or args.get("data_path") is None or model is None:
        return stacked
    try:
        scan = cached_scan(args.data_path, args.text_max_tokens)
        shape = scan.column("shape")
        if len(shape) == 0:
            return stacked
    except Exception:  # noqa: BLE001 - unreadable data is reported by preflight
        return stacked
    patch = model.patch_size
    mixed = {name: len(np.unique(shape[rows], axis=0))
             for name, rows in _streams(scan, args.get("image_sample_prob")).items()}
    if all(count <= 1 for count in mixed.values()):
        return stacked
    tokens = sample_tokens(shape, scan.column("text_len"), patch)
    largest = int(tokens.max())
    derived = tbs * largest
    shapes = Counter(tuple(int(v) for v in s) for s in shape)
    listed = ", ".join(f"{list(s)} x{n}" for s, n in shapes.most_common(3))
    more = f" and {len(shapes) - 3} more" if len(shapes) > 3 else ""
    where = ("the data holds" if "all" in mixed else
             f"the {'/'.join(n for n, c in mixed.items() if c > 1)} stream holds")
    return Batching(derived, True, (
        f"batches: packs of <= {derived} joint tokens, derived from the data ({where} "
        f"{max(mixed.values())} latent shapes: {listed}{more}): train_batch_size {tbs} x the "
        f"largest sample's {largest} tokens; set packing_token_budget to choose another"))


def check_data(args, model: ModelWidths | None) -> DataScan:
    """Scan the data of `args` and return the scan, or raise ConfigError listing every problem
    (preflight calls this for real data under check_paths, with the model's widths)."""
    from trainer.config.schema import ConfigError

    scan = cached_scan(args.data_path, args.text_max_tokens)
    problems = data_problems(args, scan, model)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"the data cannot train ({len(problems)} problem"
                          f"{'s' if len(problems) > 1 else ''}, found from {len(scan.shards)} "
                          f"shards' footers and shape columns):\n{listed}")
    return scan
