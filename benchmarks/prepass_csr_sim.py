"""Pure-Python check of kernels/sdm_prepass.cu steps 4-6: the old form (zeroed dense G, H,
Ainv; lists and nzr from dense scans; one warp per CSR row with ballots) against the new one
(no zeroing; per-row 64-bit masks of the non-zero entries, filled in step 4 by the row's
thread, by 32-bit atomicOr for the backward's H columns and by ballots in step 5; a scan of
the popcounts; one thread per half row). Each is a literal port of the kernel's loops, lane by
lane; the new one starts from dense matrices full of garbage, so that a read of an entry it
never wrote shows in the outputs. Inputs: per token row of G and H a list of terms (tau, a, b)
in the walk's order, with cancellations, -0.0 products and the odd inf; dyadic values, so that
float64 arithmetic is exact and a + b * c equals the device's fma, signed zeros included.
Compares sp_ptr, sp_col and sp_val (bit patterns, NaN canonical as on the device) over whole
buffers.

    python benchmarks/prepass_csr_sim.py [CASES]   # CASES chunks, default 300
"""
import math
import random
import struct
import sys

M64 = (1 << 64) - 1


def popc(x):
    return bin(x).count("1")


def ffs(x):   # __ffs / __ffsll: 1 + the lowest set bit
    return (x & -x).bit_length()


def fma(a, b, c):   # exact for the dyadic inputs below
    return a * b + c


def case(rng, C, L, sparse):
    """Random step-4 terms and beta of a chunk of L <= C tokens."""
    vals = [1.0, -1.0, 2.0, 0.5, -0.25, 0.0, -0.0, 3.0]
    terms = {}
    for isH in (False, True):
        for t in range(L):
            row = []
            if rng.random() < 0.5:
                for _ in range(rng.randint(1, 6)):
                    hi = t if isH else t - 1
                    if hi < 0:
                        break
                    tau = rng.randint(0, hi) if rng.random() < 0.7 else rng.randint(max(0, hi - 2), hi)
                    a, b = rng.choice(vals), rng.choice(vals)
                    if rng.random() < 0.01:
                        a = math.inf
                    row.append((tau, a, b))
                    if rng.random() < 0.3:   # cancels to an exact 0 (or a signed 0)
                        row.append((tau, -a, b))
            terms[isH, t] = row
    beta = [rng.choice([0.5, 1.0, 0.0, 2.0, -1.0]) for _ in range(C)]
    return terms, beta


def old(C, L, sparse, terms, beta):
    ld, nsec = C + 1, (2 if sparse == 1 else 4)
    Gs, Hs, Ai = ([[0.0] * ld for _ in range(C)] for _ in range(3))   # step 1 zeroing
    for (isH, t), row in terms.items():   # step 4
        M = Hs if isH else Gs
        for tau, a, b in row:
            M[t][tau] = fma(a, b, M[t][tau])
    lidx = [[k for k in range(L) if Gs[r][k] != 0.0] for r in range(L)]   # build_lists
    nzr = [r for r in range(L) if lidx[r]]
    for j in range(L):   # step 5
        Ai[j][j] = 1.0
        for t in nzr:
            if t <= j:
                continue
            s = 0.0
            for tau in lidx[t]:
                if tau >= j:
                    s = fma(Gs[t][tau], Ai[tau][j], s)
            Ai[t][j] = -beta[t] * s
    R = nsec * C   # step 6: one warp per row, two passes
    rptr = [0] * (R + 1)
    col, val = {}, {}
    for pas in (0, 1):
        for r in range(R):
            sec, row = divmod(r, C)
            M = Ai if sec in (0, 2) else Hs if sec == 1 else Gs
            tr = sparse == 2 and sec in (1, 2)
            base = rptr[r] if pas else 0
            if row < L:
                for h in range(0, C, 32):
                    v = []
                    for lane in range(32):
                        k = h + lane
                        if sec in (0, 3):
                            inn = k < row
                        elif sparse == 1:
                            inn = k <= row
                        else:
                            inn = k >= row if sec == 1 else k > row
                        inn = k < L and inn
                        v.append((M[k][row] if tr else M[row][k]) if inn else 0.0)
                    nz = sum(1 << l for l in range(32) if v[l] != 0.0)
                    for lane in range(32):
                        if pas and v[lane] != 0.0:
                            at = base + popc(nz & ((1 << lane) - 1))
                            col[at], val[at] = h + lane, v[lane]
                    base += popc(nz)
            if not pas:
                rptr[r + 1] = base
        if not pas:
            for r in range(R):
                rptr[r + 1] += rptr[r]
    return rptr, col, val


