"""No part of a checkpoint can run code: relay's own loaders, fed pickles that would.

A checkpoint is files on shared storage that anyone with write access can replace. Each test
plants a pickle whose unpickling creates a marker file, in one of the places relay unpickles
(training_state.pt, a plain weights file, a non-tensor value inside a DCP shard), then loads
through the function the trainer and the relay commands call. The marker must never appear.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint.store import (
    CheckpointError,
    ModelMember,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.checkpoint.layout import COMPLETE_FILE, QUARANTINE_REASON_FILE, TRAINING_STATE_FILE
from trainer.checkpoint.warm_start import load_warm_start


class RunsCode:
    """Unpickling this calls open(path, "w"): it creates `path`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def replace_file(checkpoint: Path, rel: str, data: bytes) -> None:
    """Overwrite one file of a checkpoint and record its new size, as an attacker would."""
    (checkpoint / rel).write_bytes(data)
    complete = json.loads((checkpoint / COMPLETE_FILE).read_text())
    complete["files"][rel] = len(data)
    (checkpoint / COMPLETE_FILE).write_text(json.dumps(complete))


def pickled(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_resume_refuses_a_training_state_that_would_run_code_and_falls_back(tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(out, step, members={"transformer": ModelMember(model(step))},
                        training_state={"step": step}, dataloader_state={"cursor": step})
    replace_file(out / "checkpoint-2", TRAINING_STATE_FILE,
                 pickled({"format": 1, "state": {"step": 2, "hook": RunsCode(marker)}}))

    fresh = model(7)
    loaded = {}

    def load(path: Path) -> None:
        loaded["state"], _ = load_checkpoint(path, {"transformer": ModelMember(fresh)})

    assert find_resume_checkpoint(out, load) == out / "checkpoint-1"
    assert not marker.exists()
    assert loaded["state"]["step"] == 1
    assert torch.equal(fresh.weight, model(1).weight)
    reason = (out / "checkpoint-2.bad" / QUARANTINE_REASON_FILE).read_text()
    assert TRAINING_STATE_FILE in reason


@pytest.mark.parametrize("layout", ["weights.pt", "dir/model_state.pt"])
def test_a_warm_start_file_that_would_run_code_is_refused(tmp_path, layout):
    marker = tmp_path / "ran"
    source = tmp_path / layout
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(pickled({"weight": torch.zeros(2, 3), "bias": RunsCode(marker)}))
    target = model(0)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    with pytest.raises(CheckpointError, match="could not read weights"):
        load_warm_start(source if layout == "weights.pt" else source.parent, target,
                        weights="live")
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_dcp_value_that_would_run_code_is_refused(tmp_path):
    # DCP pickles every non-tensor value of a state dict (an optimizer's param_groups) into
    # the shard; relay must read them back without running what they name.
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    save_checkpoint(out, 1, members={"transformer": ModelMember(model(1)),
                                     "extra": {"scale": torch.ones(2), "hook": RunsCode(marker)}},
                    training_state={"step": 1}, dataloader_state={})
    assert not marker.exists()  # saving pickles it; only loading would run it

    target = {"scale": torch.zeros(2), "hook": None}
    with pytest.raises(Exception, match="(?i)unpickl|weights_only"):
        load_checkpoint(out / "checkpoint-1", {"transformer": ModelMember(model(7)), "extra": target})
    assert not marker.exists()
