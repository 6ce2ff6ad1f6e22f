"""The PyTorch attention provider on a real GPU: with ``activate_flash_attention_impl("flash-attn4")``,
F.scaled_dot_product_attention under the flash backend and torch.nn.attention.varlen.varlen_attn
run forward and backward on our kernels and match the references; what we do not serve (dropout)
still runs PyTorch's kernel and gives its results; restoring gives PyTorch's kernels back.

References: SDPA against the math backend on float32 copies, varlen_attn against tests/reference.py,
both under FlashAttention's rule (the low-precision yardstick: the reference in the input precision),
as tests/gpu/test_fwd.py and test_bwd.py do. Every test also asserts that our kernels ran (counted at
the provider's seams), so a silent fallback to PyTorch's kernel cannot pass for ours.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn4 import ops, torch_provider
from tests.gpu.helpers import DEVICE, rand, random_lengths, seed_from_urandom
from tests.gpu.test_bwd import assert_grads_close, leaf, reference_grads
from tests.gpu.test_fwd import check
from tests.reference import assert_close_fa_rule, attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.backward]

attention = torch.nn.attention


class Provider:
    """Our provider, activated only inside ``active()``, counting the calls of our kernels."""

    def __init__(self, monkeypatch):
        self.counts = {"forward": 0, "backward": 0}
        for seam, key in (("_run_forward", "forward"), ("_run_backward", "backward")):
            monkeypatch.setattr(torch_provider, seam, self._counted(getattr(torch_provider, seam), key))
        # Register again: a Hub build of flash_attn4 imported by another test would have replaced
        # the registry entry with its own module's install.
        assert torch_provider.register()

    def _counted(self, fn, key):
        def run(*args, **kwargs):
            self.counts[key] += 1
            return fn(*args, **kwargs)
        return run

    @contextlib.contextmanager
    def active(self):
        attention.activate_flash_attention_impl(torch_provider.PROVIDER_NAME)
        try:
            yield self
        finally:
            attention.restore_flash_attention_impl()


@pytest.fixture
def provider(monkeypatch):
    if not hasattr(attention, "activate_flash_attention_impl"):
        pytest.skip(f"torch {torch.__version__} has no flash-attention provider registry")
    monkeypatch.setattr(ops, "_poison_outputs_for_tests", True)  # unwritten output elements show up
    seed_from_urandom()
    return Provider(monkeypatch)


def bhsd(b, s, h, d):
    """(b, h, s, d) view of fresh (b, s, h, d) memory, as attention modules make them."""
    return rand(b, s, h, d).transpose(1, 2)


def sdpa(q, k, v, backend, **kwargs):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_fwd_bwd(q, k, v, dout, backend=SDPBackend.FLASH_ATTENTION, **kwargs):
    leaves = [leaf(t) for t in (q, k, v)]
    out = sdpa(*leaves, backend, **kwargs)
    out.backward(dout)
    return out, {name: t.grad for name, t in zip(("dq", "dk", "dv"), leaves)}


def check_sdpa_against_math(q, k, v, dout, out, grads, causal, gqa):
    """out and grads (b, h, s, d) from the provider against the math backend on float32 copies;
    the low-precision yardstick from tests/reference.py in the input precision."""
    out_ref, grads_ref = sdpa_fwd_bwd(q.float(), k.float(), v.float(), dout.float(), SDPBackend.MATH,
                                      is_causal=causal, enable_gqa=gqa)
    q4, k4, v4, dout4 = (t.transpose(1, 2) for t in (q, k, v, dout))
    out_pt, _ = attention_ref(q4, k4, v4, causal=causal, upcast=False)
    assert_close_fa_rule(out, out_ref, out_pt.transpose(1, 2), atol=1e-5)
    pt = reference_grads(q4, k4, v4, dout4, upcast=False, causal=causal)
    assert_grads_close(grads, grads_ref, {name: g.transpose(1, 2) for name, g in pt.items()}, what="sdpa ")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,sq,sk,d", [(False, 517, 1003, 128), (True, 777, 777, 128), (True, 300, 300, 64),
                                            (False, 256, 256, 256)])
def test_sdpa_flash_backend_runs_ours_and_matches_math(provider, causal, sq, sk, d, dtype):
    q, k, v = (bhsd(2, s, 8, d).to(dtype) for s in (sq, sk, sk))
    dout = bhsd(2, sq, 8, d).to(dtype)
    with provider.active():
        out, grads = sdpa_fwd_bwd(q, k, v, dout, is_causal=causal)
    assert provider.counts == {"forward": 1, "backward": 1}
    check_sdpa_against_math(q, k, v, dout, out, grads, causal, gqa=False)


def test_sdpa_enable_gqa(provider):
    q, k, v = bhsd(2, 384, 8, 128), bhsd(2, 384, 2, 128), bhsd(2, 384, 2, 128)
    dout = bhsd(2, 384, 8, 128)
    with provider.active():
        try:
            out, grads = sdpa_fwd_bwd(q, k, v, dout, is_causal=True, enable_gqa=True)
        except RuntimeError as exc:
            if "No available kernel" not in str(exc):
                raise
            pytest.skip(f"torch {torch.__version__} does not route enable_gqa to the flash backend: {exc}")
    assert provider.counts == {"forward": 1, "backward": 1}
    check_sdpa_against_math(q, k, v, dout, out, grads, causal=True, gqa=True)


def test_sdpa_lse_is_ours_and_exact(provider):
    """The LSE the SDPA op returns (what context parallelism merges) is our kernel's, (b, h, s) float32."""
    q, k, v = bhsd(2, 333, 4, 128), bhsd(2, 333, 4, 128), bhsd(2, 333, 4, 128)
    with provider.active():
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    assert provider.counts["forward"] == 1
    assert out.stride() == q.stride()
    check(out.transpose(1, 2), lse, *(t.transpose(1, 2) for t in (q, k, v)), causal=True)


