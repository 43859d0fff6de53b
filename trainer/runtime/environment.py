"""What a job sees: versions, GPUs, kernel caches, network libraries, Slurm allocation.

`probe_environment()` returns it as a JSON-serialisable dict; `format_probe()` renders it for
people; `relay env probe [--json]` prints it, and train.py writes it into launch-manifest.json.
slurm/env.sh is the one place that *sets* the job environment; this module only *reads* it, so
a run's log says what the job actually had (kernel caches warm or cold, NCCL plugin found or
not) instead of what the script meant to give it.

Cheap and safe by design: importing this module costs only the standard library (torch and
psutil are imported inside the probe), the probe never raises (a failing section becomes
{"error": ...}), never imports the GPU kernel packages unless asked, and never reports a secret's
value.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_VARS",
    "SECRET_VARS",
    "probe_environment",
    "format_probe",
    "inspect_cache_dir",
    "inspect_caches",
    "print_probe",
]

# The kernel caches slurm/env.sh points at persistent (or node-local) storage.
CACHE_VARS = (
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
    "QUACK_CACHE_DIR",
)
FA4_CACHE_SWITCH = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
SECRET_VARS = ("WANDB_API_KEY", "HF_TOKEN")

# name -> (distribution names to ask importlib.metadata, module to import with import_kernels)
KERNEL_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "flash_attn": (("flash-attn",), "flash_attn"),
    "fa4": (("flash-attn-4",), "flash_attn.cute"),
    "quack": (("quack-kernels",), "quack"),
    "triton": (("triton", "pytorch-triton"), "triton"),
}

# The same search order as slurm/env.sh (keep the two in step).
OFI_NCCL_DIRS = (
    "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/aws-ofi-nccl/lib",
    "/opt/aws-ofi-nccl/lib",
)
EFA_LIB_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
IB_SYSFS = Path("/sys/class/infiniband")

SLURM_VARS = {
    "job_id": "SLURM_JOB_ID",
    "nodelist": "SLURM_JOB_NODELIST",
    "nnodes": "SLURM_NNODES",
    "ntasks": "SLURM_NTASKS",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
    "cpus_per_task": "SLURM_CPUS_PER_TASK",
    "restart_count": "SLURM_RESTART_COUNT",
    "partition": "SLURM_JOB_PARTITION",
}
# Environment variables worth seeing in a run's record: the prefixes env.sh and NCCL use, and
# the single variables env.sh sets.
ENV_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_")
ENV_NAMES = (
    "RELAY_ENV_SOURCED", "RELAY_NETWORK", "RELAY_CACHE_ROOT", "RELAY_NODE_CACHE_ROOT",
    "RELAY_OFI_NCCL_DIR", "RELAY_EFA_LIB_DIR", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
    "LD_LIBRARY_PATH",
)
# Any variable whose name looks like a credential is reported as set/not set only, whatever
# its prefix: NCCL/FI plugins have been known to take keys through the environment.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_KEY|_KEY$|CREDENTIAL", re.IGNORECASE)

PROBE_MAX_CACHE_FILES = 10_000


# ---------------------------------------------------------------------------------------------
# kernel caches


def inspect_cache_dir(path: str | os.PathLike | None, *, max_files: int = PROBE_MAX_CACHE_FILES,
                      check_writable: bool = True) -> dict[str, Any]:
    """The state of one cache directory; never raises.

    Returns {"path", "exists", "writable", "files", "files_truncated", "warm"}: files counts
    regular files below path (symlinked directories are not followed), stopping at max_files
    (files_truncated is then true) so a huge cache on shared storage stays cheap to probe;
    warm = at least one file. writable is tested by creating and removing a temp file (access
    bits lie on NFS with root squash); it is false for a missing directory and None when
    check_writable is false. path None (the variable is unset) gives exists false, files 0.
    """
    report: dict[str, Any] = {"path": None if path is None else str(path), "exists": False,
                              "writable": False if check_writable else None, "files": 0,
                              "files_truncated": False, "warm": False}
    if path is None or str(path) == "":
        return report
    root = Path(path)
    if not root.is_dir():
        return report
    report["exists"] = True
    count, truncated = _count_files(root, max_files)
    report.update(files=count, files_truncated=truncated, warm=count > 0)
    if check_writable:
        report["writable"] = _is_writable(root)
    return report


def _count_files(root: Path, max_files: int) -> tuple[int, bool]:
    count, stack = 0, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file():
                            count += 1
                            if count >= max_files:
                                return count, True
                    except OSError:
                        continue
        except OSError:
            continue  # an unreadable sub-directory: count what can be read
    return count, False


def _is_writable(root: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(prefix=".relay-probe-", dir=root)
    except OSError:
        return False
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass
    return True


def inspect_caches(environ: Mapping[str, str] | None = None, *,
                   max_files: int = PROBE_MAX_CACHE_FILES,
                   check_writable: bool = True) -> dict[str, dict[str, Any]]:
    """inspect_cache_dir for each of CACHE_VARS as the environment names it: {VAR: report}."""
    env = os.environ if environ is None else environ
    return {var: inspect_cache_dir(env.get(var) or None, max_files=max_files,
                                   check_writable=check_writable) for var in CACHE_VARS}


# ---------------------------------------------------------------------------------------------
# sections of the probe


def _host() -> dict[str, Any]:
    import psutil

    memory = psutil.virtual_memory()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        usable = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_total_gb": round(memory.total / 2**30, 1),
        "memory_available_gb": round(memory.available / 2**30, 1),
    }


def _torch() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": False,
        "device_count": 0,
        "devices": [],
        "nccl": None,
        "cudnn": None,
    }
    if torch.version.cuda is None:
        return report  # a CPU build: nothing below exists
    try:
        version = torch.cuda.nccl.version()
        report["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # NCCL missing from a custom build
        report["nccl"] = f"error: {type(exc).__name__}: {exc}"
    if torch.backends.cudnn.is_available():
        report["cudnn"] = torch.backends.cudnn.version()
    report["cuda_available"] = torch.cuda.is_available()
    if report["cuda_available"]:
        report["device_count"] = torch.cuda.device_count()
        for index in range(report["device_count"]):
            props = torch.cuda.get_device_properties(index)
            report["devices"].append({
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gb": round(props.total_memory / 2**30, 1),
            })
    return report


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_present(module: str) -> bool:
    """Whether `module` can be found, without importing it (importing FA4 takes seconds)."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name is found without importing
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    # a sub-package: look for its directory or module file beside the parent's
    sub = rest.replace(".", os.sep)
    return any(Path(base, sub).is_dir() or Path(base, sub + ".py").is_file()
               for base in (spec.submodule_search_locations or ()))


