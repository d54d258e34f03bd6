"""The main job (`sdm-cupy demo`) at a small size, through its command line."""

import subprocess
import sys

import numpy as np
import pytest

from sdm_cupy import cli, demo


def test_demo_recalls_stored_pairs_on_cpu():
    lines = []
    out = demo.run(B=2, N=128, S=2048, P=2, hd=32, W=8, C=64, rounds=2, device="cpu",
                   out=lines.append)
    assert out["backend"] == "CPU (Numba)"
    assert out["accuracy"] >= 0.95, out          # chance is 1/128
    assert out["rewind_error"] == 0.0            # exact snapshots rewind exactly
    assert out["fwd_tokens_per_s"] > 0 and out["fb_tokens_per_s"] > 0
    assert any("recall accuracy" in line for line in lines)


def test_recall_accuracy_counts_only_right_answers():
    stored = np.eye(4, dtype=np.float32)[None]            # [1, 4, 4]
    readings = np.concatenate([np.zeros_like(stored), stored[:, [0, 1, 3, 2]]], axis=1)
    assert demo.recall_accuracy(readings, stored) == 0.5


@pytest.mark.gpu
def test_demo_runs_on_gpu():
    out = demo.run(B=2, N=128, S=2048, P=2, hd=32, W=8, C=64, rounds=2, device="gpu",
                   out=lambda s: None)
    assert out["backend"].startswith("GPU")
    assert out["accuracy"] >= 0.95
    assert out["rewind_error"] == 0.0


def test_cli_demo_and_info():
    r = subprocess.run([sys.executable, "-m", "sdm_cupy.cli", "demo", "--device", "cpu",
                        "--batch", "1", "--pairs", "64", "--slots", "1024", "--heads", "2",
                        "--head-dim", "16", "--rounds", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "recall accuracy" in r.stdout and "CPU (Numba)" in r.stdout


def test_info_names_the_backends_and_why_there_is_no_gpu(capsys, monkeypatch):
    import sdm_cupy
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sdm-cupy {sdm_cupy.__version__}; numpy ")
    if sdm_cupy.gpu_available():
        assert "GPU backend: CuPy " in out
    else:   # the reason, not a guess between two
        assert "GPU backend: not available (CuPy " in out and "CPU backend: Numba" in out
    monkeypatch.setitem(sys.modules, "cupy", None)   # as if CuPy were not installed
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPU backend: not available (CuPy is not installed: pip install" in out


def test_demo_on_gpu_without_one_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # as if CuPy were not installed
    with pytest.raises(SystemExit, match="--device gpu asked for, but the GPU backend is not "
                                         "available: CuPy is not installed"):
        demo.run(B=1, N=16, S=256, P=1, hd=8, W=2, rounds=1, device="gpu", out=lambda s: None)
