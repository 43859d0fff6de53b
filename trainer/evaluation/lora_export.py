"""`relay export` of a LoRA run: the adapters as peft writes them, or merged into the base.

- `--format peft` (`write_peft`): a directory holding `adapter_model.safetensors`,
  `pytorch_lora_weights.safetensors` (the same file under diffusers' default LoRA weight name,
  a hard link where the filesystem has them, else a copy) and `adapter_config.json`. The
  tensors are the adapters under diffusers' key names
  (`transformer.blocks.0.attn1.to_q.lora_A.weight`), with peft's LoraConfig in the file's
  `lora_adapter_metadata` as diffusers' `save_lora_weights` writes it, so a Wan pipeline's
  `load_lora_weights(dir)` and `WanTransformer3DModel.load_lora_adapter(dir,
  use_safetensors=True)` find `pytorch_lora_weights.safetensors` with no `weight_name` and
  apply the run's lora_alpha / r; `adapter_config.json` is the same LoraConfig with
  `base_model_name_or_path` naming the base.
- `--merge-lora` (`merged_state_dict`, for the full-weight formats): the base with each adapted
  weight W replaced by W + (lora_alpha / r) B A, under the family's own keys: what the other
  writers write for a full run.

Both check the base by the reference the checkpoint recorded (trainer.checkpoint.lora_base) and
refuse a base whose bytes changed since the run trained on it (`check_recorded_base`): the
merge reads it, and the adapters alone mean something only on it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from trainer.models.lora_targets import lora_enabled, lora_scale
from trainer.runtime.files import follow_umask, replace_directory

ADAPTER_FILE = "adapter_model.safetensors"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
ADAPTER_CONFIG_FILE = "adapter_config.json"
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer"  # the pipeline component the adapters belong to


class LoraExportError(ValueError):
    """A LoRA export that cannot be written as asked (trainer.evaluation.export turns it into
    its ExportError); the message says what to do instead."""


def _export_error(message: str) -> Exception:
    return LoraExportError(message)


def require_lora(source, what: str) -> None:
    """Raise LoraExportError when `source` (trainer.evaluation.export.ExportSource) is not a LoRA
    run's checkpoint, for the request `what`."""
    if not lora_enabled(source.args):
        raise _export_error(f"{what} exports a LoRA run's adapters, and {source.checkpoint} is "
                            f"a run that trained every weight (lora_rank 0). Export it with "
                            f"--format relay or --format diffusers.")


def check_recorded_base(source) -> None:
    """Raise CheckpointError, in one paragraph, when the base `source`'s run names now holds
    other bytes than the one its checkpoint recorded (trainer.checkpoint.lora_base): the
    adapters would be exported for, or merged into, weights they were not trained on."""
    from trainer.checkpoint.lora_base import check_base, read_recorded_base

    args = source.args
    check_base(args["pretrained_transformer_path"], args["pretrained_weights"],
               read_recorded_base(source.checkpoint), source.checkpoint.name)


def _adapters(source) -> dict[str, Any]:
    from trainer.checkpoint.lora_weights import checkpoint_adapters

    return checkpoint_adapters(source.checkpoint, weights=source.weights, member=source.member)


def adapter_config(args, layers: list[str]):
    """peft's LoraConfig of the run, targeting exactly the adapted `layers`."""
    from trainer.models.lora import lora_config

    config = lora_config(args, layers)
    config.base_model_name_or_path = str(args.get("pretrained_transformer_path"))
    return config


def _config_dict(config) -> dict[str, Any]:
    """LoraConfig.to_dict() in JSON types (sets as sorted lists), as diffusers stores it."""
    plain = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            value = sorted(value)
        plain[key] = value
    return json.loads(json.dumps(plain, default=str))


def write_peft(source, out: Path, *, overwrite: bool) -> list[str]:
    """The adapters of `source` as a peft/diffusers LoRA directory at `out` (module docstring).
    Returns the lines to print. Raises LoraExportError for a run without adapters or an `out` that
    exists (without `overwrite`) or holds something else, CheckpointError when the base changed
    since the run trained on it."""
    from safetensors.torch import save_file

    require_lora(source, "--format peft")
    check_recorded_base(source)
    _check_out(out, overwrite)
    adapters = _adapters(source)
    layers = sorted({key.rsplit(".lora_", 1)[0] for key in adapters})
    config = _config_dict(adapter_config(source.args, layers))
    tensors = {f"{PREFIX}.{key}": value.contiguous() for key, value in sorted(adapters.items())}
    metadata = {"format": "pt",
                METADATA_KEY: json.dumps({f"{PREFIX}.{k}": v for k, v in config.items()},
                                         indent=2, sort_keys=True)}
    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata=metadata)
        follow_umask(tmp / ADAPTER_FILE)  # safetensors creates it 0600
        _same_file(tmp / ADAPTER_FILE, tmp / DIFFUSERS_FILE)
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    _publish_directory(out, fill)
    rank = int(source.args["lora_rank"])
    return [f"wrote {out / ADAPTER_FILE} ({len(layers)} adapted layers, rank {rank}, scale "
            f"{lora_scale(source.args):g}), the same file as {out / DIFFUSERS_FILE}, and "
            f"{out / ADAPTER_CONFIG_FILE}, from {source.describe()}"]


