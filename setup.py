"""Packaging for torchair-cached-backend (metadata here; tool config in pyproject.toml)."""

from setuptools import find_packages, setup

setup(
    name="torchair-cached-backend",
    version="0.1.0",
    description="A persistent, guard-bypassing compile cache for torch.compile on Ascend NPUs (torchair) and CPU/CUDA (Inductor)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["torchair_cached_backend", "torchair_cached_backend.*"]),
    # torch_npu users run 2.1 .. 2.14 (torchair ships inside torch_npu); torch >= 2.6 has the
    # Dynamo bytecode hook and standalone Inductor APIs this package builds on.
    install_requires=["torch>=2.6,<2.15"],
    extras_require={
        # transformers: the real-model coverage suite (tiny random configs, never downloads);
        # 4.57+ has the decorator-wrapped forwards and cache classes it exercises, 5.x works with torch 2.13
        "test": ["pytest>=7", "pytest-timeout", "numpy", "protobuf", "pyyaml", "packaging", "ruff",
                 "transformers>=4.57,<6", "redis>=4.2", "pytest-xdist>=3"],
        "bench": ["matplotlib", "psutil"],
        "progress": ["tqdm"],  # a progress bar for `torchair-cache prebuild` on a terminal (log lines without it)
        "redis": ["redis>=4.2"],  # the remote tier (option remote= / $TORCHAIR_CACHE_REMOTE); imported only when set
    },
    entry_points={
        "torch_dynamo_backends": ["npu_cached = torchair_cached_backend.registry:npu_cached"],
        "console_scripts": ["torchair-cache = torchair_cached_backend.cli:main"],
    },
)
