"""Package metadata for horovod_sparse."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
about: dict = {}
exec((here / "horovod_sparse" / "version.py").read_text(), about)

setup(
    name="horovod_sparse",
    version=about["__version__"],
    description="Sparse allreduce (threshold top-k, Spar-Reduce-Scatter / Spar-All-Gather) "
    "as a drop-in Horovod DistributedOptimizer",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["horovod_sparse", "horovod_sparse.*"]),
    python_requires=">=3.9",
    # Horovod itself is not listed: it must be built against the installed framework, with
    # source fixes, by `python -m horovod_sparse.build_horovod`; `pip install horovod`
    # fails against current PyTorch and TensorFlow.
    install_requires=["numpy"],
    entry_points={
        "console_scripts": ["horovod-sparse-build-horovod=horovod_sparse.build_horovod:main"],
    },
    extras_require={
        "torch": ["torch>=2.0"],
        "tensorflow": ["tensorflow>=2.16"],
        "dev": ["pytest", "pytest-timeout", "ruff", "mypy", "matplotlib", "scikit-learn"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
