import copy
import json

import pytest
import torch
import torch.nn.functional as F

from trainer.models.dit.family import DiTFamily
from trainer.models.dit.module import DiTBlock, VideoDiT, text_lengths_of
from trainer.models.dit.config import MODEL_CONFIG_DEFAULTS, DiTConfig

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
        DiTFamily().config({"num_attn_heads": 2})
    with pytest.raises(ValueError, match="hidden_size"):
        VideoDiT(hiden_size=32)


def test_zero_init_modulation_inside_overrides_is_rejected():
    with pytest.raises(ValueError, match="top-level"):
        DiTFamily().config({"zero_init_modulation": False})
    assert DiTFamily().config({"num_layers": 2}, {"zero_init_modulation": False})["zero_init_modulation"] is False


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


def two_time_copy(fm, gate: float = 0.25):
    """A two-time model of fm's config holding fm's weights, E_r initialised from E_t."""
    two = VideoDiT(**{**fm.config, "two_time": True, "time_gate": gate}).to(fm.patch_embed.weight.dtype)
    missing, unexpected = two.load_state_dict(fm.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("r_embedder.") for k in missing)
    two.init_second_time_from_first()
    return two


@pytest.mark.parametrize("gate,dtype", [(0.25, torch.float64), (0.3, torch.float32)])
def test_two_time_initialised_from_the_first_time_with_r_equal_t_reproduces_the_flow_matching_model_exactly(gate, dtype):
    fm = tiny().to(dtype)
    x, t, text = (a.to(dtype) for a in inputs())
    two = two_time_copy(fm, gate)
    assert torch.equal(two(x, t, text, r=t), fm(x, t, text))
    assert torch.equal(two(x, t, text), fm(x, t, text))
    assert not torch.allclose(two(x, t, text, r=t * 0.1), fm(x, t, text))
    assert two.config["two_time"] is True and two.config["time_gate"] == gate


def test_gate_zero_ignores_r():
    fm = tiny()
    x, t, text = inputs()
    two = two_time_copy(fm, gate=0.0)
    with torch.no_grad():
        for p in two.r_embedder.parameters():
            p.add_(torch.randn_like(p))
    assert torch.equal(two(x, t, text, r=torch.tensor([3.0, 80.0], dtype=torch.float64)), fm(x, t, text))


