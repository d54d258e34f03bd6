import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu():
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


HAVE_GPU = _gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # fresh inputs every run, reproducible from the printed seed
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def xp_params():
    """numpy always; cupy (marked gpu) for backend-parametrised tests."""
    return [pytest.param("numpy", id="cpu"), pytest.param("cupy", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=xp_params())
def xp(request):
    if request.param == "numpy":
        return np
    import cupy
    return cupy
