"""One rank of tests/integration/test_distributed_muon.py: Muon on FSDP2-sharded weights
against Muon on an unsharded copy, from the same gradients. Writes <out>/<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainer.optim.optimizers as optim
from trainer.parallel.distributed import destroy


def build() -> nn.Module:
    torch.manual_seed(0)
    # Row counts that 2 and 4 ranks do not divide evenly (FSDP2 pads the last chunks).
    return nn.Sequential(nn.Linear(7, 5, bias=False), nn.Linear(5, 9, bias=False),
                         nn.Linear(9, 16, bias=False), nn.Linear(16, 3, bias=False))


def main(out: Path, replicas: int) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    shape, names = ((world,), ("shard",)) if replicas == 1 else (
        (replicas, world // replicas), ("replicate", "shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference, sharded = build(), build()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    calls = {"n": 0}
    real = optim.newton_schulz5

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    optim.newton_schulz5 = counted
    opts = [optim.Muon(m.parameters(), lr=0.05, weight_decay=0.1) for m in (reference, sharded)]
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))  # the same on every rank
    ref_calls = 0
    for _ in range(3):
        for model, opt in zip((reference, sharded), opts):
            model(x).square().mean().backward()
            before = calls["n"]
            opt.step()
            opt.zero_grad()
            if model is reference:
                ref_calls += calls["n"] - before
                calls["n"] = before
    diff = max(float((a.full_tensor() - b).abs().max())
               for a, b in zip(sharded.parameters(), reference.parameters()))
    (out / f"{rank}.json").write_text(json.dumps(
        {"max_abs_diff": diff, "sharded_ns_calls": calls["n"], "reference_ns_calls": ref_calls}))
    dist.barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
