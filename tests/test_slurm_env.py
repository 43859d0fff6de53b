"""slurm/env.sh: sourced in a bash subprocess with a controlled environment.

No Slurm needed: PATH holds only mkdir and id (plus, where a test wants it, a fake
scontrol), so the real scontrol of the machine never answers.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV_SH = REPO / "slurm" / "env.sh"
BASH = shutil.which("bash") or "/bin/bash"
DUMP = f'"{sys.executable}" -c "import json, os; print(json.dumps(dict(os.environ)))"'
NETWORK_VARS = (
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "FI_EFA_FORK_SAFE",
    "FI_EFA_SET_CUDA_SYNC_MEMOPS",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME",
    "NCCL_TOPO_FILE",
)


class Sourced:
    def __init__(self, proc: subprocess.CompletedProcess[str], env: dict[str, str] | None):
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.env = env or {}

    def logged(self, name: str) -> str:
        """The value logged for NAME (the `[relay env] NAME=value (why)` line)."""
        for line in self.stderr.splitlines():
            prefix = f"[relay env] {name}="
            if line.startswith(prefix):
                return line[len(prefix):]
        raise AssertionError(f"{name} not logged:\n{self.stderr}")


@pytest.fixture
def sandbox(tmp_path: Path):
    """Return a function that sources env.sh with exactly the given environment."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("mkdir", "id"):
        (bindir / tool).symlink_to(shutil.which(tool))
    home = tmp_path / "home"
    home.mkdir()
    user = f"relaytest-{uuid.uuid4().hex[:8]}"

    def run(
        extra: dict[str, str] | None = None,
        *,
        prelude: str = "set -euo pipefail",
        after: str = DUMP,
        scontrol: str | None = None,
    ) -> Sourced:
        if scontrol is not None:
            fake = bindir / "scontrol"
            fake.write_text(f"#!{BASH}\n{scontrol}\n")
            fake.chmod(0o755)
        env = {"PATH": str(bindir), "HOME": str(home), "USER": user}
        env.update(extra or {})
        script = f'{prelude}\nsource "{ENV_SH}"\necho "[test] survived rc=$?" >&2\n{after}\n'
        proc = subprocess.run(
            [BASH, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        dumped = None
        if after.endswith(DUMP) and proc.returncode == 0:
            dumped = json.loads(proc.stdout.strip().splitlines()[-1])
        return Sourced(proc, dumped)

    run.home = home  # type: ignore[attr-defined]
    run.user = user  # type: ignore[attr-defined]
    run.tmp = tmp_path  # type: ignore[attr-defined]
    yield run
    shutil.rmtree(f"/tmp/relay-{user}", ignore_errors=True)


def test_defaults_outside_slurm(sandbox):
    r = sandbox()
    assert r.rc == 0, r.stderr
    assert "[test] survived" in r.stderr
    e = r.env
    node = f"/tmp/relay-{sandbox.user}"
    shared = f"{sandbox.home}/.cache/relay"
    assert e["TRITON_CACHE_DIR"] == f"{node}/triton"
    assert e["TORCHINDUCTOR_CACHE_DIR"] == f"{node}/inductor"
    assert e["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == f"{shared}/fa4_cute_dsl"
    assert e["QUACK_CACHE_DIR"] == f"{shared}/quack"
    for name in (
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
        "QUACK_CACHE_DIR",
    ):
        assert Path(e[name]).is_dir(), name
    assert e["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert e["HF_HUB_OFFLINE"] == "1"
    assert e["TRANSFORMERS_OFFLINE"] == "1"
    assert e["OMP_NUM_THREADS"] == "1"
    assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in e
    assert e["MASTER_PORT"] == "29500"
    assert "MASTER_ADDR" not in e
    assert e["RELAY_NETWORK"] == "tcp"
    assert e["NCCL_IB_DISABLE"] == "1"
    assert e["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert "FI_PROVIDER" not in e
    assert e["RELAY_ENV_SOURCED"] == "1"
    # Every value is logged, one line each, with where it came from.
    assert r.logged("TRITON_CACHE_DIR") == f"{node}/triton (default)"
    assert r.logged("MASTER_PORT") == "29500 (default)"
    for name in ("QUACK_CACHE_DIR", "HF_HUB_OFFLINE", "OMP_NUM_THREADS", "NCCL_IB_DISABLE"):
        r.logged(name)
    assert "[relay env] MASTER_ADDR: not set" in r.stderr


def test_leaves_no_helpers_behind(sandbox):
    r = sandbox(after='compgen -v | grep "^_relay" || true; declare -F | grep _relay || true')
    assert r.rc == 0, r.stderr
    assert r.stdout.strip() == ""


def test_presets_are_kept_and_logged(sandbox):
    r = sandbox(
        {
            "TRITON_CACHE_DIR": str(sandbox.tmp / "my-triton"),
            "RELAY_CACHE_ROOT": str(sandbox.tmp / "shared"),
            "OMP_NUM_THREADS": "7",
            "SLURM_CPUS_PER_TASK": "12",
            "HF_HUB_OFFLINE": "0",
            "MASTER_ADDR": "10.0.0.9",
            "MASTER_PORT": "1111",
            "SLURM_JOB_ID": "1234",
            "NCCL_SOCKET_IFNAME": "eth7",
        }
    )
    assert r.rc == 0, r.stderr
    e = r.env
    assert e["TRITON_CACHE_DIR"] == str(sandbox.tmp / "my-triton")
    assert (sandbox.tmp / "my-triton").is_dir()
    assert e["QUACK_CACHE_DIR"] == str(sandbox.tmp / "shared" / "quack")
    assert (sandbox.tmp / "shared" / "fa4_cute_dsl").is_dir()
    assert e["OMP_NUM_THREADS"] == "7"
    assert e["HF_HUB_OFFLINE"] == "0"
    assert e["MASTER_ADDR"] == "10.0.0.9"
    assert e["MASTER_PORT"] == "1111"
    assert e["NCCL_SOCKET_IFNAME"] == "eth7"
    assert r.logged("MASTER_PORT") == "1111 (preset)"
    assert r.logged("OMP_NUM_THREADS") == "7 (preset)"


def test_threads_from_slurm_cpus_per_task(sandbox):
    r = sandbox({"SLURM_CPUS_PER_TASK": "6"})
    assert r.rc == 0, r.stderr
    assert r.env["OMP_NUM_THREADS"] == "6"


def test_network_efa(sandbox):
    ofi = sandbox.tmp / "ofi-nccl" / "lib"
    efa = sandbox.tmp / "efa" / "lib"
    ofi.mkdir(parents=True)
    efa.mkdir(parents=True)
    topo = sandbox.tmp / "topo.xml"
    topo.write_text("<system/>")
    extra = {
        "RELAY_NETWORK": "efa",
        "RELAY_OFI_NCCL_DIR": str(ofi),
        "RELAY_EFA_LIB_DIR": str(efa),
        "RELAY_NCCL_TOPO_FILE": str(topo),
        "LD_LIBRARY_PATH": "/opt/existing",
    }
    r = sandbox(extra)
    assert r.rc == 0, r.stderr
    e = r.env
    assert e["FI_PROVIDER"] == "efa"
    assert e["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert e["FI_EFA_FORK_SAFE"] == "1"
    assert e["FI_EFA_SET_CUDA_SYNC_MEMOPS"] == "0"
    assert e["LD_LIBRARY_PATH"] == f"{ofi}:{efa}:/opt/existing"
    assert e["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert e["NCCL_TOPO_FILE"] == str(topo)
    assert "NCCL_IB_DISABLE" not in e
    assert "WARNING" not in r.stderr
    # Sourcing twice does not stack the plugin dirs.
    twice = sandbox(extra, after=f'source "{ENV_SH}" 2>/dev/null\n{DUMP}')
    assert twice.rc == 0, twice.stderr
    assert twice.env["LD_LIBRARY_PATH"] == f"{ofi}:{efa}:/opt/existing"


def test_network_efa_missing_plugin_warns(sandbox):
    missing = sandbox.tmp / "no-such-plugin"
    r = sandbox(
        {
            "RELAY_NETWORK": "EFA",  # case-insensitive
            "RELAY_OFI_NCCL_DIR": str(missing),
            "RELAY_EFA_LIB_DIR": str(sandbox.tmp / "no-efa"),
        }
    )
    assert r.rc == 0, r.stderr
    assert r.env["RELAY_NETWORK"] == "efa"
    assert r.env["FI_PROVIDER"] == "efa"
    assert "LD_LIBRARY_PATH" not in r.env
    assert f"WARNING: aws-ofi-nccl plugin dir RELAY_OFI_NCCL_DIR={missing} does not exist" in r.stderr


def test_network_ib(sandbox):
    r = sandbox(
        {
            "RELAY_NETWORK": "ib",
            "RELAY_NCCL_IB_HCA": "=mlx5_0,mlx5_1",
            "RELAY_NCCL_SOCKET_IFNAME": "ens5",
        }
    )
    assert r.rc == 0, r.stderr
    e = r.env
    assert e["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert e["NCCL_SOCKET_IFNAME"] == "ens5"
    assert "NCCL_IB_DISABLE" not in e
    assert "FI_PROVIDER" not in e


def test_network_tcp(sandbox):
    r = sandbox({"RELAY_NETWORK": "tcp"})
    assert r.rc == 0, r.stderr
    assert r.env["NCCL_IB_DISABLE"] == "1"
    assert r.env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert "FI_PROVIDER" not in r.env
    assert "NCCL_IB_HCA" not in r.env


def test_network_none(sandbox):
    r = sandbox({"RELAY_NETWORK": "none"})
    assert r.rc == 0, r.stderr
    for name in NETWORK_VARS:
        assert name not in r.env, name
    assert r.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_network_unknown_is_an_error_but_does_not_exit(sandbox):
    # `source` returns 1 after logging the error; the caller's shell goes on.
    r = sandbox({"RELAY_NETWORK": "carrier-pigeon"}, prelude="set -uo pipefail")
    assert r.rc == 0, r.stderr
    assert "ERROR: unknown RELAY_NETWORK='carrier-pigeon'" in r.stderr
    assert "[test] survived rc=1" in r.stderr
    for name in NETWORK_VARS:
        assert name not in r.env, name
    # Under the caller's own `set -e` that status stops the caller (its choice), with the
    # error already printed.
    strict = sandbox({"RELAY_NETWORK": "carrier-pigeon"}, prelude="set -euo pipefail")
    assert strict.rc == 1
    assert "ERROR: unknown RELAY_NETWORK" in strict.stderr


@pytest.mark.parametrize(
    ("job_id", "port"),
    [("1234", "21234"), ("45678", "25678"), ("20000", "20000"), ("39999", "39999"), ("0099", "20099")],
)
def test_master_port_from_job_id(sandbox, job_id, port):
    r = sandbox({"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "n1"})
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_PORT"] == port


def test_master_port_non_numeric_job_id(sandbox):
    r = sandbox({"SLURM_JOB_ID": "abc", "SLURM_JOB_NODELIST": "n1"})
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_PORT"] == "29500"
    assert "WARNING: SLURM_JOB_ID='abc'" in r.stderr


def test_master_addr_via_scontrol(sandbox):
    r = sandbox(
        {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[17-18]"},
        scontrol='[ "$1 $2 $3" = "show hostnames gpu[17-18]" ] || exit 9; printf "gpu17\\ngpu18\\n"',
    )
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_ADDR"] == "gpu17"
    assert "via scontrol" in r.logged("MASTER_ADDR")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[01-04]", "node01"),
        ("node[07,09-12]", "node07"),
        ("gpu-a[7,9],gpu-b1", "gpu-a7"),
        ("host1,host2", "host1"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("single", "single"),
    ],
)
def test_master_addr_without_scontrol(sandbox, nodelist, first):
    r = sandbox({"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": nodelist})
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_ADDR"] == first
    assert "parsed, no scontrol" in r.logged("MASTER_ADDR")


def test_master_addr_failing_scontrol_falls_back(sandbox):
    r = sandbox(
        {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[01-04]"},
        scontrol="echo 'slurm_load_ctl_conf error' >&2; exit 1",
    )
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_ADDR"] == "node01"


def test_master_addr_no_nodelist_uses_this_host(sandbox):
    r = sandbox({"SLURM_JOB_ID": "1234"})
    assert r.rc == 0, r.stderr
    assert r.env["MASTER_ADDR"] == socket.gethostname()
    assert r.env["MASTER_PORT"] == "21234"


def test_flight_recorder_in_output_dir(sandbox):
    out = sandbox.tmp / "run-out"
    r = sandbox({"RELAY_OUTPUT_DIR": str(out), "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2",
                 "SLURM_JOB_NODELIST": "n1"})
    assert r.rc == 0, r.stderr
    e = r.env
    assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert e["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(e["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert e["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{out}/nccl-flight-recorder/job77-r2-rank_"
    assert (out / "nccl-flight-recorder").is_dir()


@pytest.mark.parametrize("prelude", ["set -euo pipefail", "set -euxo pipefail"])
def test_secrets_never_printed(sandbox, prelude):
    secret = "wandb-" + uuid.uuid4().hex
    token = "hf_" + uuid.uuid4().hex
    r = sandbox(
        {"WANDB_API_KEY": secret, "HF_TOKEN": token},
        prelude=prelude,
        after='[[ $- == *x* ]] && echo xtrace-on || echo xtrace-off',
    )
    assert r.rc == 0, r.stderr
    assert secret not in r.stdout + r.stderr
    assert token not in r.stdout + r.stderr
    assert "[relay env] WANDB_API_KEY: set (hidden)" in r.stderr
    assert "[relay env] HF_TOKEN: set (hidden)" in r.stderr
    # The caller's xtrace is restored.
    assert r.stdout.strip() == ("xtrace-on" if "x" in prelude.split()[1] else "xtrace-off")


def test_secret_not_set(sandbox):
    r = sandbox()
    assert "[relay env] WANDB_API_KEY: not set" in r.stderr


def test_unwritable_cache_warns_and_survives_errexit(sandbox):
    r = sandbox({"RELAY_NODE_CACHE_ROOT": "/proc/relay-cannot-exist"})
    assert r.rc == 0, r.stderr
    assert "[test] survived" in r.stderr
    assert "WARNING: cannot create TRITON_CACHE_DIR=/proc/relay-cannot-exist/triton" in r.stderr


def test_minimal_environment_is_set_u_safe(sandbox, tmp_path):
    # No HOME, no USER: fallbacks, no unbound-variable error under set -u.
    bindir = tmp_path / "bin"
    script = f'set -euo pipefail\nsource "{ENV_SH}"\n{DUMP}\n'
    proc = subprocess.run(
        [BASH, "-c", script], env={"PATH": str(bindir)}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    e = json.loads(proc.stdout.strip().splitlines()[-1])
    user = e["TRITON_CACHE_DIR"].split("/")[2].removeprefix("relay-")
    assert user
    assert e["RELAY_CACHE_ROOT"].startswith(f"/tmp/relay-{user}")


def test_quiet(sandbox):
    r = sandbox({"RELAY_ENV_QUIET": "1", "RELAY_NETWORK": "efa", "RELAY_OFI_NCCL_DIR": "/nonexistent"})
    assert r.rc == 0, r.stderr
    assert "[relay env] TRITON_CACHE_DIR" not in r.stderr
    assert "WARNING" in r.stderr  # warnings still shown
