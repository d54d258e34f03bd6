"""Multi-query associative recall with the SDM op, trained by hand in NumPy (CuPy on a GPU).

Task: each sequence holds ``--pairs`` (key, value) tokens with distinct keys, then ``--queries``
tokens that repeat keys from the pairs; the model must output each queried key's value. Chance
is 1 / ``--values``.

Model (no autograd framework; every backward is written out below):

    x_t     = E_key[key_t]                                  token embedding      [B, T, d]
    write   = top-W over the S learned slot keys of (x_t Wk)_p, softmax of the W scores
    read    = top-W over the same slot keys of (x_t Wq)_p, softmax of the W scores
    v_t     = E_val[value_t] on pair tokens, 0 on queries   values               [B, T, D]
    beta_tp = sigmoid(b_p) on pair tokens, 0 on queries     write strength       [B, T, P]
    r       = sdm.forward(zeros, write, v, beta, read)      the SDM op           [B, T, D]
    logits  = r_t Wo + bo on query tokens                   readout              [B, Q, V]

Loss: mean cross-entropy over the queries. ``sdm.backward`` gives the gradients of the write
weights, values, beta and read weights; the top-W selection passes gradients to the selected
scores only (the slot ids are constants). Adam updates every parameter.

    python examples/associative_recall.py --steps 300 --plot docs/associative_recall.png
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

# The model's matrices are tiny (tens of rows): a multi-threaded BLAS only adds its threads'
# spinning to the op's own (Numba) threads. Seen with NumPy 2.4's OpenBLAS on a loaded 2-core
# machine: 100 steps took 32 s with the default BLAS threads and 4.8 s with one. Must be set
# before NumPy loads its BLAS; an explicit setting by the user wins.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import sdm_cupy as sdm  # noqa: E402


@dataclasses.dataclass
class Task:
    keys: int = 64          # key vocabulary
    values: int = 16        # value vocabulary (chance = 1 / values)
    pairs: int = 12         # (key, value) tokens per sequence
    queries: int = 12       # query tokens per sequence

    def batch(self, rng, B):
        """keys [B, T], values [B, T] (-1 on queries), targets [B, Q]."""
        keys = np.argsort(rng.random((B, self.keys)), axis=1)[:, :self.pairs]   # distinct
        vals = rng.integers(0, self.values, (B, self.pairs))
        pick = rng.integers(0, self.pairs, (B, self.queries))
        qkeys = np.take_along_axis(keys, pick, 1)
        targets = np.take_along_axis(vals, pick, 1)
        all_keys = np.concatenate([keys, qkeys], 1)
        all_vals = np.concatenate([vals, -np.ones_like(qkeys)], 1)
        return all_keys, all_vals, targets


@dataclasses.dataclass
class ModelConfig:
    d_model: int = 32
    heads: int = 2          # P
    head_dim: int = 16      # hd
    key_dim: int = 16       # width of the slot keys / projections per head
    slots: int = 64         # S
    width: int = 4          # W, top-W slots per token and head
    chunk: int = 16         # C


def init_params(rng, task: Task, mc: ModelConfig, dtype):
    P, dk, D = mc.heads, mc.key_dim, mc.heads * mc.head_dim
    n = lambda *s, scale=1.0: (rng.normal(size=s) * scale).astype(dtype)   # noqa: E731
    return dict(E_key=n(task.keys, mc.d_model), E_val=n(task.values, D),
                Wk=n(mc.d_model, P * dk, scale=mc.d_model ** -0.5),
                Wq=n(mc.d_model, P * dk, scale=mc.d_model ** -0.5),
                slot_keys=n(P, mc.slots, dk), beta_raw=np.full(P, 1.0, dtype),
                Wo=n(D, task.values, scale=D ** -0.5), bo=np.zeros(task.values, dtype))


# ----------------------------------------------------------------------------- the model

def _scatter_add(xp, target, idx, vals):
    if xp is np:
        np.add.at(target, idx, vals)
    else:
        import cupyx
        cupyx.scatter_add(target, idx, vals)


def address(xp, x, Wp, slot_keys, W):
    """Top-W slots of each head's projection of x [N, d]; softmax weights over the W scores.
    Returns slot ids [N, P, W], weights [N, P, W] and what ``address_bwd`` needs."""
    P, S, dk = slot_keys.shape
    h = (x @ Wp).reshape(-1, P, dk)
    hp = h.transpose(1, 0, 2)                                             # [P, N, dk]
    scores = (hp @ slot_keys.transpose(0, 2, 1)).transpose(1, 0, 2) / math.sqrt(dk)  # [N, P, S]
    idx = xp.argpartition(-scores, W - 1, axis=-1)[..., :W]
    sel = xp.take_along_axis(scores, idx, -1)
    w = xp.exp(sel - sel.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return idx, w, (x, hp, idx, w)


def address_bwd(xp, dw, Wp, slot_keys, cache):
    """Gradients (dx, dWp, dslot_keys) of the weights' cotangent dw [N, P, W]."""
    x, hp, idx, w = cache
    N, P, W = idx.shape
    S, dk = slot_keys.shape[1:]
    dsel = w * (dw - (w * dw).sum(-1, keepdims=True)) / math.sqrt(dk)     # softmax backward
    dscores = xp.zeros((P, N, S), dtype=hp.dtype)                          # only W of S nonzero
    dscores[xp.arange(P)[:, None, None], xp.arange(N)[None, :, None],
            idx.transpose(1, 0, 2)] = dsel.transpose(1, 0, 2)
    dh = (dscores @ slot_keys).transpose(1, 0, 2).reshape(N, P * dk)     # [N, P*dk]
    dslots = dscores.transpose(0, 2, 1) @ hp                               # [P, S, dk]
    return dh @ Wp.T, x.T @ dh, dslots


