"""trainer/runtime/environment.py: the probe of what a job sees, and `relay env probe`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainer.runtime import environment
from launcher.cli import main as relay_main
from trainer.runtime.environment import (CACHE_VARS, format_probe, inspect_cache_dir, inspect_caches,
                                  probe_environment)


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")


def test_probe_returns_every_section_as_json():
    report = probe_environment()
    for key in ("host", "torch", "kernels", "caches", "network", "env", "secrets", "slurm",
                "problems", "probe_seconds"):
        assert key in report, key
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda"] == torch.version.cuda
    assert set(report["kernels"]) == {"flash_attn", "fa4", "quack", "triton"}
    assert set(CACHE_VARS) <= set(report["caches"])
    assert report["host"]["cpu_count"] == os.cpu_count()
    # launch-manifest.json stores it as it is: nothing may need a default= to serialise.
    # (How long the probe takes is a benchmark: benchmarks/environment_probe.py.)
    assert json.loads(json.dumps(report)) == report


def test_secrets_are_reported_as_set_but_their_values_never_appear(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-value-3141")
    monkeypatch.setenv("HF_TOKEN", "hf-value-2718")
    # a credential hiding among the recorded prefixes is masked too
    monkeypatch.setenv("NCCL_PLUGIN_TOKEN", "nccl-value-1618")
    report = probe_environment()
    text = json.dumps(report) + format_probe(report)
    for value in ("wandb-value-3141", "hf-value-2718", "nccl-value-1618"):
        assert value not in text
    assert report["secrets"] == {"WANDB_API_KEY": "set", "HF_TOKEN": "set"}
    assert report["env"]["NCCL_PLUGIN_TOKEN"] == "set (hidden)"


def test_unset_secrets_read_not_set():
    report = probe_environment(environ={})
    assert report["secrets"] == {"WANDB_API_KEY": "not set", "HF_TOKEN": "not set"}


def test_empty_cache_dir_is_cold_and_writable(tmp_path):
    report = inspect_cache_dir(tmp_path)
    assert report == {"path": str(tmp_path), "exists": True, "writable": True, "files": 0,
                      "files_truncated": False, "warm": False}
    assert list(tmp_path.iterdir()) == []  # the writability test cleaned up after itself


def test_cache_dir_with_files_in_subdirectories_is_warm(tmp_path):
    for name in ("a", "sub/b", "sub/deeper/c"):
        _touch(tmp_path / name)
    report = inspect_cache_dir(tmp_path)
    assert report["warm"] and report["files"] == 3 and not report["files_truncated"]


def test_cache_file_count_stops_at_the_cap(tmp_path):
    for i in range(5):
        _touch(tmp_path / f"f{i}")
    report = inspect_cache_dir(tmp_path, max_files=2)
    assert report["files"] == 2 and report["files_truncated"] and report["warm"]


def test_missing_and_unset_cache_dirs(tmp_path):
    missing = inspect_cache_dir(tmp_path / "nope")
    assert not missing["exists"] and not missing["writable"] and not missing["warm"]
    unset = inspect_cache_dir(None)
    assert unset["path"] is None and not unset["exists"]


def test_read_only_cache_dir_is_not_writable(tmp_path):
    if os.geteuid() != 0:
        cache = tmp_path / "ro"
        _touch(cache / "kernel.bin")
        cache.chmod(0o555)
        try:
            report = inspect_cache_dir(cache)
        finally:
            cache.chmod(0o755)
    else:
        # Root writes through permission bits; sysfs refuses new files even to root.
        if not Path("/sys/fs").is_dir():
            pytest.skip("running as root and no /sys/fs to stand for a read-only directory")
        report = inspect_cache_dir(Path("/sys/fs"), max_files=5)
    assert report["exists"] and report["warm"] and report["writable"] is False


def test_cache_dir_where_a_file_cannot_be_created_is_not_writable(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(environment.tempfile, "mkstemp", refuse)  # as root squash would
    report = inspect_cache_dir(tmp_path)
    assert report["exists"] and report["writable"] is False


def test_probe_reads_cache_dirs_from_the_environment_and_flags_missing_ones(tmp_path):
    warm, cold = tmp_path / "triton", tmp_path / "inductor"
    _touch(warm / "kernel.cubin")
    cold.mkdir()
    env = {"TRITON_CACHE_DIR": str(warm), "TORCHINDUCTOR_CACHE_DIR": str(cold),
           "QUACK_CACHE_DIR": str(tmp_path / "missing"),
           "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
    report = probe_environment(environ=env)
    caches = report["caches"]
    assert caches["TRITON_CACHE_DIR"]["warm"] and caches["TRITON_CACHE_DIR"]["files"] == 1
    inductor = caches["TORCHINDUCTOR_CACHE_DIR"]
    assert inductor["exists"] and not inductor["warm"]
    assert not caches["QUACK_CACHE_DIR"]["exists"]
    assert caches["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    problems = "\n".join(report["problems"])
    assert "QUACK_CACHE_DIR" in problems and "does not exist" in problems
    assert "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR is not set" in problems
    assert "TRITON_CACHE_DIR" not in problems
    text = format_probe(report)
    assert "warm (1 files)" in text and "cold (empty)" in text and "MISSING" in text
    assert inspect_caches(env)["TRITON_CACHE_DIR"]["files"] == 1


def test_efa_profile_is_ok_when_plugin_and_libfabric_are_there(tmp_path):
    ofi, efa = tmp_path / "ofi", tmp_path / "efa"
    _touch(ofi / "libnccl-net.so")
    _touch(efa / "libfabric.so.1")
    env = {"RELAY_NETWORK": "EFA", "RELAY_OFI_NCCL_DIR": str(ofi), "RELAY_EFA_LIB_DIR": str(efa)}
    network = probe_environment(environ=env)["network"]
    assert network["profile"] == "efa" and network["ok"]
    assert network["ofi_nccl_plugins"] == ["libnccl-net.so"]
    assert network["libfabric"] == ["libfabric.so.1"]


def test_efa_profile_without_its_libraries_is_a_problem(tmp_path):
    env = {"RELAY_NETWORK": "efa", "RELAY_OFI_NCCL_DIR": str(tmp_path),
           "RELAY_EFA_LIB_DIR": str(tmp_path)}
    report = probe_environment(environ=env)
    assert report["network"]["ok"] is False
    assert "aws-ofi-nccl" in report["network"]["detail"]
    assert any(p.startswith("network efa") for p in report["problems"])


def test_ib_profile_needs_rdma_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "IB_SYSFS", tmp_path)
    assert probe_environment(environ={"RELAY_NETWORK": "ib"})["network"]["ok"] is False
    (tmp_path / "mlx5_0").mkdir()
    network = probe_environment(environ={"RELAY_NETWORK": "ib"})["network"]
    assert network["ok"] and network["rdma_devices"] == ["mlx5_0"]


def test_tcp_is_the_default_profile_and_unknown_ones_are_problems():
    assert probe_environment(environ={})["network"] == {
        "profile": "tcp", "ok": True, "detail": "TCP sockets (NCCL_IB_DISABLE)"}
    report = probe_environment(environ={"RELAY_NETWORK": "carrier-pigeon"})
    assert report["network"]["ok"] is False
    assert any("carrier-pigeon" in p for p in report["problems"])


def test_nccl_fi_and_job_variables_are_recorded_and_others_are_not():
    env = {"NCCL_SOCKET_IFNAME": "^lo,docker", "FI_PROVIDER": "efa", "MASTER_PORT": "20042",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "UNRELATED": "x"}
    recorded = probe_environment(environ=env)["env"]
    assert recorded == {k: v for k, v in env.items() if k != "UNRELATED"}


def test_slurm_allocation_is_read_from_the_environment():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-240]", "SLURM_NNODES": "240",
           "SLURM_NTASKS": "1920", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "12",
           "SLURM_RESTART_COUNT": "1", "SLURM_JOB_PARTITION": "train"}
    report = probe_environment(environ=env)
    assert report["slurm"] == {"job_id": "4242", "nodelist": "gpu[001-240]", "nnodes": "240",
                               "ntasks": "1920", "gpus_on_node": "8", "cpus_per_task": "12",
                               "restart_count": "1", "partition": "train", "in_job": True}
    assert "job 4242 on gpu[001-240] (240 nodes" in format_probe(report)
    assert probe_environment(environ={})["slurm"]["in_job"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpus_from_slurm_that_torch_cannot_see_are_a_problem():
    report = probe_environment(environ={"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "8"})
    assert any("torch sees no CUDA device" in p for p in report["problems"])


def test_a_failing_section_becomes_an_error_entry(monkeypatch):
    def broken():
        raise RuntimeError("psutil exploded")

    monkeypatch.setattr(environment, "_host", broken)
    report = probe_environment()
    assert report["host"] == {"error": "RuntimeError: psutil exploded"}
    assert "host: RuntimeError: psutil exploded" in report["problems"]
    assert "host      ERROR RuntimeError: psutil exploded" in format_probe(report)


def test_relay_env_probe_json_parses(capsys):
    assert relay_main(["env", "probe", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"]["version"] == torch.__version__


def test_relay_env_probe_prints_text(capsys):
    assert relay_main(["env", "probe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host ") and "\ncaches " in out and "\nproblems " in out
