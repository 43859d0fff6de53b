"""Process groups and topology: one place that knows how many ranks there are and where.

Ranks come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or from an srun task per GPU
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); a plain `python train.py` is one rank. The world
splits as dp_replicate x dp_shard x cp (trainer.parallel.topology); models are sharded with FSDP2 over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.models.protocol import FORWARD_METHODS


@dataclasses.dataclass(frozen=True)
class Topology:
    """This rank's place in the run: rank, device and the mesh (trainer.parallel.topology's split)."""

    rank: int
    world_size: int
    local_rank: int
    cp_size: int
    device: torch.device
    dp_replicate: int = 1
    dp_shard: int = 1
    # FSDP2's mesh (dp_replicate, dp_shard_cp): 1-D when there is one replica. None in one
    # process, where nothing is sharded.
    fsdp_mesh: Any = None
    # This rank's Ulysses group (cp consecutive ranks); None when cp_size is 1.
    cp_group: Any = None

    @property
    def dp_world(self) -> int:
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

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


def ranks_per_node_from_env() -> int | None:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE or srun's tasks per node); None alone."""
    if not _launched_as_ranks():
        return None
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "8(x240)" -> "8"
    return _env_int("LOCAL_WORLD_SIZE", default=int(tasks) if tasks.isdigit() else 0) or None


def _launched_as_ranks() -> bool:
    # SLURM_NTASKS alone is also set for a single batch task that then runs torchrun; only an
    # srun task (SLURM_STEP_ID present, not the batch step) is itself a rank.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and os.environ.get("SLURM_STEP_ID", "batch") not in (
        "batch", "extern")


def init_distributed(cp_size: int, backend: str = "auto", *, hybrid_shard: bool = False,
                     shard_group_size: int | None = None) -> Topology:
    """Join the process group (if there is more than one rank), pick this rank's device and
    build the FSDP2 mesh of trainer.parallel.topology.plan_mesh. Raises ConfigError for a split that
    does not divide (preflight normally said so already)."""
    from trainer.parallel.topology import plan_mesh

    if _launched_as_ranks():
        rank = _env_int("RANK", "SLURM_PROCID", default=0)
        world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    else:
        rank, world, local_rank = 0, 1, 0
    shape = plan_mesh(world, cp_size=cp_size, hybrid_shard=hybrid_shard,
                      shard_group_size=shard_group_size, ranks_per_node=ranks_per_node_from_env())
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = None
    if world > 1:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            if backend == "auto":
                backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(minutes=30))
        mesh = _fsdp_mesh(device, shape)
    cp_group = None
    if cp_size > 1:
        cp_group, _ = dist.new_subgroups(group_size=cp_size)  # consecutive ranks
    return Topology(rank=rank, world_size=world, local_rank=local_rank, cp_size=cp_size,
                    device=device, dp_replicate=shape.dp_replicate, dp_shard=shape.dp_shard,
                    fsdp_mesh=mesh, cp_group=cp_group)


def _fsdp_mesh(device: torch.device, shape):
    """The mesh FSDP2 shards over: (dp_replicate, dp_shard x cp) ranks, cp innermost, so that
    rank = (replica * dp_shard + shard) * cp + cp_rank as trainer.parallel.topology lays it out."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape.dp_replicate == 1:
        return init_device_mesh(device.type, (shape.shard_group,), mesh_dim_names=("dp_shard_cp",))
    return init_device_mesh(device.type, (shape.dp_replicate, shape.shard_group),
                            mesh_dim_names=("dp_replicate", "dp_shard_cp"))




def shard_model(model: torch.nn.Module, topo: Topology) -> torch.nn.Module:
    """FSDP2 (`fully_shard`) over the run's mesh: each unit the model family names
    (trainer.models.protocol: its blocks), then the root (the embedders, the head). Returns
    the same module, now sharded; a no-op in one process.

    A block is the unit of all-gather: its parameters are gathered just before it runs and
    freed after (reshard_after_forward), so a rank holds the full weights of about one block
    at a time. On GPU parameters compute in bf16 and gradients are reduced in fp32; on CPU
    (gloo) everything stays fp32. A frozen model (no parameter requires grad) is sharded the
    same way and never reduces anything.
    """
    if topo.fsdp_mesh is None:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if topo.device.type == "cuda" else MixedPrecisionPolicy())
    for unit in model.fsdp_units():  # the family's units (its blocks), innermost first
        fully_shard(unit, mesh=topo.fsdp_mesh, mp_policy=policy)
    fully_shard(model, mesh=topo.fsdp_mesh, mp_policy=policy)
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model


def materialise(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Give a model built on the meta device (and sharded: shard_model) real storage on
    `device`, each rank only its own shards, and initialise it as its constructor would (the
    family's `init_weights`, trainer.models.protocol). Returns it."""
    model.to_empty(device=device)
    model.init_weights()
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Within it, backward passes of a sharded `model` reduce gradients only if `enabled`
    (off for all but the last micro-batch of gradient accumulation: the reduction then happens
    once, over the summed gradients)."""
    if not is_sharded(model) or enabled:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def total_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain 0-d tensor: the full norm over every shard for FSDP2's
    DTensor norms."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


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


def max_across_ranks(value: int) -> int:
    """The largest `value` of all ranks (itself in one process): how many rounds of sharded
    forwards every rank runs when the ranks' own counts differ (packs of different lengths)."""
    if not distributed_active() or dist.get_world_size() == 1:
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over all ranks (the values themselves in one process)."""
    if not distributed_active() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-d tensor over all ranks (itself in one process), still a tensor, so the
    host need not wait for it: a logged loss is the global batch's, not rank 0's share."""
    if not distributed_active() or dist.get_world_size() == 1:
        return value
    device = value.device
    work = value.to(_collective_device(), torch.float64)
    dist.all_reduce(work)
    return (work / dist.get_world_size()).to(device)


