import copy
import json

import pytest
import torch

from trainer.model import DiTBlock, VideoDiT
from trainer.model_config import MODEL_CONFIG_DEFAULTS, DiTConfig

torch.set_num_threads(1)

B, C, H, W, L = 2, 2, 4, 4, 5


def tiny(**overrides):
    """A small fp64 model with non-zero modulation, so every path carries signal."""
    torch.manual_seed(0)
    cfg = dict(in_channels=C, hidden_size=16, num_attention_heads=2, num_layers=2, patch_size=(1, 2, 2),
               rope_axes_dim=(2, 2, 4), text_dim=6, zero_init_modulation=False)
    cfg.update(overrides)
    return VideoDiT(**cfg).double().eval()


def inputs(frames=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, frames, H, W, generator=g, dtype=torch.float64)
    text = torch.randn(B, L, 6, generator=g, dtype=torch.float64)
    t = torch.tensor([700.0, 250.0], dtype=torch.float64)
    return x, t, text


def per_chunk_change(a, b, chunk, frames):
    """Max |a - b| over each chunk of `chunk` latent frames: list, one per chunk."""
    return [(a - b)[:, :, s:s + chunk].abs().max().item() for s in range(0, frames, chunk)]


# ---- config ------------------------------------------------------------------------------


def test_output_has_input_shape_and_out_channels():
    model = VideoDiT(zero_init_modulation=False)
    x = torch.randn(2, 3, 8, 16, 16)
    y = model(x, torch.tensor([10.0, 900.0]), torch.randn(2, 8, 32))
    assert y.shape == x.shape
    wide = tiny(out_channels=3)
    x, t, text = inputs()
    assert wide(x, t, text).shape == (B, 3, 6, H, W)


def test_zero_init_modulation_makes_the_output_exactly_zero_at_init():
    model = VideoDiT()
    x = torch.randn(2, 3, 8, 16, 16)
    y = model(x, torch.tensor([10.0, 900.0]), torch.randn(2, 8, 32))
    assert torch.count_nonzero(y) == 0
    assert torch.count_nonzero(tiny()(*inputs())) > 0


def test_unknown_override_key_error_names_the_closest_key():
    with pytest.raises(ValueError, match="num_attention_heads"):
        DiTConfig.from_overrides({"num_attn_heads": 2})
    with pytest.raises(ValueError, match="hidden_size"):
        VideoDiT(hiden_size=32)


def test_zero_init_modulation_inside_overrides_is_rejected():
    with pytest.raises(ValueError, match="top-level"):
        DiTConfig.from_overrides({"zero_init_modulation": False})
    assert DiTConfig.from_overrides({"num_layers": 2}, zero_init_modulation=False).zero_init_modulation is False


def test_rope_axes_must_sum_to_head_dim():
    with pytest.raises(ValueError, match="head dim"):
        VideoDiT(rope_axes_dim=(8, 8, 4))


def test_causal_chunk_must_hold_whole_patch_frames():
    with pytest.raises(ValueError, match="temporal patch size"):
        DiTConfig(patch_size=(2, 4, 4), rope_axes_dim=(8, 8, 8), causal_chunk_size=3)


def test_config_rebuilds_the_same_model_through_json():
    model = tiny(causal_chunk_size=2, attn_window_chunks=1)
    rebuilt = VideoDiT(**json.loads(json.dumps(model.config))).double().eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    x, t, text = inputs()
    assert torch.equal(rebuilt(x, t, text), model(x, t, text))
    assert set(MODEL_CONFIG_DEFAULTS) == set(model.config)


# ---- causal and bidirectional ------------------------------------------------------------


@pytest.mark.parametrize("patch_t", [1, 2])
def test_perturbing_a_chunk_changes_only_that_chunk_and_later(patch_t):
    model = tiny(causal_chunk_size=2, patch_size=(patch_t, 2, 2))
    x, t, text = inputs()
    base = model(x, t, text)
    for j in range(3):
        x2 = x.clone()
        x2[:, :, 2 * j:2 * j + 2] += 1.0
        change = per_chunk_change(model(x2, t, text), base, 2, 6)
        assert all(c < 1e-12 for c in change[:j]), (j, change)
        assert all(c > 1e-6 for c in change[j:]), (j, change)


