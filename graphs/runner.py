"""``GraphRunner``: the SDM op of one layer replayed from captured graphs (SPEC §8).

Lifetime rules (who may call what, what stays valid until when):

* A runner keeps at most two entries: one for training calls (``needs_backward=True``), one
  for forward-only calls (decoding). Each is captured at the first call of its kind, under that
  call's key; a later call with another key runs eager, and so does every call of a runner
  whose capture failed, until ``reset_graphs()``. Graphs are never re-captured on their own.
* Both graphs run ``sdm.forward(static_bank, ..., inplace=True, check_indices=False)`` on a
  static bank that the runner loads before each launch: ``batch`` copies of ``param`` (zeros
  when it is None, a state's memory for forward-only calls; nothing to load when ``param`` is
  the ``ReplayedState`` the runner returned last: decoding continues in place). The training
  entry's backward graph (captured at the first backward) is ``sdm.backward`` on a fresh
  ``SavedState`` over the static state; the param's gradient, ``sdm.sum_memory_batch`` of its
  bank gradient, runs after that graph into a fresh array.
* Every output is a fresh array (readings, final bank, gradients): graph memory is never
  handed out, since the next replay rewrites it. The state object of a call with ``seq_len``
  copies the bank lazily and raises once the bank was overwritten.
* Calls never range-check indices (capture forbids the host sync): kernels skip an id outside
  [0, S) and ``sdm.check_device_errors()`` reports it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import Counter

import numpy as np

import sdm_cupy as sdm
from sdm_cupy import _validate as V

from . import pools
from sdm_cupy.state import LayerState

from .capture import cupy_capture
from .entry import BackwardHandle, Entry, ReplayedState, RunnerGradients
from .pools import ordered

__all__ = ["GraphRunner", "reset_graphs", "suspend_graphs", "graphs_suspended"]

logger = logging.getLogger("sdm_cupy.graphs")

_runners: "weakref.WeakSet[GraphRunner]" = weakref.WeakSet()
_suspended = 0
_suspend_lock = threading.Lock()
# One capture at a time in the process, whatever the pool (the warm-up and the capture of an
# entry form one step; other threads keep replaying their own pools meanwhile).
_capture_lock = threading.Lock()

INPUT_NAMES = V.INPUT_NAMES


def reset_graphs() -> None:
    """Drops every captured graph: the next call of each runner captures again (also in a
    runner whose capture failed). Pending backwards keep their entries alive until they run."""
    for runner in list(_runners):
        runner._entries.clear()
        runner.capture_failed = False
    pools.clear_pools()
    with pools.shared_lock:
        pools.shared.clear()
    pools.clear_regions()


@contextlib.contextmanager
def suspend_graphs():
    """Every runner call inside the block runs eager (e.g. a probe at another shape). The
    backward of such a call may run outside the block."""
    global _suspended
    with _suspend_lock:
        _suspended += 1
    try:
        yield
    finally:
        with _suspend_lock:
            _suspended -= 1


def graphs_suspended() -> bool:
    return _suspended > 0


_NO_STATICS = (None,) * len(INPUT_NAMES)
# type(values) -> capture backend for runners without one: CUDA graphs for CuPy arrays, None
# (eager) otherwise. A function of the type alone (``V.is_cupy_array``), hence cached.
_captures_by_type: dict = {}


def _capture_for_type(t, values):
    try:
        return _captures_by_type[t]
    except KeyError:
        pass
    cap = cupy_capture() if V.is_cupy_array(values) else None
    if len(_captures_by_type) < 64:
        _captures_by_type[t] = cap
    return cap


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class GraphRunner:
    """Replays the SDM op of one layer from captured graphs.

    Args:
        name: used in warnings.
        capture: the capture backend; None picks CUDA graphs for CuPy arrays (NumPy arrays then
            run eager). ``graphs.HostCapture()`` is the host stand-in the CPU tests use.

    Attributes:
        stats: a Counter of ``forward_capture``, ``forward_replay``, ``backward_capture``,
            ``backward_replay``, ``stale_replay`` (a backward that replayed its forward first),
            ``forward_shared`` (an entry taken from another runner in a region) and the eager
            reasons ``eager_shape``, ``eager_capture_failed``, ``eager_suspended``,
            ``eager_nested_capture``, ``eager_host``, ``eager_released``, ``eager_backward``,
            ``eager_backward_capture`` and ``eager_backward_settings`` (the backward runs eager
            on the graph's state: its capture failed, or settings changed since). Each reason
            logs one warning per runner.

    Example:
        >>> runner = GraphRunner("layer0")
        >>> r, bank, h = runner.forward(param, wi, ww, v, beta, ri, rw, cfg, batch=B)
        >>> g = runner.backward(h, dr)      # g.param, g.write_w, g.values, g.beta, g.read_w
    """

    def __init__(self, name: str = "SDM", capture=None):
        self.name = name
        self.capture = capture
        self.capture_failed = False
        self.stats = Counter()
        self._entries = {}          # needs_backward -> Entry
        self._warned = set()
        self._warn_lock = threading.Lock()
        self._acquire_lock = threading.Lock()
        _runners.add(self)

    def __deepcopy__(self, memo):
        # Graphs cannot be copied: the copy captures its own.
        return GraphRunner(self.name, self.capture)

    def __reduce__(self):
        return GraphRunner, (self.name, self.capture)

    def __repr__(self):
        return f"GraphRunner({self.name!r}, entries={sorted(self._entries)})"

    def note(self, reason: str, message: str) -> None:
        """Counts ``reason``; logs ``message`` the first time ``reason`` occurs here."""
        self.stats[reason] += 1
        with self._warn_lock:
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            logger.warning("%s: %s", self.name, message)

    def static_inputs(self, needs_backward: bool = False):
        """The static input arrays of the captured entry of this kind (a dict by input name,
        with ``param`` for a training entry that has one), or None before the capture. Fill
        them in place on the stream of the next call and pass these very arrays to
        ``forward``: its copies are skipped. A replay reads them; a training call whose
        inputs are these arrays keeps copies of them for a possible stale backward."""
        e = self._entries.get(bool(needs_backward))
        if e is None or e.released:
            return None
        out = dict(zip(INPUT_NAMES, e.static_in))
        if e.static_param is not None:
            out["param"] = e.static_param
        return out

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, param, write_idx, write_w, values, beta, read_idx, read_w, config, *,
                batch, dtype=None, seq_len=None, needs_backward=True):
        """Readings and final state of the op on the bank ``batch`` copies of ``param``.

        Args:
            param: [S, D] learned initial bank (copied ``batch`` times), None (zeros), or, for
                forward-only calls, an ``sdm.LayerState`` whose memory [batch*S, D] is the
                initial bank (decoding). The ``ReplayedState`` this runner returned last
                continues in place without a copy.
            write_idx, write_w, values, beta, read_idx, read_w: as ``sdm.forward``.
            config: ``sdm.SDMConfig``.
            batch: B. dtype: the bank dtype (default: param's, else values').
            seq_len: when given, the second output is a state object with this ``seq_len``
                (``ReplayedState`` for a replayed call, ``sdm.LayerState`` for an eager one).
            needs_backward: False for forward-only calls: no snapshots, no handle.

        Returns:
            (readings [B, T, D], state, handle): fresh readings; the final bank [B*S, D] as a
            fresh array (or the state object, with ``seq_len``); a ``BackwardHandle`` for
            ``backward`` (None when ``needs_backward`` is False).

        Raises:
            What ``sdm.forward`` raises for bad inputs or refused settings (never a capture
            failure); TypeError for a LayerState ``param`` in a training call.
        """
        needs_backward = bool(needs_backward)
        inputs = (write_idx, write_w, values, beta, read_idx, read_w)
        is_state = isinstance(param, LayerState)
        if is_state and needs_backward:
            raise TypeError("param must be an [S, D] array or None when needs_backward=True; "
                            "a LayerState is accepted by forward-only calls")
        batch = int(batch)
        if dtype is not None:
            bank_dtype = np.dtype(dtype)
        elif param is None:
            bank_dtype = values.dtype
        elif is_state and not isinstance(param, ReplayedState):
            bank_dtype = param.memory.dtype
        else:
            bank_dtype = param.dtype   # an array, or a ReplayedState (without copying)
        cap = self.capture
        if cap is None:
            cap = _capture_for_type(type(values), values)
            if cap is None:
                self.note("eager_host", "NumPy arrays without a capture stand-in run eager "
                          "(CUDA graphs need CuPy arrays).")
                return self._eager(param, inputs, config, batch, bank_dtype, seq_len,
                                   needs_backward)
        if _suspended:
            self.note("eager_suspended", "calls inside suspend_graphs() run eager.")
            return self._eager(param, inputs, config, batch, bank_dtype, seq_len, needs_backward)
        stream = cap.current_stream()
        if cap.is_capturing(stream):
            self.note("eager_nested_capture", "the current stream is already capturing a "
                      "graph; the call runs eager (and is recorded into that graph).")
            return self._eager(param, inputs, config, batch, bank_dtype, seq_len, needs_backward)
        if self.capture_failed:
            self.stats["eager_capture_failed"] += 1
            return self._eager(param, inputs, config, batch, bank_dtype, seq_len, needs_backward)
        e = self._entries.get(needs_backward)
        if e is None:
            call = (param, inputs, config, batch, bank_dtype, seq_len, needs_backward)
            key = self._key(cap, None, *call)
            with self._acquire_lock:   # threads sharing a runner capture once
                e = self._entries.get(needs_backward)
                if e is None and not self.capture_failed:
                    e = self._acquire(cap, key, *call)
                    if e is not None:
                        self._entries[needs_backward] = e
            if e is None:   # (counted and logged by the failure)
                return self._eager(*call)
            hit, static = e.key == key, False
        else:
            # one identity check for the usual case: every input is the entry's static array
            # (ids of live objects; a released entry has none)
            static = tuple(map(id, inputs)) == e.static_in_ids
            hit = self._matches(cap, e, param, None if static else inputs, config, batch,
                                bank_dtype, needs_backward)
        if not hit:
            self.note("eager_shape", "a call that differs from the captured one (shapes, "
                      "dtypes, devices, config or the kernels' process-wide settings) runs "
                      "eager. After a permanent change call sdm_cupy.graphs.reset_graphs() "
                      "between steps to capture the new call.")
            return self._eager(param, inputs, config, batch, bank_dtype, seq_len, needs_backward)
        if e.slot is not None:
            r = pools.current_region()
            if r is not None:
                r.used.add(e)
        if not needs_backward:
            out = self._replay_forward_only(e, stream, param, None if static else inputs,
                                            seq_len)
            if out is not None:
                return out
        else:
            with ordered(e.pool, stream) as stream:
                if not e.released:   # (another thread's out-of-memory backward releases it)
                    return self._replay(e, stream, param, inputs, config, batch, bank_dtype,
                                        seq_len, needs_backward)
        self.note("eager_released", "the graphs of this runner were released (an "
                  "out-of-memory first backward in their pool); the call runs eager.")
        return self._eager(param, inputs, config, batch, bank_dtype, seq_len, needs_backward)

    def _key(self, cap, e, param, inputs, config, batch, bank_dtype, seq_len, needs_backward):
        if needs_backward:
            p = None if param is None else (tuple(param.shape), np.dtype(param.dtype),
                                            cap.device(param))
        else:
            p = None   # the forward-only graph starts from its static bank, loaded outside
        if e is not None and not e.released:
            # the entry's own static arrays (filled in place by the caller) keep their key
            arrays = tuple(k if x is st else (x.shape, x.dtype, cap.device(x))
                           for x, st, k in zip(inputs, e.static_in, e.key[5]))
        else:
            arrays = tuple((x.shape, x.dtype, cap.device(x)) for x in inputs)
        return (needs_backward, arrays[2][2], p, batch, bank_dtype, arrays, config,
                cap.settings())

    @staticmethod
    def _matches(cap, e, param, inputs, config, batch, bank_dtype, needs_backward) -> bool:
        """``e.key == _key(cap, e, ...)`` without building the key (every replay's check).
        ``e`` is this runner's entry of ``needs_backward``, so ``key[0]`` matches; ``key[1]``
        is the device of ``arrays[2]``; a forward-only key has ``p`` None. The entry's own
        static arrays keep their key (as in ``_key``); ``inputs`` None: all six are those.
        Nothing else is cached."""
        key = e.key
        if inputs is not None:
            static = e.static_in
            if static is None:   # released
                static = _NO_STATICS
            for x, st, k in zip(inputs, static, key[5]):
                if x is not st and (x.shape, x.dtype, cap.device(x)) != k:
                    return False
        if needs_backward:
            p = None if param is None else (tuple(param.shape), np.dtype(param.dtype),
                                            cap.device(param))
            if p != key[2]:
                return False
        return (batch == key[3] and (bank_dtype is key[4] or bank_dtype == key[4])
                and (config is key[6] or config == key[6]) and cap.settings() == key[7])

    # ---- capture ----------------------------------------------------------------------------
    def _acquire(self, cap, key, *call):
        """The entry at the first graphed call of this kind: in a region, the shared entry of
        the first slot of ``key`` that no other call of the region uses; else its own. None
        when the capture failed."""
        pool = pools.pool_for(cap, key[1], cap.current_stream())
        r = pools.current_region()
        with pool.lock:
            if r is None:
                return self._capture_forward(cap, pool, key, *call)
            slot = 0
            with pools.shared_lock:
                while (e := pools.shared.get((pool, key, slot))) is not None and e in r.used:
                    slot += 1
            if e is None:   # the pool's lock keeps the slot free during the capture
                e = self._capture_forward(cap, pool, key, *call)
                if e is None:
                    return None
                e.slot = slot
                with pools.shared_lock:
                    pools.shared[(pool, key, slot)] = e
            else:
                e.runners.add(self)
                self.stats["forward_shared"] += 1
            r.used.add(e)
            return e

    def _capture_failed(self, exc) -> None:
        self.capture_failed = True
        self.note("eager_capture_failed", f"capturing the op failed ({_failure(exc)}); this "
                  "runner runs eager until sdm_cupy.graphs.reset_graphs().")

    def _capture_forward(self, cap, pool, key, param, inputs, config, batch, bank_dtype,
                         seq_len, needs_backward):
        xp = V.array_module(inputs[2])
        S, D = config.num_memory_slots, int(inputs[2].shape[-1])
        shared = not pool.has_backward
        mempool = pool.mempool if shared else cap.new_mempool()
        e = Entry(self, key, pool, mempool, needs_backward, config, batch)
        current = cap.current_stream()
        with _capture_lock:
            try:
                # Static copies (the caller's allocator), then the op once eagerly on them from
                # the graph's pool: kernels get compiled and loaded outside the capture. Out of
                # memory here falls back to eager; any other error is the call's own.
                e.static_in = tuple(xp.array(x, order="C", copy=True) for x in inputs)
                if needs_backward and param is not None:
                    e.static_param = xp.array(param, dtype=bank_dtype, order="C", copy=True)
                # both kinds run on a static bank that each replay loads outside the graph
                # (from the param, zeros, or a state): the copy eager makes too, and no more
                e.static_bank = xp.zeros((batch * S, D), dtype=bank_dtype)

                def body():
                    return sdm.forward(e.static_bank, *e.static_in, config,
                                       needs_backward=needs_backward, inplace=True,
                                       check_indices=False)

                cap.wait(pool.capture_stream, current)
                with cap.run_on(pool.capture_stream, mempool):
                    body()
            except Exception as exc:
                if not cap.is_oom(exc):
                    raise
                self._capture_failed(exc)
                return None
            try:
                e.forward, e.result = cap.capture(body, mempool, pool.capture_stream, e.held)
            except sdm.UnsupportedConfigurationError:
                raise   # a refusal is the call's own error, never a capture failure
            except Exception as exc:   # any failure of the capture itself: eager from now on
                self._capture_failed(exc)
                return None
            finally:
                cap.wait(current, pool.capture_stream)
        e.copy_readings = cap.copier(e.result.readings)
        e.copy_bank = cap.copier(e.result.bank)
        e.state_dtype = e.result.bank.dtype
        e.static_in_ids = tuple(map(id, e.static_in))
        if needs_backward:
            e.grad_in = xp.zeros(inputs[2].shape, dtype=inputs[2].dtype)
            e.static_ids = frozenset(id(x) for x in (e.static_param, *e.static_in)
                                     if x is not None)
        if shared:
            e.index = len(pool.forward)
            pool.forward.append(weakref.ref(e))
        self.stats["forward_capture"] += 1
        return e

    # ---- replay -----------------------------------------------------------------------------
    def _load_bank(self, e, param, batch):
        """Initial bank of a replay into the static bank (outside the graph): ``batch`` copies
        of the param, zeros, or a state's memory; not called when ``param`` is the state the
        static bank holds already."""
        bank = e.static_bank
        if param is None:
            bank.fill(0)
        elif isinstance(param, sdm.LayerState):
            e.pool.capture.copy_into(bank, param.memory)
        elif batch == 1:
            e.pool.capture.copy_into(bank, param)
        else:
            bank.reshape(batch, param.shape[0], param.shape[1])[...] = param

    def _launch_forward(self, e, stream, param, inputs):
        """Loads and launches ``e``'s forward and issues its token (under the pool's lock);
        ``inputs`` None: the static inputs are the call's."""
        cap = e.pool.capture
        if e.needs_backward or not (isinstance(param, ReplayedState) and param.continues(e)):
            self._load_bank(e, param, e.batch)
        if inputs is not None:   # (None: the static inputs themselves)
            for static, x in zip(e.static_in, inputs):
                if x is not static:
                    cap.copy_into(static, x)
        cap.launch(e.forward, stream)
        pool = e.pool
        pool.tokens += 1   # (under the pool's lock)
        e.token = token = pool.tokens
        if e.index is not None and pool.high != e.index:   # (else nothing to clear)
            pool.invalidate_after(e)
        return token

    def _replay_forward_only(self, e, stream, param, inputs, seq_len):
        """``_replay`` of a forward-only call (the decode step's path); ``inputs`` None: they
        are the static inputs (nothing to copy). None when ``e`` was released."""
        with ordered(e.pool, stream) as stream:
            if e.released:   # (another thread's out-of-memory backward releases it)
                return None
            token = self._launch_forward(e, stream, param, inputs)
            readings = e.copy_readings(stream)
            self.stats["forward_replay"] += 1
            state = (e.copy_bank(stream) if seq_len is None else
                     ReplayedState(e, token, seq_len))
        return readings, state, None

    def _replay(self, e, stream, param, inputs, config, batch, bank_dtype, seq_len,
                needs_backward):
        token = self._launch_forward(e, stream, param, inputs)
        readings = e.copy_readings(stream)
        self.stats["forward_replay"] += 1
        handle = None
        if needs_backward:
            # The handle keeps the call's own arrays, but copies of static ones the caller
            # filled in place: the next call overwrites those.
            ids = e.static_ids
            cap = e.pool.capture
            if param is not None and id(param) in ids:
                param = cap.copy(param)
            if not ids.isdisjoint(map(id, inputs)):
                inputs = tuple(cap.copy(x) if id(x) in ids else x for x in inputs)
            handle = BackwardHandle(e, token, param, inputs, config, batch, bank_dtype)
        state = e.copy_bank(stream) if seq_len is None else ReplayedState(e, token, seq_len)
        return readings, state, handle

    # ---- eager ------------------------------------------------------------------------------
    @staticmethod
    def _initial_bank(param, values, config, batch, bank_dtype):
        xp = V.array_module(values)
        S, D = config.num_memory_slots, int(values.shape[-1])
        if param is None:
            return xp.zeros((batch * S, D), dtype=bank_dtype)
        if isinstance(param, sdm.LayerState):
            return xp.array(param.memory, dtype=bank_dtype, order="C", copy=True)
        bank = sdm.expand_memory_batch(param, batch)
        return bank if bank.dtype == bank_dtype else bank.astype(bank_dtype)

    def _eager(self, param, inputs, config, batch, bank_dtype, seq_len, needs_backward):
        """The op without graphs. A training call keeps what a replayed one keeps (token 0,
        param, inputs) and recomputes its forward in its backward."""
        bank = self._initial_bank(param, inputs[2], config, batch, bank_dtype)
        res = sdm.forward(bank, *inputs, config, needs_backward=needs_backward, inplace=True,
                          check_indices=False)
        handle = (BackwardHandle(None, 0, param, inputs, config, batch, bank_dtype)
                  if needs_backward else None)
        state = res.bank if seq_len is None else sdm.LayerState(res.bank, seq_len)
        return res.readings, state, handle

    @classmethod
    def _eager_grads(cls, h, grad_readings) -> RunnerGradients:
        bank = cls._initial_bank(h.param, h.inputs[2], h.config, h.batch, h.bank_dtype)
        res = sdm.forward(bank, *h.inputs, h.config, needs_backward=True, inplace=True,
                          check_indices=False)
        g = sdm.backward(res.saved, grad_readings)
        gp = (None if h.param is None else
              sdm.sum_memory_batch(g.bank, h.config.num_memory_slots))
        return RunnerGradients(gp, g.write_w, g.values, g.beta, g.read_w)

    # ---- backward ---------------------------------------------------------------------------
    def backward(self, handle: BackwardHandle, grad_readings) -> RunnerGradients:
        """Gradients of a training call (fresh arrays).

        A replayed call whose entry no longer holds its state (a later forward of this runner,
        of one sharing its entry, or of one captured before it in the same pool ran since)
        first replays its forward from the handle's inputs (``stale_replay``). The backward
        rewinds the static bank: a ``ReplayedState`` of the call not read before then raises.

        Raises:
            RuntimeError: the handle was used already. ValueError/TypeError: a bad gradient.
        """
        if not isinstance(handle, BackwardHandle):
            raise TypeError("handle must be the third output of GraphRunner.forward with "
                            f"needs_backward=True, got {type(handle).__name__}")
        x = handle.inputs[2]
        V.check_grad("grad_readings", grad_readings, tuple(x.shape), "[B, T, D]",
                     V.array_module(x))
        handle.take()
        e = handle.entry
        if e is None:
            self.stats["eager_backward"] += 1
            return self._eager_grads(handle, grad_readings)
        abandoned = False
        with ordered(e.pool) as stream:
            if not e.released:
                if e.token != handle.token:
                    self.note("stale_replay", "the graph state of a forward was overwritten "
                              "before its backward (a later forward of this runner, of one "
                              "sharing its graphs, or of one captured before it in the same "
                              "pool ran in between), so the backward replays that forward "
                              "first: one more forward per such backward.")
                    self._launch_forward(e, stream, handle.param, handle.inputs)
                e.token = None   # the backward rewinds the static bank in place
                e.pool.capture.copy_into(e.grad_in, grad_readings)
                grads = self._backward_graphs(e, stream)
                if grads is not None:
                    return grads
                mempools = self._abandon(e)
                abandoned = True
        if abandoned:
            e.pool.capture.release(mempools, e.pool.capture.current_stream())
        self.stats["eager_backward"] += 1
        return self._eager_grads(handle, grad_readings)

    def _backward_body(self, e):
        """The backward on the static state: the bank's gradient (summed over the batch
        outside, by ``_param_grad``) and the inputs' gradients."""
        g = sdm.backward(e.fresh_saved(), e.grad_in)
        return (None if e.static_param is None else g.bank, g.write_w, g.values, g.beta,
                g.read_w)

    @staticmethod
    def _param_grad(e, grad_bank):
        """The param's gradient, a fresh array: the batch sum of the graph's bank gradient,
        run after the graph (one pass, as eager makes; no copy of a graph-made sum)."""
        if grad_bank is None:
            return None
        return sdm.sum_memory_batch(grad_bank, e.config.num_memory_slots)

    def _fresh(self, e, cap, grads) -> RunnerGradients:
        return RunnerGradients(self._param_grad(e, grads[0]),
                               *(None if g is None else cap.copy(g) for g in grads[1:]))

    def _backward_graphs(self, e, stream):
        """Gradients from the static state (fresh arrays), or None when the first backward ran
        out of memory."""
        cap = e.pool.capture
        settings = cap.settings()
        if e.backward is None and not e.backward_eager:
            # First backward: eagerly on the static state from the graph's pool (this call's
            # exact gradients, and the kernels get loaded), then capture it.
            cs = e.pool.capture_stream
            cap.wait(cs, stream)
            try:
                with cap.run_on(cs, e.mempool):
                    grads = self._backward_body(e)
            except Exception as exc:
                cap.wait(stream, cs)
                if cap.is_oom(exc):
                    return None
                raise
            cap.wait(stream, cs)
            out = self._fresh(e, cap, grads)
            del grads
            try:
                with _capture_lock:
                    e.backward, e.grad_out = cap.capture(lambda: self._backward_body(e),
                                                         e.mempool, cs, e.held)
            except Exception as exc:   # keep the forward graph; the backward runs eager
                e.backward_eager = True
                self.note("eager_backward_capture", f"capturing the backward failed "
                          f"({_failure(exc)}); it runs eager on the graph's state.")
            else:
                e.grad_copiers = tuple(None if g is None else cap.copier(g)
                                       for g in e.grad_out[1:])
                e.backward_settings = settings
                if e.index is not None:
                    e.pool.has_backward = True
                self.stats["backward_capture"] += 1
            finally:
                cap.wait(stream, cs)
            return out
        if e.backward_eager or e.backward_settings != settings:
            if not e.backward_eager:
                self.note("eager_backward_settings", "the kernels' process-wide settings "
                          "differ from those of the backward capture; it runs eager.")
            self.stats["eager_backward"] += 1
            gb, *rest = self._backward_body(e)
            return RunnerGradients(self._param_grad(e, gb), *rest)
        cap.launch(e.backward, stream)
        self.stats["backward_replay"] += 1
        return RunnerGradients(self._param_grad(e, e.grad_out[0]),
                               *[None if c is None else c(stream) for c in e.grad_copiers])

    def _abandon(self, e):
        """The first backward ran out of memory (under the pool's lock): drop the entry and,
        when its memory pool is shared, every entry of that pool, so that the memory can be
        freed. Their runners run eager from now on (pending backwards from their inputs).
        Returns the memory pools to release."""
        entries = [e]
        if e.index is not None:
            entries += [x for x in (ref() for ref in e.pool.forward) if x is not None and x is not e]
            pools.forget(e.pool)
        with pools.shared_lock:
            for k, x in list(pools.shared.items()):
                if any(x is y for y in entries):
                    del pools.shared[k]
        mempools = []
        for x in entries:
            if not any(m is x.mempool for m in mempools):
                mempools.append(x.mempool)
            runners = list(x.runners)
            x.release()
            for runner in runners:
                runner.capture_failed = True
                for k, y in list(runner._entries.items()):
                    if y is x:
                        del runner._entries[k]
                runner.note("eager_capture_failed", "the first backward of this runner, or of "
                            "one sharing its graphs' memory pool, ran out of memory; it runs "
                            "eager until sdm_cupy.graphs.reset_graphs().")
        return mempools
