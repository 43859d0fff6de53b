"""Stages as plug-ins: a stage defined outside relay's package (tests/plugin_stages/toy_stage.py,
its torch half tests/plugin_stages/toy_x0.py) is named in the YAML by its declaration's import
string and trains through train.py (checkpoint, resume, validation with its sampler) and the
kernel warm-up, with no product file changed; an unknown stage is refused before anything
starts; nothing outside trainer/stages/ names one of relay's stages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from trainer.stages.registry import stage_names

ROOT = Path(__file__).resolve().parents[1]
TOY = "plugin_stages.toy_stage:TOY"
TINY_MODEL = {"in_channels": 3, "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
              "mlp_ratio": 2.0, "patch_size": [2, 4, 4], "rope_axes_dim": [4, 6, 6],
              "text_dim": 32, "qk_norm": True}


def _env() -> dict[str, str]:
    """A child's environment with tests/ on PYTHONPATH (where `plugin_stages` lives)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "WANDB_API_KEY"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _config(tmp_path: Path, stage: str = TOY, **training) -> Path:
    config = {
        "model": {"transformer_config_overrides": TINY_MODEL},
        "training": {"stage": stage, "max_steps": 6, "learning_rate": 1e-3, "warmup_steps": 1,
                     "train_batch_size": 4, "seed": 0, **training},
        "data": {"data_path": str(tmp_path / "data"), "synthetic_data": True,
                 "synthetic_num_samples": 32, "synthetic_num_frames": 4,
                 "synthetic_height": 16, "synthetic_width": 16},
        "tasks": {"cfg_drop_prob": 0.1},
        "output": {"output_dir": str(tmp_path / "run"), "save_interval": 3,
                   "log_interval": 1},
        "validation": {"validation_interval": -1},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, *argv: str, timeout: float = 300,
           program: str = "trainer/train.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, program, "--config", str(config), *argv],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_stage_declared_outside_relay_trains_checkpoints_and_resumes(tmp_path):
    straight = _config(tmp_path / "straight")
    # Validated at the end, with the sampler the toy's declaration plans.
    proc = _train(straight, "--validation_interval", "0", "--validation_num_captions", "2",
                  "--validation_steps", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = _records(tmp_path / "straight" / "run")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert any(key.startswith("val/") for key in records[-1])
    # The toy's own loss ran: it logs its uniform draws' mean, which flow matching does not.
    assert all("toy_sigma_mean" in r for r in records)
    losses = [r["loss"] for r in records]
    assert all(l == l for l in losses) and len(set(losses)) > 1
    saved = json.loads((tmp_path / "straight" / "run" / "resolved-config.json").read_text())
    assert saved["stage"] == TOY

    # The same run stopped at step 3 and resumed from its checkpoint ends where it did.
    split = _config(tmp_path / "split")
    proc = _train(split, "--max_steps", "3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "split" / "run" / "checkpoint-3" / "COMPLETE").is_file()
    proc = _train(split)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "checkpoint-3" in proc.stdout + proc.stderr
    resumed = _records(tmp_path / "split" / "run")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == losses


def test_the_kernel_warm_up_runs_the_loss_the_stage_declares(tmp_path):
    proc = _train(_config(tmp_path), timeout=300, program="trainer/warmup.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["status"] == "ok" and report["stage"] == TOY
    assert report["loss"] == report["loss"]
    assert not (tmp_path / "run").exists()


def test_the_login_side_checks_a_plugin_stage_without_torch(tmp_path):
    code = (f"import sys\nfrom trainer.resolve import resolve_config\n"
            f"args = resolve_config({str(_config(tmp_path))!r})\n"
            f"print('STAGE', args.stage, 'TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"STAGE {TOY} TORCH False" in proc.stdout


def _project(tmp_path: Path) -> Path:
    """A user's project directory holding the plug-in package `plugin_stages/` and a one-stage
    pipeline of the toy stage (relative data and output paths land there)."""
    work = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "plugin_stages", work / "plugin_stages",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load(_config(tmp_path / "config").read_text())
    config["data"]["data_path"], config["output"]["output_dir"] = "data", "unused"
    (work / "toy.yaml").write_text(yaml.safe_dump(config))
    (work / "pipeline.yaml").write_text(yaml.safe_dump({"name": "toy", "root": "out", "stages": {
        "toy": {"config": "toy.yaml", "overrides": {"max_steps": 4, "save_interval": 2}}}}))
    return work


def _relay(*argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = _env()
    env["PYTHONPATH"] = str(ROOT)  # relay itself; the plug-in is found in the directory it runs in
    return subprocess.run([sys.executable, "-m", "launcher.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_plugin_stage_named_in_the_yaml_trains_under_relay_run(tmp_path):
    work = _project(tmp_path)
    proc = _relay("run", "pipeline.yaml", cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = work / "out" / "toy"
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("toy_sigma_mean" in r for r in records)  # the toy's own loss ran
    assert (out / "checkpoint-4" / "COMPLETE").is_file()
    assert json.loads((out / "resolved-config.json").read_text())["stage"] == TOY


TORCH_AT_IMPORT = """import torch  # at import: the login node would load torch to check a run
from plugin_stages.toy_stage import ToyX0
"""


def test_relay_submit_refuses_a_stage_declaration_that_imports_torch(tmp_path):
    work = _project(tmp_path)
    (work / "torchy_stage.py").write_text(TORCH_AT_IMPORT)
    pipeline = yaml.safe_load((work / "pipeline.yaml").read_text())
    pipeline["stages"]["toy"]["overrides"]["stage"] = "torchy_stage:ToyX0"
    (work / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    proc = _relay("submit", "pipeline.yaml", "--dry-run", cwd=work, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[1:] == [
        f"- stage toy: stage 'torchy_stage:ToyX0': importing torchy_stage "
        f"({work}/torchy_stage.py) imports torch. relay imports the stage declaration's module "
        f"on the login node (relay submit, relay run) to check a run before it starts, where it "
        f"never imports torch: keep that module torch-free and import torch inside the modules "
        f"its builder and warm-up loss name (import strings), as relay's own stages do."], \
        proc.stderr


def test_the_stages_own_check_refuses_at_dry_run(tmp_path):
    proc = _train(_config(tmp_path, loss_weighting="gaussian"), "--dry-run", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"stage {TOY} weighs every noise level alike: set loss_weighting: none" in proc.stderr


def test_an_unknown_stage_is_refused_with_the_known_ones_and_the_plugin_form(tmp_path):
    proc = _train(_config(tmp_path, stage="fmm"), "--dry-run", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert ("stage 'fmm' is not a known stage. Did you mean 'fm'? Known: dmd_sgf, fm, "
            "tf_anyflow; a stage outside relay is named by its declaration as "
            "package.module:Class") in proc.stderr
    proc = _train(_config(tmp_path, stage="plugin_stages.no_such_stage:TOY"), "--dry-run",
                  timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert ("stage 'plugin_stages.no_such_stage:TOY': no module named "
            "'plugin_stages.no_such_stage' on the Python path (the directory relay runs in, "
            f"{ROOT}; PYTHONPATH {_env()['PYTHONPATH']}). Run relay from the directory that holds "
            "'plugin_stages', or add the directory that holds it to PYTHONPATH.") in proc.stderr
    proc = _train(_config(tmp_path, stage="plugin_stages.toy_stage:ToyX0Stage"), "--dry-run",
                  timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (f"module plugin_stages.toy_stage ({ROOT}/tests/plugin_stages/toy_stage.py) has no "
            f"attribute 'ToyX0Stage'. It defines ToyX0: name one as "
            f"plugin_stages.toy_stage:ToyX0.") in proc.stderr


def test_no_product_file_names_the_toy_stage():
    found = subprocess.run(["git", "grep", "-l", "-e", "toy_stage", "-e", "toy_x0", "-e",
                            "plugin_stages", "--", "trainer", "launcher", "config", "scripts"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == ""


# The schema is imported by the stage registry, so it cannot ask it: its `stage` default and
# help (and train_timestep_range's help) name relay's stages in words.
NAMES_A_STAGE_FOR_ITS_USER = {"trainer/config/schema.py"}


def test_nothing_outside_the_stages_package_names_a_stage():
    word = re.compile(r"\b(" + "|".join(map(re.escape, stage_names())) + r")\b")
    offenders = []
    for package in ("trainer", "launcher"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("trainer/stages/") or rel in NAMES_A_STAGE_FOR_ITS_USER:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if word.search(line):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "ask trainer.stages.registry instead:\n" + "\n".join(offenders)