def test_causal_false_override_lets_early_frames_see_late_ones():
    model = tiny(causal_chunk_size=2)
    x, t, text = inputs()
    x2 = x.clone()
    x2[:, :, 4:] += 1.0
    change = per_chunk_change(model(x2, t, text, causal=False), model(x, t, text, causal=False), 2, 6)
    assert change[0] > 1e-6


# ---- teacher forcing ---------------------------------------------------------------------


def test_noisy_chunk_sees_only_strictly_earlier_clean_chunks():
    model = tiny(causal_chunk_size=2)
    clean, t, text = inputs(seed=1)
    noisy, _, _ = inputs(seed=2)
    base = model.forward_teacher_forcing(noisy, clean, t, text)
    for j in range(3):
        clean2 = clean.clone()
        clean2[:, :, 2 * j:2 * j + 2] += 1.0
        change = per_chunk_change(model.forward_teacher_forcing(noisy, clean2, t, text), base, 2, 6)
        assert all(c < 1e-12 for c in change[:j + 1]), (j, change)
        assert all(c > 1e-6 for c in change[j + 1:]), (j, change)


def test_noisy_chunk_sees_clean_chunks_only_within_window():
    # one layer: with more, clean context reaches further through the clean chunks' own windows
    model = tiny(causal_chunk_size=1, attn_window_chunks=2, num_layers=1)
    clean, t, text = inputs(seed=1)
    noisy, _, _ = inputs(seed=2)
    base = model.forward_teacher_forcing(noisy, clean, t, text)
    j = 1
    clean2 = clean.clone()
    clean2[:, :, j] += 1.0
    change = per_chunk_change(model.forward_teacher_forcing(noisy, clean2, t, text), base, 1, 6)
    affected = [i for i, c in enumerate(change) if c > 1e-6]
    assert affected == [2, 3]
    assert all(change[i] < 1e-12 for i in range(6) if i not in affected)


def test_perturbing_noisy_chunk_changes_only_that_noisy_chunk():
    model = tiny(causal_chunk_size=2)
    clean, t, text = inputs(seed=1)
    noisy, _, _ = inputs(seed=2)
    base = model.forward_teacher_forcing(noisy, clean, t, text)
    for j in range(3):
        noisy2 = noisy.clone()
        noisy2[:, :, 2 * j:2 * j + 2] += 1.0
        change = per_chunk_change(model.forward_teacher_forcing(noisy2, clean, t, text), base, 2, 6)
        assert change[j] > 1e-6
        assert all(c < 1e-12 for i, c in enumerate(change) if i != j), (j, change)


def test_clean_half_is_independent_of_noisy_half_and_equals_causal_forward_at_t0():
    model = tiny(causal_chunk_size=2)
    clean, t, text = inputs(seed=1)
    noisy, _, _ = inputs(seed=2)
    _, clean_a = model.forward_teacher_forcing(noisy, clean, t, text, return_clean=True)
    _, clean_b = model.forward_teacher_forcing(noisy * 3 + 1, clean, t * 0.5, text, return_clean=True)
    assert torch.equal(clean_a, clean_b)
    assert torch.allclose(clean_a, model(clean, torch.zeros(B, dtype=torch.float64), text), atol=1e-12)


def test_teacher_forcing_needs_a_causal_model():
    x, t, text = inputs()
    with pytest.raises(ValueError, match="causal_chunk_size"):
        tiny().forward_teacher_forcing(x, x, t, text)


# ---- KV cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("window,frames,two_time", [(None, 6, False), (1, 8, False), (None, 7, True)])
def test_kv_cache_rollout_matches_teacher_forcing(window, frames, two_time):
    model = tiny(causal_chunk_size=2, attn_window_chunks=window, two_time=two_time)
    clean, _, text = inputs(frames, seed=1)
    noisy, _, _ = inputs(frames, seed=2)
    text_mask = torch.ones(B, L, dtype=torch.bool)
    text_mask[0, -2:] = False
    t = torch.linspace(900, 100, frames, dtype=torch.float64).repeat(B, 1)
    r = t * 0.5 if two_time else None
    tf = model.forward_teacher_forcing(noisy, clean, t, text, text_mask, r=r)
    for i, start in enumerate(range(0, frames, 2)):
        cache = model.new_kv_cache(text, text_mask)
        for s in range(0, start, 2):
            model.commit_chunk(clean[:, :, s:s + 2], cache, s)
        kept = len(cache.chunks)
        sl = slice(start, start + 2)
        out = model.forward_chunk(noisy[:, :, sl], t[:, sl], cache, start,
                                  r_chunk=None if r is None else r[:, sl])
        assert torch.allclose(out, tf[:, :, sl], atol=1e-5), i
        assert len(cache.chunks) == kept and cache.next_frame == start  # forward_chunk is read-only
        if window is not None:
            assert kept <= window


