"""Token-by-token decoding through a CUDA-graph runner, checked against the eager op.

    python examples/decode_with_graphs.py            # CuPy arrays, real CUDA graphs
    python examples/decode_with_graphs.py --cpu      # NumPy arrays, the host capture stand-in

A toy layer turns each token's embedding into slot ids (top-W of a random projection),
weights, values and a write strength. The prompt goes through the op once (``sdm.forward``);
then every new token is one forward-only call of a ``GraphRunner``: the first captures the
graph, the others replay it. The state the runner returns (a ``ReplayedState``) is passed back
as ``param`` of the next call, so the bank advances in place inside the graph without a copy;
the step's inputs are written straight into the runner's static input arrays. The same steps
run eagerly on a ``LayerState`` beside it: readings and final bank must agree bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import sdm_cupy as sdm
from sdm_cupy import graphs


NAMES = ("write_idx", "write_w", "values", "beta", "read_idx", "read_w")   # forward's order


def layer_inputs(xp, rng_w, x, S, P, W):
    """Projections of token embeddings x [B, T, E] into the op's inputs (the layer's job)."""
    B, T, E = x.shape
    wq, wk, wv, wb = rng_w
    scores_w = (x @ wk).reshape(B, T, P, S)           # write addressing scores
    scores_r = (x @ wq).reshape(B, T, P, S)           # read addressing scores
    widx = xp.argsort(-scores_w, axis=-1)[..., :W].astype(np.int32)
    ridx = xp.argsort(-scores_r, axis=-1)[..., :W].astype(np.int32)
    ww = xp.take_along_axis(scores_w, widx, axis=-1)
    rw = xp.take_along_axis(scores_r, ridx, axis=-1)
    ww = (ww / xp.sqrt((ww ** 2).sum(-1, keepdims=True))).astype(np.float32)   # |k| = 1
    rw = (rw / xp.sqrt((rw ** 2).sum(-1, keepdims=True))).astype(np.float32)
    values = (x @ wv).astype(np.float32)
    beta = (1 / (1 + xp.exp(-(x @ wb)))).astype(np.float32)    # in (0, 1)
    return widx, ww, values, beta, ridx, rw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="NumPy arrays and the host stand-in")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.cpu:
        xp, capture = np, graphs.HostCapture()
    else:
        import cupy as xp
        capture = None   # CUDA graphs
    B, P, hd, S, W, E, prompt = 4, 4, 32, 256, 8, 64, 12
    D = P * hd
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=16)
    rng = np.random.default_rng(0)
    proj = tuple(xp.asarray(rng.normal(size=s).astype(np.float32) / np.sqrt(E))
                 for s in ((E, P * S), (E, P * S), (E, D), (E, P)))
    tokens = xp.asarray(rng.normal(size=(B, prompt + args.tokens, E)).astype(np.float32))

    # prompt: one eager call from an empty bank
    bank0 = xp.zeros((B * S, D), dtype=np.float32)
    res = sdm.forward(bank0, *layer_inputs(xp, proj, tokens[:, :prompt], S, P, W), cfg,
                      needs_backward=False)
    state = sdm.LayerState(res.bank, prompt)
    eager_state = sdm.LayerState(res.bank.copy(), prompt)

    runner = graphs.GraphRunner("decode", capture=capture)
    mismatches = 0
    t_graph = t_eager = 0.0
    for t in range(prompt, prompt + args.tokens):
        step = layer_inputs(xp, proj, tokens[:, t:t + 1], S, P, W)
        static = runner.static_inputs()          # None until the first call captured
        if static is not None:                   # write the step's inputs in place
            for name, a in zip(NAMES, step):
                static[name][...] = a
            call_inputs = [static[name] for name in NAMES]
        else:
            call_inputs = step
        t0 = time.perf_counter()
        readings, state, _ = runner.forward(state, *call_inputs, cfg, batch=B,
                                            needs_backward=False, seq_len=state.seq_len + 1)
        t1 = time.perf_counter()
        ref = sdm.forward(eager_state.memory, *step, cfg, needs_backward=False, inplace=True,
                          check_indices=False)
        eager_state.update_(ref.bank, seq_len=1)
        t2 = time.perf_counter()
        t_graph, t_eager = t_graph + (t1 - t0), t_eager + (t2 - t1)
        if not bool(xp.array_equal(readings, ref.readings)):
            mismatches += 1
            print(f"MISMATCH: readings of token {t}")
    final_ok = bool(xp.array_equal(state.memory, eager_state.memory))
    print(f"decoded {args.tokens} tokens (B={B}, P={P}, hd={hd}, S={S}, W={W}); runner stats: "
          f"{dict(runner.stats)}")
    print(f"host time per step: runner {1e6 * t_graph / args.tokens:.0f} us, eager "
          f"{1e6 * t_eager / args.tokens:.0f} us (toy shape; see benchmarks/bench_graphs.py)")
    print(f"state: {state!r}, seq_len {state.seq_len} (eager {eager_state.seq_len})")
    ok = (mismatches == 0 and final_ok and state.seq_len == eager_state.seq_len
          and runner.stats["forward_capture"] == 1
          and runner.stats["forward_replay"] == args.tokens)
    if not final_ok:
        print("MISMATCH: final bank")
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