def gather_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """The concatenation over ranks of a detached 1-D tensor (itself in one process); the
    ranks' lengths may differ (packs hold different numbers of samples)."""
    values = values.detach()
    if not distributed_active() or dist.get_world_size() == 1:
        return values
    work = values.to(_collective_device())
    world = dist.get_world_size()
    # all_gather needs one shape: the lengths first, then every part padded to the longest.
    length = torch.tensor([work.numel()], device=work.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n) for n in lengths]
    padded = torch.cat([work, work.new_zeros(max(sizes) - work.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)]).to(values.device)


def orthogonalize_sharded(updates: list, orthogonalize) -> list:
    """orthogonalize(full matrix) for FSDP2-sharded matrices (DTensors sharded on dim 0 over
    one mesh dim, replicated over any other), without every rank doing every matrix.

    Matrix i is owned by rank i mod S of its shard group: the group's rows are gathered there
    (padded to equal chunks, as FSDP2 chunks dim 0), the owner orthogonalises the whole
    matrix, and the rows are scattered back. Replicas (hybrid shard) do the same in parallel
    on identical inputs, so nothing crosses between them. Returns DTensors placed like
    `updates`, equal to orthogonalising each gathered matrix on one rank.
    """
    from torch.distributed.tensor import DTensor, Shard

    directions = []
    pending = []
    for index, update in enumerate(updates):
        dim = next(d for d, place in enumerate(update.placements) if isinstance(place, Shard))
        if update.placements[dim].dim != 0:
            raise ValueError(f"expected dim-0 sharding, got {update.placements}")
        group = update.device_mesh.get_group(dim)
        size, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        owner = index % size
        rows = update.shape[0]
        chunk = -(-rows // size)
        local = update.to_local()
        padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(size)] if me == owner else None
        dist.gather(padded, parts, group=group, group_dst=owner)
        pending.append((update, group, size, me, owner, rows, chunk, local.shape[0], parts))
    for update, group, size, me, owner, rows, chunk, local_rows, parts in pending:
        scatter = None
        if me == owner:
            full = orthogonalize(torch.cat(parts)[:rows])
            out = torch.zeros((chunk * size, *full.shape[1:]), dtype=full.dtype,
                              device=full.device)
            out[:rows] = full
            scatter = list(out.chunk(size))
        mine = torch.empty((chunk, *update.shape[1:]), dtype=update.dtype,
                           device=update.to_local().device)
        dist.scatter(mine, scatter, group=group, group_src=owner)
        directions.append(DTensor.from_local(mine[:local_rows].contiguous(), update.device_mesh,
                                             update.placements, run_check=False,
                                             shape=update.shape, stride=update.stride()))
    return directions


def exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all over `group` of x [size, ...]: slice s goes to rank s, and slice s of the
    result is what rank s sent this rank. Autograd-aware (the backward is the reverse
    exchange) and written with functional collectives, so a compiled block traces it rather
    than breaking its graph (Ulysses context parallel, trainer.parallel.context_parallel)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


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
    """Tear every process group down; call it on every rank, after a barrier where all ranks
    got there (a rank still in a collective aborts when the others tear down first)."""
    if not distributed_active():
        return
    dist.destroy_process_group()
    # A gloo worker thread frees a finished collective's tensors after the caller already has
    # the result, and needs the GIL for any tensor Python made; destroying the group does not
    # stop that thread. If the interpreter is shutting down by then, Python 3.11 ends the thread
    # inside the destructor and the process aborts with "terminate called without an active
    # exception" (about once in 30 cp runs at exit). Sleeping hands those threads the GIL to
    # finish first. GPU runs have a gloo group too (async checkpoint saves), so always.
    time.sleep(_GLOO_DRAIN_S)


_GLOO_DRAIN_S = 0.2