def test_two_time_adds_exactly_the_r_embedder_keys():
    fm = tiny()
    two = two_time_copy(fm)
    extra = set(two.state_dict()) - set(fm.state_dict())
    assert extra == {f"r_embedder.linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
    assert set(fm.state_dict()) <= set(two.state_dict())
    student = tiny()
    student.load_state_dict({k: v for k, v in two.state_dict().items() if not k.startswith("r_embedder.")})


def test_r_on_a_single_time_model_is_an_error():
    x, t, text = inputs()
    with pytest.raises(ValueError, match="two_time: true"):
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


def test_unknown_attention_backend_is_rejected_early():
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


# ---- the forward path against the plain math ------------------------------------------------


def _reference_forward(model, x, t, text, text_mask=None, causal=False):
    """The DiT written out from its weights, as it was specified before any speed work: one
    modulation vector per token, complex-number RoPE, [text | video] keys under one dense mask,
    padded text queries attending to themselves."""
    cfg = model.cfg
    b, heads, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    pt, ph, pw = cfg.patch_size
    grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
    n, per_frame = grid[0] * grid[1] * grid[2], grid[1] * grid[2]
    vid, txt = model._patchify(x), model.text_embedder(text)
    length = txt.shape[1]
    t = torch.as_tensor(t, dtype=x.dtype).expand(b, -1) if torch.as_tensor(t).ndim == 2 else \
        torch.as_tensor(t, dtype=x.dtype).expand(b)[:, None].expand(b, x.shape[2])
    cond = F.silu(model.time_embedder(t[:, ::pt].repeat_interleave(per_frame, dim=1)))  # [B, N, D]
    pos = torch.stack(torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
    angle = torch.cat([pos[:, a, None].double() * cfg.rope_theta ** (-torch.arange(0, d, 2).double() / d)
                       for a, d in enumerate(cfg.rope_axes_dim) if d], dim=-1)
    rot = torch.polar(torch.ones_like(angle), angle)

    def rope(u):  # [B, heads, N, hd]
        return torch.view_as_real(torch.view_as_complex(u.unflatten(-1, (-1, 2)).contiguous()) * rot).flatten(-2)

    def ln(u):
        return F.layer_norm(u, (cfg.hidden_size,), eps=1e-6)

    def split(block, h):
        q, k, v = block.qkv(h).view(b, h.shape[1], 3, heads, hd).permute(2, 0, 3, 1, 4)
        return (F.rms_norm(q, (hd,), block.q_norm.weight, 1e-6),
                F.rms_norm(k, (hd,), block.k_norm.weight, 1e-6), v)

    def merge(block, o):
        return block.proj(o.transpose(1, 2).flatten(-2))

    real = torch.ones(b, length, dtype=torch.bool) if text_mask is None else text_mask
    text_rows = real[:, None, None, :] | torch.eye(length, dtype=torch.bool)
    video_rows = torch.ones(n, n, dtype=torch.bool)
    if causal:
        frame = torch.arange(grid[0]).repeat_interleave(per_frame) // (cfg.causal_chunk_size // pt)
        video_rows = frame[None, :] <= frame[:, None]
    joint = torch.cat([real[:, None, :].expand(b, n, length), video_rows.expand(b, n, n)], dim=2)[:, None]
    for block in model.blocks:
        tq, tk, tv = split(block, ln(txt))
        new_txt = txt + merge(block, F.scaled_dot_product_attention(tq, tk, tv, attn_mask=text_rows))
        new_txt = new_txt + block.mlp(ln(new_txt))
        sh1, sc1, g1, sh2, sc2, g2 = block.modulation(cond).chunk(6, dim=-1)
        q, k, v = split(block, ln(vid) * (1 + sc1) + sh1)
        keys, values = torch.cat([tk, rope(k)], dim=2), torch.cat([tv, v], dim=2)
        vid = vid + g1 * merge(block, F.scaled_dot_product_attention(rope(q), keys, values, attn_mask=joint))
        vid = vid + g2 * block.mlp(ln(vid) * (1 + sc2) + sh2)
        txt = new_txt
    shift, scale = model.final_modulation(cond).chunk(2, dim=-1)
    return model._unpatchify(model.head(ln(vid) * (1 + scale) + shift), *x.shape[2:])


def _padded_mask():
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, -2:] = False
    return mask


@pytest.mark.parametrize("case", ["per_sample", "per_frame", "padded_text", "causal", "patch_t2"])
def test_forward_matches_the_written_out_math(case):
    model = tiny(causal_chunk_size=2 if case == "causal" else None,
                 patch_size=(2, 2, 2) if case == "patch_t2" else (1, 2, 2))
    x, t, text = inputs()
    mask = _padded_mask() if case == "padded_text" else None
    if case in ("per_frame", "patch_t2", "causal"):
        t = torch.tensor([[900.0, 1.0, 500.0, 2.0, 100.0, 3.0], [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]],
                         dtype=torch.float64)
    torch.testing.assert_close(model(x, t, text, mask), _reference_forward(model, x, t, text, mask,
                                                                           causal=case == "causal"),
                               rtol=0, atol=1e-12)


def _spy_attention(monkeypatch):
    import trainer.models.dit.module as model_module

    plans = []
    original = model_module.attend

    def spy(plan, q, k, v):
        plans.append(plan)
        return original(plan, q, k, v)

    monkeypatch.setattr(model_module, "attend", spy)
    return plans


def test_a_text_mask_that_hides_nothing_never_reaches_attention(monkeypatch):
    model = tiny()
    x, t, text = inputs()
    plans = _spy_attention(monkeypatch)
    out = model(x, t, text, torch.ones(B, L, dtype=torch.bool))
    assert plans and all(p.mask is None for p in plans)
    assert torch.equal(out, model(x, t, text))
    plans.clear()
    model(x, t, text, _padded_mask())
    assert all(p.mask is not None for p in plans)  # real padding does (as lengths on GPUs)


def test_text_mask_with_a_real_token_after_padding_is_refused():
    mask = torch.tensor([[True, False, True, True, True], [True] * 5])
    with pytest.raises(ValueError, match="real tokens first"):
        tiny()(*inputs(), mask)
    assert text_lengths_of(torch.ones(2, 3, dtype=torch.bool)) is None
    assert text_lengths_of(torch.tensor([[True, True, False]])).tolist() == [2]


def _mod_groups(monkeypatch):
    groups = []
    original = DiTBlock.forward_video

    def spy(self, vid, mod, *args):
        groups.append(mod.shape[1])
        return original(self, vid, mod, *args)

    monkeypatch.setattr(DiTBlock, "forward_video", spy)
    return groups


def test_equal_per_frame_times_take_the_per_sample_modulation_path(monkeypatch):
    model = tiny()
    x, t, text = inputs()
    groups = _mod_groups(monkeypatch)
    model(x, t[:, None].expand(B, 6), text)
    assert groups == [1, 1]
    groups.clear()
    model(x, torch.linspace(900, 100, 6, dtype=torch.float64).repeat(B, 1), text)
    assert groups == [6, 6]


def test_per_frame_modulation_is_never_copied_per_token():
    model = tiny().train()
    x, _, text = inputs()
    t = torch.linspace(900, 100, 6, dtype=torch.float64).repeat(B, 1)
    per_token = B * (6 * 2 * 2) * 6 * model.cfg.hidden_size  # [B, N, 6D] elements
    largest = []

    def pack(tensor):
        largest.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, t, text).sum().backward()
    assert max(largest) < per_token, (max(largest), per_token)


