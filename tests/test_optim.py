"""Muon, the Muon/AdamW optimizer, the parameter split and LR schedules.

docs/algorithms.md, "Muon", property by property, plus schedule shapes, state round trips and a descent check.
"""

import copy
import math

import pytest
import torch
from torch import nn

from trainer.optim import optimizers as optim

torch.set_num_threads(1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _orthonormal(rows, cols, seed):
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=_gen(seed), dtype=torch.float64))
    return q.float()


# --- Newton-Schulz ---------------------------------------------------------------------------

def test_ns5_squeezes_singular_values_and_keeps_singular_vectors():
    U, V = _orthonormal(64, 32, 1), _orthonormal(32, 32, 2)
    S = torch.linspace(1.0, 0.05, 32)
    X = optim.newton_schulz5(U @ torch.diag(S) @ V.T)
    sv = torch.linalg.svdvals(X)
    assert sv.min() >= 0.6 and sv.max() <= 1.2
    core = U.T @ X @ V
    off_diagonal = core - torch.diag(torch.diagonal(core))
    assert off_diagonal.abs().max() < 1e-4
    assert (torch.diagonal(core) > 0.6).all()


def test_ns5_is_scale_invariant():
    G = torch.randn(48, 24, generator=_gen(3))
    assert torch.allclose(optim.newton_schulz5(7.3 * G), optim.newton_schulz5(G), atol=1e-5)


def test_ns5_keeps_zero_singular_directions_at_zero():
    G = torch.randn(40, 4, generator=_gen(4)) @ torch.randn(4, 24, generator=_gen(5))
    sv = torch.linalg.svdvals(optim.newton_schulz5(G))
    assert (sv[:4] > 0.3).all()
    assert sv[4:].max() < 1e-4


def test_ns5_commutes_with_transpose():
    G = torch.randn(20, 36, generator=_gen(6))
    assert torch.allclose(optim.newton_schulz5(G.T), optim.newton_schulz5(G).T, atol=1e-6)


def test_ns5_keeps_shape_and_dtype_and_rejects_vectors():
    G = torch.randn(5, 9, dtype=torch.float64)
    out = optim.newton_schulz5(G)
    assert out.shape == G.shape and out.dtype == torch.float64
    with pytest.raises(ValueError, match="matrix"):
        optim.newton_schulz5(torch.randn(7))


def test_ns5_of_zero_gradient_is_zero_not_nan():
    assert torch.equal(optim.newton_schulz5(torch.zeros(6, 4)), torch.zeros(6, 4))


# --- Muon update -----------------------------------------------------------------------------

def _one_muon_step(weight, grad, **kwargs):
    p = nn.Parameter(weight.clone())
    opt = optim.Muon([p], **kwargs)
    p.grad = grad.clone()
    opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(12, 6), (6, 12)])
def test_muon_decays_weight_before_the_scaled_update(shape):
    W = torch.randn(shape, generator=_gen(7))
    G = torch.randn(shape, generator=_gen(8))
    lr, wd = 0.1, 0.5
    # First step from a zero buffer: the Nesterov direction is a multiple of G, and NS5 is
    # scale invariant, so the update is NS5(G) times the shape scale.
    O = optim.newton_schulz5(G) * math.sqrt(max(1.0, shape[0] / shape[1]))
    got = _one_muon_step(W, G, lr=lr, weight_decay=wd)
    assert torch.allclose(got, W * (1 - lr * wd) - lr * O, atol=1e-6)
    # Decay after the update would differ by lr^2 * wd * O: the order is observable.
    assert not torch.allclose(got, (W - lr * O) * (1 - lr * wd), atol=1e-4)


def test_muon_without_weight_decay_leaves_weight_unscaled():
    W = torch.randn(8, 8, generator=_gen(7))
    G = torch.randn(8, 8, generator=_gen(8))
    got = _one_muon_step(W, G, lr=0.05, weight_decay=0.0)
    assert torch.allclose(got, W - 0.05 * optim.newton_schulz5(G), atol=1e-6)


