"""Process groups and topology: one place that knows how many ranks there are and where.

Ranks come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from an srun task per GPU
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); a plain `python train.py` is one rank. The world
splits as dp x cp (cp = Ulysses context parallel, consecutive ranks form a cp group).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

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


def wrap_for_training(model: torch.nn.Module, topo: Topology) -> torch.nn.Module:
    """Data parallel when there is more than one rank (FSDP2 comes with sharding)."""
    if not topo.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [topo.device.index] if topo.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


# ---------------------------------------------------------------------------------------------
# Collectives: every one relay calls lives here, and each is a no-op in one process.
# ---------------------------------------------------------------------------------------------

def distributed_active() -> bool:
    """True when a process group is initialised (collectives must then run on every rank)."""
    return dist.is_available() and dist.is_initialized()


def _collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a small tensor must live on for a collective of `group`'s backend."""
    backend = str(dist.get_backend(group)).lower()
    # "gloo", or a mixed "cpu:gloo,cuda:nccl" backend, can reduce a CPU tensor.
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def barrier() -> None:
    if distributed_active():
        dist.barrier()


def rank_in(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if distributed_active() else 0


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank if `flag` is True on any rank (an all-reduce MAX).

    A preemption signal may reach one node only: every rank must still stop at the same step,
    or the ones that go on hang in the next collective. Call it at the same point everywhere.
    """
    if not distributed_active():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over all ranks (the values themselves in one process)."""
    if not distributed_active() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def gather_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """The concatenation over ranks of a detached 1-D tensor (itself in one process)."""
    values = values.detach()
    if not distributed_active() or dist.get_world_size() == 1:
        return values
    work = values.to(_collective_device())
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, work)
    return torch.cat(parts).to(values.device)


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Mean of the gradients over `world` data-parallel ranks, for modules not wrapped in DDP."""
    if world <= 1 or not distributed_active():
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `obj` (of `group`) on every rank."""
    if not distributed_active():
        return obj
    box = [obj]
    if group is None:
        dist.broadcast_object_list(box, src=0)
    else:
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, in rank order ([obj] in one process)."""
    if not distributed_active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def destroy() -> None:
    if distributed_active():
        dist.destroy_process_group()
