"""Importing an adapter without Horovod, or with a Horovod built without that framework,
fails at once with a message that names what is missing and what to run."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Makes the named modules unimportable, as in an environment without them (a Horovod
# built without a framework raises ImportError from horovod.<framework> the same way).
BLOCKER = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in {blocked!r}:
            raise ImportError(f"blocked for the test: {{name}}")
        return None
sys.meta_path.insert(0, Blocker())
import horovod_sparse.{framework}
"""


def import_with_blocked(framework: str, blocked: set[str]) -> str:
    code = BLOCKER.format(blocked=blocked, framework=framework)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_without_horovod_the_error_says_what_to_run(framework):
    last = import_with_blocked(framework, {"horovod"})
    assert last.startswith("ImportError: horovod_sparse.")
    assert f"horovod_sparse.{framework} needs Horovod, which is not installed" in last
    assert "`python -m horovod_sparse.build_horovod` builds it into this environment" in last
    assert "horovodrun --check-build" in last


@pytest.mark.parametrize(
    ("framework", "name"), [("torch", "PyTorch"), ("tensorflow", "TensorFlow")]
)
def test_a_horovod_without_the_framework_is_named(framework, name):
    last = import_with_blocked(framework, {f"horovod.{framework}"})
    assert f"needs Horovod built with {name}, but the Horovod 0.28.1" in last
    assert f"has no working horovod.{framework} (blocked for the test" in last


def test_without_the_framework_itself_the_error_names_it():
    last = import_with_blocked("torch", {"torch"})
    assert "horovod_sparse.torch needs PyTorch, which is not installed" in last
