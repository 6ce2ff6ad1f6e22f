"""exp2 on the FMA pipe, to share the softmax's exponentials with the MUFU unit.

MUFU.EX2 retires 16 results per clock per SM; the FMA pipe retires 128 FP32 operations. Computing
a fraction of each row's exponentials with ~7 FMA-pipe instructions lets both units work at once.

    2^x = 2^floor(x) * 2^f,  f = x - floor(x) in [0, 1)

floor(x): adding 1.5 * 2^23 with round-down leaves floor(x) in the low mantissa bits of the sum
(exact for |x| < 2^22); subtracting the constant back gives floor(x) as a float. 2^f: a degree-3
polynomial by Horner's rule (3 FFMA). The scale 2^floor(x) is an integer add of floor(x) << 23 to
the polynomial's bits: shifting the rounded sum's bits by 23 discards everything but floor(x).

Coefficients: minimax fit of 2^f on [0, 1) for relative error (Lawson's iteration over 20001 points,
rounded to fp32): max relative error 7.5e-5, far below bf16/fp16 rounding of P (2^-9 / 2^-12).

Inputs must be finite and <= 127: x is clamped below at -126, where the true value (< 1.2e-38) is
negligible next to a row sum >= 1. Not at -127: COEFFS[0] < 1 has exponent field 126, so at
floor(x) = -127 the exponent add borrows into the sign bit and 2^x comes out as NaN (found by the CPU
model, tests/tile_model.py). For x in [-126, -125) the result is subnormal (relative error up to
1.5e-4, absolute < 2^-138); the 7.5e-5 bound holds from -125 up. Callers keep -inf (masked) scores
on MUFU.

Which columns: ``emulated(c, eighths)``, one rule for every kernel. Column c of a thread's score
fragment takes the polynomial iff (c // 2) % 8 >= 8 - eighths: ``eighths`` of every 8 adjacent column
PAIRS, i.e. 2 * eighths of every 16 columns, so that packed f32x2 math (Blackwell's FFMA2) always
has both lanes on the same pipe. (Hopper's WGMMA fragment holds adjacent key pairs too.)
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

ROUND_DOWN_MAGIC = 1.5 * 2**23
INPUT_MIN = -126.0  # the clamp (see above)
COEFFS = (0.9999251365661621, 0.6958339810371399, 0.22606706619262695, 0.07802402973175049)


def emulated(column: int, eighths: int) -> bool:
    """Whether fragment column ``column`` uses ``exp2_fma`` (True) or MUFU.EX2 (False) when
    ``eighths`` of every 8 column pairs are emulated (0: none, 8: all). Plain ints, at trace time."""
    return (column // 2) % 8 >= 8 - eighths


@cute.jit
def exp2_fma(x: Float32) -> Float32:
    x = cute.arch.fmax(x, Float32(INPUT_MIN))
    rounded = cute.math.add(x, Float32(ROUND_DOWN_MAGIC), rounding=cute.math.RoundingMode.DOWN)
    frac = x - (rounded - Float32(ROUND_DOWN_MAGIC))
    poly = Float32(COEFFS[3])
    for c in (COEFFS[2], COEFFS[1], COEFFS[0]):
        poly = poly * frac + Float32(c)
    bits = poly.bitcast(Int32) + (rounded.bitcast(Int32) << 23)
    return bits.bitcast(Float32)
