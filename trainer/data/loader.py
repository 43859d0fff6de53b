"""The batch iterator of one data-parallel rank: a BatchPlan fed through torch's DataLoader.

The plan decides every batch from a cursor; worker processes only read and decode them, so the
batches are the same with 0, 2 or 4 workers, and the cursor the trainer saves is the one after
the last batch it *consumed* (the workers may have read further ahead: that work is redone after
a resume, never skipped). Host memory is bounded by num_workers x prefetch_factor batches plus
each worker's row-group cache, whatever the size of the data.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer.data.order import BatchPlan
from trainer.data.resume import position_problem

log = logging.getLogger(__name__)


class _PlannedBatches:
    """The batch sampler handed to DataLoader: the plan's batches from a cursor, endlessly."""

    def __init__(self, plan: BatchPlan, cursor: dict):
        self.plan, self.cursor = plan, cursor

    def __iter__(self):
        cursor = self.cursor
        while True:
            indices, cursor = self.plan.next(cursor)
            yield indices.tolist()


def _common(items: list[dict]) -> dict:
    indices = [item["index"] for item in items]
    return {"captions": [item["caption"] for item in items], "ids": [item["id"] for item in items],
            "indices": indices, "sample_index": torch.tensor(indices, dtype=torch.long)}


def collate_batch(items: list[dict]) -> dict:
    """One batch of same-shape samples, stacked.

    Keys: "latents" [B, C, T, H, W], "text" [B, L, D], "text_mask" bool [B, L], "first_frame"
    [B, C, 1, H, W] or None, "captions", "ids", "indices" (list) and "sample_index" long [B]
    (global sample indices).
    """
    frames = [item["first_frame"] for item in items]
    captions_only = items[0]["text"] is None  # the loader's caption encoder fills them
    return {**_common(items),
            "latents": torch.stack([item["latent"] for item in items]),
            "text": None if captions_only else torch.stack([item["text"] for item in items]),
            "text_mask": None if captions_only else torch.stack([item["text_mask"] for item in items]),
            "first_frame": None if any(f is None for f in frames) else torch.stack(frames)}


def collate_pack(items: list[dict]) -> dict:
    """One pack: the keys of collate_batch, with "packed": True and the per-sample tensors as
    lists (its samples differ in shape); trainer.data.packing lays them out for the model."""
    return {**_common(items), "packed": True,
            "latents": [item["latent"] for item in items],
            "text": [item["text"] for item in items],
            "text_mask": [item["text_mask"] for item in items],
            "first_frame": [item["first_frame"] for item in items]}


def encode_captions(batch: dict, encoder) -> dict:
    """The batch with its captions encoded by `encoder` (encode(list) -> (hidden [B, L, D],
    mask [B, L])): a stacked batch gets the encoder's padded length and mask, as stored
    embeddings are padded to text_max_tokens; a pack keeps each caption's real tokens only, as
    packs keep stored captions at their own length."""
    hidden, mask = encoder.encode(batch["captions"])
    if batch.get("packed"):
        texts = [h[m] for h, m in zip(hidden, mask)]
        return {**batch, "text": texts, "text_mask": [torch.ones(len(t), dtype=torch.bool) for t in texts]}
    return {**batch, "text": hidden, "text_mask": mask}


