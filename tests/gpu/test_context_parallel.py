"""Context parallelism (ring attention) emulated on one GPU: the sequence split into W chunks, the
query chunk of "rank" r attending to each key chunk c in turn - the diagonal chunk causal, earlier
chunks in full, later ones skipped when causal (every chunk in full otherwise) - and the partial
results merged by their log-sum-exps. Against one call over the whole sequence.

- merged with our flash_attn_combine (forward);
- merged with the LSE formula in float32 torch ops, forward and backward, the loss using the merged
  LSE too (so gradients flow through each chunk's returned LSE into our backward);
- PyTorch's own ring step, as ``context_parallel`` runs it on each rank: the ATen SDPA flash op per
  chunk through our provider, merged by torch's _SDPAMerger, and the backward per chunk given the
  *merged* output and LSE (an LSE our forward did not produce), gradients summed.

Two GPUs are not available to these tests; the multi-GPU recipe is in /work/shared/INTEGRATION.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_attn4 import flash_attn_combine, flash_attn_func
from tests.gpu.helpers import rand, seed_from_urandom
from tests.gpu.test_bwd import assert_grads_close, leaf
from tests.gpu.test_torch_provider_gpu import provider  # noqa: F401  (fixture)
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff

pytestmark = pytest.mark.gpu

W = 4  # ring size (chunks)


@pytest.fixture(autouse=True)
def seed():
    return seed_from_urandom()


def ring_steps(r: int, causal: bool) -> list[tuple[int, bool]]:
    """(key chunk, causal) pairs the query chunk of rank r attends to."""
    if not causal:
        return [(c, False) for c in range(W)]
    return [(c, c == r) for c in range(r + 1)]


def chunk(t: torch.Tensor, i: int, dim: int = 1) -> torch.Tensor:
    return t.narrow(dim, i * (t.shape[dim] // W), t.shape[dim] // W)


def merge_logsumexp(outs, lses):
    """out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i); outs (b, s, h, d), lses (b, h, s)."""
    lse_all = torch.stack(lses)
    lse = torch.logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - lse).transpose(-1, -2).unsqueeze(-1)  # (n, b, s, h, 1)
    return (weights * torch.stack(outs).float()).sum(0), lse


def merge_sigmoid(outs, lses):
    """The pairwise update torch's context parallelism uses (_SDPAMerger), in float32."""
    out, lse = outs[0].float(), lses[0]
    for o, l in zip(outs[1:], lses[1:]):
        w = torch.sigmoid(l - lse).transpose(-1, -2).unsqueeze(-1)
        out = out - w * (out - o.float())
        lse = lse - F.logsigmoid(lse - l)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,d,seqlen", [(8, 8, 128, 4 * 256), (8, 2, 64, 4 * 193)])
def test_ring_merged_with_flash_attn_combine(causal, hq, hk, d, seqlen):
    q, k, v = rand(2, seqlen, hq, d), rand(2, seqlen, hk, d), rand(2, seqlen, hk, d)
    full_out, full_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, upcast=True)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    for r in range(W):
        qr = chunk(q, r)
        parts = [flash_attn_func(qr, chunk(k, c), chunk(v, c), causal=step_causal, return_lse=True)
                 for c, step_causal in ring_steps(r, causal)]
        out, lse = flash_attn_combine(torch.stack([o for o, _ in parts]).float(), torch.stack([l for _, l in parts]),
                                      out_dtype=q.dtype)
        assert_close_fa_rule(out, chunk(out_ref, r), chunk(out_pt, r), atol=1e-5, name=f"rank {r} out")
        assert max_abs_diff(lse, chunk(lse_ref, r, dim=2)) <= 2e-3, f"rank {r} lse vs reference"
        assert max_abs_diff(lse, chunk(full_lse, r, dim=2)) <= 2e-3, f"rank {r} lse vs the full call"
        # the merge's extra rounding (each part is rounded to bf16 first) stays within the full call's error scale
        assert max_abs_diff(out, chunk(full_out, r)) <= 2 * max_abs_diff(chunk(out_pt, r), chunk(out_ref, r)) + 1e-5


def loss_and_grads(out, lse, dout, dlse, leaves):
    """Gradients of sum(out * dout) (+ sum(lse * dlse) unless dlse is None) w.r.t. the leaves."""
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse).sum()
    return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(loss, leaves)))


def reference(q, k, v, dout, dlse, causal, upcast):
    leaves = [leaf(t.float() if upcast else t) for t in (q, k, v)]
    out, lse = attention_ref(*leaves, causal=causal, upcast=upcast)
    return loss_and_grads(out, lse, dout, dlse, leaves)


