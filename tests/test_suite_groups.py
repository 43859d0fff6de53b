"""The suite's worker groups hold under `pytest -n 2 --dist loadgroup` (scripts/test.sh).

tests/conftest.py marks the Slurm tests as one xdist group (they share the cluster's one node)
and each module with a module-scoped fixture as another (the fixture is then built once). xdist
reads the marks by renaming each test's node id, which some pytest releases ignore (the groups
then vanish without a word, and the Slurm tests run side by side): this runs the same hook on a
small suite of its own under two workers and checks where each test ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

SUITE = {
    "conftest.py": f"""
import importlib.util
import sys

_spec = importlib.util.spec_from_file_location("relay_tests_conftest", {str(CONFTEST)!r})
_relay = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_relay)
pytest_collection_modifyitems = _relay.pytest_collection_modifyitems
""",
    "record.py": """
import json, os, time
from pathlib import Path

def record(kind, name):
    with open(Path(__file__).with_name("ran.jsonl"), "a") as log:
        log.write(json.dumps([kind, name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
    time.sleep(0.2)  # long enough that an idle worker would take the next test
""",
    "test_shared.py": """
import pytest
from record import record

@pytest.fixture(scope="module")
def built():
    record("fixture", "built")

@pytest.mark.parametrize("n", range(6))
def test_uses_it(built, n):
    record("test", f"shared{n}")
""",
    "test_cluster_a.py": """
import pytest
from record import record

@pytest.mark.slurm
@pytest.mark.parametrize("n", range(3))
def test_a(n):
    record("slurm", f"a{n}")
""",
    "test_cluster_b.py": """
import pytest
from record import record

@pytest.mark.slurm
@pytest.mark.parametrize("n", range(3))
def test_b(n):
    record("slurm", f"b{n}")
""",
    "test_alone.py": """
import pytest
from record import record

@pytest.mark.parametrize("n", range(8))
def test_free(n):
    record("free", f"free{n}")
""",
}


def test_slurm_tests_share_one_worker_and_a_module_fixture_is_built_once(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
                           "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [json.loads(line) for line in (tmp_path / "ran.jsonl").read_text().splitlines()]
    assert len([r for r in ran if r[0] != "fixture"]) == 20
    assert sum(kind == "fixture" for kind, _, _ in ran) == 1
    assert len({worker for kind, _, worker in ran if kind == "slurm"}) == 1
    assert len({worker for kind, _, worker in ran if kind in ("fixture", "test")}) == 1
    # the rest is spread: both workers ran tests
    assert len({worker for _, _, worker in ran}) == 2
