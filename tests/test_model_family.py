"""The model-family interface: a family defined outside relay's package plugs in through the
registry alone and trains through pretrain, from a wrapper script or named in the YAML as
`package.module:Class` under `relay run` / `relay submit`; stages refuse a family that lacks what
they call; the modules that orchestrate a run name no family's classes, methods or keys."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config.schema import ConfigError
from trainer.models.dit.family import DiTFamily
from trainer.models.registry import family_names, get_family

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "families" / "pixel_mlp.py"
TINY = str(ROOT / "config" / "tiny")
SPEC = "families.pixel_mlp:PixelMLPFamily"  # tests/families/pixel_mlp.py as a plug-in


def _env(pythonpath: list[Path] | None = None) -> dict[str, str]:
    """A child's environment; `pythonpath`: its PYTHONPATH (given: this checkout's relay first,
    so relay runs from any directory)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [ROOT, *pythonpath])
    return env


def _relay(*argv: str, cwd: Path, pythonpath: list[Path] = (),
           timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *argv], cwd=cwd,
                          env=_env(list(pythonpath)), capture_output=True, text=True,
                          timeout=timeout)


def _plugin_pipeline(path: Path, family: str = SPEC, max_steps: int = 4) -> Path:
    """A one-stage pipeline: the tiny pretrain of the family `family` names (its YAML), run
    from the directory `path` is in (relative data and output paths land there)."""
    path.write_text(yaml.safe_dump({"name": "plugin", "root": "out", "stages": {
        "pretrain": {"config": f"{TINY}/pretrain.yaml", "overrides": {
            "model_family": family, "transformer_config_overrides": {"hidden": 16, "layers": 2},
            "train_batch_size": 4, "synthetic_num_samples": 32, "data_path": "data",
            "max_steps": max_steps, "save_interval": 2, "log_interval": 1, "warmup_steps": 1,
            "validation_interval": -1, "use_muon": False}}}}))
    return path


def _project_with_the_plugin(tmp_path: Path) -> Path:
    """A user's project directory holding the plug-in package `families/`."""
    work = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "families", work / "families",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return work


def _plugin_run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLUGIN), *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _pretrain_argv(tmp_path: Path, out: Path, max_steps: int) -> list[str]:
    return ["--config", f"{TINY}/pretrain.yaml", "--model_family", "pixel_mlp",
            "--transformer_config_overrides", "{hidden: 16, layers: 2}",
            "--train_batch_size", "4", "--synthetic_num_samples", "32",
            "--data_path", str(tmp_path / "data"), "--output_dir", str(out),
            "--max_steps", str(max_steps), "--save_interval", "3", "--log_interval", "1",
            "--validation_interval", "-1", "--warmup_steps", "1"]


def test_a_family_registered_outside_relay_trains_through_pretrain_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _plugin_run(*_pretrain_argv(tmp_path, out, 6))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(l == l for l in losses) and len(set(losses)) > 1  # finite, and it trains
    complete = json.loads((out / "checkpoint-6" / "COMPLETE").read_text())
    assert complete["model_config"] == {"in_channels": 3, "hidden": 16, "layers": 2,
                                        "text_dim": 32, "patch": [1, 4, 4]}
    # A longer run in the same output_dir resumes from checkpoint-6.
    proc = _plugin_run(*_pretrain_argv(tmp_path, out, 8))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert "checkpoint-6" in proc.stdout + proc.stderr


