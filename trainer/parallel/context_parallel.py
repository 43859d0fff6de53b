"""Ulysses context parallel: the video and caption tokens of every sample spread over a cp group.

Layout. Within a group of `size` ranks, token j of the video sequence the model builds (frame
major; `[clean | noisy]` in teacher forcing; the samples one after another in a pack) lives on
cp rank j % size. Strided rather than contiguous: every rank holds a share of every frame and
of every sample of a pack, and block-causal work stays balanced (a contiguous split would give
the last rank the chunks that see the most keys). Caption token j lives on cp rank j % size
too (a pack's captions one after another), after the caption is padded at its end with
masked tokens to a multiple of size (a pack's last caption takes the padding): a rank embeds
and runs ceil(L / size) of a caption's L tokens. Masked tokens sit after the real ones, so
attention sees them as a shorter caption length (the form a padded caption has anyway) and
never as keys: the padding changes no result.

Around each block's attention, in each stream, all-to-alls trade tokens for heads. Rank r
sends head group s of its tokens to rank s and receives head group r of everyone's; rank s's
l-th token is token l * size + s, so the received pieces interleave back into the natural
order with a reshape. In this "head space" a rank holds the whole sequence for num_heads /
size heads, so the attention plan is exactly the one the unsplit model builds (full, padded,
block-causal, teacher forcing, a pack's masks; FA4, flex or SDPA): attention needs no change
at all. The second all-to-all gives each rank its own tokens back with every head.

The text stream attends to the caption only, as unsplit: its queries, keys and values go to
head space, the text-over-text plan runs over the whole (padded) caption, and its output comes
back to the rank's tokens. Its keys and values in head space are this rank's heads of the
whole caption: the prefix of its video attention, with no further exchange. A rollout's KV
cache holds exactly those (the caption and committed chunks in head space), so a rank keeps
1/size of the cache. Nothing of the text stream is read after the blocks (the last block
computes only its keys and values), so there is nothing of it to gather.

What follows the tokens: RoPE positions (taken with the same stride, before the exchange) and
the modulation runs. A run of n tokens sharing one time (a sample, or a frame) keeps its
boundaries when size divides n: rank r's share of run g is its local tokens [g n / size,
(g + 1) n / size), so the one-vector-per-run fast path of the model still applies. Runs of one
token (a pack's per-token slots) are strided like the tokens. Any other run length is refused
(trainer.preflight says so before a run starts: tokens per latent frame must divide by
cp_size). A pack's video tokens are padded to a multiple of size by the model
(a packed forward, and each chunk round of a packed rollout), the padding a sequence of
its own; a packed rollout's cache holds, per sample, this rank's heads of its caption and
committed chunks.

Gradients. The head's output is gathered, so the stages compute their losses on whole samples,
unchanged and identically on every rank of the group. The gather's backward sums the group's
output gradients, so a rank's parameter gradients are size times its tokens' share (its
caption tokens' too: the exchanges' backwards route every head group's gradient back to the
token's rank), and FSDP2's mean over the dp_shard x cp shard group turns that back into the
mean over data-parallel ranks: the gradient does not depend on the split.

Data. Only cp rank 0 of a group reads; `GroupSharedBatches` hands its batch to the others.
"""

from __future__ import annotations

import torch

from trainer.parallel.distributed import broadcast_from_rank0, exchange