class DistributedBatchIterator:
    """Endless batches for one data-parallel rank, resumable exactly.

    `dataset` is a ParquetLatentDataset; the keyword arguments are BatchPlan's (see there for
    the order, mixing and packing), plus num_workers / prefetch_factor (DataLoader's; 0 workers
    reads in this process), pin_memory (page-locked batches for a GPU), and reset_streams:
    stream names whose cursors a resume restarts (the seed's resume_video_csv: false is
    ("video",)), and caption_encoder: the text encoder (trainer.encoders.text) that encodes the
    captions of data that stores none of their embeddings, in this process (see
    encode_captions). next_batch() gives collate_batch's dict (collate_pack's with a token
    budget).

    Raises ValueError at construction if an epoch would hold no batch, or if unpacked batches
    would have to stack samples of different shapes (set a token budget to pack them).
    """

    def __init__(self, dataset, *, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 drop_last: bool = True, token_budget: int | None = None, patch_size=(1, 1, 1),
                 image_sample_prob: float | None = None, num_workers: int = 0,
                 prefetch_factor: int = 2, pin_memory: bool = False, reset_streams=(),
                 grad_accum: int = 1, caption_encoder=None):
        self.dataset = dataset
        if not dataset.index.has_text_embeddings and caption_encoder is None:
            raise ValueError("the data stores captions but no caption embeddings "
                             "(text_embedding_*), and no caption encoder was given to encode them")
        self.caption_encoder = caption_encoder if not dataset.index.has_text_embeddings else None
        self.plan = BatchPlan(dataset.index, dp_rank=dp_rank, dp_world=dp_world, seed=seed,
                              batch_size=batch_size, drop_last=drop_last,
                              token_budget=token_budget, patch_size=patch_size,
                              image_sample_prob=image_sample_prob, grad_accum=grad_accum)
        if not token_budget:
            self._check_one_shape_per_stream()
        self.batch_size, self.dp_rank, self.dp_world = int(batch_size), int(dp_rank), int(dp_world)
        self.seed, self.drop_last, self.token_budget = int(seed), bool(drop_last), token_budget
        self.num_workers, self.prefetch_factor = int(num_workers), int(prefetch_factor)
        self.pin_memory, self.reset_streams = bool(pin_memory), tuple(reset_streams)
        self.grad_accum = int(grad_accum)
        self.cursor = self.plan.initial_cursor()
        self._batches = None  # the DataLoader iterator, started at self.cursor on first use

    def _check_one_shape_per_stream(self) -> None:
        for name, members in self.plan.streams.items():
            shapes = self.dataset.index.distinct_shapes(members)
            if len(shapes) > 1:
                raise ValueError(
                    f"the {name} samples have {len(shapes)} latent shapes ({shapes[:4]}...): "
                    "batches of mixed shapes need packing; set packing_token_budget (or "
                    "image_sample_prob, when only images and videos differ)")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """[C, T, H, W] of the data's first sample (what validation samples at)."""
        return self.dataset.latent_shape

    @property
    def batches_per_epoch(self) -> int:
        """Unpacked batches in one epoch of the first stream."""
        return next(iter(self.plan.per_rank.values())) // self.batch_size

    @property
    def epoch(self) -> int:
        return next(iter(self.cursor["streams"].values()))["epoch"]

    def _start(self):
        workers = self.num_workers
        loader = DataLoader(self.dataset, batch_sampler=_PlannedBatches(self.plan, self.cursor),
                            num_workers=workers, collate_fn=collate_pack if self.token_budget else collate_batch,
                            prefetch_factor=self.prefetch_factor if workers else None,
                            pin_memory=self.pin_memory,
                            # Its own generator: DataLoader draws worker seeds when an iterator
                            # starts, and must not move the training RNG (a resume starts one).
                            generator=torch.Generator().manual_seed(self.seed))
        return iter(loader)

    def next_batch(self) -> dict:
        """The next batch of this rank (see collate_batch and collate_pack)."""
        if self._batches is None:
            self._batches = self._start()
        batch = next(self._batches)
        batch["sample_keys"] = self.plan.stream_keys(self.cursor, len(batch["sample_index"]))
        expected, self.cursor = self.plan.next(self.cursor)
        # The plan is deterministic, so the sampler and this cursor cannot drift; if they ever
        # did, the saved cursor would silently skip or repeat samples.
        assert np.array_equal(batch["sample_index"].numpy(), expected), "loader and cursor disagree"
        if self.caption_encoder is not None:
            batch = encode_captions(batch, self.caption_encoder)
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.next_batch()

    def _identity(self) -> dict:
        return {"dp_rank": self.dp_rank, "dp_world": self.dp_world, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "token_budget": self.token_budget,
                "dataset_size": len(self.dataset),
                "stream_sizes": {name: len(m) for name, m in self.plan.streams.items()},
                "epoch_lengths": {name: n * self.dp_world for name, n in self.plan.per_rank.items()}}

    def state_dict(self) -> dict:
        """The cursor as a JSON-serialisable dict: enough to continue with the same batches."""
        return {"seed": self.seed, "cursor": self.cursor, **self._identity()}

    def load_state_dict(self, state: dict, *, data_changed: bool = False) -> None:
        """Continue from a saved cursor: the next batches are those the saved iterator would
        have produced (its seed is adopted), except streams named in reset_streams, which start
        again at epoch 0.

        `data_changed` (or a "data_changed": true key in `state`, which passes through wrappers
        such as the cp group's): the data is not the data the cursor was saved on, and the user
        allowed continuing anyway (allow_data_change): each stream keeps its epoch and sample position,
        now in the new data's order (the next epoch when the new one is shorter), and the log
        says where it continues.

        Raises ValueError if the saved topology, batch size, token budget, drop_last or data
        sizes differ from this iterator's: the saved position would mean other samples.
        """
        state = dict(state)
        data_changed = bool(state.pop("data_changed", False)) or data_changed  # the key: through wrappers
        state = _upgrade_legacy_state(state)
        mine = self._identity()
        state = self._onto_this_split(state, mine)
        if data_changed:
            state = self._onto_changed_data(state, mine)
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"data cursor was saved with {key}={state[key]} but this run has "
                    f"{key}={value}; the saved position cannot be resumed exactly")
        for key in ("dp_world", "dp_rank", "dataset_size", "cursor", "seed"):
            if key not in state:
                raise ValueError(f"data cursor state lacks {key!r}: {sorted(state)}")
        cursor = {"batch": int(state["cursor"]["batch"]),
                  "streams": {k: dict(v) for k, v in state["cursor"]["streams"].items()}}
        for name in self.reset_streams:
            if name in cursor["streams"]:
                log.warning("data stream %r restarts from the top (its cursor is not resumed)", name)
                cursor["streams"][name] = {"epoch": 0, "position": 0}
        self.seed = int(state["seed"])
        self.plan.reseed(self.seed)
        self.cursor = cursor
        self._batches = None


    def _onto_this_split(self, state: dict, mine: dict) -> dict:
        """A cursor saved with another number of ranks (or another batch size), restated for
        this split. The position is global: rank r of dp ranks read order[r::dp], so p samples
        per rank are p x dp samples of the epoch. Exact when the epochs have the same length
        (the same global batch); otherwise load_state_dict refuses, naming epoch_lengths."""
        saved = (state.get("dp_world"), state.get("batch_size"))
        if saved == (self.dp_world, self.batch_size) or self.token_budget or "cursor" not in state:
            return state
        problem = position_problem(state, dp_world=self.dp_world, batch_size=self.batch_size,
                                   grad_accum=self.grad_accum, token_budget=self.token_budget,
                                   checkpoint="the data cursor", check_epochs=False)
        if problem:
            raise ValueError(problem)
        streams = {}
        for name, place in state["cursor"]["streams"].items():
            seen = int(place["position"]) * int(state["dp_world"])
            streams[name] = {"epoch": int(place["epoch"]), "position": seen // self.dp_world}
        log.warning("data cursor saved with dp_world %s, batch_size %s; resumed at the same "
                    "sample position with dp_world %d, batch_size %d", *saved, self.dp_world,
                    self.batch_size)
        return {**state, "dp_rank": mine["dp_rank"], "dp_world": mine["dp_world"],
                "batch_size": mine["batch_size"],
                "cursor": {"batch": int(state["cursor"]["batch"]), "streams": streams}}

    def _onto_changed_data(self, state: dict, mine: dict) -> dict:
        """A cursor saved on other data, restated for this data: the sizes are this data's,
        every stream keeps its epoch and position (a position past the new epoch's end moves
        to the next epoch), a stream the cursor lacks starts at the top. Logs where each
        stream continues."""
        if "cursor" not in state:
            return state
        saved_streams = state["cursor"]["streams"]
        streams = {}
        for name in self.plan.streams:
            place = saved_streams.get(name, {"epoch": 0, "position": 0})
            epoch, position = int(place["epoch"]), int(place["position"])
            if position > self.plan.per_rank[name]:
                epoch, position = epoch + 1, 0
            streams[name] = {"epoch": epoch, "position": position}
            log.warning(
                "data changed since the checkpoint (allow_data_change: true): the %s stream "
                "continues in epoch %d at sample %d of the new data's order (%d samples an "
                "epoch, was %s; %d in the stream, was %s), shuffled with seed %s",
                name, epoch, position * self.dp_world, mine["epoch_lengths"][name],
                (state.get("epoch_lengths") or {}).get(name, "unknown"),
                mine["stream_sizes"][name], (state.get("stream_sizes") or {}).get(name, "unknown"),
                state.get("seed", self.seed))
        return {**state, "dataset_size": mine["dataset_size"], "stream_sizes": mine["stream_sizes"],
                "epoch_lengths": mine["epoch_lengths"],
                "cursor": {"batch": int(state["cursor"]["batch"]), "streams": streams}}


def _upgrade_legacy_state(state: dict) -> dict:
    """A cursor saved before streams existed ({epoch, position in batches}) in today's form."""
    if "cursor" in state or "epoch" not in state:
        return state
    log.warning("data cursor from before the streaming reader: its epoch and position are kept, "
                "but this epoch's order is drawn anew, so some of its samples may repeat or be "
                "skipped until the next epoch")
    position = int(state["position"]) * int(state.get("batch_size", 1))
    return {**state, "cursor": {"batch": int(state["position"]),
                                "streams": {"all": {"epoch": int(state["epoch"]), "position": position}}}}
