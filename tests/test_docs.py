"""The docs stand alone: nothing in the repository points at documents it does not contain, and
every relative link in docs/*.md and README.md reaches a file of the checkout."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Names of design notes that are not part of the repository, and numbered section references
# into them (a section sign followed by a number). Built from pieces so that this file does not
# match itself.
FOREIGN = re.compile("|".join([re.escape("ALGORITHMS" + ".md"), re.escape("ARCHITECTURE" + ".md"),
                               "\u00a7" + r"\s*\d"]))
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_file_refers_to_documents_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        for number, line in enumerate(text.splitlines(), 1):
            if FOREIGN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not offenders, ("references to documents that are not in the repository (point to "
                           "docs/algorithms.md or another docs/*.md page instead):\n"
                           + "\n".join(offenders))


def test_relative_links_in_the_docs_reach_a_file():
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: ]({target})")
    assert not broken, "relative links to files that do not exist:\n" + "\n".join(broken)


MODULE_PATH = re.compile(r"`((?:launcher|trainer)/[\w/]*\.py)`")


def test_layout_md_names_every_module():
    """docs/layout.md names every module of launcher/ and trainer/ (package __init__.py files
    aside) by its path, and every module path it names exists."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    named = set(MODULE_PATH.findall(text))
    modules = {path.relative_to(ROOT).as_posix()
               for package in ("launcher", "trainer") for path in (ROOT / package).rglob("*.py")
               if path.name != "__init__.py" and "__pycache__" not in path.parts}
    missing = sorted(modules - named)
    gone = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, "modules docs/layout.md does not name:\n" + "\n".join(missing)
    assert not gone, "module paths in docs/layout.md that do not exist:\n" + "\n".join(gone)
