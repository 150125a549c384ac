"""Using an adapter without Horovod, or with a Horovod built without that framework,
fails at once with a message that names what is missing and what to run; the DDP hook
(horovod_sparse.torch.ddp) needs no Horovod at all."""

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
"""
# What a user's script does first: TensorFlow's package needs Horovod at import, the
# torch package for its Horovod names (the DDP hook beside them does not).
FIRST_USE = {
    "torch": "from horovod_sparse.torch import DistributedOptimizer",
    "tensorflow": "import horovod_sparse.tensorflow",
}


def run_with_blocked(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=blocked) + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def import_with_blocked(framework: str, blocked: set[str]) -> str:
    done = run_with_blocked(blocked, FIRST_USE[framework])
    assert done.returncode != 0
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_without_horovod_the_error_says_what_to_run(framework):
    last = import_with_blocked(framework, {"horovod"})
    assert last.startswith("ImportError: horovod_sparse.")
    assert f"horovod_sparse.{framework} needs Horovod, which is not installed" in last
    assert "`python -m horovod_sparse.build_horovod` builds it into this environment" in last
    assert "horovodrun --check-build" in last
    if framework == "torch":
        assert "horovod_sparse.torch.ddp, the DistributedDataParallel hook, does not" in last


def test_without_horovod_each_horovod_name_of_the_torch_package_raises_the_same_error():
    done = run_with_blocked(
        {"horovod"},
        "import horovod_sparse.torch as hvds\n"
        "print('all', *hvds.__all__)\n"
        "for name in hvds.__all__:\n"
        "    try:\n"
        "        getattr(hvds, name)\n"
        "    except ImportError as error:\n"
        "        assert 'needs Horovod, which is not installed' in str(error), error\n"
        "        print('refused', name)\n"
        "import horovod_sparse.torch.backend\n",
    )
    assert done.returncode != 0  # the Horovod backend, imported directly: the same error
    assert "needs Horovod, which is not installed" in done.stderr.strip().splitlines()[-1]
    lines = done.stdout.splitlines()
    refused = {line.split()[1] for line in lines if line.startswith("refused ")}
    names = next(line.split()[1:] for line in lines if line.startswith("all "))
    assert refused == set(names) - {"StepStats", "GatheredState"}  # both Horovod-free
    assert len(refused) == 9, refused


def test_with_horovod_installed_the_ddp_hook_still_imports_none_of_it():
    code = (
        "import sys\n"
        "import horovod_sparse.torch.ddp\n"
        "import horovod_sparse.torch as hvds\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod'], sys.modules\n"
        "assert set(hvds.__all__) == {'StepStats', 'GatheredState', *hvds._HOROVOD_NAMES}\n"
        "hvds.DistributedOptimizer  # the first use imports Horovod\n"
        "assert 'horovod.torch' in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# One rank, Gloo over a file store: the hook averages DDP's gradients without Horovod.
DDP_WITHOUT_HOROVOD = """
import os, sys, tempfile
import torch, torch.distributed as dist
from horovod_sparse.torch.ddp import SparseState, sparse_allreduce_hook
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(200, 50))
state = SparseState(density=0.1, min_sparse_numel=100)
model.register_comm_hook(state, sparse_allreduce_hook)
for step in range(3):
    model.zero_grad()
    x = torch.randn(8, 200, generator=torch.Generator().manual_seed(step))
    model(x).square().sum().backward()
assert state.stats().sparse_buckets == 1 and state.iteration == 3, state.stats()
assert "horovod" not in sys.modules and "horovod.torch" not in sys.modules
print("ok", state.stats().selected)
"""


def test_the_ddp_hook_runs_without_horovod():
    done = run_with_blocked({"horovod", "horovod.torch"}, DDP_WITHOUT_HOROVOD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "ok"


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
