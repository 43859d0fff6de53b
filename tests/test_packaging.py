"""A non-editable install works from outside the repository.

Builds the wheel (offline: no build isolation, setuptools of this environment), installs it
without dependencies into a fresh venv that reuses this environment's packages (torch etc.),
and from an empty directory runs the embedded default's dry run, a two-step `relay run` whose
stage YAML comes from the installed copy, and `python -m trainer.train --help`.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# What the build reads; copied so the build neither writes build/ into the checkout nor races
# another build there.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "launcher", "trainer",
           "config", "slurm")


def run(cmd: list[str], cwd: Path, timeout: int = 120, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**env, **kw.pop("env", {})}, **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "_data")
    for name in SOURCES:
        item = ROOT / name
        if item.is_dir():
            shutil.copytree(item, src / name, ignore=ignore)
        else:
            shutil.copy2(item, src / name)
    dist = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(src)], cwd=tmp, timeout=300)
    (wheel,) = dist.glob("relay-*.whl")

    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        cwd=tmp)
    python = venv / "bin" / "python"
    # This environment's packages after the venv's own (a plain path line: the .pth files in
    # there, among them an editable install of this checkout, are not run).
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  cwd=tmp).stdout.strip()
    (Path(purelib) / "relay-test-deps.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)], cwd=tmp, timeout=300)
    away = tmp / "elsewhere"
    away.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "away": away,
            "purelib": Path(purelib)}


def test_wheel_carries_every_package_and_the_configs_but_no_tests(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]
    packages = {str(p.parent.relative_to(ROOT)).replace("/", ".")
                for p in (ROOT / "trainer").rglob("__init__.py")}
    for package in packages | {"launcher"}:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    for path in sorted((ROOT / "config").rglob("*.yaml")) + [ROOT / "slurm" / "env.sh"]:
        assert f"launcher/_data/{path.relative_to(ROOT)}" in names, path


def test_installed_package_is_the_wheels_copy(installed):
    proc = run([str(installed["python"]), "-c",
                "import launcher, trainer, trainer.data; print(trainer.__file__, launcher.__file__)"],
               cwd=installed["away"])
    for path in proc.stdout.split():
        assert Path(path).is_relative_to(installed["purelib"]), proc.stdout


def test_train_help_from_outside_the_repository(installed):
    proc = run([str(installed["python"]), "-m", "trainer.train", "--help"], cwd=installed["away"])
    assert "--learning_rate" in proc.stdout


def test_embedded_default_dry_run_from_outside_the_repository(installed):
    away = installed["away"]
    proc = run([str(installed["venv"] / "bin" / "relay"), "submit", "config/pipeline/tiny.yaml",
                "--root", str(away / "runs"), "--dry-run"], cwd=away)
    assert "nothing was submitted" in proc.stdout
    data = installed["purelib"] / "launcher" / "_data"
    # One line says where the configs came from; the jobs read them and env.sh from the install.
    said = [line for line in proc.stderr.splitlines() if "copy installed with relay" in line]
    assert len(said) == 1 and "config/pipeline/tiny.yaml" in said[0], proc.stderr
    assert f'"--config", "{data}/config/tiny/stage2.yaml"' in proc.stdout
    assert f"source {data}/slurm/env.sh" in proc.stdout
    assert str(ROOT) not in proc.stdout


def test_relay_run_trains_from_the_installed_stage_config(installed, tmp_path):
    # A pipeline of the user's own naming a stage YAML relay ships; two steps, then a checkpoint.
    pipeline = tmp_path / "mini.yaml"
    pipeline.write_text(yaml.safe_dump({
        "name": "mini", "root": str(tmp_path / "runs"),
        "cluster": {"gpus_per_node": 0, "tasks_per_node": 1, "network": "none"},
        "stages": {"pretrain": {"config": "config/tiny/pretrain.yaml", "overrides": {
            "max_steps": 2, "train_batch_size": 4, "synthetic_num_samples": 8,
            "warmup_steps": 1, "log_interval": 1, "save_interval": 1000,
            "validation_interval": -1, "data_path": str(tmp_path / "data")}}}}))
    run([str(installed["venv"] / "bin" / "relay"), "run", str(pipeline)], cwd=tmp_path,
        timeout=300)
    result = json.loads((tmp_path / "runs" / "pretrain" / "run-result.json").read_text())
    assert result["step"] == 2, result
    assert (tmp_path / "runs" / "pretrain" / "checkpoint-2").is_dir()