EXPERTS_FILE = "adapters.json"  # a Wan2.2 A14B pair: which adapter goes into which expert


def write_peft_pair(experts: dict[str, Any], out: Path, *, overwrite: bool) -> list[str]:
    """The adapters of a Wan2.2 A14B pair of LoRA runs, {"transformer": run of the high-noise
    expert, "transformer_2": run of the low-noise one}, as two named adapters at `out`:
    high_noise/ and low_noise/, each a directory of write_peft, and adapters.json saying which
    goes into which transformer of WanPipeline (load_into_transformer_2 for low_noise).
    Written to a temporary directory and moved into place whole."""
    names = {"transformer": "high_noise", "transformer_2": "low_noise"}
    if out.exists() and not out.is_dir():
        raise _export_error(f"{out} is a file, and --format peft writes a directory: choose a "
                            f"directory path (it is created).")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise _export_error(f"{out} already exists: an export does not replace it unless "
                                f"asked. Choose another directory, or replace it on purpose "
                                f"with relay export --force.")
        if not (out / EXPERTS_FILE).is_file():
            raise _export_error(f"{out} holds files that are not a LoRA pair export (no "
                                f"{EXPERTS_FILE}); --force replaces only a previous export. "
                                f"Choose another directory.")
    lines: list[str] = []

    def fill(tmp: Path) -> None:
        record = {}
        for folder, name in names.items():
            lines.extend(line.replace(str(tmp), str(out)) for line in
                         write_peft(experts[folder], tmp / name, overwrite=False))
            record[name] = {"transformer": folder, "source": experts[folder].describe(),
                            "load_into_transformer_2": folder == "transformer_2"}
        (tmp / EXPERTS_FILE).write_text(json.dumps(record, indent=2) + "\n")

    _publish_directory(out, fill)
    return lines + [f"wrote {out / EXPERTS_FILE}: pipe.load_lora_weights('{out}/high_noise', "
                    f"adapter_name='high_noise'); pipe.load_lora_weights('{out}/low_noise', "
                    f"adapter_name='low_noise', load_into_transformer_2=True)"]


def _publish_directory(out: Path, fill) -> None:
    """`fill(tmp)` writes the export into a temporary directory beside `out`, which then
    replaces `out` whole; nothing partial is left on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.relay-export-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        fill(tmp)
        replace_directory(tmp, out)
    except OSError as exc:
        raise _export_error(f"could not write {out} ({exc.strerror or exc}); nothing partial was "
                            f"left there. Free space or choose another directory.") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _same_file(written: Path, name: Path) -> None:
    """`written` under a second `name` too: a hard link, else (a filesystem without them) a copy
    with the same mode."""
    try:
        os.link(written, name)
    except OSError:
        shutil.copyfile(written, name)
        follow_umask(name)


def merged_state_dict(source) -> dict[str, Any]:
    """The full weights of a LoRA checkpoint: its base (checked against the recorded digest)
    with the adapters merged in, under the module's own keys. Raises LoraExportError when it is
    not a LoRA run, CheckpointError when the base changed or cannot be read."""
    import torch

    from trainer.build import build_model
    from trainer.checkpoint.lora_weights import load_base
    from trainer.models.lora import merge_adapter

    require_lora(source, "--merge-lora")
    args = source.args
    check_recorded_base(source)
    model = build_model(args, torch.device("cpu"), source.model_config)
    load_base(model, args)
    base = {key: value.detach() for key, value in model.state_dict().items()}
    del model
    return merge_adapter(base, _adapters(source), lora_scale(args))


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise _export_error(f"{out} is a file, and --format peft writes a directory: choose a "
                            f"directory path (it is created).")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise _export_error(f"{out} already exists: an export does not replace it unless asked. "
                            f"Choose another directory, or replace it on purpose with relay "
                            f"export --force.")
    if not (out / ADAPTER_FILE).is_file():
        raise _export_error(f"{out} holds files that are not a LoRA export (no {ADAPTER_FILE}); "
                            f"--force replaces only a previous export. Choose another directory.")