def _kernels(import_kernels: bool) -> dict[str, Any]:
    report = {}
    for name, (distributions, module) in KERNEL_PACKAGES.items():
        entry: dict[str, Any] = {"version": _distribution_version(distributions),
                                 "module": module, "present": _module_present(module)}
        if import_kernels:
            entry["importable"] = _try_import(module)
        report[name] = entry
    return report


def _try_import(module: str) -> bool | str:
    """True, or the error (a broken CUDA build raises more than ImportError)."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return True


def _caches(env: Mapping[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = dict(inspect_caches(env))
    report[FA4_CACHE_SWITCH] = env.get(FA4_CACHE_SWITCH)
    return report


def _first_dir(candidates: tuple[str, ...]) -> str | None:
    return next((d for d in candidates if os.path.isdir(d)), None)


def _libraries(directory: str | None, pattern: str) -> list[str]:
    if not directory or not os.path.isdir(directory):
        return []
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, pattern)))


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(IB_SYSFS))
    except OSError:
        return []


def _network(env: Mapping[str, str]) -> dict[str, Any]:
    # env.sh lowercases RELAY_NETWORK and defaults it to tcp; read it the same way.
    profile = (env.get("RELAY_NETWORK") or "tcp").lower()
    report: dict[str, Any] = {"profile": profile, "ok": True, "detail": ""}
    if profile == "efa":
        ofi_dir = env.get("RELAY_OFI_NCCL_DIR") or _first_dir(OFI_NCCL_DIRS)
        efa_dir = env.get("RELAY_EFA_LIB_DIR") or _first_dir(EFA_LIB_DIRS)
        plugins = _libraries(ofi_dir, "libnccl-net*.so*")
        fabric = _libraries(efa_dir, "libfabric.so*")
        report.update(ofi_nccl_dir=ofi_dir, ofi_nccl_plugins=plugins, efa_lib_dir=efa_dir,
                      libfabric=fabric, rdma_devices=_rdma_devices(),
                      fi_provider=env.get("FI_PROVIDER"))
        missing = []
        if not plugins:
            where = ofi_dir or "any of " + ", ".join(OFI_NCCL_DIRS)
            missing.append(f"no aws-ofi-nccl plugin (libnccl-net*.so) in {where}")
        if not fabric:
            missing.append(f"no libfabric.so in {efa_dir or 'any of ' + ', '.join(EFA_LIB_DIRS)}")
        report["ok"] = not missing
        report["detail"] = ("; ".join(missing) + ": NCCL falls back to TCP sockets") if missing \
            else f"aws-ofi-nccl {', '.join(plugins)} in {ofi_dir}; libfabric in {efa_dir}"
    elif profile == "ib":
        devices = _rdma_devices()
        report.update(rdma_devices=devices, nccl_ib_hca=env.get("NCCL_IB_HCA"))
        report["ok"] = bool(devices)
        report["detail"] = (f"{len(devices)} RDMA device(s): {', '.join(devices)}" if devices
                            else f"{IB_SYSFS} is empty or missing: NCCL falls back to TCP sockets")
    elif profile == "tcp":
        report["detail"] = "TCP sockets (NCCL_IB_DISABLE)"
    elif profile == "none":
        report["detail"] = "no network settings applied"
    else:
        report.update(ok=False, detail=f"unknown RELAY_NETWORK {profile!r} (expected efa, ib, "
                                       "tcp or none)")
    return report


def _is_secret_name(name: str) -> bool:
    return name in SECRET_VARS or bool(_SECRET_NAME.search(name))


def _env_vars(env: Mapping[str, str]) -> dict[str, str]:
    names = sorted({n for n in env if n.startswith(ENV_PREFIXES)}
                   | {n for n in ENV_NAMES if n in env})
    return {n: ("set (hidden)" if _is_secret_name(n) else env[n]) for n in names}


def _secrets(env: Mapping[str, str]) -> dict[str, str]:
    return {name: "set" if env.get(name) else "not set" for name in SECRET_VARS}


def _slurm(env: Mapping[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = {key: env.get(var) or None for key, var in SLURM_VARS.items()}
    report["in_job"] = report["job_id"] is not None
    return report


def _section(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # a probe that raises would take the job (or the manifest) down
        return {"error": f"{type(exc).__name__}: {exc}"}


def _problems(report: dict[str, Any]) -> list[str]:
    """What a person should look at before trusting a run on this environment."""
    problems = [f"{name}: {section['error']}" for name, section in report.items()
                if isinstance(section, dict) and "error" in section]
    for var in CACHE_VARS:
        cache = report["caches"].get(var)
        if not isinstance(cache, dict):
            continue
        if cache["path"] is None:
            problems.append(f"{var} is not set: kernels compile into a default (often per-user, "
                            f"non-persistent) location; source slurm/env.sh")
        elif not cache["exists"]:
            problems.append(f"{var}={cache['path']} does not exist")
        elif cache["writable"] is False:
            problems.append(f"{var}={cache['path']} is not writable: tuned kernels are not kept")
    kernels = report.get("kernels", {})
    if kernels.get("fa4", {}).get("present") and report["caches"].get(FA4_CACHE_SWITCH) != "1":
        problems.append(f"FA4 is installed but {FA4_CACHE_SWITCH} is not 1: older FA4 releases "
                        "then keep no disk cache and re-tune every run")
    network = report.get("network", {})
    if network.get("ok") is False:
        problems.append(f"network {network.get('profile')}: {network.get('detail')}")
    torch_report = report.get("torch", {})
    gpus = report.get("slurm", {}).get("gpus_on_node")
    if gpus not in (None, "0") and torch_report.get("cuda_available") is False:
        problems.append(f"Slurm gave this node {gpus} GPU(s) but torch sees no CUDA device "
                        f"(torch {torch_report.get('version')}, built for CUDA "
                        f"{torch_report.get('cuda')})")
    return problems


# ---------------------------------------------------------------------------------------------
# public entry points


def probe_environment(*, import_kernels: bool = False,
                      environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a job on this machine sees, as a JSON-serialisable dict. Never raises.

    Keys: host, torch (versions, CUDA devices, NCCL, cuDNN), kernels (flash_attn, fa4, quack,
    triton: distribution version, module present; with import_kernels also "importable", True
    or the import error, which costs seconds for FA4), caches (per CACHE_VARS variable the
    inspect_cache_dir report, plus the FA4 cache switch), network (RELAY_NETWORK profile and
    whether its libraries or devices are there), env (NCCL_*, FI_*, TORCH_NCCL_* and the
    variables env.sh sets), secrets (WANDB_API_KEY, HF_TOKEN: "set" / "not set" only), slurm
    (the allocation, all None outside a job), problems (sentences for people), probe_seconds.
    A section that fails holds {"error": "..."} instead. environ defaults to os.environ.
    """
    start = time.perf_counter()
    env = os.environ if environ is None else environ
    report: dict[str, Any] = {
        "host": _section(_host),
        "torch": _section(_torch),
        "kernels": _section(lambda: _kernels(import_kernels)),
        "caches": _section(lambda: _caches(env)),
        "network": _section(lambda: _network(env)),
        "env": _section(lambda: _env_vars(env)),
        "secrets": _section(lambda: _secrets(env)),
        "slurm": _section(lambda: _slurm(env)),
    }
    try:
        report["problems"] = _problems(report)
    except Exception as exc:  # a malformed section must not lose the rest of the report
        report["problems"] = [f"problems: {type(exc).__name__}: {exc}"]
    report["probe_seconds"] = round(time.perf_counter() - start, 3)
    return report