def test_commit_refuses_a_chunk_out_of_order():
    model = tiny(causal_chunk_size=2)
    x, _, text = inputs()
    cache = model.new_kv_cache(text)
    with pytest.raises(ValueError, match="next chunk starts at latent frame 0"):
        model.commit_chunk(x[:, :, 2:4], cache, 2)
    model.commit_chunk(x[:, :, :2], cache, 0)
    with pytest.raises(ValueError, match="at most 2"):
        model.forward_chunk(x[:, :, 2:5], 500.0, cache, 2)


def test_committed_keys_are_detached():
    model = tiny(causal_chunk_size=2)
    x, _, text = inputs()
    cache = model.new_kv_cache(text)
    model.commit_chunk(x[:, :, :2].requires_grad_(), cache, 0)
    assert not any(k.requires_grad or v.requires_grad for k, v in cache.chunks[0])


# ---- two-time conditioning ---------------------------------------------------------------


@pytest.mark.parametrize("gate,dtype", [(0.25, torch.float64), (0.3, torch.float32)])
def test_enable_two_time_with_r_equal_t_reproduces_the_flow_matching_model_exactly(gate, dtype):
    fm = tiny().to(dtype)
    x, t, text = (a.to(dtype) for a in inputs())
    two = copy.deepcopy(fm)
    two.enable_two_time(gate=gate)
    assert torch.equal(two(x, t, text, r=t), fm(x, t, text))
    assert torch.equal(two(x, t, text), fm(x, t, text))
    assert not torch.allclose(two(x, t, text, r=t * 0.1), fm(x, t, text))
    assert two.config["two_time"] is True and two.config["time_gate"] == gate


def test_gate_zero_ignores_r():
    fm = tiny()
    x, t, text = inputs()
    two = copy.deepcopy(fm)
    two.enable_two_time(gate=0.0)
    with torch.no_grad():
        for p in two.r_embedder.parameters():
            p.add_(torch.randn_like(p))
    assert torch.equal(two(x, t, text, r=torch.tensor([3.0, 80.0], dtype=torch.float64)), fm(x, t, text))


def test_two_time_adds_exactly_the_r_embedder_keys():
    fm = tiny()
    two = copy.deepcopy(fm)
    two.enable_two_time()
    extra = set(two.state_dict()) - set(fm.state_dict())
    assert extra == {f"r_embedder.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
    assert set(fm.state_dict()) <= set(two.state_dict())
    student = tiny()
    student.load_state_dict({k: v for k, v in two.state_dict().items() if not k.startswith("r_embedder.")})


def test_r_on_a_single_time_model_is_an_error():
    x, t, text = inputs()
    with pytest.raises(ValueError, match="enable_two_time"):
        tiny()(x, t, text, r=t)


# ---- text and time inputs ----------------------------------------------------------------


def test_text_states_do_not_depend_on_the_video(monkeypatch):
    model = tiny(causal_chunk_size=2)
    seen = []
    original = DiTBlock.forward_text

    def spy(self, *args, **kwargs):
        txt, k, v = original(self, *args, **kwargs)
        seen.append((txt, (k, v)))
        return txt, k, v

    monkeypatch.setattr(DiTBlock, "forward_text", spy)
    x, t, text = inputs(seed=1)
    x2, _, _ = inputs(seed=2)
    model(x, t, text)
    first = list(seen)
    seen.clear()
    model(x2, t * 0.3, text)
    assert len(first) == len(seen) == 2
    for (txt_a, (k_a, v_a)), (txt_b, (k_b, v_b)) in zip(first, seen):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
        assert (txt_a is None and txt_b is None) or torch.equal(txt_a, txt_b)
    # and the cache computes the same text K/V from the caption alone
    cache = model.new_kv_cache(text)
    assert all(torch.equal(a[0], b[0]) for (_, a), b in zip(first, cache.text_kv))


def test_padded_text_tokens_do_not_change_outputs():
    model = tiny(causal_chunk_size=2)
    x, t, text = inputs()
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, -2:] = False
    text2 = text.clone()
    text2[:, -2:] = torch.randn(B, 2, 6, dtype=torch.float64) * 10
    out = model(x, t, text, mask)
    assert torch.equal(out, model(x, t, text2, mask))
    assert torch.allclose(out, model(x, t, text[:, :-2]), atol=1e-12)
    assert not torch.allclose(out, model(x, t, text2))


