#!/usr/bin/env bash
# Creates .venv in the repository root and installs relay with its test tools.
# Torch is installed first and pinned (a plain `pip install torch` pulls a multi-GB CUDA build):
#   RELAY_TORCH_SPEC   pip requirement for torch (default torch==2.13.0, the CPU build)
#   RELAY_VENV         where the environment lives (default <repo>/.venv)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RELAY_VENV:-$root/.venv}
torch_spec=${RELAY_TORCH_SPEC:-torch==2.13.0}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing $torch_spec"
  "${pip[@]}" install "$torch_spec"
fi
stamp="$venv/.relay-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  echo "[setup] installing relay and its dependencies"
  "${pip[@]}" install -e "$root[dev,encode]"
  touch "$stamp"
fi
echo "[setup] ready: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
