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


def test_spec_references_name_sections_of_docs_spec():
    """Docs, comments and kernels cite "SPEC §n" or "SPEC §n.k" (item k of §n's numbered list):
    each must exist in docs/SPEC.md."""
    spec = open(os.path.join(ROOT, "docs", "SPEC.md")).read()
    sections = {}
    for m in re.finditer(r"^## (\d+)\. .*?(?=^## |\Z)", spec, re.S | re.M):
        sections[m.group(1)] = {int(k) for k in re.findall(r"^(\d+)\. ", m.group(0), re.M)}
    assert len(sections) >= 10
    cited = []
    for top in ("sdm_cupy", "kernels", "graphs", "docs", "examples", "benchmarks", "tests"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for f in files:
                if f.endswith((".py", ".md", ".cu", ".cuh")):
                    cited += [(f, m.groups()) for m in re.finditer(
                        r"SPEC §(\d+)(?:\.(\d+))?", open(os.path.join(dirpath, f)).read())]
    cited += [("README.md", m.groups()) for m in re.finditer(
        r"SPEC §(\d+)(?:\.(\d+))?", open(os.path.join(ROOT, "README.md")).read())]
    assert len(cited) > 50   # the walk found the citations
    bad = [(f, s, k) for f, (s, k) in cited
           if s not in sections or (k is not None and int(k) not in sections[s])]
    assert not bad, f"citations of sections docs/SPEC.md lacks: {bad}"
