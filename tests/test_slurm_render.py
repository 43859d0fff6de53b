"""The rendered sbatch scripts: locked by golden files, quoted, free of secrets.

Regenerate the golden files after an intended change with
    RELAY_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_slurm_render.py
and review the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.pipeline import validate_pipeline
from launcher.slurm import (executor_parameters, render_sbatch, render_warmup_sbatch,
                            warmup_executor_parameters)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
FAKE_REPO = "/opt/relay"  # where the golden scripts pretend the repository lives
FAKE_PYTHON = "/opt/relay/.venv/bin/python"


def check_golden(name: str, text: str) -> None:
    text = text.replace(str(ROOT), FAKE_REPO)
    path = GOLDEN / name
    if os.environ.get("RELAY_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with RELAY_UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"rendered script differs from {path}"


def test_golden_240_node_efa_stage():
    pipeline = validate_pipeline(ROOT / "config/pipeline/production-example.yaml", only="pretrain",
                                 cwd=ROOT, check_paths=False, python=FAKE_PYTHON)
    check_golden("pretrain-240-node-efa.sbatch",
                 render_sbatch(pipeline.stages[0], repo_root=FAKE_REPO))


def test_golden_warmup_of_the_240_node_efa_pipeline():
    # One node, one task, one GPU; the cluster's partition, env, network and sbatch_extra; the
    # commands it runs listed at the top.
    pipeline = validate_pipeline(ROOT / "config/pipeline/production-example.yaml", cwd=ROOT,
                                 check_paths=False, python=FAKE_PYTHON)
    assert pipeline.warmup.stages == ["pretrain", "sft", "stage1", "stage2"]
    check_golden("warmup-1-node-efa.sbatch",
                 render_warmup_sbatch(pipeline.warmup, repo_root=FAKE_REPO))


def test_golden_one_node_cpu_stage_with_dependency():
    pipeline = validate_pipeline(ROOT / "config/pipeline/tiny.yaml", root="/runs/tiny", only="sft",
                                 cwd=ROOT, check_paths=False, python=FAKE_PYTHON)
    check_golden("tiny-sft-1-node.sbatch",
                 render_sbatch(pipeline.stages[0], dependency="12345", repo_root=FAKE_REPO))


def test_rendered_scripts_carry_the_preemption_and_chaining_options():
    pipeline = validate_pipeline(ROOT / "config/pipeline/tiny.yaml", root="/runs/tiny", cwd=ROOT,
                                 check_paths=False)
    first, second = pipeline.stages[:2]
    text = render_sbatch(second, dependency="77")
    for line in ("#SBATCH --dependency=afterok:77", "#SBATCH --kill-on-invalid-dep=yes",
                 "#SBATCH --requeue", "#SBATCH --signal=USR2@120", "#SBATCH --open-mode=append",
                 "#SBATCH --ntasks-per-node=1", "export RELAY_NETWORK=none",
                 "export RELAY_OUTPUT_DIR=/runs/tiny/sft"):
        assert line in text.splitlines(), line
    assert "--dependency" not in render_sbatch(first)
    assert "kill-on-invalid-dep" not in render_sbatch(first)


def test_preemption_signal_of_the_stage_is_what_slurm_sends(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"stages": {"a": {
        "config": str(ROOT / "config/tiny/pretrain.yaml"),
        "overrides": {"preemption_signal": "SIGUSR1"}}}}))
    stage = validate_pipeline(path, cwd=tmp_path, check_paths=False).stages[0]
    assert "#SBATCH --signal=USR1@120" in render_sbatch(stage).splitlines()


def malicious_pipeline(tmp_path: Path, **cluster) -> Path:
    evil = "x; touch {p}; $(touch {p}) `touch {p}` ' \" \\"
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump({
        "root": str(tmp_path / f"runs with space; $(touch {marker})"),
        "cluster": {"partition": evil.format(p=marker), "env": {"EVIL": evil.format(p=marker)},
                    "sbatch_extra": {"comment": evil.format(p=marker)}, **cluster},
        "stages": {"pretrain": {
            "config": str(ROOT / "config/tiny/pretrain.yaml"),
            "job_name": evil.format(p=marker),
            "overrides": {"wandb_run_name": evil.format(p=marker)}}}}))
    return path


@pytest.mark.parametrize("job", ["stage", "warmup"])
def test_hostile_values_stay_inert_when_the_script_runs(tmp_path, job):
    pipeline = validate_pipeline(malicious_pipeline(tmp_path, warmup=True), cwd=tmp_path,
                                 check_paths=False)
    if job == "warmup":
        text = render_warmup_sbatch(pipeline.warmup, repo_root=tmp_path / "repo")
    else:
        text = render_sbatch(pipeline.stages[0], repo_root=tmp_path / "repo")
    # Run the whole script with harmless stand-ins for what it calls: every line executes.
    (tmp_path / "repo/slurm").mkdir(parents=True)
    (tmp_path / "repo/slurm/env.sh").write_text('echo "EVIL=[$EVIL]"; return 0\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun",):
        (bin_dir / tool).write_text("#!/bin/sh\necho srun-called \"$#\"\n")
        (bin_dir / tool).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert "srun-called" in proc.stdout
    assert "EVIL=[x; touch" in proc.stdout  # the value arrived intact, as data
    assert not (tmp_path / "pwned").exists()


def test_no_secret_from_the_environment_reaches_the_rendered_script(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "relay-test-secret-4711")
    monkeypatch.setenv("HF_TOKEN", "relay-test-secret-4712")
    pipeline = validate_pipeline(ROOT / "config/pipeline/production-example.yaml", only="pretrain",
                                 cwd=ROOT, check_paths=False)
    text = render_sbatch(pipeline.stages[0]) + render_warmup_sbatch(pipeline.warmup)
    params = repr(executor_parameters(pipeline.stages[0]))
    params += repr(warmup_executor_parameters(pipeline.warmup))
    for secret in ("relay-test-secret-4711", "relay-test-secret-4712"):
        assert secret not in text and secret not in params


# ---- secrets by value -----------------------------------------------------------------------

WANDB_SECRET = "wandb-value-8c1f2e9a7d"
SERVICE_SECRET = "svc-token-5b7a3c9e1f"


def _tiny_pipeline_yaml(tmp_path: Path, cluster_env: dict | None = None,
                        sft_overrides: dict | None = None) -> Path:
    data = yaml.safe_load((ROOT / "config/pipeline/tiny.yaml").read_text())
    data["root"] = str(tmp_path / "runs")
    for stage in data["stages"].values():
        stage["config"] = str(ROOT / stage["config"])
    data["cluster"]["warmup"] = True  # the warm-up job's script is rendered and checked too
    if cluster_env:
        data["cluster"]["env"] = cluster_env
    if sft_overrides:
        data["stages"]["sft"]["overrides"].update(sft_overrides)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_cluster_env_entry_interpolating_a_secret_is_refused_naming_the_field_not_the_value(
        tmp_path, monkeypatch):
    from launcher.slurm import SecretValueError

    monkeypatch.setenv("WANDB_API_KEY", WANDB_SECRET)
    path = _tiny_pipeline_yaml(tmp_path, cluster_env={"WB": "${oc.env:WANDB_API_KEY}"})
    pipeline = validate_pipeline(path, cwd=ROOT, check_paths=False)
    for render in (lambda: render_sbatch(pipeline.stages[0]),
                   lambda: render_warmup_sbatch(pipeline.warmup)):
        with pytest.raises(SecretValueError) as info:
            render()
        assert "`env.WB` holds the value of $WANDB_API_KEY" in str(info.value)
        assert WANDB_SECRET not in str(info.value)


def test_a_train_argument_holding_any_token_named_variable_is_refused(tmp_path, monkeypatch):
    from launcher.slurm import SecretValueError

    monkeypatch.setenv("MY_SERVICE_TOKEN", SERVICE_SECRET)
    path = _tiny_pipeline_yaml(tmp_path, sft_overrides={"wandb_project": "${oc.env:MY_SERVICE_TOKEN}"})
    pipeline = validate_pipeline(path, cwd=ROOT, check_paths=False)
    pretrain, sft = pipeline.stages[:2]
    render_sbatch(pretrain)  # the stage without it renders
    with pytest.raises(SecretValueError, match=r"stage sft: `train.py --wandb_project` holds the "
                                               r"value of \$MY_SERVICE_TOKEN") as info:
        render_sbatch(sft, dependency="1")
    assert SERVICE_SECRET not in str(info.value)


def test_short_values_of_key_named_variables_do_not_block_rendering(tmp_path, monkeypatch):
    # FOO_KEY=1 is a flag, not a credential: "1" is in every script (--nodes=1).
    monkeypatch.setenv("RELAY_SORT_KEY", "1")
    pipeline = validate_pipeline(_tiny_pipeline_yaml(tmp_path), cwd=ROOT, check_paths=False)
    assert "--nodes=1" in render_sbatch(pipeline.stages[0])


@pytest.mark.parametrize("verb", [["render"], ["submit", "--dry-run"]])
def test_relay_render_and_submit_refuse_a_secret_value_with_exit_2_and_print_no_script(
        tmp_path, verb):
    path = _tiny_pipeline_yaml(tmp_path, cluster_env={"WB": "${oc.env:WANDB_API_KEY}"})
    env = {**os.environ, "WANDB_API_KEY": WANDB_SECRET, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *verb, str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing was" in proc.stderr and "`env.WB` holds the value of $WANDB_API_KEY" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert WANDB_SECRET not in proc.stdout + proc.stderr
    assert "#SBATCH" not in proc.stdout
    assert not (tmp_path / "runs").exists()
