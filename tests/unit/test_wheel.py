"""`python -m build --wheel` makes a wheel with the right metadata: the extras, the console
script, every package (the build command's included) and nothing from tests/."""

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # From a copy of the checkout's files (not its build/ folder, where setuptools would
    # find modules that no longer exist).
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    # No isolation: the environment's setuptools builds it, without asking the registry.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("horovod_sparse-*.whl")
    return built


def test_wheel_metadata_has_the_extras_and_the_console_script(wheel):
    from horovod_sparse import __version__

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(info).decode())
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert metadata["Name"] == "horovod_sparse" and metadata["Version"] == __version__
    assert set(metadata.get_all("Provides-Extra")) == {"torch", "tensorflow", "dev"}
    requires = metadata.get_all("Requires-Dist")
    assert "numpy" in requires
    assert 'torch>=2.0; extra == "torch"' in requires
    assert 'tensorflow>=2.16; extra == "tensorflow"' in requires
    assert any(r.startswith("pytest") and 'extra == "dev"' in r for r in requires)
    assert not any(r.startswith("horovod") for r in requires)  # built by build_horovod
    assert "horovod-sparse-build-horovod = horovod_sparse.build_horovod:main" in entry_points
    for module in (
        "horovod_sparse/build_horovod/__main__.py",
        "horovod_sparse/build_horovod/patches.py",
        "horovod_sparse/common/engine.py",
        "horovod_sparse/torch/optimizer.py",
        "horovod_sparse/tensorflow/keras/optimizer.py",
    ):
        assert module in names, module
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in names)
