"""benchmarks/plot_ab.py reads fwd_ab.py's tables back for its plots: the parser and the
reference each bar is compared with. No device needed."""

import pytest

from helpers import load_benchmark

TEXT = """
== some ab call (elapsed 4 s)
s15: bitwise equal to c1 (readings, final bank): [True, True]
forward+backward, W=16, S=16384, variants of bwd, 8 interleaved graph replays (ms):
| variant | median | q25 | q75 |
| c1 | 5.008 | 4.954 | 5.078 |
| s15 | 5.020 | 4.909 | 5.107 |
| c2 | 4.970 | 4.947 | 5.056 |
noise between the tables
by hand, no controls (ms):
| variant | median | q25 | q75 |
| first | 2.000 | 1.900 | 2.100 |
| other | 1.500 | 1.400 | 1.600 |
forward, base and base2 (ms):
| variant | median | q25 | q75 |
| base | 1.000 | 0.990 | 1.010 |
| x | 0.900 | 0.890 | 0.910 |
| base2 | 1.020 | 1.000 | 1.030 |
"""


def test_tables_are_parsed_in_order_with_their_rows():
    pa = load_benchmark("plot_ab")
    tables = pa.parse(TEXT)
    assert [t for t, _ in tables] == [
        "forward+backward, W=16, S=16384, variants of bwd, 8 interleaved graph replays",
        "by hand, no controls", "forward, base and base2"]
    assert tables[0][1] == [("c1", 5.008, 4.954, 5.078), ("s15", 5.020, 4.909, 5.107),
                            ("c2", 4.970, 4.947, 5.056)]
    assert [r[0] for r in tables[2][1]] == ["base", "x", "base2"]


def test_the_reference_is_the_controls_mean_or_the_first_row():
    pa = load_benchmark("plot_ab")
    c, first, base = (rows for _, rows in pa.parse(TEXT))
    assert pa.reference(c) == pytest.approx((5.008 + 4.970) / 2)
    assert pa.reference(first) == 2.0
    assert pa.reference(base) == pytest.approx(1.01)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    pa = load_benchmark("plot_ab")
    out = tmp_path / "ab.png"
    pa.plot(pa.parse(TEXT), str(out), "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
