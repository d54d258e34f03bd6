"""Software prefetch of bank rows for the Numba CPU kernels.

The kernels are bound by gathering rows of hd values at random slots (SPEC §3: each address
reads a row, most of them cold in cache). The hardware prefetchers cannot guess the next slot,
but the kernels know it: the rows of token t+2 are requested while token t is processed.
Measured on the benchmark shape (B=4, P=4, hd=64, S=4096, W=8) this halves the time of a
row gather (6.2 ms -> 3.1 ms single-threaded).

``llvm.prefetch`` is a hint: it never faults and changes no result. The helpers still prefetch
only ids inside [0, S), like every other access of the kernels.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# The intrinsic's name carries the pointer type: opaque pointers ("p0") from LLVM 17 on (the
# llvmlite of numba >= 0.67 is built on LLVM 20), typed i8* pointers before.
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"

#: tokens ahead of the one being processed (1-2 measured best; more loses rows to eviction)
PREFETCH_TOKENS = 2


def _codegen(rw: int, locality: int):
    """Codegen of llvm.prefetch(&arr[row, col], rw, locality, data cache) for a 2-D array."""
    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]],
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(locality), i32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _prefetch(typingctx, arr, row, col, write):
    """Prefetch the cache line of arr[row, col] (2-D array) into all cache levels."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None
    if not isinstance(write, types.IntegerLiteral):
        return None
    # (rw, locality 3 = keep in all levels)
    return types.void(arr, types.intp, types.intp, write), _codegen(int(write.literal_value), 3)


@intrinsic
def _prefetch_level(typingctx, arr, row, col, locality):
    """Read prefetch of the cache line of arr[row, col] (2-D array) with LLVM's locality hint
    (3: prefetcht0, 2: prefetcht1, 1: prefetcht2, 0: prefetchnta on x86)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None
    if not isinstance(locality, types.IntegerLiteral):
        return None
    return (types.void(arr, types.intp, types.intp, locality),
            _codegen(0, int(locality.literal_value)))


@njit(cache=True)
def prefetch_token_rows(arr, idx, b, t, p, W, S, row0, c0, hd, write):
    """Prefetch arr[row0 + idx[b, t, p, w], c0:c0+hd] for every w (token t of idx
    [B, T, P, W]); a no-op for t >= T. ``write`` = 1 when the rows are about to be written."""
    if t >= idx.shape[1]:
        return
    step = max(1, 64 // arr.itemsize)
    for w in range(W):
        s = idx[b, t, p, w]
        if s < 0 or s >= S:
            continue
        for off in range(0, hd, step):
            if write:
                _prefetch(arr, row0 + s, c0 + off, 1)
            else:
                _prefetch(arr, row0 + s, c0 + off, 0)
