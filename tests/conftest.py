import os

import pytest
import torch

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_ext():
    """The CPU extension module (built on first use); skips when no compiler is available."""
    from fp4offload.ops import cpu

    try:
        return cpu.extension()
    except Exception as e:  # pragma: no cover - depends on the machine's toolchain
        pytest.skip(f"CPU extension does not build here: {e}")
