"""The online softmax applied to one thread's row of a Blackwell score tile, with packed f32x2 math.

On sm_100 a softmax thread owns a whole row (one TMEM lane, TILE_N scores). The row statistics and
the rescale rule are the shared ``OnlineSoftmax``'s (fa4_kernels/softmax.py); what is specific here
is how the row's exponentials are computed: pairs of columns go through one FFMA2 for the scale and
shift, MUFU.EX2 or, for the emulated columns (fa4_kernels/exp2.py's rule), the FMA-pipe polynomial
in packed form, and the pair's row-sum contribution through FADD2. (Packed f32x2 arithmetic does
not exist on sm_90a, which is why this is not in the shared module.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..exp2 import COEFFS, INPUT_MIN, ROUND_DOWN_MAGIC, emulated


@cute.jit
def exp2_fma_x2(x0: Float32, x1: Float32):
    """exp2 of two values on the FMA pipe: fa4_kernels/exp2.py's algorithm (range reduction by the
    round-down magic add, degree-3 Horner, exponent add) with FADD2/FFMA2 for the float steps."""
    x0 = cute.arch.fmax(x0, Float32(INPUT_MIN))
    x1 = cute.arch.fmax(x1, Float32(INPUT_MIN))
    magic = (Float32(ROUND_DOWN_MAGIC), Float32(ROUND_DOWN_MAGIC))
    r0, r1 = cute.arch.add_packed_f32x2((x0, x1), magic, rnd="rm")
    f0, f1 = cute.arch.sub_packed_f32x2((r0, r1), magic)
    f0, f1 = cute.arch.sub_packed_f32x2((x0, x1), (f0, f1))
    p0, p1 = Float32(COEFFS[3]), Float32(COEFFS[3])
    for c in (COEFFS[2], COEFFS[1], COEFFS[0]):
        p0, p1 = cute.arch.fma_packed_f32x2((p0, p1), (f0, f1), (Float32(c), Float32(c)))
    e0 = p0.bitcast(Int32) + (r0.bitcast(Int32) << 23)
    e1 = p1.bitcast(Int32) + (r1.bitcast(Int32) << 23)
    return e0.bitcast(Float32), e1.bitcast(Float32)


SUM_LANES = 4  # independent packed partial sums: FADD2 chains a quarter as long


def row_sums_init():
    return [(Float32(0.0), Float32(0.0)) for _ in range(SUM_LANES)]


def row_sums_total(sums) -> Float32:
    """The row sum from the packed partial sums (plain Python at trace time: a pairwise tree)."""
    while len(sums) > 1:
        sums = [cute.arch.add_packed_f32x2(sums[i], sums[i + 1]) for i in range(0, len(sums), 2)]
    return sums[0][0] + sums[0][1]


@cute.jit
def row_probabilities(scores: list, first: cutlass.Constexpr[int], count: cutlass.Constexpr[int],
                      scale_log2: Float32, shift: Float32, probs: cute.Tensor, sums: list,
                      emulated_eighths: cutlass.Constexpr[int]) -> list:
    """probs[c] = exp2(scores[first + c] * scale_log2 - shift) for ``count`` columns of the row,
    converted to probs' 16-bit type (paired conversions); the float32 values are added into the
    packed partial row sums ``sums``, returned. ``emulated_eighths`` > 0 is only valid for rows
    without -inf scores (the column rule is exp2.emulated on the row's column index)."""
    neg_shift = -shift
    p32 = cute.make_rmem_tensor(count, Float32)
    for c in cutlass.range_constexpr(0, count, 2):
        x0, x1 = cute.arch.fma_packed_f32x2((scores[first + c], scores[first + c + 1]), (scale_log2, scale_log2),
                                            (neg_shift, neg_shift))
        if cutlass.const_expr(emulated(first + c, emulated_eighths)):
            e0, e1 = exp2_fma_x2(x0, x1)
        else:
            e0, e1 = cute.math.exp2(x0, fastmath=True), cute.math.exp2(x1, fastmath=True)
        p32[c], p32[c + 1] = e0, e1
        lane = (c // 2) % SUM_LANES
        sums[lane] = cute.arch.add_packed_f32x2(sums[lane], (e0, e1))
    out = cute.make_tensor(probs.iterator, cute.make_layout(count))
    out.store(p32.load().to(probs.element_type))
    return sums


def row_max(scores: list):
    """The maximum of a row's scores as a tree of max(max(a, b), c) steps, which ptxas fuses into
    three-input FMNMX3 (a pairwise tree leaves it two-input FMNMX: about a third more instructions)."""
    values = list(scores)
    while len(values) > 1:
        nxt = []
        for i in range(0, len(values), 3):
            group = values[i:i + 3]
            m = group[0]
            for x in group[1:]:
                m = cute.arch.fmax(m, x)
            nxt.append(m)
        values = nxt
    return values[0]
