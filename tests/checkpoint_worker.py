"""One rank of the two-process checkpoint test (tests/test_checkpoint_distributed.py).

    python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/checkpoint_worker.py save|resume OUT

`save`: an FSDP2-sharded toy model on a gloo CPU mesh saves (async) at steps 2, 4 and 6; steps 3
and 4 are the reference. Between the phases the test corrupts rank 1's shard of checkpoint-6.
`resume`: a differently initialised model resumes. checkpoint-6 fails inside DCP on rank 1;
checkpoint-4 loads, then fails on rank 1 only (as applying a data cursor might); both ranks
must agree each time and fall back to checkpoint-2, then repeat steps 3 and 4 bit for bit.
Then fresh sharded models warm-start from checkpoint-2 and from a plain state dict file.
Each rank writes OUT/result-<phase>-<rank>.json for the test to check.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trainer.checkpoint.store import (
    CheckpointManager,
    ModelMember,
    OptimizerMember,
    find_resume_checkpoint,
    load_checkpoint,
)  # noqa: E402
from trainer.checkpoint.rng import capture_rng_state, restore_rng_state  # noqa: E402
from trainer.checkpoint.warm_start import load_warm_start  # noqa: E402
from trainer.parallel.distributed import any_rank, destroy  # noqa: E402


def build(seed: int, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    loss = model(torch.randn(6, 4)).pow(2).mean()  # each rank draws its own batch
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def full_weights(model: nn.Module) -> dict[str, list]:
    return {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}


def all_rng_states() -> dict[str, dict]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, capture_rng_state())
    return {str(rank): state for rank, state in enumerate(gathered)}


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format="[rank %(process)d] %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    topology = {"dp_rank": rank, "dp_world": 2, "world_size": 2, "cp_size": 1}
    result: dict = {}
    if phase == "save":
        model, optimizer = build(0, mesh)
        torch.manual_seed(100 + rank)
        with CheckpointManager(out, async_save=True) as manager:
            for step in (1, 2):
                train_step(model, optimizer)
            manager.save(2, members={"transformer": ModelMember(model), "optimizer": OptimizerMember(model, optimizer)},
                         training_state={"step": 2, "rng": all_rng_states()},
                         dataloader_state={"rank": rank, "pos": 20 + rank}, **topology)
            result["weights_at_2"] = full_weights(model)
            if rank == 0:  # a plain state dict file, for the warm-start check
                torch.save({k: torch.tensor(v) for k, v in result["weights_at_2"].items()}, out / "plain.pt")
            result["reference_losses"] = [train_step(model, optimizer) for _ in (3, 4)]
            result["reference_weights"] = full_weights(model)
            for step in (4, 6):
                if step == 6:
                    train_step(model, optimizer)
                    train_step(model, optimizer)
                manager.save(step, members={"transformer": ModelMember(model),
                                            "optimizer": OptimizerMember(model, optimizer)},
                             training_state={"step": step, "rng": all_rng_states()},
                             dataloader_state={"rank": rank, "pos": 10 * step + rank}, **topology)
        result["blocked_s"] = [t.blocked_s for t in manager.timings]
        result["preemption_agreed"] = any_rank(rank == 1)
    else:
        model, optimizer = build(123, mesh)
        loaded: dict = {}

        def load(path: Path) -> None:
            loaded["state"], loaded["cursor"] = load_checkpoint(
                path, {"transformer": ModelMember(model), "optimizer": OptimizerMember(model, optimizer)},
                dp_rank=rank, dp_world=2, cp_size=1)
            if path.name == "checkpoint-4" and rank == 1:
                raise ValueError("simulated: rank 1 cannot apply its data cursor")

        path = find_resume_checkpoint(out, load)
        restore_rng_state(loaded["state"]["rng"][str(rank)])
        result["path"] = str(path)
        result["step"] = loaded["state"]["step"]
        result["cursor"] = loaded["cursor"]
        result["losses"] = [train_step(model, optimizer) for _ in (3, 4)]
        result["weights"] = full_weights(model)
        # Warm starts into a sharded model: from a DCP member (read shard by shard) and a plain file.
        for source, seed in (("checkpoint-2", 7), ("plain.pt", 8)):
            fresh, _ = build(seed, mesh)
            load_warm_start(out / source, fresh, weights="live")
            result[f"warm_start_from_{source}"] = full_weights(fresh)
    (out / f"result-{phase}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main()