def test_muon_momentum_uses_nesterov_lookahead():
    W = torch.zeros(6, 4)
    G1 = torch.randn(6, 4, generator=_gen(1))
    G2 = torch.randn(6, 4, generator=_gen(2))
    p = nn.Parameter(W.clone())
    opt = optim.Muon([p], lr=1.0)
    for g in (G1, G2):
        p.grad = g.clone()
        opt.step()
    M1 = 0.05 * G1
    M2 = 0.95 * M1 + 0.05 * G2
    expected_second = optim.newton_schulz5(0.05 * G2 + 0.95 * M2) * math.sqrt(1.5)
    first = optim.newton_schulz5(G1) * math.sqrt(1.5)
    assert torch.allclose(p.detach(), -first - expected_second, atol=1e-5)
    assert torch.allclose(opt.state[p]["momentum_buffer"], M2, atol=1e-7)


def test_muon_rejects_vector_parameters():
    with pytest.raises(ValueError, match="ndim"):
        optim.Muon([nn.Parameter(torch.zeros(5))])


# --- parameter split -------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d, bias=False)
        self.norm_q = nn.RMSNorm(d)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.modulation = nn.Parameter(torch.zeros(1, 6, d))
        self.scale_shift_table = nn.Parameter(torch.zeros(6, d))
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


class _TinyDiT(nn.Module):
    def __init__(self, d=8, depth=2):
        super().__init__()
        self.patch_embed = nn.Linear(4, d)
        self.time_embed = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(_Block(d) for _ in range(depth))
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.patch_embed(x)
        for block in self.blocks:
            h = h + block.out(block.mlp(block.norm1(h)))
        return self.head(self.norm_out(h))


def test_split_puts_every_trainable_parameter_in_exactly_one_group():
    model = _TinyDiT()
    muon, adamw = optim.split_parameters(model)
    ids_muon, ids_adamw = {id(p) for p in muon}, {id(p) for p in adamw}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert len(ids_muon) == len(muon) and len(ids_adamw) == len(adamw)
    assert not ids_muon & ids_adamw
    assert ids_muon | ids_adamw == trainable
    assert all(p.ndim == 2 for p in muon)


def test_split_sends_only_block_hidden_matrices_to_muon():
    model = _TinyDiT()
    muon, _ = optim.split_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(
        f"blocks.{i}.{leaf}" for i in range(2)
        for leaf in ("qkv.weight", "out.weight", "mlp.0.weight", "mlp.2.weight"))


@pytest.mark.parametrize("name, shape, expected", [
    ("blocks.3.attn.to_q.weight", (8, 8), True),
    ("_orig_mod.blocks.0._checkpoint_wrapped_module.ffn.0.weight", (8, 8), True),
    ("blocks.3.attn.to_q.bias", (8,), False),
    ("blocks.3.norm2.weight", (8,), False),
    ("blocks.3.adaLN_modulation.1.weight", (48, 8), False),
    ("blocks.3.modulation", (6, 8), False),
    ("blocks.3.cond_embed.weight", (8, 8), False),
    ("blocks.3.conv.weight", (8, 8, 3, 3), False),
    ("patch_embedding.weight", (8, 8), False),
    ("head.weight", (8, 8), False),
    ("transformer_blocks_extra.weight", (8, 8), False),
])
def test_muon_rule_by_name_and_shape(name, shape, expected):
    assert optim.is_muon_parameter(name, torch.empty(shape)) is expected


# --- MuonWithAdamW ---------------------------------------------------------------------------

