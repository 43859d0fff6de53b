"""Text encoders: caption strings -> token embeddings and an attention mask.

The embedded default uses `StandInTextEncoder`: no weights, no downloads, the same vectors on
every machine. Each word gets a fixed random vector drawn from a generator seeded by a stable
hash of (seed, word), so a dataset encoded today and a prompt encoded at sampling time next
week agree exactly. `TransformersTextEncoder` is a real one (UMT5, Qwen2-style, ...) loaded
from a local directory; `build_text_encoder` picks between them.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from trainer.encoders.directories import missing_tokenizer, tokenizer_dir

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

    positional=True adds a fixed sinusoidal vector for each token's position. Without it the
    caption is a bag of words (the model gives text tokens no RoPE), which cannot say which
    colour belongs to which shape in a two-object caption such as the benchmark's.
    """

    name = "standin"

    def __init__(self, text_dim: int = 32, max_tokens: int = 8, seed: int = 0,
                 positional: bool = False):
        if text_dim < 1 or max_tokens < 1:
            raise ValueError(
                f"text_dim and max_tokens must be >= 1, got text_dim={text_dim}, "
                f"max_tokens={max_tokens}"
            )
        self.text_dim = int(text_dim)
        self.max_tokens = int(max_tokens)
        self.seed = int(seed)
        self.positional = bool(positional)
        self._table: dict[str, np.ndarray] = {}

    @property
    def config(self) -> dict:
        """The constructor arguments plus the name: enough to rebuild an identical encoder."""
        config = {
            "name": self.name,
            "text_dim": self.text_dim,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }
        if self.positional:  # only when on: caches of the plain encoder keep their manifest
            config["positional"] = True
        return config

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
                if self.positional:
                    hidden[row, pos] += self._position_vector(pos)
            mask[row, : len(tokens)] = True
        return torch.from_numpy(hidden), torch.from_numpy(mask)

    def null_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional (empty caption) embedding: encode([""]), shapes [1, L, D] and [1, L]."""
        return self.encode([""])

    def _position_vector(self, pos: int) -> np.ndarray:
        # Transformer-style sinusoids, so neighbouring positions have similar vectors.
        dims = np.arange(self.text_dim)
        rates = 1.0 / (100.0 ** ((dims // 2 * 2) / self.text_dim))
        angles = pos * rates
        return np.where(dims % 2 == 0, np.sin(angles), np.cos(angles)).astype(np.float32)


class TransformersTextEncoder:
    """A transformers text encoder (UMT5, T5, Qwen2-style, ...) with its tokenizer, from a local
    directory (no hub at run time; needs the `encode` extra). The tokenizer is read from the
    directory, or from the tokenizer/ folder beside it, as a diffusers pipeline directory keeps
    text_encoder/ and tokenizer/ (trainer.encoders.directories.tokenizer_dir).

    encode(captions) gives the hidden state `skip_layer` layers before the last (the seed's
    text_encoder_hidden_state_skip_layer; 0 = the final, normalised output) for the first
    max_tokens tokens of each caption, float32 [B, max_tokens, D], and its mask. An
    encoder-decoder checkpoint contributes its encoder only. A caption that tokenizes to
    nothing keeps one (padding) token in its mask, so attention never sees an empty row.

    Raises ImportError naming the extra when transformers is missing, ValueError when
    skip_layer is not below the number of layers.
    """

    name = "transformers"

    def __init__(self, directory, max_tokens: int = 512, skip_layer: int = 0, device="cpu"):
        try:
            import transformers
        except ImportError as error:
            raise ImportError("a text encoder directory needs transformers: pip install "
                              "'relay[encode]'") from error
        self.directory, self.max_tokens, self.skip_layer = str(directory), int(max_tokens), int(skip_layer)
        missing = missing_tokenizer(self.directory)
        if missing:
            raise ValueError(missing)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir(self.directory)),
                                                                    local_files_only=True)
        # The class the checkpoint was saved as (UMT5EncoderModel stays encoder-only); AutoModel
        # when the config does not say.
        config = transformers.AutoConfig.from_pretrained(self.directory, local_files_only=True)
        saved_as = getattr(transformers, (config.architectures or [""])[0], None)
        model = (saved_as or transformers.AutoModel).from_pretrained(self.directory, local_files_only=True)
        if getattr(model.config, "is_encoder_decoder", False):
            model = model.get_encoder()
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") \
            else model.config.num_layers
        if not 0 <= self.skip_layer < layers:
            raise ValueError(f"text_encoder_hidden_state_skip_layer {skip_layer} must be in "
                             f"[0, {layers}) for {self.directory} ({layers} layers)")
        self.text_dim = int(getattr(model.config, "hidden_size", None) or model.config.d_model)

    @property
    def config(self) -> dict:
        return {"name": self.name, "directory": self.directory, "text_dim": self.text_dim,
                "max_tokens": self.max_tokens, "skip_layer": self.skip_layer}

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden float32 [B, max_tokens, D], mask bool [B, max_tokens]) for a list of captions."""
        if isinstance(captions, str):
            raise TypeError("encode() takes a list of captions, not a single string")
        tokens = self.tokenizer(list(captions), padding="max_length", truncation=True,
                                max_length=self.max_tokens, return_tensors="pt").to(self.device)
        mask = tokens["attention_mask"].bool()
        empty = ~mask.any(dim=1)
        mask[empty, 0] = True
        out = self.model(input_ids=tokens["input_ids"], attention_mask=mask.long(),
                         output_hidden_states=True)
        hidden = out.hidden_states[-1 - self.skip_layer].float()
        return hidden.masked_fill(~mask[..., None], 0.0).cpu(), mask.cpu()

    def null_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional (empty caption) embedding: encode([""]), shapes [1, L, D] and [1, L]."""
        return self.encode([""])


_ENCODERS: dict[str, Callable[..., StandInTextEncoder]] = {
    StandInTextEncoder.name: StandInTextEncoder,
}


def build_text_encoder(name: str = "standin", *, skip_layer: int = 0, device="cpu", **kwargs):
    """Build a text encoder: 'standin', or a directory holding a transformers encoder and its
    tokenizer. kwargs go to the stand-in's constructor (a directory's takes max_tokens only;
    its text_dim comes from the checkpoint).

    Returns an object with encode(list[str]) -> (hidden, mask), null_embedding() and config.
    Raises ValueError for an unknown name that is not a directory, listing the known ones.
    """
    if name in _ENCODERS:
        return _ENCODERS[name](**kwargs)
    if Path(name).is_dir():
        encoder = TransformersTextEncoder(name, max_tokens=kwargs.get("max_tokens", 512),
                                          skip_layer=skip_layer, device=device)
        wanted = kwargs.get("text_dim")
        if wanted is not None and wanted != encoder.text_dim:
            raise ValueError(f"text encoder {name} gives {encoder.text_dim}-wide embeddings but "
                             f"the model's text_dim is {wanted}")
        return encoder
    raise ValueError(f"unknown text encoder {name!r}: not a directory, and not one of "
                     f"{', '.join(sorted(_ENCODERS))}")