def forward(xp, params, mc: ModelConfig, keys, vals, targets, n_pairs, needs_backward=True):
    """Loss, accuracy and the cache ``backward`` needs (keys, vals [B, T]; targets [B, Q])."""
    B, T = keys.shape
    P, D = mc.heads, mc.heads * mc.head_dim
    write = vals >= 0                                                      # pair tokens
    x = params["E_key"][keys.reshape(-1)]                                  # [B*T, d]
    wi, a, acache = address(xp, x, params["Wk"], params["slot_keys"], mc.width)
    ri, c, rcache = address(xp, x, params["Wq"], params["slot_keys"], mc.width)
    v = params["E_val"][xp.maximum(vals, 0)] * write[..., None]           # [B, T, D]
    s = 1.0 / (1.0 + xp.exp(-params["beta_raw"]))
    beta = s[None, None, :] * write[..., None]                             # [B, T, P]
    shape4 = (B, T, P, mc.width)
    bank = xp.zeros((B * mc.slots, D), dtype=x.dtype)
    cfg = sdm.SDMConfig(num_memory_slots=mc.slots, num_parallel=P, chunk_size=mc.chunk)
    res = sdm.forward(bank, wi.reshape(shape4).astype(xp.int32), a.reshape(shape4), v,
                      beta.astype(x.dtype), ri.reshape(shape4).astype(xp.int32),
                      c.reshape(shape4), cfg, needs_backward=needs_backward, inplace=True)
    rq = res.readings[:, n_pairs:]                                         # [B, Q, D]
    logits = rq @ params["Wo"] + params["bo"]
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - xp.log(xp.exp(logits).sum(-1, keepdims=True))
    loss = -xp.take_along_axis(logp, targets[..., None], -1).mean()
    acc = (logits.argmax(-1) == targets).mean()
    cache = dict(keys=keys, vals=vals, targets=targets, write=write, acache=acache,
                 rcache=rcache, s=s, rq=rq, logp=logp, saved=res.saved, n_pairs=n_pairs)
    return float(loss), float(acc), cache


def backward(xp, params, mc: ModelConfig, cache):
    """Gradients of the mean cross-entropy for every parameter (same keys as ``params``)."""
    keys, vals, targets, write = cache["keys"], cache["vals"], cache["targets"], cache["write"]
    B, T = keys.shape
    Q = targets.shape[1]
    P, D, W = mc.heads, mc.heads * mc.head_dim, mc.width
    dlogits = xp.exp(cache["logp"])
    dlogits[xp.arange(B)[:, None], xp.arange(Q)[None, :], targets] -= 1.0
    dlogits /= B * Q
    rq = cache["rq"]
    g = {"Wo": rq.reshape(-1, D).T @ dlogits.reshape(-1, dlogits.shape[-1]),
         "bo": dlogits.sum((0, 1))}
    dr = xp.zeros((B, T, D), dtype=rq.dtype)
    dr[:, cache["n_pairs"]:] = dlogits @ params["Wo"].T
    op = sdm.backward(cache["saved"], dr)                                  # the SDM backward
    s = cache["s"]
    g["beta_raw"] = (op.beta * write[..., None]).sum((0, 1)) * s * (1 - s)
    g["E_val"] = xp.zeros_like(params["E_val"])
    _scatter_add(xp, g["E_val"], vals[write], op.values[write])
    dx_w, g["Wk"], dslots_w = address_bwd(xp, op.write_w.reshape(B * T, P, W), params["Wk"],
                                          params["slot_keys"], cache["acache"])
    dx_r, g["Wq"], dslots_r = address_bwd(xp, op.read_w.reshape(B * T, P, W), params["Wq"],
                                          params["slot_keys"], cache["rcache"])
    g["slot_keys"] = dslots_w + dslots_r
    g["E_key"] = xp.zeros_like(params["E_key"])
    _scatter_add(xp, g["E_key"], keys.reshape(-1), dx_w + dx_r)
    return g


