"""Keeps Numba's on-disk cache of the CPU kernels in step with their sources.

Numba keys a cached kernel on the modification time and size of the one file that defines it
(numba 0.68), not on the helpers it inlines from other files: after an edit or an upgrade that
changes only ``cpu_chunk.py`` or ``cpu_formats.py``, ``cpu_fwd.py``'s cached kernels would go on
running the old helpers. So at import we hash every ``cpu*.py`` source and, when the hash
differs from the one stamped beside the cache, delete the cached kernels first.

Covers Numba's default in-tree cache (``__pycache__`` beside the sources) and, when it is set,
``NUMBA_CACHE_DIR`` (where Numba names the folder after the sources' folder and a hash of
its path).
"""

from __future__ import annotations

import glob
import hashlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_STAMP = "sdm_cupy_kernels.sha256"


def sources_digest(src_dir: str = _HERE) -> str:
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(src_dir, "cpu*.py"))):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def cache_dirs(src_dir: str = _HERE) -> list:
    dirs = [os.path.join(src_dir, "__pycache__")]
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        # numba's _UserProvidedCacheLocator: <dir name>_<sha1 of the folder's absolute path>
        folder = os.path.abspath(src_dir)
        sub = os.path.basename(folder) + "_" + hashlib.sha1(folder.encode()).hexdigest()
        dirs.append(os.path.join(os.path.abspath(user), sub))
    return dirs


def drop_stale(src_dir: str = _HERE, dirs=None) -> int:
    """Deletes cached CPU kernels built from other sources; returns how many files went.
    Never raises: a cache it cannot write is one Numba cannot use either."""
    digest = sources_digest(src_dir)
    removed = 0
    for d in (cache_dirs(src_dir) if dirs is None else dirs):
        stamp = os.path.join(d, _STAMP)
        try:
            with open(stamp) as f:
                if f.read().strip() == digest:
                    continue
        except OSError:
            pass
        try:
            for path in glob.glob(os.path.join(d, "cpu*.nb[ic]")):
                os.remove(path)
                removed += 1
            os.makedirs(d, exist_ok=True)
            with open(stamp, "w") as f:
                f.write(digest)
        except OSError:
            continue
    return removed
