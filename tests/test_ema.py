"""trainer/optim/ema.py: the EMA of a model's weights against values worked out by hand, and the EMA
a real FM stage keeps while it trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.optim.ema import EMA


class Weights(nn.Module):
    """One float parameter, one float buffer (tracked) and one integer buffer (not tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("running", torch.zeros(2))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def set(self, value: float) -> "Weights":
        with torch.no_grad():
            self.w.fill_(value)
            self.running.fill_(-value)
            self.count.fill_(int(value))
        return self


def shadow(ema: EMA) -> list[float]:
    return [float(ema.state_dict()["w"][0]), float(ema.state_dict()["running"][0])]


def test_each_update_moves_the_average_by_one_minus_decay_toward_the_live_weights():
    model = Weights().set(0.0)
    ema = EMA(model, decay=0.75)
    # ema <- 0.75 ema + 0.25 live, by hand: 0 -> 1 -> 2.75 -> 2.0625 (all exact in binary).
    expected = []
    for count, live in ((1, 4.0), (2, 8.0), (3, 0.0)):
        assert ema.update(model.set(live), count)
        expected.append(shadow(ema))
    assert expected == [[1.0, -1.0], [2.75, -2.75], [2.0625, -2.0625]]
    assert ema.num_updates == 3
    assert set(ema.state_dict()) == {"w", "running"}  # an integer buffer is not averaged


def test_nothing_moves_before_start_the_start_copies_and_update_every_skips_counts():
    model = Weights().set(1.0)
    ema = EMA(model, decay=0.5, start=3, update_every=2)
    for count in (1, 2):
        assert not ema.update(model.set(10.0 * count), count)
    assert shadow(ema) == [1.0, -1.0]  # still the copy made at construction
    assert ema.update(model.set(6.0), 3)
    assert shadow(ema) == [6.0, -6.0]  # a copy, not an average with the stale shadow
    assert not ema.update(model.set(100.0), 4)  # (4 - 3) % 2 != 0
    assert ema.update(model.set(2.0), 5)
    assert shadow(ema) == [4.0, -4.0]  # 0.5 * 6 + 0.5 * 2
    assert ema.num_updates == 2


def test_decay_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        EMA(Weights(), decay=1.5)


def test_swapping_the_average_in_gives_the_live_weights_back_bit_exactly():
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        model.weight.add_(torch.randn(3, 3))
    ema.update(model, 1)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped_in(model):
        assert torch.equal(model.weight, ema.state_dict()["weight"])
        assert not torch.equal(model.weight, live["weight"])
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


def test_the_fm_stage_averages_its_weights_after_every_optimizer_step(tmp_path):
    from trainer.resolve import resolve_args
    from trainer.parallel.distributed import Topology
    from trainer.stages.registry import build_stage
    from conftest import REPO_ROOT, TINY_MODEL

    args, _ = resolve_args([
        "--config", str(REPO_ROOT / "config" / "tiny" / "sft.yaml"),
        "--transformer_config_overrides", TINY_MODEL, "--load_transformer_weights", "false",
        "--pretrained_transformer_path", "null", "--train_batch_size", "2",
        "--synthetic_num_samples", "8", "--data_path", str(tmp_path / "data"),
        "--output_dir", str(tmp_path / "out"), "--ema_decay", "0.5", "--warmup_steps", "0"],
        world_size=1)
    topo = Topology(rank=0, world_size=1, local_rank=0, cp_size=1, device=torch.device("cpu"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stage = build_stage(args, topo)
        ema = stage.emas["transformer"]
        floats = [k for k, v in stage.model.state_dict().items() if v.is_floating_point()]
        previous = {k: stage.model.state_dict()[k].clone() for k in floats}  # the starting copy
        for step in (1, 2):
            stage.train_step(step)
            live = stage.model.state_dict()
            for k in floats:
                expected = 0.5 * previous[k] + 0.5 * live[k]
                assert torch.allclose(ema.state_dict()[k], expected, rtol=1e-6, atol=1e-7), k
            moved = [k for k in floats if not torch.equal(live[k], previous[k])]
            assert moved, "the optimizer step changed no weight: the check above proves nothing"
            previous = {k: ema.state_dict()[k].clone() for k in floats}
    assert ema.num_updates == 2