def _fill_grads(model, seed):
    g = _gen(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


def test_adamw_groups_match_torch_adamw():
    model_a, model_b = _TinyDiT(), _TinyDiT()
    model_b.load_state_dict(model_a.state_dict())
    params_a = [p for p in model_a.parameters() if p.requires_grad]
    params_b = [p for p in model_b.parameters() if p.requires_grad]
    ours = optim.MuonWithAdamW([{"params": params_a, "use_muon": False}], lr=1e-2,
                               weight_decay=0.1, eps=1e-8, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.1, eps=1e-8, betas=(0.9, 0.95),
                            foreach=False)
    for seed in range(4):
        _fill_grads(model_a, seed)
        _fill_grads(model_b, seed)
        ours.step()
        ref.step()
    for a, b in zip(params_a, params_b):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_muon_groups_match_standalone_muon():
    W = torch.randn(10, 6, generator=_gen(1))
    p_a, p_b = nn.Parameter(W.clone()), nn.Parameter(W.clone())
    combined = optim.MuonWithAdamW([{"params": [p_a], "use_muon": True}], muon_lr=0.03,
                                   weight_decay=0.2)
    alone = optim.Muon([p_b], lr=0.03, weight_decay=0.2)
    for seed in range(3):
        grad = torch.randn(10, 6, generator=_gen(seed))
        p_a.grad, p_b.grad = grad.clone(), grad.clone()
        combined.step()
        alone.step()
    assert torch.equal(p_a, p_b)


def test_group_without_use_muon_flag_is_rejected():
    with pytest.raises(ValueError, match="use_muon"):
        optim.MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(2, 2))]}])
    with pytest.raises(ValueError, match="ndim"):
        optim.MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(2))], "use_muon": True}])


def test_build_optimizer_gives_each_group_its_learning_rate():
    model = _TinyDiT()
    opt = optim.build_optimizer(model, use_muon=True, learning_rate=3e-4,
                                muon_learning_rate=0.02, weight_decay=0.01)
    assert isinstance(opt, optim.MuonWithAdamW)
    by_kind = {g["use_muon"]: g for g in opt.param_groups}
    assert by_kind[True]["lr"] == 0.02 and by_kind[False]["lr"] == 3e-4
    assert by_kind[False]["betas"] == (0.9, 0.95)
    assert all(g["weight_decay"] == 0.01 for g in opt.param_groups)
    plain = optim.build_optimizer(model, learning_rate=3e-4)
    assert isinstance(plain, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in plain.param_groups) == sum(
        len(g["params"]) for g in opt.param_groups)


def test_build_optimizer_refuses_muon_without_block_matrices():
    with pytest.raises(ValueError, match="use_muon"):
        optim.build_optimizer(nn.Sequential(nn.Linear(3, 3)), use_muon=True, learning_rate=1e-3)


def test_scheduler_scales_both_groups_by_the_same_factor():
    opt = optim.build_optimizer(_TinyDiT(), use_muon=True, learning_rate=1e-3,
                                muon_learning_rate=0.02)
    sched = optim.build_lr_scheduler(opt, lr_scheduler_type="linear", warmup_steps=4,
                                     max_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    factor = optim.lr_multiplier(7, lr_scheduler_type="linear", warmup_steps=4, max_steps=20)
    by_kind = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert by_kind[True] == pytest.approx(0.02 * factor)
    assert by_kind[False] == pytest.approx(1e-3 * factor)


def _train_steps(model, opt, sched, steps, seed):
    for step in range(steps):
        _fill_grads(model, 1000 * seed + step)
        opt.step()
        sched.step()


def test_state_dict_round_trip_continues_identically():
    model = _TinyDiT()
    kwargs = dict(use_muon=True, learning_rate=1e-3, weight_decay=0.01)
    sched_kwargs = dict(lr_scheduler_type="cosine", warmup_steps=2, max_steps=10)
    opt = optim.build_optimizer(model, **kwargs)
    sched = optim.build_lr_scheduler(opt, **sched_kwargs)
    _train_steps(model, opt, sched, 3, seed=1)

    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    clone = _TinyDiT()
    clone.load_state_dict(saved[0])
    clone_opt = optim.build_optimizer(clone, **kwargs)
    clone_sched = optim.build_lr_scheduler(clone_opt, **sched_kwargs)
    clone_opt.load_state_dict(saved[1])
    assert optim.resume_lr_scheduler(clone_sched, saved[2]) == []

    _train_steps(model, opt, sched, 3, seed=2)
    _train_steps(clone, clone_opt, clone_sched, 3, seed=2)
    for (name, a), b in zip(model.named_parameters(), clone.parameters()):
        assert torch.equal(a, b), name
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in clone_opt.param_groups]