def _cache_line(var: str, cache: dict[str, Any]) -> str:
    if cache.get("path") is None:
        return f"          {var:<36} not set"
    if not cache.get("exists"):
        return f"          {var:<36} {cache['path']}  MISSING"
    files = f"{cache['files']}{'+' if cache.get('files_truncated') else ''} files"
    state = f"warm ({files})" if cache.get("warm") else "cold (empty)"
    writable = "writable" if cache.get("writable") else "NOT WRITABLE"
    return f"          {var:<36} {cache['path']}  {state}, {writable}"


def format_probe(report: dict[str, Any]) -> str:
    """probe_environment's dict as text for people (one topic a block). Never raises on a
    section that holds an error: it prints the error."""
    lines: list[str] = []

    def block(title: str, key: str, render: Callable[[dict[str, Any]], list[str]]) -> None:
        section = report.get(key)
        if not isinstance(section, dict):
            return
        if "error" in section:
            lines.append(f"{title:<10}ERROR {section['error']}")
            return
        try:
            body = render(section)
        except Exception as exc:
            body = [f"(cannot render: {type(exc).__name__}: {exc})"]
        lines.append(f"{title:<10}{body[0]}" if body else title)
        lines.extend(body[1:])

    def host(s):
        return [f"{s['hostname']}  python {s['python']}  cpus {s['cpus_usable']}/{s['cpu_count']}  "
                f"memory {s['memory_total_gb']} GB ({s['memory_available_gb']} GB available)"]

    def torch_(s):
        if s["cuda"] is None:
            return [f"{s['version']} (CPU build)"]
        gpus = f"{s['device_count']} device(s)" if s["cuda_available"] else "NOT AVAILABLE"
        out = [f"{s['version']}  CUDA {s['cuda']}: {gpus}  NCCL {s['nccl']}  cuDNN {s['cudnn']}"]
        out += [f"          cuda:{d['index']}  {d['name']}  sm_{d['capability'].replace('.', '')}  "
                f"{d['memory_gb']} GB" for d in s["devices"]]
        return out

    def kernels(s):
        parts = []
        for name, k in s.items():
            installed = k["version"] is not None or k["present"]
            text = f"{name} {k['version'] or ('present' if installed else 'not installed')}"
            if installed and "importable" in k:
                text += (" (imports)" if k["importable"] is True
                         else f" (IMPORT FAILS: {k['importable']})")
            parts.append(text)
        return ["  ".join(parts)]

    def caches(s):
        return [f"{FA4_CACHE_SWITCH}={s.get(FA4_CACHE_SWITCH)}"] + \
            [_cache_line(var, s[var]) for var in CACHE_VARS if var in s]

    def network(s):
        return [f"{s['profile']}: {'ok' if s['ok'] else 'PROBLEM'}  {s['detail']}"]

    def slurm(s):
        if not s["in_job"]:
            return ["not in a Slurm job"]
        return [f"job {s['job_id']} on {s['nodelist']} ({s['nnodes']} nodes, {s['ntasks']} tasks, "
                f"{s['gpus_on_node']} GPUs/node, {s['cpus_per_task']} CPUs/task, partition "
                f"{s['partition']}, restart {s['restart_count'] or 0})"]

    def secrets(s):
        return ["  ".join(f"{k} {v}" for k, v in s.items())]

    def env(s):
        pairs = [f"{k}={v}" for k, v in s.items()] or ["(none of the variables env.sh sets)"]
        return pairs[:1] + [f"          {p}" for p in pairs[1:]]

    block("host", "host", host)
    block("torch", "torch", torch_)
    block("kernels", "kernels", kernels)
    block("caches", "caches", caches)
    block("network", "network", network)
    block("slurm", "slurm", slurm)
    block("secrets", "secrets", secrets)
    block("env", "env", env)
    problems = report.get("problems") or []
    lines.append("problems  " + ("none" if not problems else problems[0]))
    lines.extend(f"          {p}" for p in problems[1:])
    return "\n".join(lines)


def print_probe(as_json: bool = False, import_kernels: bool = False) -> int:
    """`relay env probe`: print the probe (JSON or text) to stdout. Returns exit code 0."""
    report = probe_environment(import_kernels=import_kernels)
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else format_probe(report))
    return 0


def launch_manifest(topo) -> dict:
    """Who ran this, where and with what: launch-manifest.json, written by rank 0 at start
    (`topo`: the run's trainer.parallel.distributed.Topology)."""
    import torch

    env = os.environ
    return {
        "host": socket.gethostname(),
        "world_size": topo.world_size,
        "ranks_per_node": int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1")
                                      .split("(")[0] or 1)),
        "cp_size": topo.cp_size,
        "device": str(topo.device),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
        "slurm_restart_count": env.get("SLURM_RESTART_COUNT"),
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "environment": probe_environment(),
    }


def _git_commit() -> str | None:
    """The commit of the checkout this code runs from; None for an installed wheel (whose
    site-packages may sit inside some other repository, e.g. a .venv in a checkout)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=root, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":  # `python -m trainer.runtime.environment [--json] [--import-kernels]`
    sys.exit(print_probe("--json" in sys.argv[1:], "--import-kernels" in sys.argv[1:]))
