"""The ``sdm-cupy`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sdm-cupy", description="sparse delta memory on CuPy / NumPy")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="store key->value pairs, read them back, time forward+backward")
    demo.add_argument("--batch", type=int, default=4)
    demo.add_argument("--pairs", type=int, default=1024, help="key->value pairs per batch element")
    demo.add_argument("--slots", type=int, default=4096, help="S, memory slots per batch element")
    demo.add_argument("--heads", type=int, default=4, help="P, parallel heads")
    demo.add_argument("--head-dim", type=int, default=64, help="hd, head width")
    demo.add_argument("--topk", type=int, default=8, help="W, addresses per token and head")
    demo.add_argument("--chunk", type=int, default=64, help="C, chunk size")
    demo.add_argument("--rounds", type=int, default=5, help="timed forward+backward rounds")
    demo.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="versions and the backends available")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run
        run(B=args.batch, N=args.pairs, S=args.slots, P=args.heads, hd=args.head_dim,
            W=args.topk, C=args.chunk, rounds=args.rounds, device=args.device, seed=args.seed)
        return 0
    if args.command == "info":
        import numba
        import numpy as np

        from . import __version__, _why_no_gpu, gpu_available
        print(f"sdm-cupy {__version__}; numpy {np.__version__}; numba {numba.__version__}")
        if gpu_available():
            import cupy
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            print(f"GPU backend: CuPy {cupy.__version__} on {name}")
        else:
            print(f"GPU backend: not available ({_why_no_gpu()}); CPU backend: Numba")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
