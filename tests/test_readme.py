"""The README's API example runs as written (on NumPy arrays) and gives what it claims."""

import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_api_example_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(import numpy as np.*?)```", text, re.S)
    assert blocks, "README lost its API example"
    ns = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    res, g, bank = ns["res"], ns["g"], ns["bank"]
    assert res.readings.shape == (2, 100, 256)
    np.testing.assert_array_equal(res.bank, bank)        # backward rewound the bank
    assert g.bank.dtype == np.float32 and np.isfinite(g.values).all()


def test_readme_quick_start_names_the_two_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "sdm-cupy demo" in text and "python -m pytest -q" in text
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "python -m pytest -q" in ci   # CI calls the README's test command
