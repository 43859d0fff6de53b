"""One rank of the multi-process data test (tests/test_data_ranks.py).

    python -m torch.distributed.run --nproc_per_node N --master_port P tests/data_rank_worker.py DATA OUT CP

Joins the gloo process group through trainer.parallel.distributed, builds this rank's iterator with
trainer.build.build_data (packs of a FastVideo-layout dataset, 2 workers), reads one epoch and
writes OUT/rank-<rank>.json with its dp rank and the global sample indices it read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.resolve import resolve_args
from trainer.build import build_data
from trainer.parallel.distributed import barrier, broadcast_from_rank0, destroy, init_distributed


def main() -> None:
    data, out, cp = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    args, _ = resolve_args(["--data_path", data, "--output_dir", str(out), "--cp_size", cp,
                            "--transformer_config_overrides",
                            "{text_dim: 8, in_channels: 4, patch_size: [1, 2, 2]}",
                            "--packing_token_budget", "60", "--packed_dataloader_num_workers", "2",
                            "--validation_interval", "-1"])  # 4-channel latents, no VAE
    topo = init_distributed(args.cp_size, backend="gloo")
    iterator = build_data(args, topo)
    # Under cp only cp rank 0 holds a reader; it says for its group when the epoch is done.
    reader = getattr(iterator, "reader", iterator)
    seen = []
    while True:
        more = reader is not None and (reader.cursor["streams"]["all"]["position"]
                                       < reader.plan.per_rank["all"])
        if topo.cp_group is not None:
            more = broadcast_from_rank0(more, topo.cp_group)
        if not more:
            break
        seen.extend(iterator.next_batch()["sample_index"].tolist())
    (out / f"rank-{topo.rank}.json").write_text(json.dumps({"dp_rank": topo.dp_rank, "seen": seen,
                                                              "reads": reader is not None}))
    barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main()
