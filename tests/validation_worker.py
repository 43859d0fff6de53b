"""One rank of the sharded validation test (tests/test_validation_ranks.py).

    python -m torch.distributed.run --nproc_per_node N --master_port P \
        tests/validation_worker.py DATA VAE OUT

Joins gloo through trainer.parallel.distributed, builds the pretrain stage with trainer.build (FSDP2
over every rank when N > 1; the tiny AutoencoderKLWan at VAE), validates once as train.py does
(trainer.train._validate) and writes OUT/rank-<rank>.json: whether this process loaded the VAE
(trainer.encoders.vae caches the one it decodes with) and the metric names validation returned.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from test_data_train import MODEL
from trainer import train
from trainer.encoders import vae
from trainer.evaluation.validation import ValidationSettings
from trainer.resolve import resolve_args
from trainer.stages.registry import build_stage
from trainer.parallel.distributed import barrier, destroy, init_distributed

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    data, vae_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    args, _ = resolve_args(["--config", str(ROOT / "config" / "tiny" / "pretrain.yaml"),
                            "--transformer_config_overrides", MODEL, "--synthetic_data", "false",
                            "--data_path", data, "--output_dir", str(out), "--vae_path", vae_dir,
                            "--packing_token_budget", "60", "--validation_num_captions", "2",
                            "--validation_steps", "2", "--validation_weights", "live"])
    topo = init_distributed(args.cp_size, backend="gloo")
    torch.manual_seed(args.seed)  # as train.py: the same initial weights on every rank
    stage = build_stage(args, topo)
    metrics = train._validate(stage, ValidationSettings.of(args), 1, out, topo)
    report = {"sharded": topo.fsdp_mesh is not None,
              "vae_loaded": vae._cached_vae.cache_info().currsize, "metrics": sorted(metrics)}
    (out / f"rank-{topo.rank}.json").write_text(json.dumps(report))
    barrier()  # a rank that exits without tearing gloo down, or before the others, aborts
    destroy()


if __name__ == "__main__":
    main()
