"""Online softmax over the rows of a score fragment.

Shared by every architecture: a row may be spread over ``threads_per_row`` neighbouring lanes
(4 on Hopper's WGMMA accumulators, 1 on Blackwell's row-per-thread TMEM loads); the reductions
across those lanes are butterfly shuffles.

Scores arrive unscaled; probabilities are computed in the log2 domain, P = exp2(S * scale_log2 - m),
so one FFMA per element folds the softmax scale into the exponent. Row sums stay per-thread
partials until ``finalize`` (the rescale factor is uniform across a row, so partial sums can be
rescaled independently). Fully masked rows (max = -inf) give P = 0, output 0 and LSE = -inf.

One step of the online softmax is three calls, so that a kernel can keep masked blocks (-inf
scores) on MUFU while full blocks use the FMA-pipe exp2: ``update_max`` (new maxima, the output
rescale factors and the exponent shifts), ``exp2_rows`` (scores -> probabilities), ``update_sum``
(rescaled running sums). They take a block's scores as values, a list of rows each holding the
thread's Float32 scores of that row: the kernel reads its fragment once, passes the values from
step to step and stores the probabilities. (Reading and writing the fragment in every step gives
the same machine code, the fragment lives in registers either way, but every access is traced as
IR ops that the compiler then has to remove again: compile time, most at d = 256.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .exp2 import emulated, exp2_fma

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@cute.jit
def row_allreduce(x: Float32, op: cutlass.Constexpr, threads_per_row: cutlass.Constexpr) -> Float32:
    """Reduce x over the ``threads_per_row`` neighbouring lanes that share a row."""
    for i in cutlass.range_constexpr(int(math.log2(threads_per_row))):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1 << i))
    return x


def _tree_reduce(values: list, op):
    """Pairwise reduction: log-depth dependency chains instead of a serial one."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _fmax(a, b):
    return cute.arch.fmax(a, b)


def _add(a, b):
    return a + b


@cute.jit
def exp2_rows(scores: list, scale_log2: Float32, shift: cute.Tensor,
              exp2_emulated_eighths: cutlass.Constexpr[int] = 0) -> list:
    """P = exp2(S * scale_log2 - shift[row]) (one FFMA + one exp2 per element), returned as rows
    of values like ``scores``. exp2_emulated_eighths: the columns ``exp2.emulated`` picks (that many
    of every 8 column pairs) use ``exp2_fma`` instead of MUFU.EX2, which is only valid for blocks
    without -inf scores."""
    probs = []
    for r in cutlass.range_constexpr(len(scores)):
        neg_shift = -shift[r]
        row = []
        for c in cutlass.range_constexpr(len(scores[r])):
            x = cute.math.fma(scores[r][c], scale_log2, neg_shift)
            if cutlass.const_expr(emulated(c, exp2_emulated_eighths)):
                row.append(exp2_fma(x))
            else:
                row.append(cute.math.exp2(x, fastmath=True))
        probs.append(row)
    return probs


