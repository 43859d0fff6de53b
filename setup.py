"""Build step pyproject.toml cannot express: a wheel carries relay's configs and job environment.

`relay run config/pipeline/tiny.yaml` and `relay submit` read YAMLs under config/ and source
slurm/env.sh. In a checkout they are the repository's own; a wheel gets a copy of both in
launcher/_data/ (found by launcher.resources), written here from the repository's files, which
stay the one source of truth. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA_DIR = Path("launcher") / "_data"


def shipped_files() -> list[Path]:
    """Repository-relative paths of what the wheel carries besides the packages."""
    files = sorted(p.relative_to(ROOT) for p in (ROOT / "config").rglob("*.yaml"))
    files.append(Path("slurm") / "env.sh")
    missing = [str(f) for f in files if not (ROOT / f).is_file()]
    if not files[:-1] or missing:
        raise SystemExit(f"relay build: config/*.yaml or slurm/env.sh missing ({missing}): "
                         f"build from a checkout or an sdist of one")
    return files


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's own files
        for rel in shipped_files():
            target = Path(self.build_lib) / DATA_DIR / rel
            self.mkpath(str(target.parent))
            self.copy_file(str(ROOT / rel), str(target))


setup(cmdclass={"build_py": BuildWithData})
