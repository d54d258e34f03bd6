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


@pytest.hookimpl(trylast=True)   # after -m / -k have deselected
def pytest_collection_finish(session):
    """Starts the long child processes of the selected tests that list one (tests/early.py),
    so that they run beside the rest of the suite. Not under pytest-xdist (each worker
    collects every test; there a test starts its own child when it runs) nor --collect-only."""
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput") or \
            getattr(config.option, "numprocesses", None):
        return
    import early
    funcs = []
    for item in session.items:
        fn = getattr(getattr(item, "module", None), "EARLY", {}).get(getattr(item, "originalname", ""))
        if fn is not None and not item.get_closest_marker("skip") and \
                not any(m.args and m.args[0] for m in item.iter_markers("skipif")):
            funcs.append(fn)
    early.start(funcs)


def pytest_sessionfinish(session):
    import early
    early.stop_all()


def pytest_runtest_setup(item):
    import helpers
    helpers.SEED = None   # set again by the rng fixture of a test that takes one


@pytest.fixture
def rng(request):
    # fresh inputs every run, reproducible from the printed seed: SDM_TEST_SEED=<seed> pytest ...
    # gives every test that seed
    env = os.environ.get("SDM_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    import helpers
    helpers.SEED = seed   # for SDM_TEST_MARGINS' lines
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