def new(C, L, sparse, terms, beta, rng):
    ld, nsec = C + 1, (2 if sparse == 1 else 4)
    junk = lambda: rng.choice([7.0, -3.5, math.nan, 1e9])   # never zeroed
    Gs, Hs, Ai = ([[junk() for _ in range(ld)] for _ in range(C)] for _ in range(3))
    rm32 = [0] * (8 * C)   # step 1: rm[4C] = 0
    rm = lambda r: rm32[2 * r] | rm32[2 * r + 1] << 32

    def set64(r, x):
        rm32[2 * r], rm32[2 * r + 1] = x & 0xFFFFFFFF, x >> 32

    for isH in (False, True):   # step 4: thread task = t (G) or L + t (H)
        for t in range(L):
            row = (Hs if isH else Gs)[t]
            seen = 0
            for tau, a, b in terms[isH, t]:
                bit = 1 << tau
                row[tau] = fma(a, b, row[tau] if seen & bit else 0.0)
                seen |= bit
            nz, m = 0, seen
            while m:
                k = ffs(m) - 1
                if row[k] != 0.0:
                    nz |= 1 << k
                m &= m - 1
            if not isH:
                set64(3 * C + t, nz)
            elif sparse == 1:
                set64(C + t, nz)
            else:
                m = nz
                while m:
                    k = ffs(m) - 1
                    rm32[2 * (C + k) + (t >> 5)] |= 1 << (t & 31)   # atomicOr
                    m &= m - 1
    gz = 0   # step 5, warps 0 and 1 (ballots over lanes)
    for lane in range(32):
        gz |= int(lane < L and rm(3 * C + lane) != 0) << lane
        gz |= int(lane + 32 < L and rm(3 * C + 32 + lane) != 0) << (lane + 32)
    for w in range(1 + (L > 32)):   # warp 1 only when L > 32
        cols = [0] * 32
        for lane in range(32):
            j = 32 * w + lane
            if j < L:
                Ai[j][j] = 1.0
        rows = gz
        while rows:
            t = ffs(rows) - 1
            word = 0
            for lane in range(32):
                j = 32 * w + lane
                on = j < t
                s = 0.0
                m = rm(3 * C + t)
                while m:
                    tau = ffs(m) - 1
                    if on and tau >= j:
                        a = Ai[tau][j] if tau == j or (gz >> tau & 1) else 0.0
                        s = fma(Gs[t][tau], a, s)
                    m &= m - 1
                v = -beta[t] * s
                if on:
                    Ai[t][j] = v
                if on and v != 0.0:
                    word |= 1 << lane
                    cols[lane] |= 1 << t
            rm32[2 * t + w] = word   # lane 0
            rows &= rows - 1
        for lane in range(32):
            if sparse == 2 and 32 * w + lane < L:
                set64(2 * C + 32 * w + lane, cols[lane])
    R = nsec * C   # step 6: warp 0 scans, then one thread per half row
    per = (R + 31) // 32
    sums = []
    for lane in range(32):
        r0 = min(R, lane * per)
        sums.append(sum(popc(rm(r)) for r in range(r0, min(R, r0 + per))))
    rend = [None] * R   # keys' dead space: garbage until written
    for lane in range(32):
        run = sum(sums[:lane])
        r0 = min(R, lane * per)
        for r in range(r0, min(R, r0 + per)):
            run += popc(rm(r))
            rend[r] = run
    sp_ptr = [rend[r - 1] if r else 0 for r in range(R + 1)]
    col, val = {}, {}
    for i in range(2 * R):
        r, h = i >> 1, i & 1
        m64 = rm(r)
        m = m64 >> 32 if h else m64 & 0xFFFFFFFF
        if not m:
            continue
        sec, row = divmod(r, C)
        tr = sparse == 2 and sec in (1, 2)
        M = Ai if sec in (0, 2) else Hs if sec == 1 else Gs
        at = (rend[r - 1] if r else 0) + (popc(m64 & 0xFFFFFFFF) if h else 0)
        while m:
            k = 32 * h + ffs(m) - 1
            assert at not in col, "an entry written twice"
            col[at], val[at] = k, (M[k][row] if tr else M[row][k])
            at += 1
            m &= m - 1
    return sp_ptr, col, val


def bits(x):   # the device's canonical NaN
    return "nan" if x != x else struct.pack("<d", x)


def main(cases=300, seed=1):
    rng = random.Random(seed)
    nent = nterm = 0
    for n in range(cases):
        C = [1, 5, 64, 33, 32][n % 5]
        L = C if rng.random() < 0.5 else rng.randint(1, C)
        sparse = 1 + n % 2
        terms, beta = case(rng, C, L, sparse)
        a, b = old(C, L, sparse, terms, beta), new(C, L, sparse, terms, beta, rng)
        assert a[0] == b[0], (C, L, sparse, "sp_ptr")
        assert a[1] == b[1], (C, L, sparse, "sp_col")
        assert sorted(a[2]) == sorted(b[2]) and all(bits(a[2][k]) == bits(b[2][k]) for k in a[2]), \
            (C, L, sparse, "sp_val")
        assert a[0][-1] == len(a[1]) <= (1 if sparse == 1 else 2) * C * C
        nent += len(a[1])
        nterm += sum(1 for (isH, t), r in terms.items() for _ in r)
    print(f"{cases} chunks: old and new steps 4-6 agree ({nent} CSR entries from {nterm} terms)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
