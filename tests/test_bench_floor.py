"""The GPU benchmark's byte floor (SPEC §10), checked by hand on small cases: the ratios in
benchmarks/RESULTS.md are only as right as these counts. Pure NumPy: no device needed."""

import json

import numpy as np
import pytest

from helpers import load_benchmark

pytest.importorskip("cupy")   # bench_gpu imports it at the top (no device is used here)


def _bench():
    return load_benchmark("bench_gpu")


def _ids(rows):
    """[T][W] lists -> [1, T, 1, W] int32."""
    return np.asarray(rows, dtype=np.int32)[None, :, None, :]


def test_distinct_slots_are_counted_per_chunk_with_repeats_and_a_short_last_chunk():
    bg = _bench()
    # T = 3, C = 2: chunk 0 = tokens 0, 1; chunk 1 = token 2 alone (padded with itself)
    wi = _ids([[5, 5], [1, 5], [5, 2]])
    assert bg.distinct_per_chunk(wi, 2) == 2 + 2        # {1, 5} and {2, 5}
    assert bg.distinct_per_chunk(wi, 1) == 1 + 2 + 2    # {5}, {1, 5}, {2, 5}
    assert bg.distinct_per_chunk(wi, 4) == 3            # {1, 2, 5}
    ri = _ids([[0, 1], [0, 0], [2, 2]])
    assert bg.distinct_union(wi, ri, 2) == 3 + 2        # {0, 1, 5} and {2, 5}


def test_floor_bytes_follow_spec_section_10():
    bg = _bench()
    B, T, P, hd, S, W, C = 1, 2, 1, 4, 8, 2, 2
    wi = _ids([[0, 1], [1, 2]])      # writes: {0, 1, 2}
    ri = _ids([[3, 3], [0, 4]])      # reads: {0, 3, 4}; union with writes: {0..4}
    fwd, fb = bg.floors(B, T, P, hd, S, W, C, wi, ri)
    e, D, row = B * T * P * W, P * hd, hd * 2          # bf16 bank rows
    inputs = 2 * e * 4 + 2 * e * 4 + B * T * P * 4 + B * T * D * 2
    want_fwd = (inputs + B * T * D * 2      # readings
                + e * row                   # snapshots
                + (3 + 3) * row             # gathered rows: distinct write and read slots
                + 3 * row)                  # written rows
    assert fwd == want_fwd == 208
    want_bwd = (inputs + B * T * D * 2      # inputs and dr
                + e * row                   # snapshots read
                + 3 * row + 3 * row         # rewound rows written, read rows read
                + 2 * 5 * hd * 4            # grad-bank rows of the touched slots, read + write
                + B * S * D * 4             # the grad bank zeroed
                + B * T * D * 2 + 2 * e * 4 + B * T * P * 4)   # gradients written
    assert fb - fwd == want_bwd


def test_plot_draws_both_panels_from_a_saved_run(tmp_path):
    """bench_gpu.plot (also ``bench_gpu.py --replot``) draws from a run's JSON alone: the floor
    panel always, the FLA panel when FLA's device times are there."""
    pytest.importorskip("matplotlib")
    bg = _bench()
    row = dict(case="headline", g_fwd_over_floor=2.1, g_fb_over_floor=2.36, g_fwd_ms=1.11,
               g_fb_ms=4.64, floor_fwd_ms=0.528, floor_fb_ms=1.978)
    out = dict(device="a GPU", copy_bw_TBs=4.2, rows=[row, dict(row, case="W=8")],
               fla=dict(g_fwd_ms=0.29, g_fb_ms=0.88))
    sizes = {}
    for name, fla in (("both", out["fla"]), ("floor_only", {})):
        path = tmp_path / f"{name}.png"
        bg.plot(dict(out, fla=fla), str(path))
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        sizes[name] = int.from_bytes(data[16:20], "big")   # the image's width (IHDR)
    assert sizes["both"] > sizes["floor_only"]              # the second panel widens the figure


def _stubbed_bench(monkeypatch, tmp_path, stop_after=None):
    """bench_gpu with its device work stubbed: bench_sdm records its arguments and returns
    ones; after `stop_after` cases it raises, as a time limit would stop the run."""
    bench = _bench()
    calls = []

    def fake_sdm(**cfg):
        calls.append(cfg)
        if stop_after is not None and len(calls) > stop_after:
            raise KeyboardInterrupt("the time limit")
        keys = ("t_fwd_ms", "g_fwd_ms", "g_fwd_over_floor", "t_prepass_ms", "t_fwd_nosnap_ms",
                "t_fb_ms", "g_fb_ms", "g_fb_over_floor", "peak_mb", "need_mb", "floor_fwd_ms",
                "floor_fb_ms", "tile_used", "bwd_tile_used")
        out = dict.fromkeys(keys, 1.0)
        out["halve"] = True if cfg.get("tuned") else None
        out["tune_ms"] = {"False": 2.0, "True": 1.0} if cfg.get("tuned") else None
        return out

    monkeypatch.setattr(bench, "bench_sdm", fake_sdm)
    monkeypatch.setattr(bench, "bench_fla", lambda *a, **k: {"g_fwd_ms": 0.3, "g_fb_ms": 1.0})
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    monkeypatch.setattr(bench.cp.cuda.runtime, "getDeviceProperties",
                        lambda i: {"l2CacheSize": 50 << 20, "name": b"stub"})
    monkeypatch.setattr(bench.cp.cuda, "Device", lambda *a: type("D", (), {"id": 0})())
    monkeypatch.setattr("sys.argv", ["bench_gpu.py", "--quick", "--out", str(tmp_path)])
    return bench, calls


def test_a_run_cut_after_the_headline_keeps_it_and_the_fla_anchor(tmp_path, monkeypatch):
    """bench_gpu writes its JSON after every case and measures FLA right after the headline, so
    a run that a time limit stops later still has both (stop 30)."""
    bench, _ = _stubbed_bench(monkeypatch, tmp_path, stop_after=1)
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    out = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [r["case"] for r in out["rows"]] == ["headline"]
    assert out["fla"] == {"g_fwd_ms": 0.3, "g_fb_ms": 1.0}
    assert out["device"] == "stub"


def test_the_quick_run_times_the_plan_that_sdm_tune_picks_second(tmp_path, monkeypatch, capsys):
    bench, calls = _stubbed_bench(monkeypatch, tmp_path)
    bench.main()
    assert not calls[0].get("tuned") and calls[1]["tuned"] is True
    assert not any(c.get("tuned") for c in calls[2:])
    out = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [r["case"] for r in out["rows"]][:2] == ["headline", "headline tuned"]
    assert "sdm.tune: halve=True" in capsys.readouterr().out
