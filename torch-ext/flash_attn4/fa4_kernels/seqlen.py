"""Per-batch sequence bookkeeping: where a sequence starts in a packed (varlen) tensor and how long it is.

Batched inputs have one length for every batch entry (the tensor extent). Varlen inputs are packed
along the token axis and described by ``cu_seqlens`` (prefix sums, length batch + 1); ``seqused_k``
optionally shortens each key sequence (e.g. a KV cache filled to different depths), ``seqused_q``
each query sequence (padded batches: the rows past it are neither read into results nor written).
A paged KV cache (paged_kv.py) always gives its key lengths as ``seqused_k``, batched or varlen
queries alike: there the key tensor's extent is one page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    """Offsets and lengths of one batch entry; built inside a kernel from runtime values."""

    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32

    @staticmethod
    def create(
        batch_idx: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        cu_seqlens_q: Optional[cute.Tensor] = None,
        cu_seqlens_k: Optional[cute.Tensor] = None,
        seqused_k: Optional[cute.Tensor] = None,
        seqused_q: Optional[cute.Tensor] = None,
    ) -> "SeqlenInfo":
        if cutlass.const_expr(cu_seqlens_q is None):
            offset_q, seqlen_q = Int32(0), Int32(seqlen_q_static)
        else:
            offset_q = cu_seqlens_q[batch_idx]
            seqlen_q = cu_seqlens_q[batch_idx + 1] - offset_q
        if cutlass.const_expr(cu_seqlens_k is None):
            offset_k, seqlen_k = Int32(0), Int32(seqlen_k_static)
        else:
            offset_k = cu_seqlens_k[batch_idx]
            seqlen_k = cu_seqlens_k[batch_idx + 1] - offset_k
        if cutlass.const_expr(seqused_k is not None):
            seqlen_k = seqused_k[batch_idx]
        if cutlass.const_expr(seqused_q is not None):
            seqlen_q = seqused_q[batch_idx]
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k)

    def diagonal_offset(self) -> Int32:
        """Masks are aligned bottom-right: query row i lines up with key column i + (sk - sq)."""
        return self.seqlen_k - self.seqlen_q


def packed_row_offset(token_offset, batch):
    """Where batch entry ``batch``, whose tokens start at ``token_offset``, starts in the backward's
    packed float32 row buffers (lse_log2, rowsum(dO * O)). A TMA load of a block of these rows needs
    its first row 16-byte aligned (unaligned starts stopped the H200 with "illegal instruction"), so
    every entry starts at a multiple of 4 rows, after at most 3 rows of padding per earlier entry;
    ``packed_row_offset(total, batch_size)`` rows hold them all. Plain arithmetic, shared by the kernel
    (DSL Int32) and the torch layer (ints and int64 tensors)."""
    return (token_offset + 3 * batch) // 4 * 4


@cute.jit
def head_rows(t: cute.Tensor, offset: Int32, head: Int32, batch: Int32,
              varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
    """One head of one batch entry of a kernel-layout tensor, (seq, ...) with the sequence first:
    (seq, dim, head, batch) / (seq, head, batch) batched, (total, dim, head) / (total, head) packed,
    where the entry's tokens start at ``offset``."""
    if cutlass.const_expr(varlen):
        if cutlass.const_expr(cute.rank(t) == 3):
            return cute.domain_offset((offset, 0), t[None, None, head])
        else:
            return cute.domain_offset((offset,), t[None, head])
    else:
        if cutlass.const_expr(cute.rank(t) == 4):
            return t[None, None, head, batch]
        else:
            return t[None, head, batch]
