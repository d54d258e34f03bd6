"""Number formats for the Numba CPU backend: 16-bit floats on their bits, snapshot quantization.

Numba on the CPU has no float16 arithmetic (it raises NotImplementedError on float16 arrays)
and no bfloat16 type at all, so 16-bit arrays reach the kernels as ``uint16`` views together
with a format code, and the conversions below work on the bits:

* bfloat16 -> float32: the 16 bits are the top half of the float32 (``bits << 16``).
* float32 -> bfloat16: round to nearest, ties to even, NaN kept quiet.
* float16 <-> float32: IEEE binary16 (subnormals, inf, NaN), round to nearest even.

Bits are turned into floats through a small ``uint32`` scratch row and its ``float32`` view
(Numba has no scalar bit cast). All integer work is in int64: Numba types uint64 op int64 as
float64, which would silently break the bit arithmetic.

Snapshot quantization (SPEC §5) of one row of hd values:

* ``bf16``: each value rounded to bfloat16 once, float64 values too (relative error <= 2^-8).
* ``fp8_e4m3`` (e4m3fn: bias 7, no inf, max 448) and ``int8`` (max 127): a = the row's absmax
  rounded to float32 (NaN ignored), scale = a / qmax rounded to float32, and with
  y = x * (qmax / a) in float64 the code is the e4m3 (RNE, saturated at +-448) of y rounded to
  float32, or RNE(y) clamped to [-127, 127]. fp8: relative error <= 2^-4 for |x| >= 2^-6 *
  scale, absolute error <= 2^-10 * scale below that; int8: absolute error <= scale / 2 (plus
  float32 rounding of the scale). Subnormal rows included, the GPU computes the same numbers
  (``kernels/sdm_common.cuh``, ``quant1``).

A row of zeros (or with an infinite absmax) gets zero codes; zeros decode to zeros exactly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# storage format of a 2-D float array handed to the kernels
FMT_NATIVE, FMT_F16, FMT_BF16 = 0, 1, 2
# snapshot modes inside the kernels
SNAP_OFF, SNAP_EXACT, SNAP_BF16, SNAP_FP8, SNAP_INT8 = -1, 0, 1, 2, 3
SNAP_CODES = {None: SNAP_EXACT, "bf16": SNAP_BF16, "fp8_e4m3": SNAP_FP8, "int8": SNAP_INT8}

FP8_MAX = 448.0
INT8_MAX = 127.0


@njit(cache=True)
def f16_to_f32_bits(h):
    """binary16 bits (int) -> binary32 bits (int64)."""
    h = np.int64(h)
    s = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return s
        e = 1                        # subnormal: shift the mantissa up to an implicit bit
        while (m & 0x400) == 0:
            m <<= 1
            e -= 1
        m &= 0x3FF
        return s | ((e + 112) << 23) | (m << 13)
    if e == 31:
        return s | 0x7F800000 | (m << 13)
    return s | ((e + 112) << 23) | (m << 13)


@njit(cache=True)
def _subnormal_rne(ax, shift):
    """The 24-bit significand of binary32 bits ``ax`` shifted right by ``shift`` (>= 1),
    rounded to nearest even: the subnormal code of a narrower format."""
    m = (ax & 0x7FFFFF) | 0x800000
    h = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return h


@njit(cache=True)
def f32_bits_to_f16(x):
    """binary32 bits -> binary16 bits (int64), round to nearest even."""
    x = np.int64(x)
    s = (x >> 16) & 0x8000
    ax = x & 0x7FFFFFFF
    if ax > 0x7F800000:
        return s | 0x7E00                          # NaN stays a (quiet) NaN
    if ax >= 0x47800000:
        return s | 0x7C00                          # >= 65536: inf (65520..65536 round below)
    if ax < 0x38800000:                            # below 2^-14: subnormal half or zero
        e = ax >> 23
        shift = 126 - e
        if shift > 24:
            return s
        return s | _subnormal_rne(ax, shift)
    h = (ax - 0x38000000) >> 13                    # rebias 127 -> 15
    rem = ax & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
        h += 1
    return s | h


@njit(cache=True)
def f32_bits_to_bf16(x):
    """binary32 bits -> bfloat16 bits (int64), round to nearest even."""
    x = np.int64(x)
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return ((x >> 16) | 0x40) & 0xFFFF
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF


@njit(cache=True)
def load_row(src, r, c0, hd, fmt, out, orow, u32, f32v):
    """out[orow, :hd] = src[r, c0:c0+hd] as numbers (decoding 16-bit bits when fmt says so).
    Rows are indexed rather than sliced: a view costs atomic reference counting."""
    uhd = np.uint64(hd)
    uc0 = np.uint64(c0)
    if fmt == FMT_NATIVE:
        for k in range(uhd):
            out[orow, k] = src[r, uc0 + k]
    elif fmt == FMT_BF16:
        for k in range(uhd):
            u32[k] = np.uint32(np.int64(src[r, uc0 + k]) << 16)
        for k in range(uhd):
            out[orow, k] = f32v[k]
    else:
        for k in range(uhd):
            u32[k] = np.uint32(f16_to_f32_bits(src[r, uc0 + k]))
        for k in range(uhd):
            out[orow, k] = f32v[k]


@njit(cache=True)
def store_row(dst, r, c0, hd, fmt, vals, vrow, u32, f32v):
    """dst[r, c0:c0+hd] = vals[vrow, :hd], rounded to the storage format (RNE)."""
    uhd = np.uint64(hd)
    uc0 = np.uint64(c0)
    if fmt == FMT_NATIVE:
        for k in range(uhd):
            dst[r, uc0 + k] = vals[vrow, k]
    else:
        for k in range(uhd):
            f32v[k] = vals[vrow, k]
        if fmt == FMT_BF16:
            for k in range(uhd):
                dst[r, uc0 + k] = np.uint16(f32_bits_to_bf16(u32[k]))
        else:
            for k in range(uhd):
                dst[r, uc0 + k] = np.uint16(f32_bits_to_f16(u32[k]))


@njit(cache=True)
def fp8_e4m3_encode(x):
    """binary32 bits of a value -> e4m3fn code (int64), RNE, saturating at +-448."""
    x = np.int64(x)
    sign = (x >> 24) & 0x80
    ax = x & 0x7FFFFFFF
    if ax > 0x7F800000:
        return sign | 0x7F                          # NaN
    e = (ax >> 23) - 127
    if e >= -6:
        h = ((e + 7) << 3) | ((ax >> 20) & 7)
        rem = ax & 0xFFFFF
        if rem > 0x80000 or (rem == 0x80000 and (h & 1) == 1):
            h += 1
        if h > 0x7E:
            h = 0x7E                                # saturate (0x7F is NaN in e4m3fn)
        return sign | h
    shift = 14 - e                                  # subnormal: units of 2^-9
    if shift > 25:
        return sign
    return sign | _subnormal_rne(ax, shift)


@njit(cache=True)
def fp8_e4m3_decode(q):
    """e4m3fn code -> float64 value."""
    q = np.int64(q)
    mag = q & 0x7F
    if mag == 0x7F:
        return np.nan
    e = mag >> 3
    m = mag & 7
    if e == 0:
        val = m * 0.001953125                       # 2^-9
    else:
        val = (8 + m) * 2.0 ** (e - 10)
    return -val if (q & 0x80) != 0 else val


@njit(cache=True)
def quantize_row(vals, vrow, hd, mode, srow, snap_u16, snap_u8, scales, u32, f32v):
    """Stores vals[vrow, :hd] as snapshot row ``srow`` in ``mode`` (SNAP_BF16/FP8/INT8)."""
    uhd = np.uint64(hd)
    if mode == SNAP_BF16:
        for k in range(uhd):
            x = vals[vrow, k]
            f32v[k] = x
            # float64 values: round to odd in float32, so that bf16 rounds once
            if f32v[k] != x and f32v[k] == f32v[k]:
                if abs(np.float64(f32v[k])) > abs(x):
                    u32[k] -= 1                    # toward zero (bits are sign-magnitude)
                u32[k] |= 1                        # sticky: below bf16's last place
            snap_u16[srow, k] = np.uint16(f32_bits_to_bf16(u32[k]))
        return
    amax = 0.0
    for k in range(uhd):
        x = abs(vals[vrow, k])
        if x > amax:
            amax = x
    qmax = FP8_MAX if mode == SNAP_FP8 else INT8_MAX
    a = np.float64(np.float32(amax))
    scales[srow] = np.float32(a / qmax)
    if a == 0.0 or not np.isfinite(a):
        for k in range(uhd):
            snap_u8[srow, k] = 0
        return
    inv = qmax / a
    if mode == SNAP_FP8:
        for k in range(uhd):
            f32v[k] = vals[vrow, k] * inv
        for k in range(uhd):
            snap_u8[srow, k] = np.uint8(fp8_e4m3_encode(u32[k]))
    else:
        for k in range(uhd):
            q = np.rint(vals[vrow, k] * inv)
            if q > INT8_MAX:
                q = INT8_MAX
            elif q < -INT8_MAX:
                q = -INT8_MAX
            snap_u8[srow, k] = np.uint8(np.int64(q) & 0xFF)


@njit(cache=True)
def dequantize_row(mode, srow, hd, snap_u16, snap_u8, scales, out, orow, u32, f32v):
    """out[orow, :hd] = the value of snapshot row ``srow`` stored in ``mode``."""
    uhd = np.uint64(hd)
    if mode == SNAP_BF16:
        for k in range(uhd):
            u32[k] = np.uint32(np.int64(snap_u16[srow, k]) << 16)
        for k in range(uhd):
            out[orow, k] = f32v[k]
        return
    scale = np.float64(scales[srow])
    if mode == SNAP_FP8:
        for k in range(uhd):
            out[orow, k] = fp8_e4m3_decode(snap_u8[srow, k]) * scale
    else:
        for k in range(uhd):
            q = np.int64(snap_u8[srow, k])
            if q >= 128:
                q -= 256
            out[orow, k] = q * scale