def test_a_restart_with_a_new_learning_rate_goes_on_with_it_at_the_saved_step():
    model = _TinyDiT()
    sched_kwargs = dict(lr_scheduler_type="cosine", warmup_steps=2, max_steps=10)
    opt = optim.build_optimizer(model, use_muon=True, learning_rate=1e-3, muon_learning_rate=0.02)
    sched = optim.build_lr_scheduler(opt, **sched_kwargs)
    _train_steps(model, opt, sched, 5, seed=1)
    saved = copy.deepcopy((opt.state_dict(), sched.state_dict()))

    # The user lowers AdamW's LR and restarts; Muon's stays.
    clone_opt = optim.build_optimizer(copy.deepcopy(model), use_muon=True, learning_rate=5e-4,
                                      muon_learning_rate=0.02)
    clone_sched = optim.build_lr_scheduler(clone_opt, **sched_kwargs)
    clone_opt.load_state_dict(saved[0])
    changed = optim.resume_lr_scheduler(clone_sched, saved[1])

    assert changed == [(1e-3, 5e-4)]
    factor = optim.lr_multiplier(5, **sched_kwargs)
    by_kind = {g["use_muon"]: g["lr"] for g in clone_opt.param_groups}
    assert by_kind == {False: pytest.approx(5e-4 * factor), True: pytest.approx(0.02 * factor)}
    assert clone_sched.last_epoch == 5
    clone_opt.step()
    clone_sched.step()  # and the schedule goes on from the new peak
    by_kind = {g["use_muon"]: g["lr"] for g in clone_opt.param_groups}
    assert by_kind[False] == pytest.approx(5e-4 * optim.lr_multiplier(6, **sched_kwargs))


def test_dcp_optimizer_state_dict_round_trip():
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model = _TinyDiT()
    opt = optim.build_optimizer(model, use_muon=True, learning_rate=1e-3)
    _fill_grads(model, 0)
    opt.step()
    state = get_optimizer_state_dict(model, opt)
    muon_name = "blocks.0.qkv.weight"
    assert torch.is_tensor(state["state"][muon_name]["momentum_buffer"])
    assert torch.is_tensor(state["state"]["head.weight"]["exp_avg"])

    clone = copy.deepcopy(model)
    clone_opt = optim.build_optimizer(clone, use_muon=True, learning_rate=1e-3)
    set_optimizer_state_dict(clone, clone_opt, copy.deepcopy(state))
    _fill_grads(model, 5)
    _fill_grads(clone, 5)
    opt.step()
    clone_opt.step()
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_muon_with_adamw_fits_a_small_regression():
    torch.manual_seed(0)
    model = _TinyDiT(d=16)
    x = torch.randn(256, 4, generator=_gen(1))
    y = torch.sin(x @ torch.randn(4, 4, generator=_gen(2)))
    opt = optim.build_optimizer(model, use_muon=True, learning_rate=3e-3,
                                muon_learning_rate=0.02)
    sched = optim.build_lr_scheduler(opt, lr_scheduler_type="cosine", warmup_steps=10,
                                     max_steps=150)
    losses = []
    for _ in range(150):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.3 * losses[0]


# --- LR schedule -----------------------------------------------------------------------------

def _mult(step, **kwargs):
    base = dict(lr_scheduler_type="cosine", warmup_steps=10, max_steps=110)
    base.update(kwargs)
    return optim.lr_multiplier(step, **base)


def test_warmup_rises_linearly_to_peak():
    assert _mult(0) == pytest.approx(0.1)
    assert _mult(4) == pytest.approx(0.5)
    assert _mult(9) == 1.0 and _mult(10) == 1.0