class Ulysses:
    """A cp group as the model sees it: `size` ranks, this one `rank` within them.

    The model holds one in `ulysses` (None without cp); `attach` puts it there.
    """

    def __init__(self, group, size: int, rank: int, num_heads: int):
        if num_heads % size:
            raise ValueError(f"the model's {num_heads} attention heads are not divisible by cp_size {size}")
        self.group, self.size, self.rank = group, size, rank

    def padding(self, num_tokens: int) -> int:
        """Tokens to add so that num_tokens splits evenly over the group."""
        return -num_tokens % self.size

    def split(self, vid: torch.Tensor, slots: torch.Tensor | None, positions: torch.Tensor,
              groups: int):
        """This rank's share of video tokens [B, N, D] that form `groups` equal modulation runs
        (run g uses slot slots[g]; None: slot g), with their RoPE positions [N, 3].

        Returns (tokens [B, N / size, D], slots of the local runs, positions [N / size, 3]).
        Raises ValueError when N, or a run longer than one token, does not divide by size.
        """
        n = vid.shape[1]
        run = n // groups
        if n % self.size or (run > 1 and run % self.size):
            raise ValueError(
                f"context parallel: {n} video tokens in runs of {run} tokens that share a "
                f"time do not split over cp_size {self.size}; the tokens of one latent frame "
                f"must divide by cp_size (pick a cp_size that divides them, or another "
                f"resolution or patch size)")
        if run == 1 and slots is not None:
            slots = self.share(slots, dim=0)  # per-token slots follow their tokens
        elif run == 1:
            slots = self.share(torch.arange(groups, device=vid.device), dim=0)
        return self.share(vid), slots, self.share(positions, dim=0)

    def share(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of x along `dim` (the tokens of [B, N, ...] by default): tokens
        rank, rank + size, ... of a count that divides by size."""
        return x[(slice(None),) * dim + (slice(self.rank, None, self.size),)]

    def pad_caption(self, text: torch.Tensor, mask: torch.Tensor | None):
        """A caption [B, L, C] and its mask (bool [B, L], None: all real) padded at the end
        with masked zero tokens to a multiple of size: (text [B, L', C], mask or None).

        The mask stays None only when nothing is padded. The padding is never a key: padded
        keys sit after the real ones, so attention sees them as a shorter caption length.
        """
        b, length, _ = text.shape
        pad = self.padding(length)
        if not pad:
            return text, mask
        if mask is None:
            mask = torch.ones(b, length, dtype=torch.bool, device=text.device)
        return (torch.cat([text, text.new_zeros(b, pad, text.shape[2])], dim=1),
                torch.cat([mask, mask.new_zeros(b, pad)], dim=1))

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Local tokens with every head [B, n, H, d] -> every token, this rank's heads
        [B, n x size, H / size, d], in the natural token order."""
        b, n, h, d = x.shape
        send = x.reshape(b, n, self.size, h // self.size, d).permute(2, 0, 1, 3, 4)
        received = exchange(send, self.group)  # [source rank, B, n, H / size, d]
        return received.permute(1, 2, 0, 3, 4).reshape(b, n * self.size, h // self.size, d)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of to_heads: [B, N, H / size, d] -> [B, N / size, H, d]."""
        b, total, hc, d = x.shape
        send = x.reshape(b, total // self.size, self.size, hc, d).permute(2, 0, 1, 3, 4)
        received = exchange(send, self.group)  # [head group, B, n, H / size, d]
        return received.permute(1, 2, 0, 3, 4).reshape(b, total // self.size, self.size * hc, d)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's tokens [B, n, C] in the natural order [B, n x size, C].

        An exchange of size copies: its backward sums the group's gradients of this rank's
        tokens (the reduce-scatter an all-gather's backward is; gloo has none of its own).
        """
        b, n, c = x.shape
        parts = exchange(x.expand(self.size, b, n, c), self.group)  # [source rank, B, n, C]
        return parts.permute(1, 2, 0, 3).reshape(b, n * self.size, c)


def attach(model: torch.nn.Module, group, size: int, rank: int) -> torch.nn.Module:
    """Make `model` (a family module, sharded or not) run context-parallel over `group`;
    returns it. The family decides where the exchanges run (`attach_context_parallel`).
    Raises ValueError when its heads do not divide by size."""
    model.attach_context_parallel(Ulysses(group, size, rank, model.geometry.num_heads))
    return model


class GroupSharedBatches:
    """The batches of one cp group: cp rank 0 reads them (`reader`, a DistributedBatchIterator;
    None on the other ranks) and every rank of `group` gets the same batch.

    The cursor is cp rank 0's: only it saves one (trainer.checkpoint.store) and loads one.
    """

    def __init__(self, reader, group):
        self.reader, self.group = reader, group
        self.latent_shape = broadcast_from_rank0(
            None if reader is None else reader.latent_shape, group)

    def next_batch(self) -> dict:
        return broadcast_from_rank0(None if self.reader is None else self.reader.next_batch(),
                                    self.group)

    def state_dict(self) -> dict:
        return {} if self.reader is None else self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.reader is not None:
            self.reader.load_state_dict(state)
