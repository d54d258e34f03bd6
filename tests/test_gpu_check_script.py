"""benchmarks/gpu_check.py's report of a GPU suite that a time limit stopped before pytest's
summary (stop 30: the H200 run's last line was a progress line), checked without a device."""

from helpers import load_benchmark


def test_tally_counts_every_outcome_of_the_progress_lines_and_nothing_else():
    check = load_benchmark("gpu_check")
    log = "\n".join([
        "bringing up nodes...",
        "",
        "..s.F. [ 40%]",
        "E.xX                                                         [ 80%]",
        "...",                      # the last line, cut before its percentage
        "tests/test_x.py:3: some warning ...",   # text with dots is not a progress line
        "FAILED tests/test_y.py::test_z - assert 1 == 2",
    ])
    assert check.tally(log) == "8 passed, 1 skipped, 1 failed, 1 errors, 1 xfailed, 1 xpassed"
    assert check.tally("no tests ran") == "nothing"