def test_cosine_midpoint_and_end_respect_floor():
    assert _mult(60) == pytest.approx(0.5)
    assert _mult(60, lr_decay_floor_ratio=0.2) == pytest.approx(0.6)
    assert _mult(110, lr_decay_floor_ratio=0.2) == pytest.approx(0.2)
    assert _mult(500, lr_decay_floor_ratio=0.2) == pytest.approx(0.2)
    values = [_mult(s, lr_decay_floor_ratio=0.2) for s in range(10, 300)]
    assert min(values) >= 0.2 - 1e-12
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))


def test_linear_decay_reaches_floor_at_decay_steps_then_stays():
    kw = dict(lr_scheduler_type="linear", lr_decay_steps=40, lr_decay_floor_ratio=0.1)
    assert _mult(30, **kw) == pytest.approx(1 - 0.5 * 0.9)
    assert _mult(50, **kw) == pytest.approx(0.1)
    assert _mult(100, **kw) == pytest.approx(0.1)


def test_constant_schedule_holds_peak_after_warmup():
    assert [_mult(s, lr_scheduler_type="constant", lr_decay_floor_ratio=0.5)
            for s in (10, 50, 1000)] == [1.0, 1.0, 1.0]
    assert _mult(0, lr_scheduler_type="constant", warmup_steps=0) == 1.0


def test_schedule_rejects_bad_settings():
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        _mult(0, lr_scheduler_type="step")
    with pytest.raises(ValueError, match="decay step"):
        _mult(0, lr_decay_steps=0)
    with pytest.raises(ValueError, match="floor"):
        _mult(0, lr_decay_floor_ratio=1.5)


def test_run_shorter_than_warmup_still_gets_a_schedule():
    # `--max_steps 20` on a config with 100 warm-up steps: warm-up is simply cut short.
    values = [_mult(s, warmup_steps=100, max_steps=20) for s in range(20)]
    assert values == sorted(values) and 0 < values[-1] <= 0.21


def test_lr_scheduler_applies_multiplier_to_initial_lr():
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = optim.build_lr_scheduler(opt, lr_scheduler_type="cosine", warmup_steps=4,
                                     max_steps=24, lr_decay_floor_ratio=0.1)
    seen = []
    for _ in range(30):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.5 * 0.25)
    assert seen[3] == pytest.approx(0.5)
    assert seen[14] == pytest.approx(0.5 * (0.1 + 0.9 * 0.5))
    assert seen[-1] == pytest.approx(0.05)


# --- sharded (FSDP2-style DTensor) parameters ------------------------------------------------

def _muon_on_sharded_matches_plain(rank, world_size, init_method):
    """Two Muon steps on a Shard(0) DTensor weight equal the same steps on a plain tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.parallel.distributed import destroy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        W = torch.randn(10, 6, generator=_gen(0))
        plain = nn.Parameter(W.clone())
        sharded = nn.Parameter(distribute_tensor(W.clone(), mesh, [Shard(0)]))
        opt_plain = optim.Muon([plain], lr=0.05, weight_decay=0.1)
        opt_sharded = optim.Muon([sharded], lr=0.05, weight_decay=0.1)
        for seed in (1, 2):
            grad = torch.randn(10, 6, generator=_gen(seed))
            plain.grad = grad.clone()
            sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            opt_plain.step()
            opt_sharded.step()
        buf = opt_sharded.state[sharded]["momentum_buffer"]
        assert buf.placements == sharded.placements  # state stays sharded like the weight
        assert torch.allclose(sharded.full_tensor(), plain.detach(), atol=1e-6)
    finally:
        destroy()  # with the pause a spawned rank needs before its interpreter exits


def test_muon_on_single_rank_dtensor_matches_plain(tmp_path):
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    _muon_on_sharded_matches_plain(0, 1, f"file://{tmp_path / 'store'}")


def test_muon_on_two_rank_sharded_weight_matches_plain(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_muon_on_sharded_matches_plain, args=(2, f"file://{tmp_path / 'store'}"),
             nprocs=2, join=True)
