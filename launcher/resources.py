"""The files relay reads at run time that are not Python modules: the YAMLs under config/ and
the job environment slurm/env.sh.

In a checkout (and an editable install of it) they are the repository's own. A wheel carries a
copy of both inside this package, in `launcher/_data/` (setup.py's build step writes it from
the repository's config/ and slurm/env.sh, the one source of truth), so `relay run
config/pipeline/tiny.yaml` and `relay submit` work from any directory after `pip install`.
Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT = PACKAGE_DIR.parent  # the repository root, when this package sits in one
BUNDLED = PACKAGE_DIR / "_data"  # the wheel's copy (absent in a checkout)
ENV_SH = Path("slurm") / "env.sh"


class ResourceError(Exception):
    """Neither a checkout nor the installed package holds the file relay needs."""


def resource_roots() -> list[Path]:
    """Directories that hold relay's config/ and slurm/env.sh, the checkout first."""
    return [root for root in (CHECKOUT, BUNDLED) if (root / ENV_SH).is_file()]


def resource_root() -> Path:
    """The directory holding config/ and slurm/env.sh: the checkout this package is in, else the
    copy installed with the package. Raises ResourceError when there is neither."""
    roots = resource_roots()
    if not roots:
        raise ResourceError(
            f"relay's slurm/env.sh is neither in a checkout ({CHECKOUT}) nor installed with the "
            f"package ({BUNDLED}): reinstall relay from a wheel built by `pip wheel` / `pip "
            f"install .` in the repository, or run from a checkout.")
    return roots[0]


def shipped_file(path: str | os.PathLike) -> Path | None:
    """The copy relay ships of a relative path such as `config/pipeline/tiny.yaml`, or None.

    Only paths under config/ are looked up, so nothing else a user names is ever swapped for a
    file of relay's.
    """
    rel = Path(os.path.expanduser(str(path)))
    if rel.is_absolute() or not rel.parts or rel.parts[0] != "config" or ".." in rel.parts:
        return None
    for root in resource_roots():
        if (root / rel).is_file():
            return (root / rel).resolve()
    return None
