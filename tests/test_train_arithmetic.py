"""Training arithmetic a user relies on without looking: gradient accumulation.

Accumulating gradient_accumulation_steps micro-batches must train as one batch holding all of
them: the same loss, the same gradient (not k times it, not the last micro-batch's alone) and
so the same step. The stage's random draws (noise, sigma, caption drop) are keyed by each
sample and the step (trainer.diffusion.sample_draws), so the larger batch is formed here from the same
micro-batches with the same draws: one backward of the mean of their losses, which (equal
sizes, no masked frames) is the mean loss over all their samples.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO_ROOT, TINY_MODEL
from trainer.resolve import resolve_args
from trainer.parallel.distributed import Topology
from trainer.stages.registry import build_stage

TOPOLOGY = Topology(rank=0, world_size=1, local_rank=0, cp_size=1, device=torch.device("cpu"))


def fm_stage(tmp_path, accum: int):
    args, _ = resolve_args([
        "--config", str(REPO_ROOT / "config" / "tiny" / "pretrain.yaml"),
        "--transformer_config_overrides", TINY_MODEL, "--train_batch_size", "2",
        "--gradient_accumulation_steps", str(accum), "--synthetic_num_samples", "16",
        "--data_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
        "--max_grad_norm", "0", "--warmup_steps", "0"], world_size=1)
    torch.manual_seed(0)
    return build_stage(args, TOPOLOGY)


def test_two_accumulated_micro_batches_train_as_one_batch_of_both(tmp_path):
    with torch.random.fork_rng():
        accumulating = fm_stage(tmp_path, accum=2)
        torch.manual_seed(11)
        numbers = accumulating.train_step(1)

        reference = fm_stage(tmp_path, accum=2)  # the same initial weights and data order
        torch.manual_seed(11)
        batches = [reference.data.next_batch() for _ in range(2)]
        losses = [reference.micro_batch_loss(batch, micro, reference.draws(batch, 1))[0]
                  for micro, batch in enumerate(batches)]
        loss = (losses[0] + losses[1]) / 2
        loss.backward()
        grads = [p.grad for p in reference.model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        reference.optimizers["transformer"].step()

    assert numbers["samples"] == 4
    assert numbers["loss"] == pytest.approx(float(loss), rel=1e-6)
    # max_grad_norm 0: grad_norm is the norm of the accumulated gradient, unclipped.
    assert numbers["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for (name, got), want in zip(accumulating.model.state_dict().items(),
                                 reference.model.state_dict().values()):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), name