def test_no_product_file_names_the_test_family():
    found = subprocess.run(["git", "grep", "-l", "pixel_mlp", "--", "trainer", "launcher",
                            "config", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == ""


def test_a_stage_refuses_a_family_that_lacks_what_it_calls_at_dry_run(tmp_path):
    proc = _plugin_run("--config", f"{TINY}/stage1.yaml", "--model_family", "pixel_mlp",
                       "--transformer_config_overrides", "{}",
                       "--pretrained_transformer_path", "null",
                       "--load_transformer_weights", "false",
                       "--output_dir", str(tmp_path / "s1"), "--dry-run", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    message = proc.stderr
    assert "stage tf_anyflow needs what model family 'pixel_mlp' cannot do" in message
    assert "teacher forcing" in message and "KV cache" in message and "second time input" in message


def test_an_unknown_family_is_refused_with_the_closest_name(tmp_path):
    proc = subprocess.run([sys.executable, "trainer/train.py", "--config", f"{TINY}/pretrain.yaml",
                           "--model_family", "ditt", "--output_dir", str(tmp_path / "o"),
                           "--dry-run"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model_family 'ditt' is not a known model family. Did you mean 'dit'?" in proc.stderr


def test_the_dit_family_is_the_default_and_reports_its_own_geometry():
    assert "dit" in family_names()
    family = get_family("dit")
    config = family.config({"hidden_size": 64, "num_attention_heads": 2, "rope_axes_dim": [8, 12, 12],
                            "causal_chunk_size": 2, "two_time": True, "time_gate": 0.5})
    geometry = family.geometry(config)
    assert (geometry.num_heads, geometry.head_dim, geometry.hidden_size) == (2, 32, 64)
    assert (geometry.causal_chunk_frames, geometry.two_time, geometry.time_gate) == (2, True, 0.5)
    teacher = family.geometry(family.bidirectional_config(config))
    assert (teacher.causal_chunk_frames, teacher.two_time) == (None, False)
    with pytest.raises(ValueError, match="Did you mean `hidden_size`"):
        family.config({"hiden_size": 3})


def test_the_dit_module_follows_the_protocol():
    import torch

    family = DiTFamily()
    config = family.config({"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
                            "rope_axes_dim": [4, 6, 6], "two_time": True})
    model = family.build(config)
    assert model.geometry == family.geometry(config)
    assert len(model.checkpoint_units()) == 2 and len(model.fsdp_units()) == 4
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.init_second_time_from_first()
    x, t, text = torch.randn(1, 3, 2, 8, 8), torch.tensor([300.0]), torch.randn(1, 4, 32)
    assert torch.equal(model(x, t, text, r=t), model(x, t, text))


# Names of the DiT's classes, methods and keys that the orchestration must not use: it reaches a
# model only through trainer.models.family / trainer.models.protocol.
DIT_NAMES = re.compile(r"VideoDiT|DiTConfig|DiTBlock|r_embedder|time_embedder|causal_chunk_size|"
                       r"models\.dit|enable_two_time|TIME_FREQ_DIM|\.blocks\b|block\.modulation|"
                       r"\.cfg\.|mlp_ratio|rope_axes_dim|zero_init_modulation")
FAMILY_FREE = ["trainer/stages", "trainer/build.py", "trainer/preflight.py",
               "trainer/parallel", "trainer/warmup.py", "trainer/evaluation/inference.py",
               "trainer/run_state.py", "trainer/checkpoint/warm_start.py",
               "trainer/checks/stage.py", "benchmarks/flops.py"]


def test_the_orchestration_names_no_dit_class_method_or_key():
    offenders = []
    for entry in FAMILY_FREE:
        path = ROOT / entry
        for file in sorted(path.rglob("*.py") if path.is_dir() else [path]):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if DIT_NAMES.search(line):
                    offenders.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_config_error_of_the_family_reaches_the_user_as_one_paragraph(tmp_path):
    from trainer.resolve import resolve_config

    with pytest.raises(ConfigError, match="top-level key only"):
        resolve_config(f"{TINY}/pretrain.yaml",
                       {"transformer_config_overrides": {"zero_init_modulation": False},
                        "output_dir": str(tmp_path)}, check_paths=False)


def test_a_plugin_family_named_in_the_yaml_trains_under_relay_run_and_samples_later(tmp_path):
    # relay runs in the project directory that holds `families/`: no PYTHONPATH for it.
    work = _project_with_the_plugin(tmp_path)
    pipeline = _plugin_pipeline(work / "pipeline.yaml")
    proc = _relay("run", str(pipeline), cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = work / "out" / "pretrain"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    complete = json.loads((out / "checkpoint-4" / "COMPLETE").read_text())
    assert complete["model_config"] == {"in_channels": 3, "hidden": 16, "layers": 2,
                                        "text_dim": 32, "patch": [1, 4, 4]}
    assert json.loads((out / "resolved-config.json").read_text())["model_family"] == SPEC

    # A later process rebuilds the run's model from its resolved config: here from another
    # directory, with the project on PYTHONPATH.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sample = ["sample", "--checkpoint", str(out), "--prompt", "a red square moving right",
              "--steps", "2", "--out", str(elsewhere / "clip")]
    proc = _relay(*sample, cwd=elsewhere, pythonpath=[work], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (elsewhere / "clip" / "frames.npy").stat().st_size > 0
    # Without it the family is not found, and relay says where it looked and what to do.
    proc = _relay(*sample, cwd=elsewhere, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.strip()
    assert message.count("\n") == 0, message
    assert message.startswith(f"relay sample: cannot rebuild the model of {out / 'checkpoint-4'}: "
                              f"model_family {SPEC!r}: no module named 'families' on the Python "
                              f"path (the directory relay runs in, {elsewhere}")
    assert "Run relay from the directory that holds 'families', or add the directory that " \
        "holds it to PYTHONPATH." in message


def test_relay_submit_dry_run_validates_a_plugin_family_found_through_pythonpath(tmp_path):
    pipeline = _plugin_pipeline(tmp_path / "pipeline.yaml")
    proc = _relay("submit", str(pipeline), "--dry-run", cwd=tmp_path,
                  pythonpath=[ROOT / "tests"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "nothing was submitted" in proc.stdout
    # The plan is the plug-in's model (its geometry: 2 blocks of width 16), and the job is
    # given the family as the YAML names it.
    assert "(2 blocks of" in proc.stdout and " x hidden 16 x " in proc.stdout, proc.stdout
    assert f'"--model_family={SPEC}"' in proc.stdout


TORCH_AT_IMPORT = """import torch  # at import: the login node would load torch to check a run
from families.pixel_mlp import PixelMLPFamily
"""


@pytest.mark.parametrize("family, refusal", [
    ("families.pixel_mlpx:PixelMLPFamily",
     "model_family 'families.pixel_mlpx:PixelMLPFamily': no module named "
     "'families.pixel_mlpx' on the Python path (the directory relay runs in, {work}; PYTHONPATH "
     "{root}). Run relay from the directory that holds 'families', or add the directory that "
     "holds it to PYTHONPATH."),
    ("families.pixel_mlp:PixelMLP_Family",
     "model_family 'families.pixel_mlp:PixelMLP_Family': module families.pixel_mlp "
     "({work}/families/pixel_mlp.py) has no attribute 'PixelMLP_Family'. It defines "
     "PixelMLPFamily: name one as families.pixel_mlp:PixelMLPFamily."),
    ("families.pixel_mlp:PixelMLP",
     "model_family 'families.pixel_mlp:PixelMLP' names a value of type function, not a model "
     "family. Name a subclass of trainer.models.family.ModelFamily (or an instance of one) in "
     "families.pixel_mlp: `families.pixel_mlp:<Class>`."),
    ("torchy:PixelMLPFamily",
     "model_family 'torchy:PixelMLPFamily': importing torchy ({work}/torchy.py) imports torch. "
     "relay imports the family's module on the login node (relay submit, relay run) to check a "
     "run before it starts, where it never imports torch: keep that module torch-free and "
     "import torch and the model's nn.Module inside the family's build(), as relay's own "
     "families do."),
    ("pixel_mpl",
     "model_family 'pixel_mpl' is not a known model family. Known: dit, wan; a family outside "
     "relay is named by its class as `package.module:Class` (docs/model.md, \"Adding a "
     "family\"). Set model_family in the YAML's model section."),
])
def test_relay_submit_dry_run_refuses_a_bad_plugin_in_one_paragraph(tmp_path, family, refusal):
    work = _project_with_the_plugin(tmp_path)
    (work / "torchy.py").write_text(TORCH_AT_IMPORT)
    pipeline = _plugin_pipeline(work / "pipeline.yaml", family=family)
    proc = _relay("submit", str(pipeline), "--dry-run", cwd=work, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    expected = refusal.format(work=work, root=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"relay submit: {pipeline}: nothing was submitted, because:",
                     f"- stage pretrain: {expected}"], proc.stderr
