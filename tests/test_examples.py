"""The examples run as scripts (a public example that does not run teaches the wrong thing).

Each runs in its own interpreter, as a user would run it; it exits non-zero when its own check
fails. Where torch/JAX see a GPU (and CuPy does), the examples check the CUDA path too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, *args, timeout=300):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def test_torch_autograd_example():
    pytest.importorskip("torch")
    out = run_example("torch_autograd.py")
    assert "PASSED" in out and "MISMATCH" not in out


def test_jax_vjp_example():
    pytest.importorskip("jax")
    out = run_example("jax_vjp.py")
    assert "PASSED" in out and "MISMATCH" not in out


def test_associative_recall_ci_run(tmp_path):
    """A CI-sized training run: far above chance (1/16) and a plot written."""
    png = tmp_path / "recall.png"
    out = run_example("associative_recall.py", "--steps", "150", "--no-progress", "--plot",
                      str(png), "--min-accuracy", "0.5")
    assert "final accuracy" in out
    assert png.stat().st_size > 10_000, "no plot written"
