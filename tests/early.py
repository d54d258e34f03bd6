"""Child processes that long tests start as soon as collection is over.

The emulator's sanitizer runs (AddressSanitizer, ThreadSanitizer) are child processes of a few
minutes that use one core each. Run when their test's turn comes, they leave the CI machine's
second core idle; started right after collection, they run beside the rest of the suite, and
their tests only wait for them and assert on what they printed.

A test module lists its children in ``EARLY = {test name: function}``; each function returns
``{key: Child}`` (or ``{}`` where its test will skip). ``conftest.py`` calls it for every
selected test that has one, in a plain pytest process only: under pytest-xdist every worker
collects every test, so there each test starts its own children when it runs. A test takes its
child with :func:`take`, which starts a fresh one if nothing was started early.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

_started: dict = {}


class Child:
    """One child process; its stdout and stderr go to temporary files (pipes that nobody reads
    while the suite runs would fill and stop it)."""

    def __init__(self, cmd, env=None, cwd=None):
        self.cmd = list(cmd)
        self.t0 = time.monotonic()
        self.out = tempfile.TemporaryFile(mode="w+")
        self.err = tempfile.TemporaryFile(mode="w+")
        # a session of its own, so that kill() takes its own children along
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=cwd, stdout=self.out,
                                     stderr=self.err, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """The finished child, as subprocess.run gives it; `timeout` counts from its start.
        Raises subprocess.TimeoutExpired (the child killed) past it."""
        left = max(1.0, timeout - (time.monotonic() - self.t0))
        try:
            rc = self.proc.wait(left)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.cmd, rc, texts[0], texts[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def python_call(module: str, call: str) -> list:
    """The command of a fresh Python that imports the test module `module` (from this folder)
    as ``t`` and runs ``t.<call>``, e.g.
    ``python_call("test_nvrtc", "_compile_all()")``."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import {module} as t; t.{call}"
    return [sys.executable, "-c", code]


def start(funcs) -> None:
    """Calls each start function once and keeps the children they return."""
    for fn in dict.fromkeys(funcs):
        for key, child in fn().items():
            if key in _started:
                child.kill()
            else:
                _started[key] = child


def take(key: str, cmd, env=None, cwd=None) -> Child:
    """The child started early under `key`, else a fresh one of `cmd`."""
    child = _started.pop(key, None)
    return child if child is not None else Child(cmd, env=env, cwd=cwd)


def stop_all() -> None:
    """Kills the children that no test took (a run stopped early, -x, Ctrl-C)."""
    while _started:
        _started.popitem()[1].kill()
