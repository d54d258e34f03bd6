"""The examples run as scripts (a public example that does not run teaches the wrong thing).

Each runs in its own interpreter, as a user would run it; it exits non-zero when its own check
fails. Where torch/JAX see a GPU (and CuPy does), the examples check the CUDA path too."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The gpu-marked checks ask JAX for its GPUs in this process: keep JAX from preallocating 75%
# of the GPU's memory, which the rest of the suite needs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def run_example(name, *args, timeout=600):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


@functools.lru_cache(maxsize=None)
def run_cached(name):
    """One run per session: the CPU test and its gpu-marked twin read the same output."""
    return run_example(name)


def test_torch_autograd_example():
    pytest.importorskip("torch")
    out = run_cached("torch_autograd.py")
    assert "PASSED" in out and "MISMATCH" not in out


def test_jax_vjp_example():
    pytest.importorskip("jax")
    out = run_cached("jax_vjp.py")
    assert "PASSED" in out and "MISMATCH" not in out


@pytest.mark.gpu
def test_torch_autograd_example_checked_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    out = run_cached("torch_autograd.py")
    assert "[cuda float64]" in out and "[cuda float32]" in out, out
    assert "PASSED" in out


@pytest.mark.gpu
def test_jax_vjp_example_checked_gpu():
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    out = run_cached("jax_vjp.py")
    assert "[gpu float64]" in out and "[gpu float32]" in out, out
    assert "PASSED" in out


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_associative_recall_ci_run(tmp_path):
    """A CI-sized training run: far above chance (1/16), and a plot written where matplotlib
    (the [plot] extra; the README's quick start installs [test] only) is there."""
    png = tmp_path / "recall.png"
    plot = ("--plot", str(png)) if _have_matplotlib() else ()
    out = run_example("associative_recall.py", "--steps", "150", "--no-progress", *plot,
                      "--min-accuracy", "0.5")
    assert "final accuracy" in out
    if plot:
        assert png.stat().st_size > 10_000, "no plot written"


@pytest.mark.skipif(_have_matplotlib(), reason="checks the message without matplotlib")
def test_associative_recall_refuses_a_plot_without_matplotlib(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "associative_recall.py"),
                           "--plot", str(tmp_path / "x.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--plot needs matplotlib" in proc.stderr, proc.stderr
    assert "final accuracy" not in proc.stdout   # refused before training
