"""scripts/<stage>.sh: one body (scripts/_stage.sh) behind four #SBATCH headers.

No Slurm needed: outside a job the scripts run train.py as one process, and RELAY_PYTHON is a
stand-in that records the arguments train.py would get instead of training.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAGES = ("pretrain", "sft", "stage1", "stage2")
BASH = shutil.which("bash") or "/bin/bash"


def split_header(name: str) -> tuple[list[str], list[str]]:
    """(header, body) of scripts/<name>.sh: the header ends with its RELAY_STAGE_NAME line."""
    lines = (REPO / "scripts" / f"{name}.sh").read_text().splitlines()
    marker = [i for i, line in enumerate(lines) if line.startswith("RELAY_STAGE_NAME=")]
    assert len(marker) == 1, f"{name}.sh: one RELAY_STAGE_NAME= line"
    return lines[:marker[0] + 1], lines[marker[0] + 1:]


def test_stage_scripts_differ_only_in_their_headers():
    bodies = {}
    for name in STAGES:
        header, body = split_header(name)
        assert header[-1].split("#")[0].strip() == f"RELAY_STAGE_NAME={name}"
        # Nothing runs in the header but the stage name: comments and #SBATCH lines.
        assert all(line.startswith("#") for line in header[:-1]), header
        bodies[name] = body
    assert all(body == bodies["pretrain"] for body in bodies.values())
    assert bodies["pretrain"][-1] == 'source "$RELAY_ROOT/scripts/_stage.sh"'


@pytest.mark.parametrize("name", STAGES)
def test_stage_script_defaults_to_the_stage_config_of_the_repository(name, tmp_path):
    # The stand-in python: `-c` snippets (reading the dry run's JSON) go to the real one;
    # `-m trainer.train ...` is recorded, and answers the dry run with an output_dir.
    log = tmp_path / "argv.log"
    fake = tmp_path / "python"
    fake.write_text(f'#!{BASH}\n'
                    f'if [[ "$1" == -c ]]; then exec "{sys.executable}" "$@"; fi\n'
                    f'printf "%s\\n" "$*" >> "{log}"\n'
                    f'echo \'{{"output_dir": "{tmp_path / "out"}"}}\'\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RELAY_ROOT=str(REPO), RELAY_PYTHON=str(fake), RELAY_NETWORK="none",
               RELAY_ENV_QUIET="1", RELAY_CACHE_ROOT=str(tmp_path / "cache"),
               RELAY_NODE_CACHE_ROOT=str(tmp_path / "node-cache"))
    proc = subprocess.run([BASH, str(REPO / "scripts" / f"{name}.sh"), "--max_steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    dry_run, run = log.read_text().splitlines()
    config = f"config/{name}.yaml"
    assert dry_run == f"-m trainer.train --config {config} --max_steps 2 --dry-run"
    assert run == f"-u -m trainer.train --config {config} --max_steps 2"
    assert (REPO / config).is_file()  # relative to RELAY_ROOT, where the script runs train.py