class Adam:
    def __init__(self, xp, params, lr=3e-3, b1=0.9, b2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
        self.m = {k: xp.zeros_like(p) for k, p in params.items()}
        self.v = {k: xp.zeros_like(p) for k, p in params.items()}

    def step(self, params, grads, lr=None):
        self.t += 1
        lr = self.lr if lr is None else lr
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k, gk in grads.items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * gk
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * gk * gk
            params[k] -= lr * (self.m[k] / c1) / ((self.v[k] / c2) ** 0.5 + self.eps)


# ------------------------------------------------------------------------------- training

def evaluate(xp, params, mc, task, rng, n=1024, batch=256):
    accs = []
    for _ in range(max(1, n // batch)):
        k, v, t = (xp.asarray(z) for z in task.batch(rng, batch))
        accs.append(forward(xp, params, mc, k, v, t, task.pairs, needs_backward=False)[1])
    return float(np.mean(accs))


def train(args, xp):
    from tqdm import tqdm
    task = Task(keys=args.keys, values=args.values, pairs=args.pairs, queries=args.queries)
    mc = ModelConfig(slots=args.slots, width=args.width, heads=args.heads,
                     head_dim=args.head_dim, chunk=args.chunk)
    rng = np.random.default_rng(args.seed)
    params = {k: xp.asarray(p) for k, p in init_params(rng, task, mc, np.float32).items()}
    opt = Adam(xp, params, lr=args.lr)
    hist = dict(step=[], loss=[], acc=[], eval_step=[], eval_acc=[])
    bar = tqdm(range(1, args.steps + 1), desc="recall", disable=args.no_progress)
    for step in bar:
        k, v, t = (xp.asarray(z) for z in task.batch(rng, args.batch))
        loss, acc, cache = forward(xp, params, mc, k, v, t, task.pairs)
        grads = backward(xp, params, mc, cache)
        warm = min(1.0, step / 20)                                         # short warm-up
        decay = 0.5 * (1 + math.cos(math.pi * step / args.steps))          # cosine to 0
        opt.step(params, grads, lr=args.lr * warm * max(decay, 0.05))
        hist["step"].append(step), hist["loss"].append(loss), hist["acc"].append(acc)
        if step % args.eval_every == 0 or step == args.steps:
            hist["eval_step"].append(step)
            hist["eval_acc"].append(evaluate(xp, params, mc, task, rng, n=512))
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}")
    final = evaluate(xp, params, mc, task, np.random.default_rng(args.seed + 1), n=2048)
    return final, hist, task


def plot(hist, task, final, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(hist["step"], hist["loss"], lw=0.8, color="tab:blue")
    ax1.axhline(math.log(task.values), ls="--", color="gray", lw=0.8, label="chance")
    ax1.set(xlabel="step", ylabel="cross-entropy", title="training loss")
    ax1.legend()
    ax2.plot(hist["step"], hist["acc"], lw=0.6, alpha=0.5, color="tab:blue", label="train batch")
    ax2.plot(hist["eval_step"], hist["eval_acc"], "o-", ms=3, color="tab:orange",
             label="held-out")
    ax2.axhline(1 / task.values, ls="--", color="gray", lw=0.8, label="chance")
    ax2.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02),
            title=f"recall accuracy (final {final:.3f})")
    ax2.legend(loc="lower right")
    fig.suptitle(f"SDM associative recall: {task.pairs} pairs, {task.queries} queries, "
                 f"{task.keys} keys, {task.values} values", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--values", type=int, default=16)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--queries", type=int, default=12)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--plot", default=None, help="write the loss/accuracy plot (PNG) here")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit 1 if the final held-out accuracy is below this")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.plot:   # refuse before training, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib (or sdm-cupy's [plot] extra)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    use_gpu = args.device == "gpu" or (args.device == "auto" and sdm.gpu_available())
    if use_gpu:
        import cupy as xp
    else:
        xp = np
    t0 = time.perf_counter()
    final, hist, task = train(args, xp)
    secs = time.perf_counter() - t0
    print(f"final accuracy: {final:.4f} (chance {1 / task.values:.4f}) after {args.steps} "
          f"steps, {secs:.1f} s on {'GPU' if use_gpu else 'CPU'}")
    if args.plot:
        plot(hist, task, final, args.plot)
        print(f"plot: {args.plot}")
    if args.min_accuracy is not None and final < args.min_accuracy:
        print(f"accuracy {final:.4f} below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
