"""Text encoders: caption strings -> token embeddings and an attention mask.

The embedded default uses `StandInTextEncoder`: no weights, no downloads, the same vectors on
every machine. Each word gets a fixed random vector drawn from a generator seeded by a stable
hash of (seed, word), so a dataset encoded today and a prompt encoded at sampling time next
week agree exactly. `build_text_encoder` is the one place a real encoder (T5, UMT5, ...) will
be plugged in later.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable

import numpy as np
import torch

NULL_TOKEN = "<null>"

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(caption: str) -> list[str]:
    """Split a caption into lowercase word tokens (runs of a-z/0-9; everything else separates).

    Returns [] for a caption without words, e.g. "" or "  !".
    """
    return _WORD.findall(caption.lower())


class StandInTextEncoder:
    """Deterministic bag-of-words text encoder for the embedded default.

    encode(captions) gives, per caption, one vector per word token (first `max_tokens` words;
    later words are dropped), zero vectors after that, and a mask that is True on real tokens.
    A caption with no words ("" included) is encoded as the single token "<null>": the
    unconditional embedding for classifier-free guidance. Its mask has exactly one True, so
    attention over the caption never sees an all-masked row (which would give NaN softmax).

    Word vectors have i.i.d. standard-normal entries, drawn from numpy's PCG64 seeded with a
    BLAKE2b hash of "<seed>:<word>" (not Python's hash(), which changes per process). Any word,
    known or not, gets its vector this way, so there is no vocabulary to keep in sync.
    """

    name = "standin"

    def __init__(self, text_dim: int = 32, max_tokens: int = 8, seed: int = 0):
        if text_dim < 1 or max_tokens < 1:
            raise ValueError(
                f"text_dim and max_tokens must be >= 1, got text_dim={text_dim}, "
                f"max_tokens={max_tokens}"
            )
        self.text_dim = int(text_dim)
        self.max_tokens = int(max_tokens)
        self.seed = int(seed)
        self._table: dict[str, np.ndarray] = {}

    @property
    def config(self) -> dict:
        """The constructor arguments plus the name: enough to rebuild an identical encoder."""
        return {
            "name": self.name,
            "text_dim": self.text_dim,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }

    def word_vector(self, word: str) -> np.ndarray:
        """The float32 [text_dim] embedding of one token (same on every machine and run)."""
        vec = self._table.get(word)
        if vec is None:
            digest = hashlib.blake2b(f"{self.seed}:{word}".encode(), digest_size=8).digest()
            rng = np.random.default_rng(int.from_bytes(digest, "little"))
            vec = rng.standard_normal(self.text_dim).astype(np.float32)
            self._table[word] = vec
        return vec

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode a batch of captions.

        Returns (hidden float32 [B, max_tokens, text_dim], mask bool [B, max_tokens]).
        Raises TypeError if `captions` is a single string rather than a list of them.
        """
        if isinstance(captions, str):
            # A bare string would silently be encoded letter by letter.
            raise TypeError("encode() takes a list of captions, not a single string")
        hidden = np.zeros((len(captions), self.max_tokens, self.text_dim), dtype=np.float32)
        mask = np.zeros((len(captions), self.max_tokens), dtype=bool)
        for row, caption in enumerate(captions):
            tokens = tokenize(caption)[: self.max_tokens] or [NULL_TOKEN]
            for pos, token in enumerate(tokens):
                hidden[row, pos] = self.word_vector(token)
            mask[row, : len(tokens)] = True
        return torch.from_numpy(hidden), torch.from_numpy(mask)

    def null_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional (empty caption) embedding: encode([""]), shapes [1, L, D] and [1, L]."""
        return self.encode([""])


_ENCODERS: dict[str, Callable[..., StandInTextEncoder]] = {
    StandInTextEncoder.name: StandInTextEncoder,
}


def build_text_encoder(name: str = "standin", **kwargs):
    """Build a text encoder by name; kwargs go to its constructor.

    Returns an object with encode(list[str]) -> (hidden, mask), null_embedding() and config.
    Raises ValueError for an unknown name, listing the known ones.
    """
    try:
        factory = _ENCODERS[name]
    except KeyError:
        raise ValueError(
            f"unknown text encoder {name!r}; known: {', '.join(sorted(_ENCODERS))}"
        ) from None
    return factory(**kwargs)