def test_rope_rotates_pairs_like_complex_multiplication():
    from trainer.models.common.rope import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 20, (5, 3), generator=g)
    cos, sin = rope_tables(positions, (2, 2, 4), 10000.0, dtype=torch.float64)
    rot = torch.complex(cos, sin)[:, None]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * rot)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected.flatten(-2), rtol=0, atol=1e-14)
    assert apply_rope(x.float(), cos, sin).dtype == torch.float32
    # the real-valued form GPUs and compiled blocks run
    real = torch.compile(apply_rope, backend="eager", fullgraph=True)(x, cos, sin)
    torch.testing.assert_close(real, expected.flatten(-2), rtol=0, atol=1e-14)


def test_qk_norm_runs_in_the_input_dtype_under_autocast():
    block = DiTBlock(DiTConfig(hidden_size=16, num_attention_heads=2, rope_axes_dim=(2, 2, 4)))
    h = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = block._qkv(block.norm1(h))
        normed = block.norm1(h.bfloat16())
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert normed.dtype == torch.bfloat16
    torch.testing.assert_close(q.float(), F.rms_norm(block.qkv(block.norm1(h)).unflatten(-1, (3, 2, -1))[:, :, 0],
                                                     (8,), block.q_norm.weight, 1e-6), rtol=2e-2, atol=2e-2)


def test_a_block_returns_the_video_kv_only_when_asked(monkeypatch):
    # Training never reads a block's video K/V; a compiled block that returned them anyway would
    # have autograd fill their unused gradients with zeros in every backward pass. A rollout's
    # cache asks for them.
    model = tiny(causal_chunk_size=2)
    returned = []
    original = DiTBlock.forward

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.vid is not None:
            returned.append(out.video_kv)
        return out

    monkeypatch.setattr(DiTBlock, "forward", spy)
    x, t, text = inputs()
    model(x, t, text)
    assert returned == [None, None]
    returned.clear()
    cache = model.new_kv_cache(text, torch.ones(B, L, dtype=torch.bool))
    model.commit_chunk(x[:, :, :2], cache, 0)
    assert [k.shape for k, _ in returned] == [(B, 8, 2, 8)] * 2
    assert torch.equal(cache.chunks[0][0][0], returned[0][0])
