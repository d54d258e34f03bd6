"""What one captured key owns (``Entry``), what a call hands out (``ReplayedState``,
``BackwardHandle``, ``RunnerGradients``)."""

from __future__ import annotations

import dataclasses
import threading
import weakref

import sdm_cupy as sdm

from .pools import ordered

__all__ = ["Entry", "ReplayedState", "BackwardHandle", "RunnerGradients"]


class Entry:
    """Static buffers, graphs and live state of one key, used by the runners of one slot.

    Every array a graph reads or writes is referenced here (static inputs, the bank, readings,
    the SavedState template, the gradient buffers, and ``held``: every block a capture
    allocated), so none is freed while a graph may still replay it. ``token`` names the call
    whose state the static buffers hold (None: nobody's, e.g. after the backward rewound it).
    """

    def __init__(self, runner, key, pool, mempool, needs_backward, config, batch):
        self.runners = weakref.WeakSet((runner,))
        self.key, self.pool, self.mempool = key, pool, mempool
        self.needs_backward, self.config, self.batch = needs_backward, config, batch
        self.static_param = None   # [S, D] in the bank dtype (training key with a param)
        self.static_bank = None    # [B*S, D] the graphs' bank, loaded before each forward launch
        self.static_in = None      # the six input arrays
        self.forward = None        # the forward graph
        self.result = None         # its ForwardResult: readings, final bank, SavedState template
        self.copy_readings = None  # capture.copier() of the readings / final bank: f(stream)
        self.copy_bank = None
        self.held = []             # blocks allocated by the captures
        self.static_ids = frozenset()   # ids of static_param and static_in (training key)
        self.static_in_ids = ()    # ids of static_in, in order (one check per replay)
        self.state_dtype = None    # dtype of the final bank
        self.ref = weakref.ref(self)
        self.grad_in = None        # static grad of the readings
        self.backward = None       # the backward graph, captured at the first backward
        self.grad_out = None
        self.grad_copiers = ()     # capture.copier() of each of grad_out (None stays None)
        self.backward_eager = False
        self.backward_settings = None
        self.index = None          # position in pool.forward when the pool's memory is shared
        self.slot = None           # its slot when shared by runners in regions
        self.token = None
        self.released = False

    @property
    def readings(self):
        return self.result.readings

    @property
    def bank(self):
        return self.result.bank

    def fresh_saved(self):
        """An unconsumed SavedState over the static state, for one backward (launch or
        capture). The template itself is never consumed."""
        return self.result.saved.rearmed()

    def release(self) -> None:
        """Drops graphs and buffers; later backwards of this entry run eager."""
        self.released, self.token = True, None
        self.forward = self.backward = self.result = self.grad_out = self.grad_in = None
        self.copy_readings = self.copy_bank = None
        self.grad_copiers = ()
        self.static_ids = frozenset()
        self.static_in_ids = ()
        self.static_param = self.static_bank = self.static_in = None
        self.held = []


_STALE = ("sdm_cupy.graphs: the final bank of this replayed call was overwritten before its "
          "state was first read (by a later replay of the same graphs, of a runner sharing "
          "them or of one captured before it in the same pool, or by the call's backward). "
          "Read state.memory right after the call and keep that copy, pass the state itself "
          "to the next call of the same runner, or run the call under suspend_graphs().")


class ReplayedState(sdm.LayerState):
    """The state of a replayed call. Its first read of ``memory`` copies the call's final
    bank from the graph's static bank (graph memory is never handed out); it raises
    RuntimeError when a later replay or the backward has overwritten that bank first.

    Passing the state itself as ``param`` of the next forward-only call of the same runner
    continues in place, without any copy."""

    def __init__(self, entry, token, seq_len=0):
        self._entry, self._token, self._copy = entry.ref, token, None
        self._dtype = entry.state_dtype
        self.seq_len = int(seq_len)

    def continues(self, entry) -> bool:
        """True when ``entry``'s static bank still holds this state (no copy needed)."""
        return (self._entry is not None and self._entry() is entry and not entry.released
                and entry.token == self._token)

    @property
    def dtype(self):
        return self._dtype if self._copy is None else self._copy.dtype

    @property
    def memory(self):
        if self._copy is None:
            e = self._entry() if self._entry is not None else None
            if e is None or e.released:
                raise RuntimeError(_STALE)
            with ordered(e.pool):
                if e.token != self._token or e.released:
                    raise RuntimeError(_STALE)
                self._copy = e.pool.capture.copy(e.bank)
            self._entry = None
        return self._copy

    @memory.setter
    def memory(self, value):
        self._copy, self._entry = value, None

    def update_(self, new_memory, seq_len: int = 1):
        if int(seq_len) < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        self.memory = new_memory   # without reading (copying) the replaced bank
        self.seq_len += int(seq_len)
        return self

    def __repr__(self):
        where = "copied" if self._copy is not None else "in graph"
        return f"ReplayedState({where}, seq_len={self.seq_len})"


class BackwardHandle:
    """What a training call keeps for its backward, on either path: a token (0 for an eager
    call), the entry (None for an eager call), ``param`` and the inputs. The arrays are kept
    by reference (like ``sdm.SavedState``): do not modify them before the backward."""

    def __init__(self, entry, token, param, inputs, config, batch, bank_dtype):
        self.entry, self.token = entry, token
        self.param, self.inputs = param, inputs
        self.config, self.batch, self.bank_dtype = config, batch, bank_dtype
        self._lock = threading.Lock()
        self._consumed = False

    def take(self) -> None:
        with self._lock:
            if self._consumed:
                raise RuntimeError("sdm_cupy.graphs: this backward handle was already used by "
                                   "an earlier backward; run forward again for a new one")
            self._consumed = True

    @property
    def graphed(self) -> bool:
        return self.entry is not None


@dataclasses.dataclass
class RunnerGradients:
    """Fresh gradient arrays of a runner's backward. ``param`` is the gradient of the learned
    initial bank [S, D] summed over the batch (``sdm.sum_memory_batch``; the grad-bank dtype),
    None when the call had no ``param``."""

    param: object
    write_w: object
    values: object
    beta: object
    read_w: object
