"""The model families share through trainer/models/common/ only: no family imports another, and
nothing shared (common/, the attention and fused-kernel modules) imports a family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "trainer" / "models"
FAMILIES = ("dit", "wan")


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offenders(files, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{f.relative_to(ROOT)}: {name}" for f in files for name in sorted(_imported(f))
            if any(name == p or name.startswith(p + ".") for p in forbidden)]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_imports_another(family):
    others = tuple(f"trainer.models.{o}" for o in FAMILIES if o != family)
    assert not _offenders(sorted((MODELS / family).rglob("*.py")), others)


def test_shared_model_code_imports_no_family():
    shared = sorted((MODELS / "common").rglob("*.py")) + [MODELS / "attention.py",
                                                          MODELS / "fused_ops.py"]
    assert not _offenders(shared, tuple(f"trainer.models.{f}" for f in FAMILIES))
