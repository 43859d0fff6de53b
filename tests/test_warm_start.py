"""Warm starts from every kind of source, the ones refused, and weight export."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from trainer.checkpoint.store import CheckpointError, ModelMember, save_checkpoint
from trainer.checkpoint.warm_start import export_weights, load_warm_start


class Toy(nn.Module):
    def __init__(self, hidden: int = 8, with_r: bool = False) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(4, hidden)
        self.head = nn.Linear(hidden, 2)
        if with_r:
            self.r_embedder = nn.Linear(1, hidden)


def filled(value: float, **kwargs) -> Toy:
    model = Toy(**kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def weights_equal(model: nn.Module, value: float) -> bool:
    return all(torch.all(p == value) for p in model.parameters())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One of each source kind. Live weights are 1.0, EMA weights 2.0; the older checkpoint of
    `run` holds 5.0 and 6.0, so a source that picked it would show."""
    root = tmp_path_factory.mktemp("sources")
    live, ema = filled(1.0), filled(2.0)
    torch.save(live.state_dict(), root / "plain.pt")
    save_file(live.state_dict(), str(root / "plain.safetensors"))
    (root / "dir_with_model_state").mkdir()
    torch.save(live.state_dict(), root / "dir_with_model_state" / "model_state.pt")
    for step, (step_live, step_ema) in ((1, (filled(5.0), filled(6.0))), (2, (live, ema))):
        save_checkpoint(root / "run", step,
                        members={"transformer": ModelMember(step_live), "ema": ModelMember(step_ema)},
                        training_state={"step": step}, dataloader_state={}, model_config={"hidden": 8})
    save_checkpoint(root / "run_without_ema", 1, members={"transformer": ModelMember(live)},
                    training_state={"step": 1}, dataloader_state={})
    save_checkpoint(root / "stage2", 1, members={"student": ModelMember(live), "critic": ModelMember(ema)},
                    training_state={"step": 1}, dataloader_state={})
    return root


@pytest.mark.parametrize(
    "relative, weights, expected",
    [
        ("plain.pt", "live", 1.0),
        ("plain.safetensors", "live", 1.0),
        ("dir_with_model_state", "live", 1.0),
        ("run/checkpoint-2", "live", 1.0),
        ("run/checkpoint-2", "ema", 2.0),
        ("run/checkpoint-2/transformer", "live", 1.0),
        ("run/checkpoint-2/ema", "ema", 2.0),
        ("run", "ema", 2.0),
    ],
)
def test_warm_start_loads_each_kind_of_source(sources, relative, weights, expected):
    model = filled(0.0)
    report = load_warm_start(sources / relative, model, weights=weights)
    assert weights_equal(model, expected)
    assert sorted(report["loaded"]) == sorted(model.state_dict())
    assert report["missing"] == [] and report["unexpected"] == []


def test_output_dir_source_uses_its_newest_checkpoint(sources):
    model = filled(0.0)
    report = load_warm_start(sources / "run", model, weights="live")
    assert weights_equal(model, 1.0)  # checkpoint-1's live weights are 5.0
    assert report["source"].endswith("checkpoint-2/transformer")


def test_member_names_a_role_of_a_multi_role_checkpoint(sources):
    model = filled(0.0)
    report = load_warm_start(sources / "stage2", model, weights="live", member="critic")
    assert weights_equal(model, 2.0) and report["member"] == "critic"


def test_missing_path_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_warm_start(tmp_path / "nope", filled(0.0), weights="live")


def test_ema_asked_but_absent_says_so(sources):
    with pytest.raises(CheckpointError, match="no 'ema' member.*Use weights=live"):
        load_warm_start(sources / "run_without_ema", filled(0.0), weights="ema")


def test_member_directory_contradicting_weights_is_refused(sources):
    with pytest.raises(CheckpointError, match="holds 'transformer' weights but weights='ema'"):
        load_warm_start(sources / "run" / "checkpoint-2" / "transformer", filled(0.0), weights="ema")


