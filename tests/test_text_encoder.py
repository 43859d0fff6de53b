import pytest
import torch

from trainer.encoders.text import StandInTextEncoder, build_text_encoder, tokenize


def test_same_caption_encodes_identically_across_instances():
    a = StandInTextEncoder(text_dim=16, max_tokens=8, seed=3)
    b = StandInTextEncoder(text_dim=16, max_tokens=8, seed=3)
    hidden_a, mask_a = a.encode(["a red square moving left"])
    hidden_b, mask_b = b.encode(["a red square moving left"])
    assert torch.equal(hidden_a, hidden_b) and torch.equal(mask_a, mask_b)


def test_encode_returns_padded_hidden_and_mask_of_word_count():
    hidden, mask = StandInTextEncoder(text_dim=16, max_tokens=8).encode(["a red square moving left", "Blue!"])
    assert hidden.shape == (2, 8, 16) and hidden.dtype == torch.float32
    assert mask.dtype == torch.bool
    assert mask.sum(dim=1).tolist() == [5, 1]
    assert torch.all(hidden[0, 5:] == 0)


def test_words_are_lowercased_and_seed_changes_vectors():
    encoder = StandInTextEncoder(text_dim=16, seed=0)
    assert tokenize("A RED, square.") == ["a", "red", "square"]
    upper, _ = encoder.encode(["RED"])
    lower, _ = encoder.encode(["red"])
    assert torch.equal(upper, lower)
    other, _ = StandInTextEncoder(text_dim=16, seed=1).encode(["red"])
    assert not torch.equal(lower, other)


def test_unknown_words_get_deterministic_distinct_vectors():
    encoder = StandInTextEncoder(text_dim=16)
    first = encoder.word_vector("zebra")
    assert (first == StandInTextEncoder(text_dim=16).word_vector("zebra")).all()
    assert not (first == encoder.word_vector("red")).all()


def test_null_embedding_is_the_empty_caption_as_one_token():
    encoder = StandInTextEncoder(text_dim=16, max_tokens=8)
    hidden, mask = encoder.null_embedding()
    assert hidden.shape == (1, 8, 16)
    assert mask.tolist() == [[True] + [False] * 7]
    empty_hidden, empty_mask = encoder.encode([""])
    assert torch.equal(hidden, empty_hidden) and torch.equal(mask, empty_mask)
    assert hidden[0, 0].abs().sum() > 0


def test_words_beyond_max_tokens_are_dropped():
    encoder = StandInTextEncoder(text_dim=8, max_tokens=3)
    long, mask = encoder.encode(["one two three four five"])
    short, _ = encoder.encode(["one two three"])
    assert mask.sum() == 3 and torch.equal(long, short)


def test_encode_rejects_a_bare_string():
    with pytest.raises(TypeError):
        StandInTextEncoder().encode("a red square")


def test_build_text_encoder_by_name_and_rejects_unknown():
    encoder = build_text_encoder("standin", text_dim=4, max_tokens=2, seed=5)
    assert encoder.config == {"name": "standin", "text_dim": 4, "max_tokens": 2, "seed": 5}
    with pytest.raises(ValueError, match="standin"):
        build_text_encoder("t5")
