"""One rank of tests/integration/test_save_failure.py: a save that fails on rank 1 only.

    python -m torch.distributed.run --nproc_per_node 2 --master_port P \
        tests/integration/save_failure_worker.py OUT

An FSDP2-sharded toy model on a gloo CPU mesh saves checkpoint-1, then tries three saves
while rank 1 alone cannot write large files (RLIMIT_FSIZE, as a full disk or a quota on its
node would refuse): step 2 fails writing rank 1's model shard, step 3 (asynchronous) too,
step 4 fails writing rank 1's oversized data cursor, after every shard was written. With the
limit lifted, step 5 saves. Each rank records the error text of each save in
OUT/result-<rank>.json.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trainer.checkpoint.store import CheckpointError, CheckpointManager, ModelMember  # noqa: E402
from trainer.parallel.distributed import destroy  # noqa: E402

# Bytes rank 1 may write per file while "the disk is full". Its model shard (half of two
# 64 x 64 layers) is about 17 KB: the small limit refuses it, the large one refuses only a
# cursor padded past it.
SMALL_LIMIT, LARGE_LIMIT = 2048, 65536


def save(manager: CheckpointManager, model: nn.Module, step: int, rank: int,
         cursor_pad: int = 0) -> str | None:
    """The error this rank sees for the save of `step` (None if it was saved)."""
    cursor = {"rank": rank, "pad": "x" * cursor_pad}
    try:
        manager.save(step, members={"transformer": ModelMember(model)},
                     training_state={"step": step}, dataloader_state=cursor, dp_rank=rank,
                     dp_world=2, world_size=2)
        manager.wait()
    except CheckpointError as exc:
        return str(exc)
    return None


def limit(rank: int, size: int) -> None:
    """Limit the size of the files rank 1 may write (up to the hard limit, which stays)."""
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    # A write past RLIMIT_FSIZE raises SIGXFSZ, which would kill the process; ignored, the
    # write fails with EFBIG like any other I/O error.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    errors: dict[str, str | None] = {}
    with CheckpointManager(out) as sync, CheckpointManager(out, async_save=True) as background:
        errors["1"] = save(sync, model, 1, rank)
        limit(rank, SMALL_LIMIT)
        errors["2"] = save(sync, model, 2, rank)
        errors["3"] = save(background, model, 3, rank)
        limit(rank, LARGE_LIMIT)
        errors["4"] = save(sync, model, 4, rank, cursor_pad=2 * LARGE_LIMIT if rank == 1 else 0)
        limit(rank, hard)
        errors["5"] = save(sync, model, 5, rank)
    (out / f"result-{rank}.json").write_text(json.dumps(errors))
    dist.barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main()
