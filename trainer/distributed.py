"""Process groups and topology: one place that knows how many ranks there are and where.

Ranks come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from an srun task per GPU
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); a plain `python train.py` is one rank. The world
splits as dp x cp (cp = Ulysses context parallel, consecutive ranks form a cp group).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    cp_size: int
    device: torch.device

    @property
    def dp_world(self) -> int:
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def world_size_from_env() -> int:
    """The world size this process will join (1 outside torchrun/srun)."""
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1) if _launched_as_ranks() else 1


def _launched_as_ranks() -> bool:
    # SLURM_NTASKS alone is also set for a single batch task that then runs torchrun; only an
    # srun task (SLURM_STEP_ID present, not the batch step) is itself a rank.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and os.environ.get("SLURM_STEP_ID", "batch") not in (
        "batch", "extern")


def init_distributed(cp_size: int, backend: str = "auto") -> Topology:
    """Join the process group (if there is more than one rank) and pick this rank's device."""
    if _launched_as_ranks():
        rank = _env_int("RANK", "SLURM_PROCID", default=0)
        world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    else:
        rank, world, local_rank = 0, 1, 0
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))
    return Topology(rank=rank, world_size=world, local_rank=local_rank, cp_size=cp_size,
                    device=device)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_max(value: float) -> float:
    """The maximum of a scalar over all ranks (the scalar itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def all_reduce_mean(value: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