@dataclass
class OnlineSoftmax:
    scale_log2: Float32
    num_rows: cutlass.Constexpr[int]
    threads_per_row: cutlass.Constexpr[int]
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, threads_per_row: int) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(scale_log2, num_rows, threads_per_row, row_max, row_sum)

    @cute.jit
    def update_max(self, scores: list, row_scale: cute.Tensor,
                   rescale_threshold: cutlass.Constexpr[float] = 0.0, block_max: list = None) -> cute.Tensor:
        """Fold a block's scores into the running row maxima. Returns each row's exponent shift
        (max * scale_log2) and writes the output rescale factor into ``row_scale``.

        rescale_threshold > 0 (log2 units): keep a row's stale maximum unless the new one exceeds it
        by more than the threshold; P then stays <= 2^threshold, the factor is exactly 1 and the
        output needs no rescale. Final normalisation stays exact: output and sum share the stale max.

        block_max: each row's maximum over the block's scores where the kernel has reduced them
        itself (per thread, before the reduction across a row's threads); else reduced here.
        """
        shift = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m_old = self.row_max[r]
            if cutlass.const_expr(block_max is None):
                m_local = _tree_reduce(scores[r], cute.arch.fmax)
            else:
                m_local = block_max[r]
            m_new = row_allreduce(cute.arch.fmax(m_local, m_old), _fmax, self.threads_per_row)
            if cutlass.const_expr(rescale_threshold > 0.0):
                if (m_new - m_old) * self.scale_log2 <= rescale_threshold:
                    m_new = m_old
            # A row that has seen only masked keys keeps max = -inf; shift it by 0 so that exp2
            # gives 0 (not NaN) for it.
            m_scaled = m_new * self.scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            shift[r] = m_scaled
            factor = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
            if cutlass.const_expr(rescale_threshold > 0.0):
                # The factor above is FFMA(m_old, s, -round(m_new * s)): with the maximum kept it is
                # 1 + O(2^-24), not 1, and the kernels skip O's multiplies only when every factor of a
                # warp is exactly 1. (The stale maximum makes the skip exact: O and the sum share it.)
                if m_new == m_old:
                    factor = Float32(1.0)
            row_scale[r] = factor
            self.row_max[r] = m_new
        return shift

    @cute.jit
    def update_sum(self, probs: list, row_scale: cute.Tensor, block_sums: list = None):
        """row_sum = row_sum * row_scale + this block's sum, per row. ``block_sums``: the block's
        per-thread row sums where the kernel has added them itself (sm100's packed partial sums),
        else reduced here from ``probs``."""
        for r in cutlass.range_constexpr(self.num_rows):
            if cutlass.const_expr(block_sums is None):
                block_sum = _tree_reduce(probs[r], _add)
            else:
                block_sum = block_sums[r]
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + block_sum

    @cute.jit
    def finalize(self, sink_logit=None):
        """Return (output scale per row, LSE per row, natural log). With a learnable sink, the sink
        logit joins the denominator only (it has no value row); ``sink_logit`` is one Float32 for
        every row, or a tensor of one per row."""
        out_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = row_allreduce(self.row_sum[r], _add, self.threads_per_row)
            m = self.row_max[r] * self.scale_log2  # -inf for a fully masked row
            if cutlass.const_expr(sink_logit is not None):
                if cutlass.const_expr(isinstance(sink_logit, cute.Tensor)):
                    sink2 = sink_logit[r] * LOG2_E
                else:
                    sink2 = sink_logit * LOG2_E
                mm = cute.arch.fmax(m, sink2)
                keep = cute.math.exp2(m - mm, fastmath=True)
                total = total * keep + cute.math.exp2(sink2 - mm, fastmath=True)
                out_scale[r] = keep / total
                lse[r] = (mm + cute.math.log2(total, fastmath=True)) * LN_2
            else:
                scale = Float32(0.0)
                lse_r = -Float32.inf
                if total > Float32(0.0):
                    scale = cute.arch.rcp_approx(total)
                    lse_r = (m + cute.math.log2(total, fastmath=True)) * LN_2
                out_scale[r] = scale
                lse[r] = lse_r
        return out_scale, lse


def score_scales(softmax_scale, softcap, has_softcap: bool):
    """(score_prescale, scale_log2) of a kernel: what multiplies the raw scores before the softmax
    (1, or softmax_scale / softcap ahead of the tanh), and the log2-domain scale the softmax uses.
    Softcap squashes the scaled scores, softcap * tanh(s * scale / softcap), so the softmax's own
    scale is then the cap itself. Host side (at trace time), values of the DSL's Float32."""
    if has_softcap:
        return softmax_scale / softcap, softcap * LOG2_E
    return Float32(1.0), softmax_scale * LOG2_E


@dataclass(frozen=True)
class BackwardScales:
    """The backward's scales, shared by every arch's kernel: softmax (dK's scale), score (applied
    before softcap's tanh: the softmax scale, or it over the cap), log2 (turns a capped score into
    P's exponent, log2(e) included). The forward scored cap * tanh(s * scale / cap); the backward
    recomputes P the same way."""

    softmax: Float32
    score: Float32
    log2: Float32

    @staticmethod
    def of(softmax_scale: Float32, softcap: Float32, has_softcap: bool) -> "BackwardScales":
        if has_softcap:
            return BackwardScales(softmax_scale, softmax_scale / softcap, softcap * LOG2_E)
        return BackwardScales(softmax_scale, softmax_scale, softmax_scale * LOG2_E)
