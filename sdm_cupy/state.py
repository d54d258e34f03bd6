"""State carried across calls of one layer (decoding)."""

from __future__ import annotations

__all__ = ["LayerState"]


class LayerState:
    """The bank a layer carries from one call to the next, and how many tokens it has seen.

    Args:
        memory: [B*S, D] bank after the last call (NumPy or CuPy).
        seq_len: tokens written so far.

    Example:
        >>> state = LayerState(bank0, 0)
        >>> res = forward(state.memory, wi, ww, v, beta, ri, rw, cfg, needs_backward=False)
        >>> state.update_(res.bank, seq_len=T)
    """

    def __init__(self, memory, seq_len: int = 0):
        self.memory = memory
        self.seq_len = int(seq_len)

    def update_(self, new_memory, seq_len: int = 1) -> "LayerState":
        """Replaces the memory and advances ``seq_len`` by ``seq_len`` tokens; returns self."""
        if int(seq_len) < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        self.memory = new_memory
        self.seq_len += int(seq_len)
        return self

    def __repr__(self) -> str:
        shape = getattr(self.memory, "shape", None)
        return f"LayerState(memory shape={shape}, seq_len={self.seq_len})"
