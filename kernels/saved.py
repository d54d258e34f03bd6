"""The snapshot arrays a forward hands to its backward, with the chunk they were saved for.

A snapshot holds a written row as it was at the start of the forward's chunk (SPEC §3), so the
backward must walk the very chunks of the forward that saved it. Both backends compute their
chunk from the config and module-level knobs (``kernels.gpu``'s tile and chunk knobs,
``kernels.cpu.CHUNK_CAP``); the snapshots carry the forward's, so that a knob changed before
the backward cannot make it walk other chunks.
"""

from __future__ import annotations


class SavedSnapshots(tuple):
    """The snapshot arrays ``(rows, scales or None)``, a plain tuple to every reader, plus
    ``chunk``: the chunk the forward ran, whose starts the rows hold, and ``settings``: the
    backend's knobs then (for error messages; may be empty)."""

    chunk: int
    settings: tuple

    def __new__(cls, arrays, chunk: int, knobs: tuple = ()):
        self = super().__new__(cls, arrays)
        self.chunk = int(chunk)
        self.settings = tuple(knobs)
        return self

    def __reduce__(self):
        return (SavedSnapshots, (tuple(self), self.chunk, self.settings))
