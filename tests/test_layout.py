"""The house rules of the code layout (docs/layout.md): trainer/ in layers that import only
downwards, no family importing another, no import circles among relay's modules, the compute
side never imports the login side, and the login side runs without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "trainer")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """relay modules `path` imports, at module level or inside functions (lazy imports count:
    a circle through a lazy import is still a circle a reader has to untangle)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out.update(n for n in names if n in modules)
    return out


def test_no_import_circles_among_relay_modules():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # A package's __init__ importing its own submodules is not a circle of ours.
    for name in graph:
        graph[name] = {d for d in graph[name] if not d.startswith(name + ".")}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# trainer/ from the bottom up: each entry (a folder, or a module at trainer/'s top level) may
# import itself and the entries before it, never one after it. docs/layout.md draws the same.
LAYERS = ("runtime", "config", "encoders", "data", "diffusion", "models", "parallel", "optim",
          "checkpoint", "build", "stages", "evaluation", "checks", "source_model", "preflight",
          "resolve", "run_state", "encode", "warmup", "train")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer" and len(parts) > 1 else None


def test_trainer_is_in_layers_that_import_only_downwards():
    modules = _modules()
    unplaced = sorted({_layer(m) for m in modules} - set(LAYERS) - {None})
    assert not unplaced, f"trainer entries without a place in LAYERS: {unplaced}"
    against = []
    for name, path in modules.items():
        here = _layer(name)
        if here is None:
            continue
        for dep in sorted(_imports(path, modules)):
            there = _layer(dep)
            if there is not None and LAYERS.index(there) > LAYERS.index(here):
                against.append(f"{name} ({here}) imports {dep} ({there})")
    assert not against, "imports against the layers:\n" + "\n".join(against)


def _family_packages() -> list[str]:
    return sorted(path.parent.name for path in (ROOT / "trainer/models").glob("*/family.py"))


def test_no_model_family_imports_another_and_shared_parts_import_none():
    modules = _modules()
    families = _family_packages()
    assert {"dit", "wan"} <= set(families)
    offenders = []
    for name, path in modules.items():
        # The registry is where the built-in families are registered: it names each.
        if not name.startswith("trainer.models.") or name == "trainer.models.registry":
            continue
        own = name.split(".")[2]
        for dep in _imports(path, modules):
            other = dep.split(".")[2] if dep.startswith("trainer.models.") else None
            if other in families and other != own:
                offenders.append(f"{name} imports {dep}")
    assert not offenders, ("a family (or a part shared by all) imports a family:\n"
                           + "\n".join(sorted(offenders)))


def test_the_compute_side_never_imports_the_login_side():
    modules = _modules()
    offenders = {name: sorted(d for d in _imports(path, modules) if d.startswith("launcher"))
                 for name, path in modules.items() if name.startswith("trainer")}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("module", sorted(_modules()))
def test_each_module_imports_on_its_own(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


TORCH_FREE = ("launcher.cli", "launcher.pipeline", "launcher.slurm", "launcher.status",
              "launcher.record", "launcher.local", "trainer.config.schema", "trainer.config.args",
              "trainer.resolve", "trainer.checks.stage", "trainer.checks.lora", "trainer.checks.memory",
              "trainer.preflight", "trainer.models.dit.config",
              "trainer.checkpoint.weights_source", "trainer.checkpoint.layout", "trainer.runtime.environment",
              "trainer.runtime.files", "trainer.stages.declaration", "trainer.stages.declarations",
              "trainer.stages.registry")


def _torch_loaded_after(code: str) -> tuple[bool, str]:
    probe = code + "\nimport sys\nprint('TORCH', 'torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert "TORCH" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    return "TORCH True" in proc.stdout, proc.stdout + proc.stderr


def test_login_side_modules_import_without_torch():
    loaded, out = _torch_loaded_after("\n".join(f"import {m}" for m in TORCH_FREE))
    assert not loaded, out[-2000:]


def test_relay_submit_dry_run_of_the_tiny_pipeline_never_imports_torch(tmp_path):
    code = (f"import sys\nsys.argv = ['relay', 'submit', {str(ROOT / 'config/pipeline/tiny.yaml')!r}, "
            f"'--root', {str(tmp_path / 'root')!r}, '--dry-run']\n"
            "from launcher.cli import main\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n")
    loaded, out = _torch_loaded_after(code)
    assert "nothing was submitted" in out, out[-3000:]
    assert not loaded, out[-3000:]


@pytest.mark.parametrize("argv", [
    [sys.executable, "trainer/train.py", "--help"],
    [sys.executable, "-m", "launcher.cli", "--help"],
    [sys.executable, "-m", "launcher.cli", "submit", "--help"],
])
def test_help_exits_zero_and_lists_the_keys(argv):
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
    if "train.py" in argv[1]:
        assert "--learning_rate" in proc.stdout and "--validation_interval" in proc.stdout