@pytest.mark.backward
@pytest.mark.parametrize("merge", [merge_logsumexp, merge_sigmoid])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_merged_by_lse_forward_and_backward(causal, merge):
    q, k, v = rand(2, 4 * 192, 8, 128), rand(2, 4 * 192, 2, 128), rand(2, 4 * 192, 2, 128)
    dout, dlse = rand(2, 4 * 192, 8, 128), rand(2, 8, 4 * 192, dtype=torch.float32)
    leaves = [leaf(t) for t in (q, k, v)]
    outs, lses = [], []
    for r in range(W):
        parts = [flash_attn_func(chunk(leaves[0], r), chunk(leaves[1], c), chunk(leaves[2], c), causal=step_causal,
                                 return_lse=True) for c, step_causal in ring_steps(r, causal)]
        out, lse = merge([o for o, _ in parts], [l for _, l in parts])
        outs.append(out)
        lses.append(lse)
    ring = loss_and_grads(torch.cat(outs, 1), torch.cat(lses, 2), dout, dlse, leaves)

    full_leaves = [leaf(t) for t in (q, k, v)]
    full_out, full_lse = flash_attn_func(*full_leaves, causal=causal, return_lse=True)
    full = loss_and_grads(full_out, full_lse, dout, dlse, full_leaves)
    ref = reference(q, k, v, dout, dlse, causal, upcast=True)
    pt = reference(q, k, v, dout, dlse, causal, upcast=False)
    assert_grads_close(ring, ref, pt, what="ring ")
    assert_grads_close(full, ref, pt, what="full call ")


@pytest.mark.backward
@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_ring_steps_through_the_provider(provider, causal):  # noqa: F811  (the imported fixture)
    """One rank's work in torch's ring attention, for every rank: ATen's SDPA flash op per step
    (our kernels, through the provider), torch's _SDPAMerger, then the backward op per step with the
    merged output and LSE, as torch.distributed.tensor's context parallelism calls them."""
    cp = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
    if not hasattr(cp, "_SDPAMerger"):
        pytest.skip(f"torch {torch.__version__} has no _SDPAMerger")
    b, h, s, d = 2, 8, 4 * 160, 128
    q, k, v, dout = (rand(b, s, h, d).transpose(1, 2) for _ in range(4))  # (b, h, s, d) views
    scale = d ** -0.5
    dq, dk, dv = (torch.zeros(b, h, s, d, device=q.device) for _ in range(3))
    outs = []
    steps = 0
    aten = torch.ops.aten
    with provider.active():
        for r in range(W):
            qr, dout_r = chunk(q, r, 2), chunk(dout, r, 2)
            merger = cp._SDPAMerger(True, seq_dim=2)
            for c, step_causal in ring_steps(r, causal):
                o, lse, *_ = aten._scaled_dot_product_flash_attention(qr, chunk(k, c, 2), chunk(v, c, 2), 0.0,
                                                                      step_causal, scale=scale)
                merger.step(o, lse, False)
            out, lse = merger.results()
            outs.append(out)
            for c, step_causal in ring_steps(r, causal):
                seed, offset = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.zeros(
                    (), dtype=torch.uint64, device=q.device)
                g = aten._scaled_dot_product_flash_attention_backward(
                    dout_r, qr, chunk(k, c, 2), chunk(v, c, 2), out, lse, None, None, s // W, s // W, 0.0, step_causal,
                    seed, offset, scale=scale)
                chunk(dq, r, 2).add_(g[0].float())
                chunk(dk, c, 2).add_(g[1].float())
                chunk(dv, c, 2).add_(g[2].float())
                steps += 1
    assert provider.counts == {"forward": steps, "backward": steps}

    q4, k4, v4, dout4 = (t.transpose(1, 2) for t in (q, k, v, dout))
    out_ref, _ = attention_ref(q4, k4, v4, causal=causal, upcast=True)
    out_pt, _ = attention_ref(q4, k4, v4, causal=causal, upcast=False)
    assert_close_fa_rule(torch.cat(outs, 2).transpose(1, 2), out_ref, out_pt, atol=1e-5)
    ref = reference(q4, k4, v4, dout4, None, causal, upcast=True)
    pt = reference(q4, k4, v4, dout4, None, causal, upcast=False)
    got = {name: g.transpose(1, 2).to(q.dtype) for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv))}
    assert_grads_close(got, ref, pt, what="torch ring ")
