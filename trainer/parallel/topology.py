"""How a run's ranks split into data-parallel replicas, shard groups and context-parallel groups.

Torch-free: `relay submit` and `train.py --dry-run` check the split before any process group
exists, and trainer.parallel.distributed builds its device mesh from the same answer, so what the login
node printed is what the job runs.

The world is dp_replicate x dp_shard x cp, cp innermost (consecutive ranks form a cp group,
so a cp group stays inside a node) and dp_replicate outermost (replicas talk across nodes
only for the gradient all-reduce). FSDP2 shards parameters over the dp_shard x cp ranks of
one replica: cp ranks hold the same weights and see different tokens of the same samples, so
their gradients are reduced together with the shard group's.
"""

from __future__ import annotations

import dataclasses

from trainer.config.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int
    cp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each reads its own samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks that share one copy of the parameters (FSDP2's shard group)."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} x cp {self.cp} (parameters sharded over {self.shard_group} "
                f"ranks, {self.dp_replicate} replica(s))")


def plan_mesh(world_size: int, *, cp_size: int, hybrid_shard: bool,
              shard_group_size: int | None, ranks_per_node: int | None) -> MeshShape:
    """The split of `world_size` ranks the run's keys ask for. Raises ConfigError with the
    arithmetic when it does not divide.

    hybrid_shard false: one replica, parameters sharded over every rank. hybrid_shard true:
    shard groups of shard_group_size ranks (default: the ranks of one node), replicated across
    the groups. shard_group_size without hybrid_shard is refused (it would be ignored).
    """
    if world_size % cp_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by cp_size {cp_size}. Use a cp_size "
            f"that divides the number of ranks (nodes x gpus_per_node).")
    if not hybrid_shard:
        if shard_group_size is not None:
            raise ConfigError(
                f"shard_group_size is {shard_group_size} but hybrid_shard is false, so it would "
                f"be ignored (full sharding uses all {world_size} ranks). Set hybrid_shard: true "
                f"or shard_group_size: null.")
        return MeshShape(1, world_size // cp_size, cp_size)
    group = shard_group_size if shard_group_size is not None else ranks_per_node
    if group is None:
        raise ConfigError(
            "hybrid_shard is true but the ranks per node are unknown here; set "
            "shard_group_size (usually gpus_per_node).")
    if group < 1 or world_size % group:
        raise ConfigError(
            f"hybrid_shard: the shard group of {group} ranks does not divide the world size "
            f"{world_size} ({world_size} / {group} = {world_size / group:g} replicas). Use a "
            f"shard_group_size that divides {world_size}.")
    if group % cp_size:
        raise ConfigError(
            f"hybrid_shard: the shard group of {group} ranks is not a multiple of cp_size "
            f"{cp_size}; a cp group must fit inside one shard group.")
    return MeshShape(world_size // group, group // cp_size, cp_size)