def test_strict_warm_start_refuses_a_key_the_source_lacks(sources):
    model = filled(0.0, with_r=True)
    with pytest.raises(CheckpointError, match=r"missing from the source \['r_embedder.bias', 'r_embedder.weight'\]"):
        load_warm_start(sources / "plain.pt", model, weights="live")
    assert weights_equal(model, 0.0)  # nothing was loaded


def test_allow_missing_pattern_lets_a_new_module_keep_its_init(sources):
    model = filled(0.0, with_r=True)
    report = load_warm_start(sources / "run", model, weights="live", allow_missing=["r_embedder.*"])
    assert report["missing"] == ["r_embedder.bias", "r_embedder.weight"]
    assert torch.all(model.head.weight == 1.0) and torch.all(model.r_embedder.weight == 0.0)


def test_allow_unexpected_pattern_drops_source_keys_the_model_lacks(tmp_path):
    torch.save(filled(3.0, with_r=True).state_dict(), tmp_path / "with_r.pt")
    model = filled(0.0)
    with pytest.raises(CheckpointError, match="not in the model"):
        load_warm_start(tmp_path / "with_r.pt", model, weights="live")
    report = load_warm_start(tmp_path / "with_r.pt", model, weights="live", allow_unexpected=["r_embedder.*"])
    assert report["unexpected"] == ["r_embedder.bias", "r_embedder.weight"] and weights_equal(model, 3.0)


def test_shape_mismatch_names_the_key_and_both_shapes(sources):
    with pytest.raises(CheckpointError, match=r"x_embedder.weight: source \(8, 4\), model \(16, 4\)"):
        load_warm_start(sources / "run", filled(0.0, hidden=16), weights="live")


def test_non_strict_warm_start_reports_instead_of_refusing(sources):
    model = filled(0.0, with_r=True)
    report = load_warm_start(sources / "plain.safetensors", model, weights="live", strict=False)
    assert report["missing"] == ["r_embedder.bias", "r_embedder.weight"]
    assert torch.all(model.head.weight == 1.0)


def test_export_writes_safetensors_and_model_config(sources, tmp_path):
    out = export_weights(sources / "run", tmp_path / "export" / "model.safetensors", weights="ema")
    tensors = load_file(str(out))
    assert set(tensors) == set(Toy().state_dict()) and all(torch.all(t == 2.0) for t in tensors.values())
    assert json.loads((tmp_path / "export" / "model_config.json").read_text()) == {"hidden": 8}


def test_export_without_a_recorded_config_needs_one_passed(sources, tmp_path):
    with pytest.raises(CheckpointError, match="pass model_config"):
        export_weights(sources / "run_without_ema", tmp_path / "m.safetensors", weights="live")
    export_weights(sources / "run_without_ema", tmp_path / "m.safetensors", weights="live",
                   model_config={"hidden": 8, "layers": 1})
    assert json.loads((tmp_path / "model_config.json").read_text())["layers"] == 1


def test_export_onto_an_existing_file_is_refused_unless_overwrite(sources, tmp_path):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone's weights")
    with pytest.raises(CheckpointError, match=r"already exists.*relay export --force"):
        export_weights(sources / "run", out, weights="ema")
    assert out.read_bytes() == b"someone's weights"
    assert not (tmp_path / "model_config.json").exists()
    export_weights(sources / "run", out, weights="ema", overwrite=True)
    assert all(torch.all(t == 2.0) for t in load_file(str(out)).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model_config.json"]


def test_export_never_replaces_a_config_it_did_not_write(sources, tmp_path):
    (tmp_path / "model_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model_config.json already exists"):
        export_weights(sources / "run", tmp_path / "model.safetensors", weights="ema")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_config.json"]


def test_export_onto_a_directory_is_refused_and_leaves_no_temporary(sources, tmp_path):
    target = tmp_path / "weights"
    target.mkdir()
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="is a directory.*weights/model.safetensors"):
            export_weights(sources / "run", target, weights="ema", overwrite=overwrite)
    assert [p.name for p in tmp_path.iterdir()] == ["weights"] and not any(target.iterdir())


def test_a_failed_export_leaves_no_temporary(sources, tmp_path, monkeypatch):
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*nothing partial"):
        export_weights(sources / "run", tmp_path / "model.safetensors", weights="ema")
    assert list(tmp_path.iterdir()) == []
