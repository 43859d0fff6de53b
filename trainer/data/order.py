"""Which samples a data-parallel rank reads, batch after batch: the epoch order and the plan.

Torch-free (`relay data plan` runs it on a login node). One global order per epoch and stream,
the same on every rank; logical dp rank r takes every dp_world-th sample of it, starting at r
(the scale-out work owns this assignment; keep it in `rank_epoch`). A plan is a pure function
of a cursor, so the training process, the loader's sampler and `relay data plan` agree on
every batch without talking to each other, and a saved cursor resumes exactly.

The order is shuffled with locality: row groups (the unit a reader fetches) are permuted, and
samples are shuffled within windows of WINDOW_BLOCKS consecutive row groups, so a reader keeps
a window's row groups in memory instead of fetching one row group per sample.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from trainer.data.index import SampleIndex

WINDOW_BLOCKS = 4
# Keys that separate this module's random streams from each other (numpy seed sequences).
_ORDER_KEY, _MIX_KEY = 1, 2
STREAM_KEYS = {"all": 0, "video": 1, "image": 2}


def epoch_order(blocks: np.ndarray, members: np.ndarray, *, seed: int, epoch: int,
                stream: str) -> np.ndarray:
    """A permutation of `members` (sorted global indices) for one epoch of one stream.

    `blocks` are SampleIndex.blocks. Every member appears exactly once.
    """
    rng = np.random.default_rng([seed, _ORDER_KEY, STREAM_KEYS[stream], epoch])
    block_of = np.searchsorted(blocks, members, side="right") - 1
    _, inverse = np.unique(block_of, return_inverse=True)
    place = rng.permutation(inverse.max() + 1 if len(inverse) else 0)  # each block's slot
    window = place[inverse] // WINDOW_BLOCKS
    return members[np.lexsort((rng.random(len(members)), window))]


def sample_tokens(index: SampleIndex, patch_size) -> np.ndarray:
    """Joint-attention tokens of each sample [N]: its video tokens plus its caption tokens."""
    return index.video_tokens(tuple(patch_size)) + index.text_len


class BatchPlan:
    """The batches of one dp rank, as global sample indices, from a cursor.

    Without token_budget every batch holds batch_size samples of one stream. With it, a batch
    is a pack: consecutive samples of the rank's order while their joint tokens fit the budget
    (at least one; a pack never crosses an epoch). With image_sample_prob set the images and the
    videos are two streams, each with its own epochs; every batch comes from one of them, the
    image stream with that probability, drawn per batch number. drop_last cuts each epoch's order
    to whole global batches (packing: to a multiple of dp_world); without it the order wraps
    around to its own start instead, so no sample is left out.

    Raises ValueError when a stream holds too few samples for one global batch, when a sample
    alone exceeds the token budget, or when image_sample_prob asks for a stream with no samples.
    """

    def __init__(self, index: SampleIndex, *, dp_rank: int, dp_world: int, seed: int,
                 batch_size: int = 1, drop_last: bool = True, token_budget: int | None = None,
                 patch_size=(1, 1, 1), image_sample_prob: float | None = None, grad_accum: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        self.index = index
        self.dp_rank, self.dp_world, self.seed = int(dp_rank), int(dp_world), int(seed)
        self.batch_size, self.drop_last = int(batch_size), bool(drop_last)
        self.token_budget = token_budget
        self.image_sample_prob = image_sample_prob
        self.tokens = sample_tokens(index, patch_size)
        self.streams = self._split_streams(index, image_sample_prob)
        # Epochs are cut to whole optimizer steps, so any split of a step's global batch over
        # ranks and accumulation reads the same samples in the same steps.
        unit = self.dp_world if token_budget else self.batch_size * self.dp_world * int(grad_accum)
        self.per_rank = {}
        for name, members in self.streams.items():
            count = len(members) // unit if drop_last else math.ceil(len(members) / unit)
            if count == 0:
                raise ValueError(
                    f"{len(members)} {name} samples make no full global batch of {unit} "
                    f"(batch_size {batch_size} x dp_world {dp_world}); use more data or drop_last=False")
            self.per_rank[name] = count * unit // self.dp_world
        if token_budget:
            too_long = self.tokens > token_budget
            if too_long.any():
                raise ValueError(
                    f"{int(too_long.sum())} samples hold more joint tokens than the token budget "
                    f"{token_budget} (the longest {int(self.tokens.max())}); raise the budget "
                    f"or leave those samples out of the data")
        self._cache: tuple[str, int, np.ndarray] | None = None

    @staticmethod
    def _split_streams(index: SampleIndex, image_prob: float | None) -> dict[str, np.ndarray]:
        everything = np.arange(len(index))
        if image_prob is None:
            return {"all": everything}
        streams = {"video": everything[~index.is_image], "image": everything[index.is_image]}
        wanted = {"video": image_prob < 1, "image": image_prob > 0}
        for name, needed in wanted.items():
            if needed and len(streams[name]) == 0:
                raise ValueError(f"image_sample_prob is {image_prob} but the data holds no "
                                 f"{name} samples; set image_sample_prob to "
                                 f"{0.0 if name == 'image' else 1.0} or add {name} data")
        return {name: members for name, members in streams.items() if wanted[name]}

    def reseed(self, seed: int) -> None:
        """Use another seed (a resumed cursor brings the seed it was saved with)."""
        if int(seed) != self.seed:
            self.seed, self._cache = int(seed), None

    def initial_cursor(self) -> dict:
        """The cursor of a fresh run: batch 0, every stream at the start of epoch 0."""
        return {"batch": 0, "streams": {name: {"epoch": 0, "position": 0} for name in self.streams}}

    def rank_epoch(self, stream: str, epoch: int) -> np.ndarray:
        """This rank's global indices for one epoch of one stream, in reading order."""
        if self._cache is None or self._cache[:2] != (stream, epoch):
            order = epoch_order(self.index.blocks, self.streams[stream], seed=self.seed,
                                epoch=epoch, stream=stream)
            order = np.resize(order, self.per_rank[stream] * self.dp_world)  # cut, or wrap
            self._cache = (stream, epoch, order[self.dp_rank :: self.dp_world])
        return self._cache[2]

    def stream_of_batch(self, batch: int) -> str:
        """Which stream batch number `batch` is drawn from (the same on every rank)."""
        if len(self.streams) == 1:
            return next(iter(self.streams))
        draw = np.random.default_rng([self.seed, _MIX_KEY, batch]).random()
        return "image" if draw < self.image_sample_prob else "video"

    def stream_keys(self, cursor: dict, count: int) -> list[int]:
        """The global stream positions of the `count` samples of the batch at `cursor`: sample
        p of this rank's epoch e is sample p x dp_world + dp_rank of the epoch's one global
        order, the same sample whatever the number of ranks. They key the samples' random draws
        (trainer.diffusion.sample_draws), so the draws do not depend on how the world is split."""
        stream = self.stream_of_batch(cursor["batch"])
        place = cursor["streams"][stream]
        epoch, start = place["epoch"], place["position"]
        if start >= self.per_rank[stream]:
            epoch, start = epoch + 1, 0
        epoch_length = self.per_rank[stream] * self.dp_world
        offset = sorted(self.streams).index(stream) << 48  # streams never share a key
        return [offset + epoch * epoch_length + (start + i) * self.dp_world + self.dp_rank
                for i in range(count)]

    def next(self, cursor: dict) -> tuple[np.ndarray, dict]:
        """(global indices of the batch at `cursor`, the cursor after it); `cursor` is unchanged."""
        cursor = copy.deepcopy(cursor)
        stream = self.stream_of_batch(cursor["batch"])
        place = cursor["streams"][stream]
        if place["position"] >= self.per_rank[stream]:
            place["epoch"], place["position"] = place["epoch"] + 1, 0
        order = self.rank_epoch(stream, place["epoch"])
        start = place["position"]
        if self.token_budget:
            # Greedy: as many following samples as fit (a prefix sum over a bounded window).
            window = order[start : start + self.token_budget]
            fits = int(np.searchsorted(np.cumsum(self.tokens[window]), self.token_budget, side="right"))
            take = max(1, fits)
        else:
            take = self.batch_size
        place["position"] = start + take
        cursor["batch"] += 1
        return order[start : start + take], cursor