@pytest.mark.parametrize("window_size,gqa", [((-1, -1), False), ((-1, 0), True), ((96, 0), False)])
def test_varlen_attn_runs_ours_forward_and_backward(provider, window_size, gqa):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if gqa and "enable_gqa" not in inspect.signature(varlen.varlen_attn).parameters:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa")
    lens_q, lens_k = random_lengths(5, 400)
    if window_size == (-1, -1):
        lens_k = lens_q  # also self-attention lengths
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
                  for lens in (lens_q, lens_k))
    hq, hk = (8, 2) if gqa else (4, 4)
    q, k, v = rand(sum(lens_q), hq, 128), rand(sum(lens_k), hk, 128), rand(sum(lens_k), hk, 128)
    dout = rand(sum(lens_q), hq, 128)
    leaves = [leaf(t) for t in (q, k, v)]
    gqa_kwargs = {"enable_gqa": True} if gqa else {}  # torch 2.11's varlen_attn has no such parameter
    with provider.active():
        out, lse = varlen.varlen_attn(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), window_size=window_size,
                                      return_aux=varlen.AuxRequest(lse=True), **gqa_kwargs)
        out.backward(dout)
    assert provider.counts == {"forward": 1, "backward": 1}
    left, right = window_size
    ref_kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=window_size == (-1, 0),
                      window_size=window_size if left >= 0 else (-1, -1))
    check(out.detach(), lse.detach(), q, k, v, **ref_kwargs)
    got = {name: t.grad for name, t in zip(("dq", "dk", "dv"), leaves)}
    assert_grads_close(got, reference_grads(q, k, v, dout, upcast=True, **ref_kwargs),
                       reference_grads(q, k, v, dout, upcast=False, **ref_kwargs), what="varlen_attn ")


def test_dropout_falls_back_to_pytorchs_kernel(provider):
    """dropout_p > 0 is not ours: with the provider active SDPA gives exactly what PyTorch's flash
    kernel gives without it (same seed, same dropout mask), forward and backward."""
    q, k, v, dout = (bhsd(2, 256, 4, 64) for _ in range(4))
    seed = int(torch.randint(0, 2**31, ()))

    def run():
        torch.manual_seed(seed)
        return sdpa_fwd_bwd(q, k, v, dout, dropout_p=0.3)

    with provider.active():
        out, grads = run()
    assert provider.counts == {"forward": 0, "backward": 0}
    out_pt, grads_pt = run()
    assert torch.equal(out, out_pt)
    for name in grads:  # PyTorch's dq accumulates with atomics: equal up to summation order
        torch.testing.assert_close(grads[name], grads_pt[name], atol=2e-3, rtol=1e-2, msg=name)
    no_dropout = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION)
    assert (out - no_dropout).abs().max() > 0.1, "dropout was applied"


def test_restore_gives_pytorchs_kernels_back(provider):
    q, k, v = (bhsd(2, 300, 4, 128) for _ in range(3))
    before = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, is_causal=True)
    with provider.active():
        ours = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, is_causal=True)
    after = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, is_causal=True)
    assert provider.counts["forward"] == 1, "ours ran only while active"
    assert attention.current_flash_attention_impl() is None
    assert torch.equal(before, after)
    torch.testing.assert_close(ours, before, atol=2e-2, rtol=2e-2)


def test_sdpa_under_torch_compile(provider):
    """Inductor calls the SDPA op from compiled code: our output strides must be the meta function's."""
    torch._dynamo.reset()
    q, k, v, dout = (bhsd(2, 512, 8, 128) for _ in range(4))
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)
    with provider.active(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        leaves = [leaf(t) for t in (q, k, v)]
        out = compiled(*leaves)
        out.backward(dout)
        assert provider.counts["forward"] >= 1 and provider.counts["backward"] >= 1, "compiled code ran ours"
        eager, eager_grads = sdpa_fwd_bwd(q, k, v, dout * 2, is_causal=True)
    assert torch.equal(out, eager * 2), "the same forward kernel on the same inputs"
    for name, t in zip(("dq", "dk", "dv"), leaves):  # dQ accumulates with atomics: equal up to summation order
        torch.testing.assert_close(t.grad, eager_grads[name], atol=2e-3, rtol=1e-2, msg=name)


def test_deterministic_algorithms_make_the_backward_repeatable(provider):
    q, k, v, dout = (bhsd(1, 1024, 4, 128) for _ in range(4))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with provider.active():
            runs = [sdpa_fwd_bwd(q, k, v, dout, is_causal=True)[1] for _ in range(3)]
    except RuntimeError as exc:
        if "No available kernel" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__} routes no deterministic SDPA to the flash backend: {exc}")
    finally:
        torch.use_deterministic_algorithms(previous)
    assert provider.counts["backward"] == 3
    for run in runs[1:]:
        for name in run:
            assert torch.equal(run[name], runs[0][name]), name
