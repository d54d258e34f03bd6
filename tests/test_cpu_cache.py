"""Numba's cache of the CPU kernels is dropped when any CPU kernel source changes."""

import hashlib
import os
import subprocess
import sys

from sdm_cupy.kernels import cpu_cache


def _tree(tmp_path):
    src = tmp_path / "src"
    cache = src / "__pycache__"
    cache.mkdir(parents=True)
    (src / "cpu_fwd.py").write_text("def f(): pass\n")
    (src / "cpu_chunk.py").write_text("def helper(): return 1\n")
    for name in ("cpu_fwd.f-1.py311.nbi", "cpu_fwd.f-1.py311.1.nbc"):
        (cache / name).write_bytes(b"cached")
    (cache / "other.pyc").write_bytes(b"keep")
    return src, cache


def test_stale_cache_is_dropped_when_a_helper_file_changes(tmp_path):
    src, cache = _tree(tmp_path)
    dirs = [str(cache)]
    assert cpu_cache.drop_stale(str(src), dirs) == 2          # no stamp yet: start clean
    (cache / "cpu_fwd.f-1.py311.nbi").write_bytes(b"cached again")
    assert cpu_cache.drop_stale(str(src), dirs) == 0          # same sources: cache kept
    assert (cache / "cpu_fwd.f-1.py311.nbi").exists()
    (src / "cpu_chunk.py").write_text("def helper(): return 2\n")   # only the helper changes
    assert cpu_cache.drop_stale(str(src), dirs) == 1
    assert not (cache / "cpu_fwd.f-1.py311.nbi").exists()
    assert (cache / "other.pyc").exists()                     # only Numba's kernel files go


def test_numba_cache_dir_is_covered(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "nc"))
    dirs = cpu_cache.cache_dirs("/some/where/kernels")
    # the folder numba 0.68 uses there: name + sha1 of the absolute path of the sources
    sha = hashlib.sha1(b"/some/where/kernels").hexdigest()
    assert dirs[1] == os.path.join(str(tmp_path / "nc"), "kernels_" + sha)


def test_the_installed_cache_is_stamped_with_the_current_sources():
    from sdm_cupy.kernels import cpu  # noqa: F401 - the import stamps the cache
    stamp = os.path.join(cpu_cache.cache_dirs()[0], cpu_cache._STAMP)
    if os.access(os.path.dirname(stamp), os.W_OK):
        assert open(stamp).read().strip() == cpu_cache.sources_digest()


def test_numba_cache_dir_location_matches_numba(tmp_path, monkeypatch):
    # a real process compiles with NUMBA_CACHE_DIR set; its kernels land where we look. One
    # small cached kernel of the same folder does (Numba's locator keys on the folder), so the
    # child does not spend ~20 s compiling a whole forward
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = ("from sdm_cupy.kernels import cpu, cpu_chunk\n"
            "assert cpu_chunk.hash_size(4, 64, 2) == 16\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    where = cpu_cache.cache_dirs()[1]
    got = os.listdir(where)
    assert any(f.startswith("cpu_chunk.hash_size-") and f.endswith(".nbi") for f in got), got
    assert open(os.path.join(where, cpu_cache._STAMP)).read() == cpu_cache.sources_digest()
