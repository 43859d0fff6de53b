"""One rank of tests/test_streamed_warm_start.py (run under torchrun, gloo, CPU): builds the
wan model of a diffusers directory as a streamed warm start builds it, counts the bytes it
allocates, loads the directory, and writes what it found to <out>/rank<r>.json.

    python -m torch.distributed.run --nproc_per_node 2 tests/streamed_load_worker.py DIR OUT DATA
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.build import build_trained_model  # noqa: E402
from trainer.checkpoint import warm_start  # noqa: E402
from trainer.resolve import resolve_config  # noqa: E402
from trainer.models.registry import family_of  # noqa: E402
from trainer.parallel.distributed import init_distributed  # noqa: E402


def _storage(t: torch.Tensor):
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local, local.untyped_storage().data_ptr()


class AllocatedBytes(TorchDispatchMode):
    """Every byte of tensor storage that torch ops create while it is active (an op's outputs
    that alias none of its inputs; a DTensor counts its local part; meta tensors nothing): the
    sum bounds from above what was ever held at once."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)[1] for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                local, ptr = _storage(t)
                if ptr not in inputs and local.numel():
                    self.bytes += local.untyped_storage().nbytes()
        return out


def main(directory: str, out: str, data: str) -> None:
    args = resolve_config(str(ROOT / "config/tiny/pretrain.yaml"), [
        "--model_family", "wan", "--pretrained_transformer_path", directory,
        "--load_transformer_weights", "true", "--transformer_config_overrides", "{}",
        "--text_encoder", "standin", "--data_path", data, "--output_dir", out],
        world_size=2, cwd=ROOT, check_paths=False)
    topo = init_distributed(args.cp_size)
    torch.manual_seed(0)
    meter = AllocatedBytes()
    with meter:
        model = build_trained_model(args, topo, warm_start=True)
    streamed_build = meter.bytes
    params = list(model.parameters())
    whole_model = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel: global
    # What the rank holds of them: each shard's storage (FSDP2 pads uneven ones).
    shards = sum({_storage(p)[1]: _storage(p)[0].untyped_storage().nbytes()
                  for p in params}.values())
    held: list[int] = []
    warm_start.LOAD_OBSERVERS.append(lambda key, size: held.append(size))
    report = warm_start.load_warm_start(directory, model, weights="live", family=family_of(args))
    warm_start.LOAD_OBSERVERS.clear()
    gathered = {key: value.full_tensor() if isinstance(value, DTensor) else value
                for key, value in model.state_dict().items()}
    # The files, read whole here (the test's reference), through the same adapter.
    from safetensors.torch import load_file
    from trainer.checkpoint.weights_source import resolve_weights_source

    adapter = family_of(args).state_dict_adapter("diffusers")
    stored = {}
    for file in resolve_weights_source(directory, weights="live").files:
        for key, value in load_file(str(file)).items():
            if adapter.to_relay(key) is not None:
                stored[adapter.to_relay(key)] = value
    differ = sorted(key for key in stored
                    if key not in gathered or not torch.equal(gathered[key], stored[key]))
    # The old way for contrast: the model built whole on this rank, then sharded.
    meter = AllocatedBytes()
    with meter:
        build_trained_model(args, topo)
    (Path(out) / f"rank{topo.rank}.json").write_text(json.dumps({
        "sharded": all(isinstance(p, DTensor) for p in params),
        "whole_model_bytes": whole_model, "shard_bytes": shards,
        "streamed_build_bytes": streamed_build, "whole_build_bytes": meter.bytes,
        "largest_tensor_held": max(held), "tensors_read": len(held),
        "differ": differ, "files_keys": len(stored), "report": report}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
