"""Upstream FlashAttention-4 (flash_attn.cute.interface) spellings that the public functions accept,
and the head dims below 64 that upstream serves (docs/API_COMPAT.md has the differences that remain).

- window_size sides given as None mean unbounded, exactly as -1 does, in flash_attn_func,
  flash_attn_varlen_func and flash_attn_with_kvcache: the same kernel configuration, bitwise the
  same output, and the reference's.
- head dims 16 and 32 run forward and backward (the backward zero-padded to 32); 8 (head_dim or
  head_dim_v) is a NotImplementedError raised by validation, before the device check and before any
  kernel is picked, and the workaround the message gives is checked to be the same attention.

As in test_ops.py, the kernels are torch stand-ins on the CPU: this checks the torch layer, not the
kernels' numerics.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flash_attn4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tests.cpu.test_kvcache_cpu import as_i32, assert_close, kernels, problem, reference  # noqa: F401 (fixture)
from tests.cpu.test_ops import (  # noqa: F401 (fixtures)
    _check_causal_backward_at_head_dims,
    cpu_backward,
    cpu_kernel,
    rand_qkv,
    rand_varlen,
)
from tests.reference import attention_ref

BF16 = torch.bfloat16

# (upstream spelling, ours with -1): the same mask
WINDOWS = [(None, (-1, -1)), ((None, None), (-1, -1)), ((None, 0), (-1, 0)), ((None, 6), (-1, 6)),
           ((5, None), (5, -1))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("upstream,ours", WINDOWS)
def test_window_none_batched(cpu_kernel, upstream, ours, causal):
    q, k, v = rand_qkv(2, random.randint(1, 20), random.randint(1, 20), 4, 2, 64)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=upstream, return_lse=True)
    cfg = cpu_kernel[-1]
    out_m1, lse_m1 = flash_attn_func(q, k, v, causal=causal, window_size=ours, return_lse=True)
    assert cpu_kernel[-1] == cfg
    assert torch.equal(out, out_m1) and torch.equal(lse, lse_m1)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=ours)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("upstream,ours", WINDOWS)
def test_window_none_varlen(cpu_kernel, upstream, ours):
    q, k, v, cu_q, cu_k = rand_varlen(4, 16, 4, 2, 64)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, window_size=upstream, return_lse=True)
    cfg = cpu_kernel[-1]
    out_m1, lse_m1 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, window_size=ours, return_lse=True)
    assert cpu_kernel[-1] == cfg and cfg.varlen
    assert torch.equal(out, out_m1) and torch.equal(lse, lse_m1)
    ref, ref_lse = attention_ref(q, k, v, window_size=ours, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("upstream,ours", WINDOWS)
def test_window_none_kvcache(kernels, upstream, ours):  # noqa: F811 (the fixture)
    q, kc, vc, k, v = problem(b=2, sq=3, s_cache=64, s_new=2)
    seq = as_i32([random.randint(0, 62), random.randint(0, 62)])
    results = []
    for window in (upstream, ours):
        kc_w, vc_w = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, kc_w, vc_w, k, v, cache_seqlens=seq, window_size=window,
                                           return_softmax_lse=True, num_splits=1)
        results.append((out, lse, kc_w, vc_w))
    (out, lse, kc_n, vc_n), (out_m1, lse_m1, kc_m1, vc_m1) = results
    assert torch.equal(out, out_m1) and torch.equal(lse, lse_m1)
    assert torch.equal(kc_n, kc_m1) and torch.equal(vc_n, vc_m1)
    want_kc, want_vc, ro, rl = reference(q, kc, vc, k, v, seq, window_size=ours)
    assert torch.equal(kc_n, want_kc) and torch.equal(vc_n, want_vc)
    assert_close(out, lse, ro, rl)


@pytest.mark.parametrize("window", [(None, -2), (-3, None), (None, 1.5), ("x", None)])
def test_window_errors_still_name_the_side(window):
    q, k, v = rand_qkv(1, 3, 3, 2, 2, 64)
    side = "right" if window[0] is None else "left"
    with pytest.raises(ValueError, match=f"^window_size {side} must be .*None"):
        flash_attn_func(q, k, v, window_size=window)


# ---- head dims below 64 ----


@pytest.mark.parametrize("d,dv", [(16, 16), (32, 32), (16, 32), (32, 16), (24, 16)])
def test_small_head_dims_run_forward_and_backward(cpu_backward, d, dv):
    """16 and 32 (upstream's small head dims) pass validation, reach a forward kernel at their own
    width and a backward kernel zero-padded to 32, with the reference gradients."""
    cfg = _check_causal_backward_at_head_dims(cpu_backward, d, dv)
    assert (cfg.head_dim, cfg.head_dim_v) == (32, 32)


def _calls(d, dv, requires_grad):
    """The three public functions on CPU tensors with head dims d/dv."""
    q, k, v = rand_qkv(2, 5, 7, 4, 2, d, dv)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
    flat = [t.detach().reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    return {
        "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(*flat, cu, cu_k),
        "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(q.detach(), k.detach(), v.detach(),
                                                                    cache_seqlens=3),
    }


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("d,dv,name", [(8, 8, "head_dim"), (8, 64, "head_dim"), (64, 8, "head_dim_v"),
                                       (16, 8, "head_dim_v")])
def test_head_dim_8_is_refused_by_validation(d, dv, name, requires_grad):
    """Without the CPU hook: the NotImplementedError comes before the device check (a ValueError on
    these CPU tensors), so from validation, not from dispatch or a compile."""
    for function, call in _calls(d, dv, requires_grad).items():
        with pytest.raises(NotImplementedError, match=f"^flash-attn4: {name} = 8 is not implemented") as info:
            call()
        assert "zero-pad" in str(info.value), function


def test_head_dim_8_is_refused_before_a_kernel_is_picked(cpu_kernel):
    for call in _calls(8, 8, requires_grad=False).values():
        with pytest.raises(NotImplementedError, match="head_dim = 8"):
            call()
    assert cpu_kernel == []


def test_the_workaround_in_the_head_dim_8_message_is_the_same_attention(cpu_kernel):
    """Zero-padding q and k to 16 with softmax_scale = 8 ** -0.5, and v to 16 with out[..., :8]: the
    attention of the unpadded problem (against the reference at head dim 8)."""
    q, k, v = rand_qkv(2, random.randint(1, 20), random.randint(1, 20), 4, 2, 8)
    sink = torch.randn(4)
    out, lse = flash_attn_func(F.pad(q, (0, 8)), F.pad(k, (0, 8)), F.pad(v, (0, 8)), softmax_scale=8 ** -0.5,
                               causal=True, learnable_sink=sink, return_lse=True)
    assert (cpu_kernel[-1].head_dim, cpu_kernel[-1].head_dim_v) == (16, 16)
    assert torch.count_nonzero(out[..., 8:]) == 0
    ref, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    torch.testing.assert_close(out[..., :8], ref)
    torch.testing.assert_close(lse, ref_lse)