def test_per_frame_time_constant_across_frames_equals_scalar_time():
    model = tiny()
    x, t, text = inputs()
    per_frame = t[:, None].expand(B, 6)
    assert torch.allclose(model(x, per_frame, text), model(x, t, text), atol=1e-12)


def test_per_frame_time_reads_the_first_frame_of_each_patch_frame():
    model = tiny(patch_size=(2, 2, 2))
    x, _, text = inputs()
    t = torch.tensor([[900.0, 1.0, 500.0, 2.0, 100.0, 3.0]] * B, dtype=torch.float64)
    t2 = t.clone()
    t2[:, 1::2] = 777.0
    assert torch.equal(model(x, t, text), model(x, t2, text))
    t3 = t.clone()
    t3[:, 4] = 200.0
    change = per_chunk_change(model(x, t3, text), model(x, t, text), 2, 6)
    assert change[2] > 1e-6


def test_causal_model_with_a_maskless_backend_is_rejected_early():
    with pytest.raises(ValueError, match="sdpa"):
        DiTConfig(causal_chunk_size=2, attention_backend="flash_attn")
    with pytest.raises(ValueError, match="unknown"):
        DiTConfig(attention_backend="flashy")


# ---- activation checkpointing --------------------------------------------------------------


def _saved_bytes_and_grads(model, x, t, text):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x, t, text).square().mean()
    loss.backward()
    return sum(saved), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients_from_fewer_saved_activations():
    from types import SimpleNamespace

    from trainer.build import prepare_for_training

    plain = tiny(num_layers=3).train()
    checkpointed = prepare_for_training(
        copy.deepcopy(plain), SimpleNamespace(enable_gradient_checkpointing=True,
                                              use_dedicated_gradient_checkpointing=False,
                                              compile_transformer=False))
    # Parameter names stay as they were: checkpoints and warm starts do not see it.
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    x, t, text = inputs()
    plain_saved, plain_grads = _saved_bytes_and_grads(plain, x, t, text)
    ckpt_saved, ckpt_grads = _saved_bytes_and_grads(checkpointed, x, t, text)
    assert ckpt_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=1e-12, msg=name)
    # Only each block's inputs stay alive through the forward, not its inner activations.
    assert ckpt_saved < plain_saved / 3, (ckpt_saved, plain_saved)


def _attention_kernel_calls(model, x, t, text) -> int:
    """How many times the attention kernel runs in one forward + backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func) and "backward" not in str(func):
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model(x, t, text).square().mean().backward()
    return Count.calls


def test_selective_checkpointing_keeps_attention_outputs_and_the_same_gradients():
    from types import SimpleNamespace

    from trainer.build import prepare_for_training

    def prepared(selective: bool):
        return prepare_for_training(copy.deepcopy(plain), SimpleNamespace(
            enable_gradient_checkpointing=True, use_dedicated_gradient_checkpointing=selective,
            compile_transformer=False))

    plain = tiny(num_layers=3).train()
    x, t, text = inputs()
    plain_saved, plain_grads = _saved_bytes_and_grads(plain, x, t, text)
    selective_saved, selective_grads = _saved_bytes_and_grads(prepared(True), x, t, text)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(selective_grads[name], grad, rtol=0, atol=1e-12, msg=name)
    assert selective_saved < plain_saved / 3, (selective_saved, plain_saved)  # the rest recomputed
    # Full checkpointing runs every attention twice (forward, recompute); selective keeps the
    # outputs, so attention runs once, as without checkpointing.
    once = _attention_kernel_calls(plain, x, t, text)
    assert _attention_kernel_calls(prepared(False), x, t, text) == 2 * once
    assert _attention_kernel_calls(prepared(True), x, t, text) == once
